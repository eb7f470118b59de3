"""FSDP's `last`: a folder of torch.distributed.checkpoint (DCP) beside best.pth, in which each rank
writes its own shards; it resumes at any number of processes, and in any mode.

    last.dcp/   .metadata       DCP's: where each piece of each tensor is
                __R_0.distcp    rank R's pieces of the weights, the optimizer state and the weight
                                average (--ema-decay), as its shards hold them: no rank gathers more
                training.pt     what last.pth holds besides those tensors (rank 0's): the history,
                                the place in the epoch, each rank's metric sums of its finished
                                steps, the schedule, the gradient scaler, the run's info

Written whole or not at all: every rank writes into a new folder beside it
(`.last.dcp.STEP-N.tmp`); once DCP's metadata is there (rank 0 writes it after every rank has
written its part), rank 0 moves the old folder aside (`.last.dcp.previous`), renames the new one
into place and removes the old one. A crash before the first rename leaves the old folder in place
and a temporary one that the next start removes; a crash between the renames leaves no last.dcp
and the old folder whole beside it, which the next start puts back (repair). Readers go by
`whole_folder`: last.dcp, else the previous one.

Step checkpoints are written with dcp.async_save: the shards are copied to host memory (the
staging, FileSystemWriter's), then written by a thread while training goes on; the next save, a
stop and the end of the run wait for it first (ShardWriter.wait). Their collectives go over a
process group of their own (gloo), which the training's collectives never wait behind.

A run of another mode (one device, DDP, accelerate) reads the folder whole (read_whole) without a
process group; FSDP loads its pieces of it (load_shards), which DCP cuts from the saved pieces at
any world size.
"""
import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from src.config import Config
from src.errors import UserError

NAME = "last.dcp"
TRAINING = "training.pt"
PREVIOUS = f".{NAME}.previous"
TENSORS = ("model", "optimizer", "average")  # the parts DCP holds; training.pt holds the rest


def folder_of(args: Config) -> Path:
    """The last.dcp folder of a run (beside --checkpoint)."""
    return Path(args.checkpoint).parent / NAME


def whole_folder(folder: Path) -> Path | None:
    """The whole last.dcp at `folder`: the folder itself, or the previous one that a crash between
    the two renames of a save left beside it; None without either."""
    folder = Path(folder)
    for path in (folder, folder.parent / PREVIOUS):
        if path.is_dir() and not path.is_symlink():
            return path
    return None


def temporaries(folder: Path) -> list[Path]:
    """The new folders of saves that never finished (a crash, a kill), beside `folder`."""
    folder = Path(folder)
    try:
        names = os.listdir(folder.parent)
    except OSError:
        return []
    return [folder.parent / name for name in names if name.startswith(f".{NAME}.") and name.endswith(".tmp")]


def repair(folder: Path) -> None:
    """At a run's start (rank 0, holding the folder's lock): the previous folder back in place
    where a crash came between a save's two renames, or removed where the new one got there; the
    new folders of saves that never finished removed."""
    folder = Path(folder)
    previous = folder.parent / PREVIOUS
    if previous.is_dir():
        if folder.exists():
            shutil.rmtree(previous)
        else:
            os.replace(previous, folder)
    for stale in temporaries(folder):
        shutil.rmtree(stale, ignore_errors=True)


def remove(folder: Path) -> None:
    """last.dcp and whatever its saves left beside it (--overwrite)."""
    folder = Path(folder)
    for path in (folder, folder.parent / PREVIOUS, *temporaries(folder)):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)


def read_training(folder: Path) -> dict:
    """training.pt of a whole last.dcp: last.pth's content without the model, optimizer and
    average tensors ("average" holds its update count alone)."""
    return torch.load(Path(folder) / TRAINING, map_location="cpu", weights_only=True)


def position(folder: Path) -> tuple[int, int] | None:
    """(finished epochs, steps into the next) of the whole last.dcp at `folder`, None without one."""
    whole = whole_folder(folder)
    if whole is None:
        return None
    training = read_training(whole)
    return int(training["epoch"]), int(training.get("step", 0))


# Writing.

def _names(model: nn.Module) -> dict[int, str]:
    return {id(param): name for name, param in model.named_parameters()}


def shards_of(model: nn.Module, optimizer: torch.optim.Optimizer, average) -> dict:
    """What each rank writes: its pieces (DTensors' local shards) of the weights and buffers, of the
    optimizer state (keyed by parameter name, as torch's get_optimizer_state_dict gives it) and of
    the weight average (by parameter name; its buffers are the model's). No collective, no copy."""
    shards: dict[str, Any] = {"model": get_model_state_dict(model)}
    if optimizer.state:
        shards["optimizer"] = get_optimizer_state_dict(model, optimizer)
    else:  # a stateless optimizer (SGD without momentum): torch's call would step it once to make one
        names = _names(model)
        shards["optimizer"] = {"state": {}, "param_groups": [
            {**{key: value for key, value in group.items() if key != "params"},
             "params": [names[id(param)] for param in group["params"]]} for group in optimizer.param_groups]}
    if average is not None and average.on:
        shards["average"] = average_shards(model, average)
    return shards


def average_shards(model: nn.Module, average) -> dict:
    """The weight average's tensors (this rank's shards), by the name of the parameter each averages."""
    names = _names(model)
    return {names[id(param)]: tensor for param, tensor in zip(average.params, average.average)}


def _fsync_folder(folder: Path) -> None:
    """The folder's entries (a rename) on disk."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(new: Path, folder: Path, replaces: Path | None = None) -> None:
    """Rank 0, once every rank's part of the save in `new` and DCP's metadata are there: `new`
    becomes `folder` (see the module's docstring); `replaces` (an older last.pth beside it) goes."""
    previous = folder.parent / PREVIOUS
    if folder.exists():
        if previous.exists():  # left by a crash after the renames; folder is whole
            shutil.rmtree(previous)
        os.replace(folder, previous)
    os.replace(new, folder)
    _fsync_folder(folder.parent)
    shutil.rmtree(previous, ignore_errors=True)
    if replaces is not None:
        replaces.unlink(missing_ok=True)


def host_copy(value):
    """A copy of a state_dict in host memory, each tensor copied once (a DTensor's shard, as a
    DTensor of the same mesh and placements); what dcp.async_save writes while training goes on."""
    if isinstance(value, dict):
        return {key: host_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [host_copy(item) for item in value]
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().to("cpu", copy=True), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.to("cpu", copy=True)
    return value


class _Writer(FileSystemWriter):
    """DCP's FileSystemWriter, whose staging (the copy dcp.async_save makes before its thread writes)
    copies each tensor once (host_copy): torch's deep-copies a DTensor first and copies it again
    (ResNet-18 in a world of one, torch 2.14.1, 2 busy cores: three copies of each tensor, 5.4 s
    against host_copy's 0.5 s)."""

    def stage(self, state_dict: dict) -> dict:
        self.per_thread_copy_ahead = 0  # as torch's: the copy is in host memory already
        return host_copy(state_dict)


class ShardWriter:
    """Writes last.dcp with DCP's dcp.save or dcp.async_save (`write`), one save at a time. Every
    rank calls save() at the same places; rank 0 writes training.pt and renames the folder."""

    def __init__(self):
        self.group = None  # the saves' own process group, made at the first save (every rank at once)
        self.pending: tuple[Future, threading.Event, list] | None = None
        self.saves = 0

    def save(self, write: Callable, folder: Path, shards: dict, training: dict | None, run_step: int,
             replaces: Path | None = None) -> None:
        """write(shards) into a new folder beside `folder`, renamed onto it when complete. `training`:
        training.pt's content (rank 0; None elsewhere). Returns when dcp.save has written it, or
        when dcp.async_save has copied the shards to host memory (its thread writes them)."""
        self.wait()
        if self.group is None:
            self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.saves += 1
        new = folder.parent / f".{NAME}.{run_step}-{self.saves}.tmp"
        if training is not None:
            new.mkdir(parents=True, exist_ok=True)
            with open(new / TRAINING, "wb") as file:
                torch.save(training, file)
                file.flush()
                os.fsync(file.fileno())
        writer = _Writer(new)  # its stage() copies the shards to host memory for async_save
        result = write(shards, storage_writer=writer, process_group=self.group)
        future = getattr(result, "upload_completion", result)  # torch's AsyncSaveResponse, or a Future
        if not isinstance(future, Future):  # dcp.save: written
            if training is not None:
                commit(new, folder, replaces)
            return
        done, failed = threading.Event(), []

        def finished(future: Future) -> None:  # in the writing thread, when every rank's part is there
            try:
                future.result()
                if training is not None:
                    commit(new, folder, replaces)
            except BaseException as error:  # raised by wait(), in the training thread
                failed.append(error)
            finally:
                done.set()
        future.add_done_callback(finished)
        self.pending = (future, done, failed)

    def wait(self) -> None:
        """Until the save in progress (if any) is written and in place."""
        if self.pending is None:
            return
        _, done, failed = self.pending
        self.pending = None
        done.wait()
        if failed:
            raise failed[0]


# Reading.

def read_whole(folder: Path) -> dict:
    """The whole last.dcp at `folder` as last.pth holds it: whole tensors, the optimizer state
    numbered by parameter as one process numbers it; read in this process, with or without a
    process group (for a run of another mode, and the tools)."""
    training = read_training(folder)
    shards: dict = {}
    _load_state_dict(shards, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(),
                     no_dist=True)
    model = shards["model"]
    optimizer = shards["optimizer"]
    order = [name for group in optimizer["param_groups"] for name in group["params"]]
    number = {name: i for i, name in enumerate(order)}
    numbered = {"state": {number[name]: state for name, state in optimizer.get("state", {}).items()},
                "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                                 for group in optimizer["param_groups"]]}
    average = training.get("average")
    if average is not None:  # the averaged parameters, and the model's buffers
        averaged = shards["average"]
        average = {"model": {key: averaged.get(key, value) for key, value in model.items()},
                   "updates": average["updates"]}
    return {**training, "model": model, "optimizer": numbered, "average": average}


def saved_keys(folder: Path) -> set[str]:
    """The tensors (flattened names: model.NAME, optimizer.state.NAME.KEY, ...) that a last.dcp holds."""
    return set(FileSystemReader(folder).read_metadata().state_dict_metadata)


def load_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, average,
                updates: int | None) -> None:
    """A whole last.dcp into this rank's shards of the model, optimizer and weight average, at any
    world size (DCP reads the pieces of the saved pieces that this rank's shards cover); `updates`:
    the average's update count (training.pt's). Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    from src.fsdp import requiring_grad
    # The parameters with an optimizer state in the file (not those that were frozen then): torch's
    # optimizer calls give every parameter that requires a gradient one (src/fsdp.py).
    held = {key.rsplit(".", 1)[0] for key in saved_keys(folder) if key.startswith("optimizer.state.")}
    names = _names(model)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    with requiring_grad(params, [f"optimizer.state.{names[id(param)]}" in held for param in params]):
        shards: dict[str, Any] = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(shards, checkpoint_id=folder)
        set_model_state_dict(model, shards["model"])
        set_optimizer_state_dict(model, optimizer, shards["optimizer"])
    if average is not None and average.on:
        if updates is None:  # --ema-decay is compared on --resume: a run with an average resumes one that had it
            raise UserError(f"{folder} holds no weight average (--ema-decay): resume it without --ema-decay")
        # After the optimizer: loading one may step it (a stateless one), which updates the average.
        dcp.load({"average": average_shards(model, average)}, checkpoint_id=folder)
        average.updates, average.skipped = int(updates), None


def local_tensors(state: dict) -> dict[str, torch.Tensor]:
    """A state_dict's tensors as this rank holds them (a DTensor's local shard)."""
    return {key: value.to_local() if isinstance(value, DTensor) else value
            for key, value in state.items() if isinstance(value, torch.Tensor)}
