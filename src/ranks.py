"""The processes of a distributed run: which one speaks, what rank 0 reads for all, and whether
torchrun restarted this one (joining and leaving the group: src/process_group.py).

Only the first process (global rank 0) prints, draws progress bars and writes files; every rank
takes part in every collective. Without a process group (one device, DataParallel, a world of
one) the one process is the first.
"""
import os
from typing import Any, Callable, TypeVar

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
    values: list[Any] = [None] * dist.get_world_size()
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
    box: list[Any] = [None]
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


# Set in a Ray Train worker that Ray started anew after a lost one (src.ray_worker.on_this_worker):
# Ray says it through the checkpoint it hands back, not through the environment.
_restarted_by_ray = False


def restarted() -> bool:
    """Whether torchrun restarted this worker (--max-restarts), SLURM requeued its job (sbatch
    --requeue, docs/slurm/train.sbatch) or Ray Train restarted its workers: it resumes from
    last.pth. A first start does none of these."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
            or int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0 or _restarted_by_ray)


def mark_restarted_by_ray() -> None:
    """This process is a Ray Train worker that Ray started after a lost one (restarted() from now)."""
    global _restarted_by_ray
    _restarted_by_ray = True

