"""FSDP's `last`: a folder of torch.distributed.checkpoint (DCP) beside best.pth, in which each rank
writes its own shards; it resumes at any number of processes, and in any mode.

    last.dcp/   .metadata       DCP's: where each piece of each tensor is
                __R_0.distcp    rank R's pieces of the weights, the optimizer state and the weight
                                average (--ema-decay), as its shards hold them: no rank gathers more
                training.pt     what last.pth holds besides those tensors (rank 0's): the history,
                                the place in the epoch, each rank's metric sums of its finished
                                steps, the schedule, the gradient scaler, the run's info

One save, every part: each save has an id (a random token drawn once per run, the run's step and
the save's number), which training.pt holds, DCP's metadata holds (its save_id) and each rank's
file holds (the entry "save.R"). A file of another run or another save in the folder (a shard
copied over) is refused in one line naming it, before anything is loaded from it.

Nothing read runs code: DCP unpickles .metadata with pickle.load and the values that are not
tensors with torch.load(weights_only=False). Every read here goes through `checked` first, which
reads .metadata with an unpickler that builds DCP's own metadata classes and nothing else and
checks that every part is of one save; DCP then gets that metadata (_Reader) and loads the values
with weights_only=True (_WeightsOnly).

Written whole or not at all: every rank writes into a new folder beside it
(`.last.dcp.STEP-N.tmp`); once every rank has written its part and DCP's metadata is there, rank 0
writes training.pt into it, moves the old folder aside (`.last.dcp.previous`), renames the new
one into place and removes the old one, all inside DCP's last step (_Writer.finish), so that a
failure there reaches every rank as DCP's own do. A failed save (a full disk) is one line (rank
0's), the new folder is removed and the old one stays. A crash before the first rename leaves the
old folder in place and a temporary one that the next start removes; a crash between the renames
leaves no last.dcp and the old folder whole beside it, which the next start puts back (repair).
Readers go by `whole_folder`: last.dcp, else the previous one.

A folder is removed or renamed only when it is recognisably a save's (is_ours: a folder, not a
link, holding only the files a save writes): a folder of the user's at one of these names is
refused at the start of a run (check_ours), never replaced.

Step checkpoints are written with dcp.async_save: the shards are copied to host memory (the
staging, _Writer.stage: pinned buffers kept from one save to the next, the copies queued without
making the host wait, src.checkpoint_writer.HostCopies), then written by a thread while training
goes on; the next save, a stop and the end of the run wait for it first (ShardWriter.wait). Their
collectives go over a process group of their own (gloo), which the training's collectives never
wait behind.

A run of another mode (one device, DDP, accelerate) reads the folder whole (read_whole) without a
process group; FSDP loads its pieces of it (load_shards), which DCP cuts from the saved pieces at
any world size.
"""
import io
import os
import pickle
import re
import secrets
import shutil
import stat
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future as TorchFuture

from src.checkpoint_writer import Copied, HostCopies, numbers
from src.config import Config
from src.errors import UserError, one_line
from src.outputs import cannot_write
from src.ranks import is_first

NAME = "last.dcp"
TRAINING = "training.pt"
METADATA = ".metadata"
PREVIOUS = f".{NAME}.previous"
SAVE = "save"  # the entry of each rank's file that holds the save's id ("save.R")
# The names a save writes in its folder: training.pt, DCP's metadata (and its temporary file) and
# each rank's file. A folder holding anything else is not a save's.
SAVE_FILES = re.compile(r"training\.pt|\.metadata(\.tmp)?|__\d+_\d+\.distcp")
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")
TEMPORARY = re.compile(rf"\.{re.escape(NAME)}\.\d+-\d+\.tmp")


class Unreadable(ValueError):
    """A last.dcp that is not one whole save: its message names the file and what is wrong with it."""


def folder_of(args: Config) -> Path:
    """The last.dcp folder of a run (beside --checkpoint)."""
    return Path(args.checkpoint).parent / NAME


def is_ours(path: Path) -> bool:
    """Whether `path` is a folder that a save wrote: not a link, holding only regular files of the
    names a save writes (SAVE_FILES), and, where it is a whole save (last.dcp, the previous one),
    a training.pt that loads without running code as a save's content. A save's temporary folder
    may be empty or partial (a save killed at its start or in its middle): its name
    (TEMPORARY, which holds the save's step and number) and its files' names mark it."""
    path = Path(path)
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        if not all(entry.is_file(follow_symlinks=False) and SAVE_FILES.fullmatch(entry.name)
                   for entry in os.scandir(path)):
            return False
        return bool(TEMPORARY.fullmatch(path.name)) or _holds_a_saves_training(path)
    except OSError:
        return False


def _holds_a_saves_training(path: Path) -> bool:
    """Whether path/training.pt is what a save writes there: a dict holding the epoch (a folder of
    the user's named last.dcp, empty or holding a text file of that name, is not)."""
    try:
        training = read_training(path)
    except Exception:  # noqa: BLE001  # any file torch cannot read as a save's is not ours
        return False
    return isinstance(training, dict) and "epoch" in training


def _not_ours(path: Path) -> str:
    """What the existing `path`, which is not a save's folder, is."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)}"
    if not stat.S_ISDIR(mode):
        return "a file"
    try:
        foreign = sorted(entry.name for entry in os.scandir(path)
                         if not (entry.is_file(follow_symlinks=False) and SAVE_FILES.fullmatch(entry.name)))
    except OSError as error:
        return f"a folder that cannot be read ({error.strerror})"
    if not foreign:
        return f"a folder without a save's {TRAINING}"
    return f"a folder holding {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}"


def check_ours(folder: Path) -> None:
    """At a run's start (rank 0): refuse, in one line, a last.dcp, a previous one or a save's
    temporary folder beside --checkpoint that a save did not write (a folder of the user's by
    that name): the run would replace, rename or remove it."""
    folder = Path(folder)
    for path in (folder, folder.parent / PREVIOUS, *temporaries(folder, all_of_them=True)):
        if os.path.lexists(path) and not is_ours(path):
            raise UserError(f"--checkpoint {folder.parent}: {path.name} there is {_not_ours(path)}, not the folder "
                            f"of FSDP's checkpoint that a run writes and replaces at that name; move it away, "
                            "or name another --checkpoint folder")


def whole_folder(folder: Path) -> Path | None:
    """The whole last.dcp at `folder`: the folder itself, or the previous one that a crash between
    the two renames of a save left beside it (each only if a save wrote it: is_ours); None without
    either."""
    folder = Path(folder)
    for path in (folder, folder.parent / PREVIOUS):
        if is_ours(path):
            return path
    return None


def temporaries(folder: Path, all_of_them: bool = False) -> list[Path]:
    """The new folders of saves that never finished (a crash, a kill), beside `folder`: those a
    save wrote (is_ours), or `all_of_them` of that name."""
    folder = Path(folder)
    try:
        names = os.listdir(folder.parent)
    except OSError:
        return []
    found = [folder.parent / name for name in names if TEMPORARY.fullmatch(name)]
    return found if all_of_them else [path for path in found if is_ours(path)]


def _remove(path: Path) -> None:
    """The folder, if a save wrote it (is_ours)."""
    if is_ours(path):
        shutil.rmtree(path)


def repair(folder: Path) -> None:
    """At a run's start (rank 0, holding the folder's lock): the previous folder back in place
    where a crash came between a save's two renames, or removed where the new one got there; the
    new folders of saves that never finished removed. Only folders a save wrote (is_ours)."""
    folder = Path(folder)
    previous = folder.parent / PREVIOUS
    if is_ours(previous):
        if os.path.lexists(folder):
            _remove(previous)
        else:
            os.replace(previous, folder)
    for stale in temporaries(folder):
        shutil.rmtree(stale, ignore_errors=True)


def remove(folder: Path) -> None:
    """last.dcp and whatever its saves left beside it (--overwrite), each only if a save wrote it."""
    folder = Path(folder)
    for path in (folder, folder.parent / PREVIOUS, *temporaries(folder)):
        _remove(path)


def read_training(folder: Path) -> dict:
    """training.pt of a whole last.dcp: last.pth's content without the model, optimizer and
    average tensors ("average" holds its update count alone), and the save's id."""
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
            _remove(previous)
        os.replace(folder, previous)
    os.replace(new, folder)
    _fsync_folder(folder.parent)
    shutil.rmtree(previous, ignore_errors=True)
    if replaces is not None:
        replaces.unlink(missing_ok=True)


def _behind(error: BaseException) -> BaseException:
    """The OSError behind an error (torch.save on a full disk raises "unexpected pos ...", with
    the OSError, "No space left on device", as its context), else the error."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return error


class _Writer(FileSystemWriter):
    """DCP's FileSystemWriter for one save into `new`, renamed onto `folder` when whole (rank 0's
    `training`: training.pt's content; None elsewhere). Its staging (the copy dcp.async_save makes
    before its thread writes) copies each tensor once into host buffers kept across saves
    (`copies`): torch's FileSystemWriter deep-copies a DTensor first and copies it again (ResNet-18
    in a world of one, torch 2.14.1, 2 busy cores: three copies of each tensor, 5.4 s against 0.5 s
    for one)."""

    def __init__(self, new: Path, folder: Path, save_id: str, training: dict | None, replaces: Path | None,
                 copies: HostCopies):
        super().__init__(new)
        self.new, self.folder, self.marked, self.training, self.replaces = new, folder, save_id, training, replaces
        self.copies = copies  # the staging's buffers
        self.copied: Copied | None = None  # the end of the staging's copies, where they go on a GPU
        self.staged = False  # whether stage() made them (dcp.async_save); dcp.save stages nothing
        self.save_id = save_id  # DCP's metadata holds it (storage_meta): the metadata of this save

    def reset(self, checkpoint_id=None) -> None:
        super().reset(checkpoint_id)
        self.save_id = self.marked

    def stage(self, state_dict: dict) -> dict:
        self.per_thread_copy_ahead = 0  # as torch's: the copy is in host memory already
        # training.pt's tensors too (a step's metric sums, on the device): one event behind every copy
        staged, self.copied = self.copies.copy({"shards": state_dict, "training": self.training})
        self.training, self.staged = staged["training"], True
        return staged["shards"]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        try:
            if self.copied is not None:
                self.copied.wait()  # DCP's writing thread waits for the copies (on their GPU); training goes on
            return super().write_data(plan, planner)
        except Exception as error:  # sent to rank 0 as it is (pickled): the OSError, not torch.save's RuntimeError
            raise _behind(error) from None

    def finish(self, metadata: Metadata, results: list) -> None:
        """Rank 0, inside DCP's last collective step (its error reaches every rank): the metadata,
        training.pt, and the renames."""
        try:
            super().finish(metadata, results)
            training = self.training
            if not self.staged:  # dcp.save: its tensors (if any) to the host here, outside a step
                training, copied = HostCopies().copy(training)
                if copied is not None:
                    copied.wait()
            with open(self.new / TRAINING, "wb") as file:
                torch.save(numbers(training), file)  # the staging's copies are done: write_data waited
                file.flush()
                os.fsync(file.fileno())
            commit(self.new, self.folder, self.replaces)
        except Exception as error:
            raise _behind(error) from None


def unwrapped(error: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (which gathers every rank's, with their
    tracebacks in its message): the first failed rank's own; else the error."""
    if isinstance(error, CheckpointException) and error.failures:
        return next(iter(error.failures.values()))[0]
    return error


def save_failed(folder: Path, error: BaseException) -> UserError:
    """The one line of a save of `folder` that failed (on any rank); rank 0 says it."""
    error = _behind(unwrapped(error))
    message = error.args[0] if isinstance(error, UserError) else cannot_write(folder, error)
    return UserError(message, quiet=not is_first())


class ShardWriter:
    """Writes last.dcp with DCP's dcp.save or dcp.async_save (`write`), one save at a time. Every
    rank calls save() at the same places; rank 0 writes training.pt and renames the folder."""

    def __init__(self):
        self.group = None  # the saves' own process group, made at the first save (every rank at once)
        self.token: str | None = None  # drawn by rank 0 at the first save: this run's saves' ids begin with it
        self.pending: tuple[Future, Path, Path] | None = None
        self.saves = 0
        self.copies = HostCopies()  # async_save's staging buffers, kept from one save to the next

    def save(self, write: Callable, folder: Path, shards: dict, training: dict | None, run_step: int,
             replaces: Path | None = None) -> None:
        """write(shards) into a new folder beside `folder`, renamed onto it when complete. `training`:
        training.pt's content (rank 0; None elsewhere). Returns when dcp.save has written it, or
        when dcp.async_save has queued the shards' copies to host memory (its thread writes them).
        A failure: one line (UserError, rank 0's), the new folder removed, the old one in place."""
        self.wait()
        if self.group is None:
            self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
            token = [secrets.token_hex(8)]
            if isinstance(self.group, dist.ProcessGroup):  # every rank's saves carry rank 0's token
                dist.broadcast_object_list(token, src=0, group=self.group)
            self.token = token[0]
        self.saves += 1
        save_id = f"{self.token}-{run_step}-{self.saves}"
        new = folder.parent / f".{NAME}.{run_step}-{self.saves}.tmp"
        rank = dist.get_rank() if dist.is_initialized() else 0
        shards = {**shards, SAVE: {str(rank): save_id}}  # in this rank's file: the file is of this save
        training = None if training is None else {**training, SAVE: save_id}
        writer = _Writer(new, folder, save_id, training, replaces, self.copies)
        try:
            result = write(shards, storage_writer=writer, process_group=self.group)
        except (Exception, CheckpointException) as error:
            raise self._failed(folder, new, error) from None
        future = getattr(result, "upload_completion", result)  # torch's AsyncSaveResponse, or a Future
        if isinstance(future, Future):  # dcp.async_save: its thread writes; wait() says how it went
            self.pending = (future, folder, new)

    def wait(self) -> None:
        """Until the save in progress (if any) is written and in place; its one-line error if it failed."""
        if self.pending is None:
            return
        future, folder, new = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, CheckpointException) as error:
            raise self._failed(folder, new, error) from None

    def _failed(self, folder: Path, new: Path, error: BaseException) -> UserError:
        """A save that failed: its new folder removed (rank 0; every rank is done with it: DCP
        raises on every rank after its collective step), its one line."""
        if is_first():
            _remove(new)
        return save_failed(folder, error)


# Reading.

# What DCP's .metadata names when it is unpickled (torch 2.14.1): its metadata classes, the
# torch values in them (sizes, dtypes, the strided layout by name) and the path it was saved to.
# Nothing else is looked up, so nothing else can be called.
METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
    *(("torch", name) for name, value in vars(torch).items() if isinstance(value, torch.dtype)),
}


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's Unpickler that builds METADATA_GLOBALS alone (Python's documented way to restrict
    what an unpickling may call)."""

    def find_class(self, module: str, name: str):
        if (module, name) not in METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which DCP's metadata never holds")
        return super().find_class(module, name)


def _regular(path: Path) -> None:
    """Refuse a path that is not a regular file (a named pipe would block the read)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise Unreadable(f"{path} is missing") from None
    if not stat.S_ISREG(mode):
        raise Unreadable(f"{path} is not a regular file")


def read_metadata(folder: Path) -> Metadata:
    """DCP's .metadata of the folder, unpickled without running anything (_MetadataUnpickler)."""
    path = Path(folder) / METADATA
    _regular(path)
    try:
        with open(path, "rb") as file:
            metadata = _MetadataUnpickler(file).load()
    except Exception as error:  # a truncated or foreign file: many exception types
        raise Unreadable(f"{path} is not DCP's metadata ({one_line(error)}); nothing in it was run") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise Unreadable(f"{path} is not DCP's metadata (a {type(metadata).__name__})")
    return metadata


def _entry(path: Path, where: _StorageInfo):
    """A value that is not a tensor (an entry DCP saved with torch.save) at its place in a rank's
    file, loaded with weights_only=True; None where it cannot be read."""
    try:
        with open(path, "rb") as file:
            file.seek(where.offset)
            return torch.load(io.BytesIO(file.read(where.length)), weights_only=True)
    except Exception:  # a file of another layout: many exception types
        return None


def checked(folder: Path) -> Metadata:
    """The metadata of the whole last.dcp at `folder`, once every part of it is found to be of the
    one save that its training.pt names (the module's docstring): the metadata's save_id, and
    each rank's file its "save.R" entry. Raises Unreadable naming the file that is not."""
    folder = Path(folder)
    _regular(folder / TRAINING)
    try:
        save = read_training(folder).get(SAVE)
    except Exception as error:  # a truncated or foreign file: many exception types
        raise Unreadable(f"{folder / TRAINING} cannot be read ({type(error).__name__}: {one_line(error)})") from None
    if not isinstance(save, str):
        raise Unreadable(f"{folder / TRAINING} names no save (written before a save's parts were bound to it)")
    metadata = read_metadata(folder)
    if getattr(metadata.storage_meta, "save_id", None) != save:
        raise Unreadable(f"{folder / METADATA} is of another save than {folder / TRAINING} (copied from another "
                         "run or save?)")
    marks: dict[str, object] = {}  # each rank's file: the save its entry names
    for index, where in metadata.storage_data.items():
        if not (isinstance(where, _StorageInfo) and isinstance(where.relative_path, str)
                and SHARD_FILE.fullmatch(where.relative_path) and not where.transform_descriptors):
            raise Unreadable(f"{folder / METADATA} names a part that a save never writes ({where!r})")
        marks.setdefault(where.relative_path, None)
    for key, kind in metadata.state_dict_metadata.items():
        where = metadata.storage_data.get(MetadataIndex(key))
        if key.startswith(f"{SAVE}.") and isinstance(kind, BytesStorageMetadata) and where is not None:
            _regular(folder / where.relative_path)
            marks[where.relative_path] = _entry(folder / where.relative_path, where)
    for name, mark in sorted(marks.items()):
        _regular(folder / name)
        if mark != save:
            raise Unreadable(f"{folder / name} is not part of the save that {folder / TRAINING} names (a file "
                             "copied from another run or save?)")
    return metadata


class _Reader(FileSystemReader):
    """DCP's FileSystemReader, given the metadata that `checked` read: DCP's own read_metadata
    unpickles .metadata (or a rank's __R.metadata) with pickle.load."""

    def __init__(self, folder: Path):
        self.metadata = checked(folder)
        super().__init__(folder)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        if self.metadata.storage_meta is not None:  # checked: it names the save
            self.metadata.storage_meta.load_id = self.load_id  # as torch's does
        return self.metadata


class _WeightsOnly:
    """DCP's loading of the values that are not tensors (an optimizer's settings, the save's id)
    with torch.load(weights_only=True): torch's planners load them with weights_only=False."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            # torch's message is a page: its line naming what the pickle would call
            why = next((line.strip() for line in str(error).splitlines() if "GLOBAL" in line), "")
            raise Unreadable(f"its value {read_item.dest_index.fqn} is not plain data ({why or one_line(error)}); "
                             "nothing in it was run") from None
        if self.flatten_state_dict:  # type: ignore[attr-defined]  # the planner's
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)  # type: ignore[attr-defined]
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded  # type: ignore[attr-defined]


class _Planner(_WeightsOnly, DefaultLoadPlanner):
    """dcp.load's planner (the pieces of this rank's shards)."""


class _WholePlanner(_WeightsOnly, _EmptyStateDictLoadPlanner):
    """The planner that loads everything the folder holds (read_whole)."""


def read_whole(folder: Path) -> dict:
    """The whole last.dcp at `folder` as last.pth holds it: whole tensors, the optimizer state
    numbered by parameter as one process numbers it; read in this process, with or without a
    process group (for a run of another mode, and the tools)."""
    reader = _Reader(folder)  # first: every part is of one save
    training = read_training(folder)
    shards: dict = {}
    _load_state_dict(shards, storage_reader=reader, planner=_WholePlanner(), no_dist=True)
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
    return {**{key: value for key, value in training.items() if key != SAVE}, "model": model, "optimizer": numbered,
            "average": average}


def load_shards(folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, average,
                updates: int | None) -> None:
    """A whole last.dcp into this rank's shards of the model, optimizer and weight average, at any
    world size (DCP reads the pieces of the saved pieces that this rank's shards cover); `updates`:
    the average's update count (training.pt's). Every rank calls it."""
    import torch.distributed.checkpoint as dcp

    from src.fsdp import requiring_grad
    reader = _Reader(folder)  # first: every part is of one save
    # The parameters with an optimizer state in the file (not those that were frozen then): torch's
    # optimizer calls give every parameter that requires a gradient one (src/fsdp.py).
    held = {key.rsplit(".", 1)[0] for key in reader.metadata.state_dict_metadata if key.startswith("optimizer.state.")}
    names = _names(model)
    params = [param for group in optimizer.param_groups for param in group["params"]]
    with requiring_grad(params, [f"optimizer.state.{names[id(param)]}" in held for param in params]):
        shards: dict[str, Any] = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(shards, storage_reader=reader, planner=_Planner())
        set_model_state_dict(model, shards["model"])
        set_optimizer_state_dict(model, optimizer, shards["optimizer"])
    if average is not None and average.on:
        if updates is None:  # --ema-decay is compared on --resume: a run with an average resumes one that had it
            raise UserError(f"{folder} holds no weight average (--ema-decay): resume it without --ema-decay")
        # After the optimizer: loading one may step it (a stateless one), which updates the average.
        dcp.load({"average": average_shards(model, average)}, storage_reader=reader, planner=_Planner())
        average.updates, average.skipped = int(updates), None


def local_tensors(state: dict) -> dict[str, torch.Tensor]:
    """A state_dict's tensors as this rank holds them (a DTensor's local shard)."""
    return {key: value.to_local() if isinstance(value, DTensor) else value
            for key, value in state.items() if isinstance(value, torch.Tensor)}
