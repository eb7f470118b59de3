"""The per-epoch history: its records, the best epoch by --best-by, and history.json's text."""
import json

from src.config import Config
from src.divergence import check_finite_loss
from src.metrics import summarize

# The validation fields of the weight average (--ema-decay), beside the weights' own.
AVERAGE = {"val_loss": "val_loss_ema", "val_acc": "val_acc_ema", "val_log_loss": "val_log_loss_ema"}
# The fields of a record (epoch_record), which --resume checks a last.pth's history for.
RECORD_KEYS = ("epoch", "train_loss", "train_acc", "train_samples", "val_loss", "val_acc", "val_log_loss",
               "val_samples", "lr", "train_seconds", "data_wait_seconds", "val_seconds", "seconds")


def epoch_record(*, epoch: int, train_sums, val_sums, train_seconds: float, val_seconds: float,
                 data_wait_seconds: float, lr: float, average_sums=None) -> dict:
    """One history.json record (`epoch` counts from 0, the record's from 1).

    data_wait_seconds: the part of train_seconds that rank 0 spent waiting for its data loader;
    lr: the learning rate after the epoch's last step (the next step's); average_sums: the
    validation sums of the weight average (--ema-decay), None without one; val_seconds covers both.
    A loss that is not finite stops the run here, on every rank, before anything of the epoch is
    saved (src.divergence).
    """
    check_finite_loss(train_sums, f"epoch {epoch + 1}", "training")
    check_finite_loss(val_sums, f"epoch {epoch + 1}", "validation")
    train, val = summarize(train_sums), summarize(val_sums)
    record = {"epoch": epoch + 1,
              "train_loss": train["loss"], "train_acc": train["acc"], "train_samples": train["samples"],
              "val_loss": val["loss"], "val_acc": val["acc"], "val_log_loss": val["log_loss"],
              "val_samples": val["samples"], "lr": lr, "train_seconds": round(train_seconds, 3),
              "data_wait_seconds": round(data_wait_seconds, 3), "val_seconds": round(val_seconds, 3),
              "seconds": round(train_seconds + val_seconds, 3)}
    if average_sums is not None:
        check_finite_loss(average_sums, f"epoch {epoch + 1}", "the weight average's validation")
        average = summarize(average_sums)
        record.update({AVERAGE["val_loss"]: average["loss"], AVERAGE["val_acc"]: average["acc"],
                       AVERAGE["val_log_loss"]: average["log_loss"]})
    return record


def done_line(history: list[dict], args: Config, seconds: float) -> str:
    """The line a run ends with: its time and the epoch (and weights) of best.pth."""
    best, weights = best_choice(history, args.best_by)
    which = ", the weight average" if weights == "average" else ""
    return (f"done in {seconds:.0f} s: best {args.best_by} {best[args.best_by]:.4f} "
            f"(epoch {best['epoch']}{which}) in {args.checkpoint}")


def format_record(record: dict, epochs: int) -> str:
    line = (f"epoch {record['epoch']}/{epochs}  "
            f"train loss {record['train_loss']:.4f} acc {record['train_acc']:.4f}  "
            f"val loss {record['val_loss']:.4f} acc {record['val_acc']:.4f} "
            f"log loss {record['val_log_loss']:.4f}")
    if AVERAGE["val_acc"] in record:
        line += (f"  average: val loss {record[AVERAGE['val_loss']]:.4f} acc {record[AVERAGE['val_acc']]:.4f} "
                 f"log loss {record[AVERAGE['val_log_loss']]:.4f}")
    return line + f"  ({record['seconds']:.1f} s)"


def is_better(record: dict, than: dict | None, best_by: str) -> bool:
    """Whether an epoch's record beats another by --best-by (accuracy up, log loss down).

    Equal accuracies, common on small validation sets, go to the lower log loss.
    """
    if than is None:
        return True
    if best_by == "val_log_loss":
        return record["val_log_loss"] < than["val_log_loss"]
    return (record["val_acc"], -record["val_log_loss"]) > (than["val_acc"], -than["val_log_loss"])


def choices(record: dict) -> list[tuple[dict, str]]:
    """What an epoch offers best.pth: its weights, and their average (--ema-decay) if it has one,
    each as the validation fields that --best-by reads."""
    offered = [(record, "weights")]
    if AVERAGE["val_acc"] in record:
        offered.append(({**record, **{field: record[average] for field, average in AVERAGE.items()}}, "average"))
    return offered


def best_choice(history: list[dict], best_by: str) -> tuple[dict, str]:
    """The first (epoch, weights or their average) that nothing later beats by --best-by: what
    best.pth holds, as (the record with that choice's validation fields, "weights" or "average")."""
    best: tuple[dict, str] | None = None
    for record in history:
        for offered in choices(record):
            if is_better(offered[0], best and best[0], best_by):
                best = offered
    if best is None:
        raise ValueError("best_choice: the history holds no epoch")
    return best


def best_record(history: list[dict], best_by: str) -> dict:
    """The record of the epoch that best.pth comes from (best_choice)."""
    epoch = best_choice(history, best_by)[0]["epoch"]
    return next(record for record in history if record["epoch"] == epoch)


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
