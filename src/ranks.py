"""What the processes of a distributed run share: facts that rank 0 alone reads from its disk."""
from typing import Callable, TypeVar

import torch.distributed as dist

from src.errors import UserError

T = TypeVar("T")


def from_rank_0(make: Callable[[], T]) -> T:
    """make() on rank 0 alone; every rank gets its result, or raises its error.

    For what must be the same on every rank and may exist only on rank 0's node: the label
    table (a scan of every image) and last.pth, which nodes without a shared disk do not have.
    Without a process group (one device, DataParallel, a world of one) it is just make().
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
