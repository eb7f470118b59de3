"""Joining and leaving the process group that torchrun describes in the environment: the one call
train_ddp.py, train_fsdp.py and predict make (the tutorial's `ddp_setup`), with the guarantees and
workarounds that a reader of those scripts need not study.

- Without a launcher a training script is a world of one process, as `torchrun --nproc_per_node=1`
  would make it (predict then joins nothing: it needs no collective alone).
- One process per GPU: more processes on a node than GPUs is one line (unless SHARE_GPUS=1).
- A peer that stops answering fails a collective after --dist-timeout instead of hanging forever,
  and the others say which rank it was and where (src/heartbeat.py, through torchrun's store).
- torchrun --max-restarts keeps its store across restarts: each attempt gets its own key prefix.
- NCCL for one rank per GPU, gloo on the CPU and for ranks sharing a GPU.
"""
import argparse
import gc
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from src import heartbeat
from src.cli import dist_timeout
from src.devices import check_gpus, process_group_backend, training_device


def join_process_group(args: argparse.Namespace, world_of_one: bool = True) -> tuple[int, int, torch.device]:
    """Join the process group of the launcher; returns (rank, world size, this process's device).

    `args`: the command's --dist-timeout, --amp and --deterministic (a command without that flag:
    off). world_of_one=False: without a launcher (or in a world of one) join nothing and return
    (0, 1, the device): for a command whose one process needs no collective (predict).
    """
    deterministic = getattr(args, "deterministic", False)
    if not world_of_one and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        return 0, 1, training_device(deterministic, args.amp)
    world_of_one_without_launcher()  # plain `python train_ddp.py`: RANK 0 of WORLD_SIZE 1
    check_gpus(int(os.environ["LOCAL_WORLD_SIZE"]))  # one GPU per process
    device = training_device(deterministic, args.amp, int(os.environ["LOCAL_RANK"]))
    # A peer that stops answering fails a collective after this long instead of hanging forever;
    # long enough for the slowest node's --cache build: the other nodes wait in their next collective.
    timeout = dist_timeout(args)
    store, rank, world_size = torchrun_store(timeout)
    dist.init_process_group(process_group_backend(device), store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    heartbeat.start(store, rank, world_size, timeout.total_seconds())
    return rank, world_size, device


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


def end_process_group() -> None:
    """destroy_process_group(), after freeing what still holds the group's tensors: measured,
    gloo ranks can abort at exit when the model outlives the group."""
    heartbeat.stop()
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
