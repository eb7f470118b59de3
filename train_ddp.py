"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with DistributedDataParallel.

Launch one process per GPU (or CPU share) with torchrun: torchrun --nproc_per_node=4 train_ddp.py
"""
import contextlib
import gc
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from src.checkpoint import best_record, check_writable, resume, run_info, save_epoch
from src.cli import amp_dtype, parse_args
from src.devices import check_gpus, training_device
from src.errors import exit_on_error
from src.freeze import stages
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.recipe import make_optimizer, make_schedule, optimizer_step, steps_per_epoch
from src.seeds import seed_epoch
from src.transforms import memory_format, model_inputs
from src.watch import Steps, Watch, tensorboard


def setup_distributed(args) -> tuple[int, int, torch.device]:
    """Join the process group torchrun describes in the environment; returns rank, world size, device."""
    if "RANK" not in os.environ:  # plain `python train_ddp.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ.get("LOCAL_RANK", args.local_rank or 0))
    check_gpus(int(os.environ["LOCAL_WORLD_SIZE"]))  # one GPU per process
    device = training_device(args.deterministic, args.amp, local_rank)
    # A peer that stops answering fails a collective after this long instead of hanging forever.
    timeout = timedelta(minutes=10)
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun --max-restarts keeps its store across restarts: without a fresh key prefix per
    # attempt the restarted workers read the dead workers' addresses and fail to connect.
    store = dist.PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world_size, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), device


def run_epoch(model, steps: Steps, device, args, optimizer=None, scaler=None, schedule=None,
              frozen=False) -> torch.Tensor:
    """One pass over the steps' loader, training if an optimizer is given; returns the metric sums."""
    training, amp = optimizer is not None, amp_dtype(args)
    model.train(training and not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = torch.zeros(4, device=device)
    for step, (inputs, labels) in enumerate(steps.track(sums)):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        last = (step + 1) % args.accumulate == 0
        # The gradients of all but a step's last micro-batch stay on each rank: one all-reduce a step.
        with model.no_sync() if training and not last else contextlib.nullcontext():
            with torch.set_grad_enabled(training), torch.autocast(device.type, amp, enabled=amp is not None):
                logits = model(inputs)
                loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
            if training:
                scaler.scale(loss / args.accumulate).backward()  # gradients add up over micro-batches
        if training and last:
            optimizer_step(model, optimizer, scaler, schedule, args.clip_grad_norm)
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
    dataset, train_idx, val_idx, digest = labelled_data(args, workers, show_progress=rank == 0)
    global_batch = args.batch_size * world_size * args.accumulate
    steps = steps_per_epoch(len(train_idx), global_batch)

    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    info = run_info(args, global_batch, digest)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0  # torchrun --max-restarts
    history = (resume(args, info, model, optimizer, scaler, schedule, announce=rank == 0)
               if args.resume or restarted else [])
    log, close_log = tensorboard(args.log_dir) if args.log_dir and rank == 0 else (None, lambda: None)
    watch = Watch(args, optimizer, steps, args.batch_size * world_size, device, show=rank == 0, log=log)

    if rank == 0:
        print(f"{args.arch} on {world_size} x {device.type}: {len(train_idx)} train / "
              f"{len(val_idx)} val images, batch {args.batch_size} x {world_size}"
              + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))
    since = time.time()
    for stage in stages(args, model, dataset, len(history), device, workers, show=rank == 0):
        # DDP all-reduces the gradients of the parameters that train in this stage, no others.
        net = DDP(stage.net, device_ids=[device.index] if device.type == "cuda" else None)
        net = torch.compile(net) if args.compile else net
        train_loader, val_loader = make_loaders(stage.data, train_idx, val_idx, args.batch_size, args.seed,
                                                workers, rank, world_size, pin_memory=device.type == "cuda",
                                                accumulate=args.accumulate, augment=args.augment)
        for epoch in stage.epochs:
            seed_epoch(args.seed, epoch, rank)
            train_loader.sampler.set_epoch(epoch)
            start = time.time()
            desc = f"epoch {epoch + 1}/{args.epochs}"
            train_steps = watch.steps(train_loader, f"{desc} train", epoch)
            train_sums = run_epoch(net, train_steps, device, args, optimizer, scaler, schedule, stage.frozen)
            middle = time.time()
            val_sums = run_epoch(net, watch.steps(val_loader, f"{desc} val"), device, args)
            history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle,
                                        train_steps.data_wait, optimizer.param_groups[0]["lr"]))
            if rank == 0:
                is_best = save_epoch(args, history, model, optimizer, scaler, schedule, info)
                watch.epoch_end(history[-1])
                print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
    close_log()

    best = best_record(history, args.best_by)
    if rank == 0:
        print(f"done in {time.time() - since:.0f} s: best {args.best_by} {best[args.best_by]:.4f} "
              f"(epoch {best['epoch']}) in {args.checkpoint}")


if __name__ == "__main__":
    try:
        exit_on_error(main)
    finally:
        if dist.is_initialized():
            gc.collect()  # measured: freeing the model before this avoids gloo aborts at exit
            dist.destroy_process_group()
