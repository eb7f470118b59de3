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
        except UserError as error:  # the others would wait in the broadcast until its timeout
            box = [error]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], UserError):
        raise UserError(str(box[0]), quiet=rank != 0)
    return box[0]
