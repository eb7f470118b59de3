"""training_results.png: the accuracy and loss curves of a run's history, marked as a run's plot
(MARK, a PNG text chunk) so that a later run replaces it and nothing else (src.outputs)."""
from pathlib import Path
from typing import BinaryIO

import matplotlib

matplotlib.use("Agg")  # no display on servers and in tests
import matplotlib.pyplot as plt  # noqa: E402

# Load the backend now, not at the first plot: a Ctrl-C landing inside its C-extension
# initialisation surfaces as ImportError instead of KeyboardInterrupt.
plt.switch_backend("Agg")

# The PNG text chunk (key and value) every plot of a run holds: matplotlib writes text chunks before
# the image data, within the file's first few hundred bytes.
MARK = ("Source", "training curves of a dogs-vs-cats run (src/plot.py)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def plot_history(history: list[dict], file: BinaryIO | Path) -> None:
    """Accuracy and loss curves, train and validation, one point per epoch, as a PNG."""
    figure = history_figure(history)
    try:
        figure.savefig(file, format="png", metadata=dict([MARK]))
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


def is_plot(path: Path) -> bool:
    """Whether the file is a plot that a training run wrote (a PNG holding MARK near its start)."""
    key, value = MARK
    try:
        with open(path, "rb") as file:
            head = file.read(4096)
    except OSError:
        return False
    return head.startswith(PNG_SIGNATURE) and b"tEXt" + key.encode() + b"\0" + value.encode() in head
