"""The per-epoch history: records, history.json and the training_results.png curves."""
import json
from pathlib import Path
from typing import BinaryIO

import matplotlib

matplotlib.use("Agg")  # no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402

# Load the backend now, not at the first plot: a Ctrl-C landing inside its C-extension
# initialisation surfaces as ImportError instead of KeyboardInterrupt.
plt.switch_backend("Agg")

from src.metrics import summarize  # noqa: E402


def epoch_record(epoch: int, train_sums, val_sums, train_seconds: float, val_seconds: float,
                 data_wait_seconds: float, lr: float) -> dict:
    """One history.json record (epochs count from 1).

    data_wait_seconds: the part of train_seconds that rank 0 spent waiting for its data loader;
    lr: the learning rate after the epoch's last step (the next step's).
    """
    train, val = summarize(train_sums), summarize(val_sums)
    return {"epoch": epoch + 1,
            "train_loss": train["loss"], "train_acc": train["acc"], "train_samples": train["samples"],
            "val_loss": val["loss"], "val_acc": val["acc"], "val_log_loss": val["log_loss"],
            "val_samples": val["samples"], "lr": lr, "train_seconds": round(train_seconds, 3),
            "data_wait_seconds": round(data_wait_seconds, 3), "val_seconds": round(val_seconds, 3),
            "seconds": round(train_seconds + val_seconds, 3)}


def format_record(record: dict, epochs: int) -> str:
    return (f"epoch {record['epoch']}/{epochs}  "
            f"train loss {record['train_loss']:.4f} acc {record['train_acc']:.4f}  "
            f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} "
            f"log loss {record['val_log_loss']:.4f}  ({record['seconds']:.1f} s)")


def plot_history(history: list[dict], file: BinaryIO | Path) -> None:
    """Accuracy and loss curves, train and validation, one point per epoch, as a PNG."""
    figure = history_figure(history)
    try:
        figure.savefig(file, format="png")
    finally:
        plt.close(figure)


def history_figure(history: list[dict]) -> plt.Figure:
    """The figure of plot_history: accuracy on the left, loss on the right, train and validation."""
    epochs = [r["epoch"] for r in history]
    figure, (acc_axes, loss_axes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axes, key, title in ((acc_axes, "acc", "Accuracy"), (loss_axes, "loss", "Loss")):
        axes.plot(epochs, [r[f"train_{key}"] for r in history], "o-", label=f"Training {title.lower()}")
        axes.plot(epochs, [r[f"val_{key}"] for r in history], "s-", label=f"Validation {title.lower()}")
        axes.set_title(f"Training and validation {title.lower()}")
        axes.set_xlabel("epoch")
        axes.set_xticks(epochs)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    return figure


def history_text(history: list[dict]) -> str:
    return json.dumps(history, indent=2) + "\n"
