"""training_results.png: the accuracy and loss curves of a run's history."""
from pathlib import Path
from typing import BinaryIO

import matplotlib

matplotlib.use("Agg")  # no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402

# Load the backend now, not at the first plot: a Ctrl-C landing inside its C-extension
# initialisation surfaces as ImportError instead of KeyboardInterrupt.
plt.switch_backend("Agg")


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
