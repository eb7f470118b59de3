"""The processes of a distributed run: which one speaks, what rank 0 reads for all, and the
plumbing of torchrun's process group that a reader of train_ddp.py need not study.

Only the first process (global rank 0) prints, draws progress bars and writes files; every rank
takes part in every collective. Without a process group (one device, DataParallel, a world of
one) the one process is the first.
"""
import gc
import os
import socket
from datetime import timedelta
from typing import Callable, TypeVar

import torch.distributed as dist

from src.errors import UserError

T = TypeVar("T")


def is_first() -> bool:
    """Whether this process is global rank 0, the one that prints and writes."""
    return not dist.is_initialized() or dist.get_rank() == 0


def is_node_first() -> bool:
    """Whether this process is the first of its node (LOCAL_RANK 0): the one that reads what only
    its node's disk may hold."""
    return int(os.environ.get("LOCAL_RANK", 0)) == 0


def gather(value: T) -> list[T]:
    """Every rank's value, in rank order, on every rank ([value] without a process group)."""
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def from_rank_0(make: Callable[[], T]) -> T:
    """make() on rank 0 alone; every rank gets its result, or raises its error.

    For what must be the same on every rank and may exist only on rank 0's node: the label
    table (a scan of every image). Without a process group it is just make().
    """
    return from_rank(0, make)


def from_rank(source: int, make: Callable[[], T]) -> T:
    """make() on rank `source` alone; every rank gets its result, or raises its error, which
    rank 0 reports (a UserError as it is, anything else as "rank N failed (its type)", the
    source showing the traceback). Without a process group it is just make()."""
    if not dist.is_initialized():
        return make()
    box = [None]
    if dist.get_rank() == source:
        try:
            box = [make()]
        except Exception as error:  # the others would wait in the broadcast until its timeout
            box = [error if isinstance(error, UserError) else _Failed(type(error).__name__)]
            dist.broadcast_object_list(box, src=source)
            if isinstance(error, UserError) and source != 0:
                raise UserError(str(error), quiet=True) from None  # rank 0 says it
            raise
    dist.broadcast_object_list(box, src=source)
    if isinstance(box[0], UserError):
        raise UserError(str(box[0]), quiet=not is_first())  # one rank says it
    if isinstance(box[0], _Failed):
        raise UserError(f"rank {source} failed ({box[0].name})", quiet=not is_first())
    return box[0]


class _Failed:
    """What rank 0 sends in place of a result when make() raised something else than a UserError."""

    def __init__(self, name: str):
        self.name = name


def world_of_one_without_launcher() -> None:
    """Plain `python train_ddp.py`: describe a world of one process, as torchrun would, on a free
    local port (a fixed one may be taken by another run on this machine)."""
    if "RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def torchrun_store(timeout: timedelta) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) of the rendezvous torchrun describes in the environment.

    torchrun --max-restarts keeps its store across restarts: without a fresh key prefix per
    attempt, restarted workers read the dead workers' addresses and fail to connect.
    """
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}", store), rank, world_size


def restarted() -> bool:
    """Whether torchrun restarted this worker (--max-restarts): it resumes from last.pth."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0


def end_process_group() -> None:
    """destroy_process_group(), after freeing what still holds the group's tensors: measured,
    gloo ranks can abort at exit when the model outlives the group."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
