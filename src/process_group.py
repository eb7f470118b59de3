"""What guards the process group that train_ddp.py and train_fsdp.py join with
dist.init_process_group (and predict under torchrun): the rendezvous store, one GPU per process,
the end of the group after an error, the same flags on every rank (train_accelerate.py's group
too).

- Without a launcher a script is a world of one process, as `torchrun --nproc_per_node=1` would
  make it: an in-memory store, nothing written into the environment (predict then joins nothing:
  it needs no collective alone).
- torchrun --max-restarts keeps its store across restarts: each attempt gets its own key prefix,
  or the restarted workers would read the dead workers' addresses and fail to connect.
- One process per GPU: more processes on a node than GPUs is one line (unless SHARE_GPUS=1).
- A peer that stops answering fails a collective after --dist-timeout instead of hanging forever,
  and the others say which rank it was and where (src/heartbeat.py, through this store).
- NCCL for one rank per GPU, gloo on the CPU and for ranks sharing a GPU
  (src.devices.process_group_backend).
"""
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from src.cli import dist_timeout
from src.config import Config
from src.devices import check_gpus, process_group_backend, training_device
from src.errors import UserError
from src.heartbeat import Heartbeat
from src.outputs import input_problem, sha256_of
from src.ranks import gather, is_first

# What torchrun (and accelerate launch, and SLURM's srun with torchrun) set for every process.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def launched() -> bool:
    """Whether a launcher started this process (its variables are set)."""
    return "RANK" in os.environ or "WORLD_SIZE" in os.environ


def check_launcher_variables(command: str = "torchrun --nproc_per_node=N") -> None:
    """A launcher sets all of LAUNCHER_VARIABLES; some cluster launchers (or a leftover `export
    RANK=0`) set only some: one line naming the missing ones, before any of them is read."""
    if not launched():
        return
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    if missing:
        set_ = [name for name in LAUNCHER_VARIABLES if name in os.environ]
        raise UserError(f"{', '.join(set_)} set in the environment but not {', '.join(missing)}: launch "
                        f"with {command} (which sets them all), or unset {', '.join(set_)} to run one process")
    # Values no launcher sets (a hand-written export): a rank past the world would wait for peers
    # that never come, for --dist-timeout; a word where a number goes would end in a traceback.
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        text = os.environ[name]
        if not (text.isascii() and text.isdigit()):
            raise UserError(f"{name}={text} in the environment is not a whole number: launch with {command}, "
                            "which sets it")
        numbers[name] = int(text)
    rank, world, local, local_world = (numbers[name] for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"))
    if not (0 <= rank < world and 0 <= local < local_world <= world and 0 < numbers["MASTER_PORT"] < 2**16):
        raise UserError(f"RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} LOCAL_WORLD_SIZE={local_world} "
                        f"MASTER_PORT={numbers['MASTER_PORT']} in the environment: no launcher sets these (a rank "
                        f"is below the world's size, a port in 1 to 65535): launch with {command}, which sets them")


def local_rank() -> int:
    """This process's index on its node (LOCAL_RANK), 0 without a launcher."""
    check_launcher_variables()
    return int(os.environ.get("LOCAL_RANK", 0))


def process_device(deterministic: bool, amp: str = "no") -> torch.device:
    """This process's GPU (its LOCAL_RANK; checked: one GPU per process, bfloat16 where --amp
    asks) or the CPU, with --deterministic's numerics set."""
    rank = local_rank()
    check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return training_device(deterministic, amp, rank)


def torchrun_store(minutes: float) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) for dist.init_process_group: torchrun's rendezvous with a key prefix
    per restart attempt (waiting --dist-timeout `minutes`), or an in-memory store for a world of one
    without a launcher."""
    if not launched():
        return dist.HashStore(), 0, 1
    check_launcher_variables()
    store, rank, world_size = next(dist.rendezvous("env://", timeout=dist_timeout(minutes)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}", store), rank, world_size


def watch_ranks(store: dist.Store | None, minutes: float, device: torch.device | None = None) -> Heartbeat:
    """The watch that names a rank that stops answering (src/heartbeat.py) after --dist-timeout
    `minutes`: use it as a context manager inside the process group's life. `device`: on a GPU it
    tells the places the GPU has reached. Without a store or a process group of 2+, it only keeps
    the place."""
    if store is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return Heartbeat()
    return Heartbeat(store, dist.get_rank(), dist.get_world_size(), dist_timeout(minutes).total_seconds(), device)


def joined_store() -> dist.Store | None:
    """The store of the process group that a library joined for us (accelerate's Accelerator calls
    init_process_group itself), with the key prefix per torchrun restart attempt that
    torchrun_store gives (torchrun's agent keeps its store across restarts); None without a group.
    torch keeps it with the default group (distributed_c10d._get_default_store, in torch 2.11 and
    2.14 alike): accelerate does not expose it."""
    if not dist.is_initialized():
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}", dist.distributed_c10d._get_default_store())


def join_process_group(minutes: float, amp: str = "no") -> tuple[int, int, torch.device, Heartbeat]:
    """For a command whose one process needs no collective (predict): without a launcher (or in a
    world of one) join nothing; else join the launcher's group, waiting --dist-timeout `minutes`.
    Returns (rank, world size, device, its heartbeat, not started)."""
    device = process_device(False, amp)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, device, Heartbeat()
    store, rank, world_size = torchrun_store(minutes)
    dist.init_process_group(process_group_backend(device), store=store, rank=rank, world_size=world_size,
                            timeout=dist_timeout(minutes))
    return rank, world_size, device, Heartbeat(store, rank, world_size, dist_timeout(minutes).total_seconds(), device)


# The flags each node may give its own value, left out of check_same_flags: places on the node's
# own disk (a copy of the images, its --cache, its --checkpoint folder, which holds its last.pth
# for --resume; docs/multi-node.md runs two machines with a folder each), what rank 0 alone uses
# (--plot, --log-dir, --tracking-uri: it alone writes and tracks), and --workers (the node's CPUs:
# how fast the batches come, not which). `command` is the command line as typed (the parsed
# values are compared: --lr 0.01 and --lr=1e-2 agree), `local_rank` torch.distributed.launch's.
PER_NODE = ("data_dir", "cache", "checkpoint", "plot", "log_dir", "tracking_uri", "workers", "evaluate_file",
            "command", "local_rank")


def check_same_flags(args: Config) -> None:
    """Refuse, in one line naming each flag and which ranks gave which value, ranks launched with
    different flags (two nodes started by hand, one with --lr 0.01 and one with --lr 0.5): they
    would train silently with rank 0's record of its own, or fail in a collective (another
    --batch-size). Every rank calls it once, after the process group exists; without one (or in
    a world of one) it does nothing."""
    check_same_values(compared_flags(args), "paths and --workers")


def check_same_values(mine: dict[str, Any], differ: str) -> None:
    """check_same_flags of any command that runs on several ranks (predict under torchrun: its
    rank 1 with --tta wrote half the CSV with it): `mine`, this rank's flags as compared (the
    flags each node may give its own value left out, files by_content), against every rank's,
    before any work; `differ` names what may differ, for the user."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    said = flags_that_differ(gather(mine))
    if said:
        raise UserError(f"the ranks were launched with different flags ({said}): launch every process with the "
                        f"same flags ({differ} may differ per node)", quiet=not is_first())


def compared_flags(args: Config) -> dict[str, Any]:
    """This rank's flags as check_same_flags compares them: PER_NODE left out, the script by its
    file name, a --weights file by its content (its path is the node's)."""
    mine = {key: value for key, value in args.as_dict().items() if key not in PER_NODE}
    if args.command:
        mine["mode"] = args.command[0]
    return by_content(mine, ("weights",))


def by_content(flags: dict[str, Any], files: tuple[str, ...]) -> dict[str, Any]:
    """`flags` with each of `files` that names a file given by its content (a digest): its path is
    the node's, two machines may mount one file at two places."""
    flags = dict(flags)
    for key in files:
        if flags.get(key) not in (None, "default", "none"):
            problem = input_problem(Path(flags[key]))  # never open a named pipe: it waits for a writer
            if problem is not None:
                flags[key] = f"a file that cannot be read ({problem})"
                continue
            try:
                flags[key] = f"a file of sha256 {sha256_of(flags[key])[:16]}"
            except OSError as error:  # the load says it; here it only has to differ from a file that is read
                flags[key] = f"a file that cannot be read ({error.strerror})"
    return flags


def flags_that_differ(everyone: list[dict]) -> str:
    """"--lr: 0.01 on rank 0, 0.5 on rank 1; ..." for each flag whose value is not the same on
    every rank (everyone: compared_flags of each rank, in rank order); "" when they agree."""
    keys = list(dict.fromkeys(key for flags in everyone for key in flags))
    differ = [key for key in keys if any(flags.get(key) != everyone[0].get(key) for flags in everyone)]
    return "; ".join(f"{_flag(key)}: " + ", ".join(f"{_shown(value)} on {_ranks(ranks)}"
                                                  for value, ranks in _by_value(everyone, key)) for key in differ)


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
    for before, rank in zip(ranks, [*ranks[1:], -1]):  # -1: past the last (a rank is never before + 1 = -1)
        if rank != before + 1:
            spans.append(f"{start}-{before}" if before > start else f"{start}")
            start = rank
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(spans)
