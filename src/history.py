"""The per-epoch history: its records, the best epoch by --best-by, and history.json's text."""
import json

from src.divergence import check_finite_loss
from src.metrics import summarize

# The fields of a record (epoch_record), which --resume checks a last.pth's history for.
RECORD_KEYS = ("epoch", "train_loss", "train_acc", "train_samples", "val_loss", "val_acc", "val_log_loss",
               "val_samples", "lr", "train_seconds", "data_wait_seconds", "val_seconds", "seconds")


def epoch_record(*, epoch: int, train_sums, val_sums, train_seconds: float, val_seconds: float,
                 data_wait_seconds: float, lr: float) -> dict:
    """One history.json record (`epoch` counts from 0, the record's from 1).

    data_wait_seconds: the part of train_seconds that rank 0 spent waiting for its data loader;
    lr: the learning rate after the epoch's last step (the next step's). A loss that is not finite
    stops the run here, on every rank, before anything of the epoch is saved (src.divergence).
    """
    check_finite_loss(train_sums, f"epoch {epoch + 1}", "training")
    check_finite_loss(val_sums, f"epoch {epoch + 1}", "validation")
    train, val = summarize(train_sums), summarize(val_sums)
    return {"epoch": epoch + 1,
            "train_loss": train["loss"], "train_acc": train["acc"], "train_samples": train["samples"],
            "val_loss": val["loss"], "val_acc": val["acc"], "val_log_loss": val["log_loss"],
            "val_samples": val["samples"], "lr": lr, "train_seconds": round(train_seconds, 3),
            "data_wait_seconds": round(data_wait_seconds, 3), "val_seconds": round(val_seconds, 3),
            "seconds": round(train_seconds + val_seconds, 3)}


def run_header(args, data, device, processes: int = 1) -> str:
    """The line a run starts with: model, device, images and batch."""
    where = str(device) if processes == 1 else f"{processes} x {device.type}"
    return (f"{args.arch} on {where}: {len(data.train_idx)} train / {len(data.val_idx)} val images, "
            f"batch {args.batch_size}" + (f" x {processes}" if processes > 1 else "")
            + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))


def done_line(history: list[dict], args, seconds: float) -> str:
    """The line a run ends with: its time and the epoch of best.pth."""
    best = best_record(history, args.best_by)
    return (f"done in {seconds:.0f} s: best {args.best_by} {best[args.best_by]:.4f} "
            f"(epoch {best['epoch']}) in {args.checkpoint}")


def format_record(record: dict, epochs: int) -> str:
    return (f"epoch {record['epoch']}/{epochs}  "
            f"train loss {record['train_loss']:.4f} acc {record['train_acc']:.4f}  "
            f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} "
            f"log loss {record['val_log_loss']:.4f}  ({record['seconds']:.1f} s)")


def is_better(record: dict, than: dict | None, best_by: str) -> bool:
    """Whether an epoch's record beats another by --best-by (accuracy up, log loss down).

    Equal accuracies, common on small validation sets, go to the lower log loss.
    """
    if than is None:
        return True
    if best_by == "val_log_loss":
        return record["val_log_loss"] < than["val_log_loss"]
    return (record["val_acc"], -record["val_log_loss"]) > (than["val_acc"], -than["val_log_loss"])


def best_record(history: list[dict], best_by: str) -> dict:
    """The first epoch that no later one beats by --best-by: the epoch of best.pth."""
    best = None
    for record in history:
        if is_better(record, best, best_by):
            best = record
    return best


def history_text(history: list[dict]) -> str:
    return json.dumps(history, indent=2) + "\n"


def evaluation_record(val_sums, val_seconds: float) -> dict:
    """--evaluate's record: the validation fields of a history.json record."""
    val = summarize(val_sums)
    return {"val_loss": val["loss"], "val_acc": val["acc"], "val_log_loss": val["log_loss"],
            "val_samples": val["samples"], "val_seconds": round(val_seconds, 3)}


def format_evaluation(named: str, record: dict) -> str:
    """--evaluate's line, as an epoch's: `named` says what was validated."""
    return (f"validated {named}: val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} "
            f"log loss {record['val_log_loss']:.4f} on {record['val_samples']} images "
            f"({record['val_seconds']:.1f} s)")
