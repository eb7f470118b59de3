"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with DistributedDataParallel.

Launch one process per GPU (or CPU share) with torchrun: torchrun --nproc_per_node=4 train_ddp.py
"""
import gc
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from src.checkpoint import check_writable, resume, save_epoch
from src.cli import amp_dtype, parse_args
from src.errors import exit_on_error
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.transforms import memory_format, normalize


def setup_distributed(args) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; returns rank, world size, device."""
    if "RANK" not in os.environ:  # plain `python train_ddp.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # A peer that stops answering fails a collective after this long instead of hanging forever.
    timeout = timedelta(minutes=10)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun --max-restarts keeps its store across restarts: without a fresh key prefix per
    # attempt the restarted workers read the dead workers' addresses and fail to connect.
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def run_epoch(model, loader, device, args, desc, optimizer=None, scaler=None) -> torch.Tensor:
    """One pass over `loader`, training if an optimizer is given; returns the metric sums."""
    training, amp = optimizer is not None, amp_dtype(args)
    model.train(training)
    sums = torch.zeros(4, device=device)
    for images, labels in tqdm(loader, desc=desc, leave=False, disable=dist.get_rank() != 0):
        images = normalize(images.to(device, non_blocking=True), args.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.set_grad_enabled(training), torch.autocast(device.type, amp, enabled=amp is not None):
            logits = model(images)
            loss = F.cross_entropy(logits, labels)
        if training:
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        sums += batch_sums(logits, labels)
    dist.all_reduce(sums)  # every rank's sums: each validation sample is in exactly one shard
    return sums.cpu()  # waits for the device, so the epoch timings are true


def main() -> None:
    args = parse_args(__doc__, local_rank=True)
    rank, world_size, device = setup_distributed(args)
    check_writable(args)
    torch.manual_seed(args.seed)

    local_processes = int(os.environ["LOCAL_WORLD_SIZE"])
    workers = default_workers(local_processes) if args.workers is None else args.workers
    dataset, train_idx, val_idx = labelled_data(args, workers, show_progress=rank == 0)
    train_loader, val_loader = make_loaders(dataset, train_idx, val_idx, args.batch_size, args.seed,
                                            workers, rank, world_size, pin_memory=device.type == "cuda")

    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    global_batch = args.batch_size * world_size
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0  # torchrun --max-restarts
    history = (resume(args, model.module, optimizer, scaler, global_batch, announce=rank == 0)
               if args.resume or restarted else [])

    if rank == 0:
        print(f"{args.arch} on {world_size} x {device.type}: {len(train_idx)} train / "
              f"{len(val_idx)} val images, batch {args.batch_size} x {world_size}")
    since = time.time()
    for epoch in range(len(history), args.epochs):
        train_loader.sampler.set_epoch(epoch)
        start = time.time()
        desc = f"epoch {epoch + 1}/{args.epochs}"
        train_sums = run_epoch(model, train_loader, device, args, f"{desc} train", optimizer, scaler)
        middle = time.time()
        val_sums = run_epoch(model, val_loader, device, args, f"{desc} val")
        history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle))
        if rank == 0:
            is_best = save_epoch(args, history, model.module, optimizer, scaler, global_batch)
            print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))

    best = max(history, key=lambda record: record["val_acc"])
    if rank == 0:
        print(f"done in {time.time() - since:.0f} s: best val acc {best['val_acc']:.4f} "
              f"(epoch {best['epoch']}) in {args.checkpoint}")


if __name__ == "__main__":
    try:
        exit_on_error(main)
    finally:
        if dist.is_initialized():
            gc.collect()  # measured: freeing the model before this avoids gloo aborts at exit
            dist.destroy_process_group()
