"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with nn.DataParallel over all GPUs."""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.checkpoint import best_record, check_writable, resume, run_info, save_epoch
from src.cli import amp_dtype, parse_args
from src.devices import training_device
from src.errors import UserError, exit_on_error
from src.freeze import stages
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.recipe import make_optimizer, make_schedule, optimizer_step, steps_per_epoch
from src.seeds import seed_epoch
from src.transforms import memory_format, model_inputs
from src.watch import Steps, Watch, tensorboard


class AutocastReplica(nn.Module):
    """A replica that runs under the autocast dtype of the thread that made it."""

    def __init__(self, replica: nn.Module, device_type: str):
        super().__init__()
        self.replica, self.device_type = replica, device_type
        self.dtype = torch.get_autocast_dtype(device_type)  # read in the caller's thread

    def forward(self, *inputs, **kwargs):
        with torch.autocast(self.device_type, self.dtype, enabled=torch.is_autocast_enabled(self.device_type)):
            return self.replica(*inputs, **kwargs)


class DataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas autocast to the dtype asked for (--amp bf16).

    On two or more GPUs each replica runs in a thread of its own, which re-enters autocast
    without a dtype (torch/nn/parallel/parallel_apply.py); the dtype is per thread and float16 by
    default on CUDA, so bf16 would silently train in float16 without a gradient scaler.
    """

    def replicate(self, module, device_ids):
        return [AutocastReplica(replica, self.src_device_obj.type)
                for replica in super().replicate(module, device_ids)]


def run_epoch(model, steps: Steps, device, args, optimizer=None, scaler=None, schedule=None,
              frozen=False) -> torch.Tensor:
    """One pass over the steps' loader, training if an optimizer is given; returns the metric sums."""
    training, amp = optimizer is not None, amp_dtype(args)
    model.train(training and not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = torch.zeros(4, device=device)
    for step, (inputs, labels) in enumerate(steps.track(sums)):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.set_grad_enabled(training), torch.autocast(device.type, amp, enabled=amp is not None):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
        if training:
            scaler.scale(loss / args.accumulate).backward()  # gradients add up over micro-batches
            if (step + 1) % args.accumulate == 0:
                optimizer_step(model, optimizer, scaler, schedule, args.clip_grad_norm)
        sums += batch_sums(logits, labels)
    return sums.cpu()  # waits for the device, so the epoch timings are true


def main() -> None:
    args = parse_args(__doc__)
    gpus = torch.cuda.device_count()
    if args.compile and gpus > 1:  # Dynamo compiles per thread, and the replicas run in threads
        raise UserError(f"--compile with DataParallel on {gpus} GPUs would compile nothing (pytorch/pytorch"
                        f"#94636): use torchrun --nproc_per_node={gpus} train_ddp.py --compile")
    device = training_device(args.deterministic, args.amp)
    check_writable(args)
    torch.manual_seed(args.seed)

    workers = default_workers() if args.workers is None else args.workers
    dataset, train_idx, val_idx, digest = labelled_data(args, workers)
    global_batch = args.batch_size * args.accumulate
    steps = steps_per_epoch(len(train_idx), global_batch)

    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    info = run_info(args, global_batch, digest)
    history = resume(args, info, model, optimizer, scaler, schedule) if args.resume else []
    log, close_log = tensorboard(args.log_dir) if args.log_dir else (None, lambda: None)
    watch = Watch(args, optimizer, steps, args.batch_size, device, log=log)

    if gpus < 2:
        print(f"train_dp.py: {gpus} GPU(s) visible, DataParallel runs on one device")
    print(f"{args.arch} on {device}: {len(train_idx)} train / {len(val_idx)} val images, "
          f"batch {args.batch_size}" + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))
    since = time.time()
    for stage in stages(args, model, dataset, len(history), device, workers):
        net = DataParallel(stage.net)  # splits each batch across the GPUs, gathers outputs on the first
        net = torch.compile(net) if args.compile else net
        train_loader, val_loader = make_loaders(stage.data, train_idx, val_idx, args.batch_size, args.seed,
                                                workers, pin_memory=device.type == "cuda",
                                                accumulate=args.accumulate, augment=args.augment)
        for epoch in stage.epochs:
            seed_epoch(args.seed, epoch)
            train_loader.sampler.set_epoch(epoch)
            start = time.time()
            desc = f"epoch {epoch + 1}/{args.epochs}"
            train_steps = watch.steps(train_loader, f"{desc} train", epoch)
            train_sums = run_epoch(net, train_steps, device, args, optimizer, scaler, schedule, stage.frozen)
            middle = time.time()
            val_sums = run_epoch(net, watch.steps(val_loader, f"{desc} val"), device, args)
            history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle,
                                        train_steps.data_wait, optimizer.param_groups[0]["lr"]))
            is_best = save_epoch(args, history, model, optimizer, scaler, schedule, info)
            watch.epoch_end(history[-1])
            print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
    close_log()

    best = best_record(history, args.best_by)
    print(f"done in {time.time() - since:.0f} s: best {args.best_by} {best[args.best_by]:.4f} "
          f"(epoch {best['epoch']}) in {args.checkpoint}")


if __name__ == "__main__":
    exit_on_error(main)
