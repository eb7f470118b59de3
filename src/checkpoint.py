"""Checkpoint files, each written to a temporary file in its folder and renamed into place.

- best.pth   plain state_dict of the unwrapped model at its best validation accuracy
- best.json  what predict needs to use it: architecture, image size, normalisation, classes
- last.pth   everything to resume: model, optimizer, scaler, epoch, history, RNG state
- history.json  one record per finished epoch
"""
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from src.datasets import CLASSES
from src.errors import UserError
from src.history import history_text, plot_history
from src.transforms import IMAGENET_MEAN, IMAGENET_STD

# What must match for --resume to continue the same run.
RESUME_KEYS = ("arch", "image_size", "batch_size", "seed", "val_fraction", "lr", "momentum")


def _atomic(path: Path, write: Callable[[str], None]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def atomic_torch_save(obj, path: Path) -> None:
    _atomic(path, lambda tmp: torch.save(obj, tmp))


def atomic_write_text(path: Path, text: str) -> None:
    _atomic(path, lambda tmp: Path(tmp).write_text(text))


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
    plot_history(history, paths["plot"])
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
