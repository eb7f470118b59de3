"""Checkpoint files, each written to a temporary file in its folder and renamed into place.

- best.pth   plain state_dict of the unwrapped model at its best validation score (--best-by)
- best.json  what predict needs to use it: architecture, image size, normalisation, classes, and
             the sha256 of the best.pth it describes, so that a pair torn by a crash is detected
- last.pth   everything to resume: model, optimizer, scaler, schedule, epoch, history
- history.json  one record per finished epoch
"""
import json
import tempfile
from pathlib import Path

import torch

from src.atomic import atomic_torch_save, atomic_write, atomic_write_text
from src.datasets import CLASSES
from src.errors import UserError, one_line
from src.history import best_record, history_text
from src.plot import plot_history
from src.ranks import from_rank_0, is_first, restarted
from src.transforms import IMAGENET_MEAN, IMAGENET_STD

# What must match for --resume to continue the same run. --accumulate is not among them: the
# same global batch in other micro-batches takes the same steps.
RECIPE_FLAGS = ("lr", "momentum", "optimizer", "weight_decay", "lr_schedule", "warmup_epochs",
                "label_smoothing", "clip_grad_norm", "augment", "dropout", "best_by", "freeze",
                "freeze_epochs")
RESUME_KEYS = ("arch", "image_size", "batch_size", "seed", "val_fraction", "data") + RECIPE_FLAGS
# How each key is spelled on the command line, where it is not --key.
FLAGS = {"batch_size": "--batch-size (x processes x --accumulate)", "data": "--data-dir (its images)"}

def output_paths(args) -> dict[str, Path]:
    folder = Path(args.checkpoint).parent
    return {"best": Path(args.checkpoint), "info": Path(args.checkpoint).with_suffix(".json"),
            "last": folder / "last.pth", "history": folder / "history.json", "plot": Path(args.plot)}


def check_writable(args) -> None:
    """Fail before training, not after the first epoch, when an output cannot be written.

    Tries it: makes the folders, writes and removes a probe file in each (os.access answers yes
    to root where nothing can be created, as in /proc). Also removes the temporary files that a
    killed run of these outputs left behind. Rank 0 tries; every rank gets its verdict.
    """
    from_rank_0(lambda: _try_outputs(args))


def _try_outputs(args) -> None:
    for name, path in output_paths(args).items():
        flag = "--plot" if name == "plot" else "--checkpoint"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=path.parent):
                pass
        except OSError as error:
            raise UserError(f"{flag}: cannot write to folder {path.parent} ({error.strerror})") from None
        for stale in path.parent.glob(f".{path.name}.*.tmp"):  # from a run killed while saving
            stale.unlink(missing_ok=True)


def run_info(args, global_batch: int, data: str) -> dict:
    """What identifies this run: best.json's content, and what --resume must find unchanged.

    `data` is the digest of the label table (labelled_data); global_batch includes --accumulate.
    """
    return {"arch": args.arch, "image_size": args.image_size, "num_classes": len(CLASSES),
            "classes": list(CLASSES), "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
            "batch_size": global_batch, "seed": args.seed, "val_fraction": args.val_fraction,
            "data": data, "epochs": args.epochs,
            **{key: getattr(args, key) for key in RECIPE_FLAGS}}


def save_epoch(args, history: list[dict], model: torch.nn.Module, optimizer, scaler, schedule,
               info: dict) -> bool:
    """Write the files of a finished epoch (call on rank 0 only); True if it is the best so far."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: save the plain names
    paths = output_paths(args)
    is_best = best_record(history, args.best_by) is history[-1]
    if is_best:
        digest = atomic_torch_save(model.state_dict(), paths["best"])
        atomic_write_text(paths["info"], json.dumps(
            {**info, "epoch": history[-1]["epoch"], "sha256": digest}, indent=2))
    atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                       "scaler": scaler.state_dict() if scaler is not None else {},
                       "schedule": schedule.state_dict(), "epoch": history[-1]["epoch"],
                       "history": history, "info": info}, paths["last"])
    atomic_write_text(paths["history"], history_text(history))
    atomic_write(paths["plot"], lambda file: plot_history(history, file))
    return is_best


def _read_last(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a truncated or foreign file: many exception types
        raise UserError(f"cannot resume from {path} ({type(error).__name__}); delete it to start over") from None


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """optimizer.load_state_dict(saved), keeping this device's kernel choice (fused on a GPU, not
    on a CPU), which the fp16 scaler relies on. The choice goes into the saved groups before
    loading: load_state_dict places AdamW's `step` tensors by the saved groups' flags
    (torch/optim/optimizer.py), so a CPU checkpoint's would stay on the CPU, and fused AdamW on a
    GPU refuses them at the first step."""
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group}
               for group in optimizer.param_groups]
    groups = [{**old, **kept} for old, kept in zip(saved["param_groups"], kernels)]
    optimizer.load_state_dict({**saved, "param_groups": groups})


def resume(args, info: dict, model: torch.nn.Module, optimizer, scaler, schedule) -> list[dict]:
    """With --resume (or in a worker that torchrun restarted), load last.pth into model,
    optimizer, scaler and schedule; returns the history so far ([] without).

    Rank 0 reads the file and sends it to every rank: on nodes without a shared disk only rank
    0's node has it. Refuses a last.pth of another run (flags, data) or one that has --epochs
    already.
    """
    if not (args.resume or restarted()):
        return []
    path, announce = output_paths(args)["last"], is_first()
    state = from_rank_0(lambda: _read_last(path))
    if state is None:
        if announce:
            print(f"--resume: no {path} yet, starting from epoch 1")
        return []
    try:
        saved = state["info"]
        for key in RESUME_KEYS + (("epochs",) if args.lr_schedule != "constant" else ()):
            if saved.get(key) != info[key]:
                flag = FLAGS.get(key, "--" + key.replace("_", "-"))
                why = " (the schedule spans the run)" if key == "epochs" else ""
                raise UserError(f"{path} was trained with {flag} {saved.get(key)}, not {info[key]}{why}; "
                                "use the same flags to resume, or delete it to start over")
        if state["epoch"] > args.epochs:
            raise UserError(f"{path} has finished {state['epoch']} epochs, more than --epochs "
                            f"{args.epochs}; pass --epochs above {state['epoch']} to train more")
        getattr(model, "_orig_mod", model).load_state_dict(state["model"])
        load_optimizer(optimizer, state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        if scaler is not None and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:  # an older or foreign last.pth
        raise UserError(f"cannot resume from {path} ({type(error).__name__}: {one_line(error)}); "
                        "delete it to start over") from None
    if announce:
        more = "nothing left to train" if state["epoch"] == args.epochs else "going on"
        print(f"resumed from {path} after epoch {state['epoch']} of {args.epochs}: {more}")
    return state["history"]
