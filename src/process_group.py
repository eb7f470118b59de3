"""What guards the process group that train_ddp.py and train_fsdp.py join with
dist.init_process_group (and predict under torchrun): the rendezvous store, one GPU per process,
the end of the group after an error.

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
import argparse
import os

import torch
import torch.distributed as dist

from src.cli import dist_timeout
from src.devices import check_gpus, process_group_backend, training_device
from src.errors import UserError
from src.heartbeat import Heartbeat

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


def local_rank() -> int:
    """This process's index on its node (LOCAL_RANK), 0 without a launcher."""
    check_launcher_variables()
    return int(os.environ.get("LOCAL_RANK", 0))


def process_device(args: argparse.Namespace) -> torch.device:
    """This process's GPU (its LOCAL_RANK; checked: one GPU per process, bfloat16 where asked) or the
    CPU, with --deterministic's numerics set."""
    rank = local_rank()
    check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    return training_device(getattr(args, "deterministic", False), getattr(args, "amp", "no"), rank)


def torchrun_store(args: argparse.Namespace) -> tuple[dist.Store, int, int]:
    """(store, rank, world size) for dist.init_process_group: torchrun's rendezvous with a key prefix
    per restart attempt, or an in-memory store for a world of one without a launcher."""
    if not launched():
        return dist.HashStore(), 0, 1
    check_launcher_variables()
    store, rank, world_size = next(dist.rendezvous("env://", timeout=dist_timeout(args)))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"attempt{attempt}", store), rank, world_size


def watch_ranks(store: dist.Store | None, args: argparse.Namespace, device: torch.device | None = None) -> Heartbeat:
    """The watch that names a rank that stops answering (src/heartbeat.py): use it as a context
    manager inside the process group's life. `device`: on a GPU it tells the places the GPU has
    reached. Without a store or a process group of 2+, it only keeps the place."""
    if store is None or not dist.is_initialized() or dist.get_world_size() == 1:
        return Heartbeat()
    return Heartbeat(store, dist.get_rank(), dist.get_world_size(), dist_timeout(args).total_seconds(), device)


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


def join_process_group(args: argparse.Namespace) -> tuple[int, int, torch.device, Heartbeat]:
    """For a command whose one process needs no collective (predict): without a launcher (or in a
    world of one) join nothing; else join the launcher's group. Returns (rank, world size, device,
    its heartbeat, not started)."""
    device = process_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, device, Heartbeat()
    store, rank, world_size = torchrun_store(args)
    dist.init_process_group(process_group_backend(device), store=store, rank=rank, world_size=world_size,
                            timeout=dist_timeout(args))
    return rank, world_size, device, Heartbeat(store, rank, world_size, dist_timeout(args).total_seconds(), device)
