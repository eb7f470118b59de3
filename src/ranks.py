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


def from_rank_0(make: Callable[[], T]) -> T:
    """make() on rank 0 alone; every rank gets its result, or raises its error.

    For what must be the same on every rank and may exist only on rank 0's node: the label
    table (a scan of every image). Without a process group it is just make().
    """
    if not dist.is_initialized():
        return make()
    rank = dist.get_rank()
    box = [None]
    if rank == 0:
        try:
            box = [make()]
        except Exception as error:  # the others would wait in the broadcast until its timeout
            box = [error if isinstance(error, UserError) else _Failed(type(error).__name__)]
            dist.broadcast_object_list(box, src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise UserError(str(box[0]), quiet=True)  # rank 0 says it
    if isinstance(box[0], _Failed):
        raise UserError(f"rank 0 failed ({box[0].name})", quiet=True)  # rank 0 shows the traceback
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
