"""Checkpoint files, each written to a temporary file in its folder and renamed into place.

- best.pth   plain state_dict of the unwrapped model at its best validation score (--best-by)
- best.json  what predict needs to use it: architecture, image size, normalisation, classes, and
             the sha256 of the best.pth it describes, so that a pair torn by a crash is detected
- last.pth   everything to resume: model, optimizer, scaler, schedule, epoch, history; written at
             each epoch's end, and with --save-every-steps (or a stop on a signal) inside an epoch
             too, with the steps done in it and their partial sums (src/state.py)
- last.dcp/  the same under FSDP, each rank's shards written by itself (src/sharded_checkpoint.py);
             --resume reads whichever of the two is newer, in any mode
- history.json  one record per finished epoch
"""
import json
import os
import socket
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from src import sharded_checkpoint
from src.checkpoint_writer import Later
from src.config import Config
from src.datasets import CLASSES
from src.devices import hardware
from src.divergence import check_finite_weights, refuse_non_finite
from src.errors import UserError, one_line
from src.history import RECORD_KEYS, best_choice, history_text
from src.outputs import atomic_torch_save, atomic_write, atomic_write_text, input_problem, output_paths
from src.plot import plot_history
from src.ranks import from_rank, gather, is_first, is_node_first, restarted
from src.transforms import IMAGENET_MEAN, IMAGENET_STD

if TYPE_CHECKING:  # src.fsdp loads FSDP's modules, which a run without them does not need
    from src.fsdp import WholeModel, WholeOptimizer

# Recipe flags younger than some last.pth files, with their defaults: a last.pth without the key was
# trained with the default, which it then resumes with.
ADDED_LATER = {"auto_augment": None, "ra_magnitude": 9, "augmix_severity": 3, "random_erase": 0.0,
               "mixup_alpha": 0.0, "cutmix_alpha": 0.0}
# What must match for --resume to continue the same run. --accumulate is not among them: the
# same global batch in other micro-batches takes the same steps.
RECIPE_FLAGS = ("lr", "momentum", "optimizer", "weight_decay", "lr_schedule", "warmup_epochs",
                "label_smoothing", "clip_grad_norm", "augment", "dropout", "best_by", "freeze",
                "freeze_epochs", "sync_bn", "ema_decay") + tuple(ADDED_LATER)
RESUME_KEYS = ("arch", "image_size", "batch_size", "seed", "val_fraction", "data", "val_data") + RECIPE_FLAGS
# How each key is spelled on the command line, where it is not --key.
FLAGS = {"batch_size": "--batch-size (x processes x --accumulate)", "data": "--data-dir (its images)",
         "val_data": "--val-dir (its images)"}


def flag_of(key: str) -> str:
    """The command-line flag that sets a key of best.json / last.pth's info."""
    return FLAGS.get(key, "--" + key.replace("_", "-"))


def run_info(args: Config, global_batch: int, data: str, val_data: str | None = None) -> dict:
    """What identifies this run: best.json's content, and what --resume must find unchanged.

    `data` is the digest of the label table (labelled_data), `val_data` that of --val-dir's (None
    without it; val_fraction is None with it); global_batch includes --accumulate.
    """
    return {"arch": args.arch, "image_size": args.image_size, "num_classes": len(CLASSES),
            "classes": list(CLASSES), "mean": list(IMAGENET_MEAN), "std": list(IMAGENET_STD),
            "batch_size": global_batch, "seed": args.seed, "val_fraction": args.val_fraction,
            "data": data, "val_data": val_data, "epochs": args.epochs,
            **{key: getattr(args, key) for key in RECIPE_FLAGS}, **run_context(args)}


def run_context(args: Config) -> dict:
    """What the report shows and --resume does not compare (a last.pth resumes in another mode):
    the mode (the script's name: train_ddp.py is "ddp"), the processes, when, rank 0's machine
    and every flag."""
    return {"mode": args.mode,
            "processes": dist.get_world_size() if dist.is_initialized() else 1,  # not a WORLD_SIZE left in the environment
            "started": datetime.now().isoformat(timespec="seconds"),
            "hardware": hardware() if is_first() else "",  # rank 0 asks for GPU 0's name: its own
            "flags": {key: value if isinstance(value, (str, int, float, bool, type(None))) else str(value)
                      for key, value in args.as_dict().items() if key not in ("local_rank", "command", "mode")}}


def write_epoch(args: Config, history: list[dict], info: dict, model_state: dict, last: dict,
                average_state: dict | None = None) -> bool:
    """Write the files of a finished epoch (rank 0): best.pth if it is the best so far, best.json,
    last.pth (`last`, last_state's), history.json and the plot; True if it is the best so far.

    `model_state`: the plain model's state_dict; `average_state`: the weight average's
    (src.ema.WeightAverage.state_dict(): {"model", "updates"}), None without --ema-decay. best.pth
    holds whichever of the weights and their average --best-by picks, and best.json says which."""
    is_best = write_best(args, history, info, model_state, average_state)
    paths = output_paths(args)
    atomic_torch_save(last, paths["last"])
    sharded_checkpoint.remove(sharded_checkpoint.folder_of(args))  # an FSDP run's, that this one resumed: older
    write_history(args, history)
    return is_best


def write_best(args: Config, history: list[dict], info: dict, model_state: dict | None,
               average_state: dict | None) -> bool:
    """best.pth and best.json if the last epoch of `history` is the best so far (write_epoch's
    first files); whether it is. `model_state` may be None where best.pth is not to hold the
    weights (FSDP gathers them for a new best only)."""
    paths = output_paths(args)
    best, weights = best_choice(history, args.best_by)
    is_best = best["epoch"] == history[-1]["epoch"]
    if is_best:
        # best.json holds its digest: predict checks the pair (the only file whose hash is used).
        if weights == "average" and average_state is None:  # best_choice offers an average only where the records hold one
            raise ValueError("the history holds --ema-decay's average but the run keeps none")
        if weights == "weights" and model_state is None:
            raise ValueError("a new best of the weights without their whole state_dict")
        chosen = average_state["model"] if weights == "average" and average_state is not None else model_state
        digest = atomic_torch_save(chosen, paths["best"], hashed=True)
        atomic_write_text(paths["info"], json.dumps(
            {**info, "epoch": history[-1]["epoch"], "weights": weights, "sha256": digest}, indent=2))
    return is_best


def write_history(args: Config, history: list[dict]) -> None:
    """history.json and the plot (write_epoch's last files)."""
    paths = output_paths(args)
    atomic_write_text(paths["history"], history_text(history))
    atomic_write(paths["plot"], lambda file: plot_history(history, file))


def last_state(history: list[dict], model_state: dict | None, optimizer_state: dict | None, average_state: dict | None,
               scaler, schedule, info: dict, step: int = 0, partial: dict | None = None, held: bool = False) -> dict:
    """last.pth's content after the epochs in `history` and `step` optimizer steps of the next one;
    `partial` (step > 0): each rank's metric sums of those steps (one row per rank) and their
    seconds (train_seconds, data_wait_seconds). `held`: for a writer that copies its tensors and
    makes its Laters (src.checkpoint_writer; a step checkpoint): nothing read from the device here."""
    state = {"model": model_state, "optimizer": optimizer_state, "scaler": scaler_state(scaler, held),
             "schedule": schedule.state_dict(), "average": average_state,
             "epoch": history[-1]["epoch"] if history else 0, "step": step, "history": list(history), "info": info}
    return {**state, "partial": partial} if step else state


def scaler_state(scaler, held: bool = False) -> dict:
    """The gradient scaler's state_dict ({} without one). `held` (a step checkpoint, which its
    writer copies and writes): the scale and the growth tracker that the device holds as Laters
    (src.checkpoint_writer), where torch's state_dict reads each with .item() (torch 2.14.1,
    amp/grad_scaler.py: get_scale, _get_growth_tracker), making the host wait inside the step."""
    if scaler is None:
        return {}
    scale, tracker = getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None)
    if not (held and scaler.is_enabled() and isinstance(scale, torch.Tensor) and isinstance(tracker, torch.Tensor)):
        return scaler.state_dict()
    # state_dict's five entries, in its order
    return {"scale": Later(scale, lambda value: float(value.item())), "growth_factor": scaler.get_growth_factor(),
            "backoff_factor": scaler.get_backoff_factor(), "growth_interval": scaler.get_growth_interval(),
            "_growth_tracker": Later(tracker, lambda value: int(value.item()))}


def _read_last(path: Path, mmap: bool = False) -> dict | None:
    """last.pth, or None where there is none; mmap: map the tensors instead of reading them."""
    if not os.path.lexists(path):
        return None
    if input_problem(path) is not None:  # not opened: a named pipe would wait for a writer
        raise UserError(f"cannot resume from {_where(path)}: {input_problem(path)}; delete it to start over")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # a truncated or foreign file: many exception types
        raise UserError(f"cannot resume from {_where(path)} ({type(error).__name__}); "
                        "delete it to start over") from None


def _where(path: Path) -> str:
    """path, with this machine's name in a job that spans several."""
    nodes = int(os.environ.get("WORLD_SIZE", 1)) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return f"{socket.gethostname()}:{path}" if nodes > 1 else str(path)


def _epoch_here(path: Path, sharded: bool = False) -> tuple[tuple[int, int], int, str] | None | UserError:
    """What this node's last holds, as its first process sees it: ((the epoch, the steps of the
    next one), a preference, its path) of the newer of last.pth and last.dcp (on a tie the one
    this mode writes: last.dcp under FSDP), None without either (or on the node's other
    processes), or why it cannot be read."""
    return _newer_here(path, sharded) if is_node_first() else None


def _newer_here(path: Path, sharded: bool) -> tuple[tuple[int, int], int, str] | None | UserError:
    found = []
    try:
        state = _read_last(path, mmap=True)  # the epoch only: the tensors stay on disk
        if state is not None:
            found.append(((int(state["epoch"]), int(state.get("step", 0))), int(not sharded), str(path)))
    except UserError as error:
        return error
    except (KeyError, IndexError, TypeError, ValueError):  # another kind of file
        return UserError(f"cannot resume from {_where(path)} (no epoch in it); delete it to start over")
    folder = path.parent / sharded_checkpoint.NAME
    try:
        at = sharded_checkpoint.position(folder)
        if at is not None:
            found.append((at, int(sharded), str(folder)))
    except Exception as error:  # a truncated or foreign training.pt: many exception types
        return UserError(f"cannot resume from {_where(folder)} ({type(error).__name__} in its "
                         f"{sharded_checkpoint.TRAINING}); delete it to start over")
    return max(found) if found else None


def _newest_last(path: Path, sharded: bool = False) -> tuple[int, dict | None]:
    """(the rank it came from, its content) of the newest last (last.pth or last.dcp) on any node,
    on every rank. A last.dcp as last.pth holds it (read whole), or `sharded` (FSDP, which loads
    its pieces itself) its training.pt with the folder under "shards".

    Without a shared disk each node has its own folder, and rank 0 may sit on another node
    than in the run that wrote the file (torchrun's c10d rendezvous places it anew at every
    start and restart). So each node's first process reports the epoch of its last, and
    the newest is sent from there (rank 0's on a tie: nothing to copy)."""
    epochs = gather(_epoch_here(path, sharded))
    for epoch in epochs:
        if isinstance(epoch, UserError):
            raise UserError(str(epoch), quiet=not is_first())
    places = [epoch for epoch in epochs if not isinstance(epoch, UserError)]  # all of them: raised above
    held = [(epoch[:2], -rank, epoch[2]) for rank, epoch in enumerate(places) if epoch is not None]
    if not held:
        return 0, None
    source = -max(held)[1]
    found = Path(max(held)[2])
    if found == path:
        return source, from_rank(source, lambda: _read_found(path))
    return source, from_rank(source, lambda: _read_folder(found, sharded))


def _read_found(path: Path) -> dict:
    """The last.pth that _newest_last found, as it sends it."""
    state = _read_last(path)
    if state is None:
        raise _gone(path)
    return {**state, "from": _where(path)}


def _gone(path: Path) -> UserError:
    """A last that _newest_last found and that is gone when it is read (deleted, or a run of the
    same folder moved it): one line, not a traceback."""
    return UserError(f"cannot resume from {_where(path)}: it was removed while this run started; start the run again")


def _read_folder(folder: Path, sharded: bool, resuming: bool = True) -> dict:
    """A whole last.dcp as _newest_last sends it (`resuming`: its error says so)."""
    whole = sharded_checkpoint.whole_folder(folder)
    if whole is None:
        raise _gone(folder)
    try:
        if sharded:
            return {**sharded_checkpoint.read_training(whole), "from": _where(folder), "shards": str(whole)}
        return {**sharded_checkpoint.read_whole(whole), "from": _where(folder)}
    except (Exception, CheckpointException) as error:  # a torn or foreign folder: many exception types
        if not resuming:
            raise UserError(f"cannot read {_where(folder)} ({_why(error)})") from None
        raise UserError(f"cannot resume from {_where(folder)} ({_why(error)}); delete it to start over") from None


def _why(error: BaseException) -> str:
    """What is wrong with a last that cannot be read, on one line: a last.dcp's part that is not of
    its save says so itself (sharded_checkpoint.Unreadable); other errors with their type."""
    error = sharded_checkpoint.unwrapped(error)
    if isinstance(error, sharded_checkpoint.Unreadable):
        return one_line(error)
    return f"{type(error).__name__}: {one_line(error)}"


def last_position(folder: Path) -> tuple[int, int] | None:
    """(finished epochs, steps into the next) of a run folder's last (the newer of last.pth and
    last.dcp), None without either."""
    found = _newer_here(Path(folder) / "last.pth", sharded=False)
    if isinstance(found, UserError):
        raise found
    return None if found is None else found[0]


def read_last(folder: Path) -> dict | None:
    """The last of a run's folder (the newer of last.pth and last.dcp) as last.pth holds it, read in
    this process; None without either. For the tools and tests."""
    path = Path(folder) / "last.pth"
    found = _newer_here(path, sharded=False)
    if isinstance(found, UserError):
        raise found
    if found is None:
        return None
    if Path(found[2]) == path:
        return _read_last(path)
    return _read_folder(Path(found[2]), sharded=False, resuming=False)


def _best_files(args: Config) -> tuple[bytes | None, str | None]:
    paths = output_paths(args)
    best, info = paths["best"], paths["info"]
    return (best.read_bytes() if best.exists() else None, info.read_text() if info.exists() else None)


def _copy_to_rank_0(args: Config, state: dict, source: int) -> None:
    """Rank 0 on another node than the newest last.pth: bring the run's files here, where this
    run writes its next ones, so that this folder holds the whole run (best.pth may be from an
    epoch this node never saw). Every rank takes part in the broadcast."""
    best, info = from_rank(source, lambda: _best_files(args))
    if not is_first():
        return
    paths = output_paths(args)
    atomic_torch_save({key: value for key, value in state.items() if key != "from"}, paths["last"])
    written = ["last", "history", "plot"]
    if best is not None and info is not None:
        atomic_write(paths["best"], lambda file: file.write(best))
        atomic_write_text(paths["info"], info)
        written += ["best", "info"]
    atomic_write_text(paths["history"], history_text(state["history"]))
    atomic_write(paths["plot"], lambda file: plot_history(state["history"], file))
    print(f"rank 0 is on another node than {state['from']}: copied {', '.join(paths[key].name for key in written)} "
          f"from there to {_where(paths['last'].parent)}, where this run writes")


def _shown(key: str, value) -> str:
    """A saved or requested value as the user writes it on the command line."""
    if key == "dropout" and value is None:
        return "torchvision's default"
    if key == "val_fraction" and value is None:
        return "none (--val-dir)"
    if value is None or value is False:
        return "off"
    if value is True:
        return "on"
    return str(value)


def load_optimizer(optimizer: "torch.optim.Optimizer | WholeOptimizer", saved: dict) -> None:
    """optimizer.load_state_dict(saved), keeping this device's kernel choice (fused on a GPU, not
    on a CPU), which the fp16 scaler relies on. The choice goes into the saved groups before
    loading: load_state_dict places AdamW's `step` tensors by the saved groups' flags
    (torch/optim/optimizer.py), so a CPU checkpoint's would stay on the CPU, and fused AdamW on a
    GPU refuses them at the first step."""
    kernels = [{key: group[key] for key in ("fused", "foreach") if key in group}
               for group in optimizer.param_groups]
    groups = [{**old, **kept} for old, kept in zip(saved["param_groups"], kernels)]
    optimizer.load_state_dict({**saved, "param_groups": groups})
    # A state tensor keeps the memory format it was saved in: a run resumed with another
    # --channels-last would give CUDA's fused kernels momentum in one layout and weights in the
    # other, which they refuse. Each takes its parameter's layout.
    for param, state in getattr(optimizer, "state", {}).items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.stride() != param.stride():
                state[key] = torch.empty_like(param).copy_(value)


def _check_history(state: dict) -> None:
    """last.pth's history: a record with every field for each epoch it has finished."""
    history, epoch = state["history"], state["epoch"]
    if not isinstance(history, list) or not isinstance(epoch, int) or len(history) != epoch:
        raise ValueError(f"its history is not a list of its {epoch} epochs' records")
    for record in history:
        missing = [key for key in RECORD_KEYS if not isinstance(record, dict) or key not in record]
        if missing:
            raise ValueError(f"a record of its history lacks {', '.join(missing)}")


class Resumed(NamedTuple):
    """What load_last found: the history so far, and where the run goes on inside the next epoch
    (None: at its start): its steps done, this rank's metric sums of them and their seconds; the
    ids of the run's tracked runs (--track, src/tracking.py), None where it has none."""
    history: list[dict]
    partial: dict | None
    tracked_ids: dict | None = None


def load_last(args: Config, info: dict, model: "torch.nn.Module | WholeModel",
              optimizer: "torch.optim.Optimizer | WholeOptimizer", scaler, schedule, average=None,
              shards=None) -> Resumed:
    """With --resume (or in a worker that torchrun restarted), load last.pth (or last.dcp) into
    model, optimizer, the weight average, scaler and schedule; returns the history so far and the
    place in the next epoch (nothing without).

    The newest last of any node is sent to every rank (_newest_last): nodes without a
    shared disk each hold their own, and rank 0 may have moved. Refuses a last of another
    run (flags, data) or one that has --epochs already. `shards(folder, updates)` (FSDP): loads a
    last.dcp into this rank's shards and returns the names of its weights that are not finite;
    without it a last.dcp is read whole.
    """
    if not (args.resume or restarted()):
        return Resumed([], None)
    path, announce = output_paths(args)["last"], is_first()
    source, state = _newest_last(path, sharded=shards is not None)
    if state is None:
        if announce:
            print(f"--resume: no {path} yet, starting from epoch 1")
        return Resumed([], None)
    try:
        saved = state["info"]
        if not isinstance(saved, dict):
            raise TypeError(f"its info is a {type(saved).__name__}, not a dict")
        _check_history(state)
        for key in RESUME_KEYS + (("epochs",) if args.lr_schedule != "constant" else ()):
            trained = saved.get(key, ADDED_LATER.get(key))
            if trained != info[key]:
                flag = flag_of(key)
                why = " (the schedule spans the run)" if key == "epochs" else ""
                raise UserError(f"{state['from']} was trained with {flag} {_shown(key, trained)}, "
                                f"not {_shown(key, info[key])}{why}; "
                                "use the same flags to resume, or delete it to start over")
        if state["epoch"] > args.epochs:
            raise UserError(f"{state['from']} has finished {state['epoch']} epochs, more than --epochs "
                            f"{args.epochs}; pass --epochs above {state['epoch']} to train more")
        advice = "delete it to start over, with a lower --lr"
        if "shards" in state:  # FSDP's last.dcp: each rank reads the pieces its shards cover
            _check_shared(Path(state["shards"]), state["from"])
            found = gather(shards(Path(state["shards"]), (state["average"] or {}).get("updates")))
            refuse_non_finite(list(dict.fromkeys(name for names in found for name in names)), state["from"], advice)
        else:
            check_finite_weights(state["model"], state["from"], advice)
            getattr(model, "_orig_mod", model).load_state_dict(state["model"])
            # The optimizer before the average: loading a sharded (FSDP) optimizer steps it once with zero
            # gradients (torch's set_optimizer_state_dict), which would count as an update of the average.
            load_optimizer(optimizer, state["optimizer"])
            if average is not None:
                average.load(getattr(model, "_orig_mod", model), state["average"])
        schedule.load_state_dict(state["schedule"])
        if scaler is not None and state["scaler"]:
            scaler.load_state_dict(state["scaler"])
        step = int(state.get("step", 0)) if state["epoch"] < args.epochs else 0
        partial = _partial(state, step)
        tracked_ids = _tracked_ids(saved)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError, CheckpointException) as error:
        # an older or foreign last, or a last.dcp that lacks a piece
        raise UserError(f"cannot resume from {state['from']} ({_why(error)}); delete it to start over",
                        quiet=not is_first()) from None
    if source != 0 and "shards" not in state:  # a last.dcp is where every node sees it already
        _copy_to_rank_0(args, state, source)
    if announce:
        more = "nothing left to train" if state["epoch"] == args.epochs else "going on"
        where = (f"after epoch {state['epoch']} of {args.epochs}" if not step else
                 f"in epoch {state['epoch'] + 1} of {args.epochs} after its step {step}")
        print(f"resumed from {state['from']} {where}: {more}")
    return Resumed(list(state["history"]), partial, tracked_ids)


def _tracked_ids(info: dict) -> dict | None:
    """The ids of the tracked runs that last.pth's info names ({"mlflow": id, ...}), None without."""
    ids = info.get("tracking")
    if ids is not None and not (isinstance(ids, dict) and all(isinstance(v, str) for v in [*ids, *ids.values()])):
        raise TypeError(f"its tracked runs' ids {ids!r} are not a mapping of names to strings")
    return ids


def _check_shared(folder: Path, where: str) -> None:
    """Every rank sees the last.dcp folder: each reads its pieces from every rank's file in it."""
    blind = [rank for rank, seen in enumerate(gather(folder.is_dir())) if not seen]
    if blind:
        raise UserError(f"cannot resume from {where}: rank(s) {', '.join(map(str, blind))} do not see it; FSDP's "
                        "last.dcp must be in a folder that every node shares (--checkpoint)", quiet=not is_first())


def _partial(state: dict, step: int) -> dict | None:
    """Where the resumed run goes on inside epoch state["epoch"] (None at its start): the steps
    done, this rank's metric sums of them (each rank its own row: the same float sums as a run
    never stopped; in another number of processes, rank 0 takes their total) and their seconds."""
    if not step:
        return None
    rows, rank = state["partial"]["sums"], dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if len(rows) == world_size:
        sums = rows[rank].clone()
    else:
        sums = rows.sum(dim=0) if rank == 0 else torch.zeros_like(rows[0])
    return {"epoch": int(state["epoch"]), "step": step, "sums": sums,
            "train_seconds": float(state["partial"]["train_seconds"]),
            "data_wait_seconds": float(state["partial"]["data_wait_seconds"])}
