"""The processes of a distributed run: which one speaks, what rank 0 reads for all, and whether
torchrun restarted this one (joining and leaving the group: src/process_group.py).

Only the first process (global rank 0) prints, draws progress bars and writes files; every rank
takes part in every collective. Without a process group (one device, DataParallel, a world of
one) the one process is the first.
"""
import os
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


def restarted() -> bool:
    """Whether torchrun restarted this worker (--max-restarts) or SLURM requeued its job (sbatch
    --requeue, docs/slurm/train.sbatch): it resumes from last.pth. A first start does neither."""
    return (int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0
            or int(os.environ.get("SLURM_RESTART_COUNT", 0)) > 0)


# The flags each node may give its own value, left out of check_same_flags: places on the node's
# own disk (a copy of the images, its --cache, its --checkpoint folder, which holds its last.pth
# for --resume; docs/multi-node.md runs two machines with a folder each), what rank 0 alone uses
# (--plot, --log-dir, --tracking-uri: it alone writes and tracks), and --workers (the node's CPUs:
# how fast the batches come, not which). `command` is the command line as typed (the parsed
# values are compared: --lr 0.01 and --lr=1e-2 agree), `local_rank` torch.distributed.launch's.
PER_NODE = ("data_dir", "cache", "checkpoint", "plot", "log_dir", "tracking_uri", "workers", "evaluate_file",
            "command", "local_rank")


def check_same_flags(args) -> None:
    """Refuse, in one line naming each flag and which ranks gave which value, ranks launched with
    different flags (two nodes started by hand, one with --lr 0.01 and one with --lr 0.5): they
    would train silently with rank 0's record of its own, or fail in a collective (another
    --batch-size). Every rank calls it once, after the process group exists; without one (or in
    a world of one) it does nothing."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    said = flags_that_differ(gather(compared_flags(args)))
    if said:
        raise UserError(f"the ranks were launched with different flags ({said}): launch every process with the "
                        "same flags (paths and --workers may differ per node)", quiet=not is_first())


def compared_flags(args) -> dict:
    """This rank's flags as check_same_flags compares them: PER_NODE left out, the script by its
    file name, a --weights file by its content (its path is the node's)."""
    mine = {key: value for key, value in vars(args).items() if key not in PER_NODE}
    if "mode" in mine and getattr(args, "command", None):
        mine["mode"] = args.command[0]
    if mine.get("weights") not in (None, "default", "none"):
        mine["weights"] = f"a file of sha256 {_sha256(mine['weights'])}"
    return mine


def flags_that_differ(everyone: list[dict]) -> str:
    """"--lr: 0.01 on rank 0, 0.5 on rank 1; ..." for each flag whose value is not the same on
    every rank (everyone: compared_flags of each rank, in rank order); "" when they agree."""
    keys = list(dict.fromkeys(key for flags in everyone for key in flags))
    differ = [key for key in keys if any(flags.get(key) != everyone[0].get(key) for flags in everyone)]
    return "; ".join(f"{_flag(key)}: " + ", ".join(f"{_shown(value)} on {_ranks(ranks)}"
                                                  for value, ranks in _by_value(everyone, key)) for key in differ)


def _sha256(path: str) -> str:
    import hashlib
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError as error:
        return f"unreadable ({error.strerror})"  # the load says it; here it only has to differ
    return digest.hexdigest()[:16]


def _flag(key: str) -> str:
    return "the script" if key == "mode" else "--" + key.replace("_", "-")


def _shown(value) -> str:
    if value is True:
        return "given"
    if value is False:
        return "not given"
    if value is None:
        return "the default"
    if isinstance(value, list):
        return " ".join(map(str, value))
    return str(value)


def _by_value(everyone: list[dict], key: str) -> list[tuple]:
    """[(value, [ranks])] in order of the lowest rank holding each value."""
    groups: list[tuple] = []
    for rank, flags in enumerate(everyone):
        value = flags.get(key)
        for held, ranks in groups:
            if held == value:
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return groups


def _ranks(ranks: list[int]) -> str:
    """"rank 1", "ranks 0-3, 6" """
    spans, start = [], ranks[0]
    for before, rank in zip(ranks, ranks[1:] + [None]):
        if rank != before + 1:
            spans.append(f"{start}-{before}" if before > start else f"{start}")
            start = rank
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)
