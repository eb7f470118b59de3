"""Checkpoint files, each written to a temporary file in its folder and renamed into place.

- best.pth   plain state_dict of the unwrapped model at its best validation accuracy
- best.json  what predict needs to use it: architecture, image size, normalisation, classes
- last.pth   everything to resume: model, optimizer, scaler, epoch, history, RNG state
- history.json  one record per finished epoch
"""
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

import torch

from src.datasets import CLASSES
from src.errors import UserError, one_line
from src.history import history_text, plot_history
from src.transforms import IMAGENET_MEAN, IMAGENET_STD

# What must match for --resume to continue the same run.
RESUME_KEYS = ("arch", "image_size", "batch_size", "seed", "val_fraction", "lr", "momentum")

_UMASK = os.umask(0)
os.umask(_UMASK)


class _KeepsWriteErrors:
    """A file that remembers why a write failed: torch.save reports it as a RuntimeError
    ("unexpected pos ...") without the errno that says "No space left on device"."""

    def __init__(self, file: BinaryIO):
        self.file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def _atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """write(file) into a temporary file beside path, then rename it onto path: path holds the
    old or the new content, never half of one.

    A write that fails (a full disk, say) becomes a UserError naming path; the old file stays.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = file = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes it private; outputs get the usual mode
        with os.fdopen(fd, "wb") as raw:
            file = _KeepsWriteErrors(raw)
            write(file)
            raw.flush()
            os.fsync(raw.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
    except BaseException as error:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, (OSError, RuntimeError)):
            raise UserError(cannot_write(path, getattr(file, "error", None) or error)) from None
        raise


def cannot_write(path: Path, error: BaseException) -> str:
    reason = error.strerror if isinstance(error, OSError) and error.strerror else one_line(error)
    try:
        free = f"; {shutil.disk_usage(path.parent).free / 1e6:.1f} MB free there"
    except OSError:
        free = ""
    kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
    return f"cannot write {path} ({reason}{free}): make room or write elsewhere; {kept}"


def atomic_torch_save(obj, path: Path) -> None:
    _atomic(path, lambda file: torch.save(obj, file))


def atomic_write_text(path: Path, text: str) -> None:
    _atomic(path, lambda file: file.write(text.encode()))


def output_paths(args) -> dict[str, Path]:
    folder = Path(args.checkpoint).parent
    return {"best": Path(args.checkpoint), "info": Path(args.checkpoint).with_suffix(".json"),
            "last": folder / "last.pth", "history": folder / "history.json", "plot": Path(args.plot)}


def check_writable(args) -> None:
    """Fail before training, not after the first epoch, when an output cannot be written.

    Creates nothing, so every rank may call it: the folders are made by rank 0 when it saves.
    """
    for name, path in output_paths(args).items():
        existing = path.parent.absolute()
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            flag = "--plot" if name == "plot" else "--checkpoint"
            why = "is not a folder" if not existing.is_dir() else "is not writable"
            raise UserError(f"{flag}: cannot write to folder {path.parent} ({existing} {why})")


def model_info(args, global_batch: int) -> dict:
    return {"arch": args.arch, "image_size": args.image_size, "num_classes": len(CLASSES),
            "classes": list(CLASSES), "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
            "batch_size": global_batch, "seed": args.seed, "val_fraction": args.val_fraction,
            "lr": args.lr, "momentum": args.momentum}


def save_epoch(args, history: list[dict], model: torch.nn.Module, optimizer, scaler,
               global_batch: int) -> bool:
    """Write the files of a finished epoch (call on rank 0 only); True if it is the best so far."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: save the plain names
    paths = output_paths(args)
    is_best = history[-1]["val_acc"] > max((r["val_acc"] for r in history[:-1]), default=-1.0)
    info = model_info(args, global_batch)
    if is_best:
        atomic_torch_save(model.state_dict(), paths["best"])
        atomic_write_text(paths["info"], json.dumps({**info, "epoch": history[-1]["epoch"]}, indent=2))
    atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "scaler": scaler.state_dict() if scaler is not None else {},
                       "epoch": history[-1]["epoch"], "history": history, "info": info,
                       "rng": torch.get_rng_state()}, paths["last"])
    atomic_write_text(paths["history"], history_text(history))
    _atomic(paths["plot"], lambda file: plot_history(history, file))
    return is_best


def resume(args, model: torch.nn.Module, optimizer, scaler, global_batch: int,
           announce: bool = True) -> list[dict]:
    """Load last.pth into model, optimizer and scaler; returns the history so far ([] if fresh)."""
    path = output_paths(args)["last"]
    if not path.exists():
        if announce:
            print(f"--resume: no {path} yet, starting from epoch 1")
        return []
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        saved = state["info"]
    except Exception as error:  # a truncated or foreign file: many exception types
        raise UserError(f"cannot resume from {path} ({type(error).__name__}); delete it to start over") from None
    now = model_info(args, global_batch)
    for key in RESUME_KEYS:
        if saved.get(key) != now[key]:
            flag = "--batch-size (x processes)" if key == "batch_size" else "--" + key.replace("_", "-")
            raise UserError(f"{path} was trained with {flag} {saved.get(key)}, not {now[key]}; "
                            "use the same flags to resume, or delete it to start over")
    getattr(model, "_orig_mod", model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler is not None and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"])
    if announce:
        print(f"resumed from {path} after epoch {state['epoch']}")
    return state["history"]
