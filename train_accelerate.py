"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with Hugging Face accelerate.

Run `accelerate launch train_accelerate.py` (one process per GPU after `accelerate config`),
`accelerate launch --num_processes 4 train_accelerate.py`, or plain `python train_accelerate.py`.
Mixed precision is accelerate's own setting: `accelerate launch --mixed_precision bf16 ...`.
"""
import gc
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from src.checkpoint import best_record, check_writable, resume, run_info, save_epoch
from src.cli import parse_args
from src.devices import check_bf16, configure_numerics
from src.errors import UserError, exit_on_error
from src.freeze import stages
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.recipe import make_optimizer, make_schedule, steps_per_epoch
from src.seeds import seed_epoch
from src.transforms import memory_format, model_inputs
from src.watch import Steps, Watch


def run_epoch(accelerator, model, steps: Steps, args, optimizer=None, schedule=None,
              frozen=False) -> torch.Tensor:
    """One pass over the steps' loader, training if an optimizer is given; returns the metric sums."""
    training = optimizer is not None
    model.train(training and not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = torch.zeros(4, device=accelerator.device)
    for inputs, labels in steps.track(sums):
        inputs = model_inputs(inputs, accelerator.device, args.channels_last)  # already there
        if training:
            # Skips the gradient all-reduce and the optimizer step but on a step's last micro-batch.
            with accelerator.accumulate(model):
                logits = model(inputs)  # the prepared model applies the mixed-precision setting
                loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
                accelerator.backward(loss)  # divides by --accumulate, scales for fp16
                if args.clip_grad_norm and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
            sums += batch_sums(logits, labels)
        else:
            with torch.no_grad():
                logits = model(inputs)
            # Every process's samples, less those accelerate repeated to fill the last batch.
            sums += batch_sums(*accelerator.gather_for_metrics((logits, labels)))
    if training:
        sums = accelerator.reduce(sums, reduction="sum")  # every process's training samples
    return sums.cpu()  # waits for the device, so the epoch timings are true


def main() -> None:
    args = parse_args(__doc__, amp=False)
    configure_numerics(args.deterministic)
    check_bf16(os.environ.get("ACCELERATE_MIXED_PRECISION"), int(os.environ.get("LOCAL_RANK", 0)))
    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,
    # so the global batches are those of train_single.py --batch-size (batch_size x processes).
    # non_blocking: copies from the pinned batches do not make the host wait for the GPU.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulate, log_with="tensorboard" if args.log_dir else None,
        project_dir=args.log_dir,
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True))
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched > 1 and accelerator.num_processes == 1:
        raise UserError(f"launched as {launched} processes but accelerate sees one, so each would "
                        "train alone on all the data; without GPUs run ACCELERATE_USE_CPU=1 "
                        f"accelerate launch --multi_gpu --num_processes {launched} train_accelerate.py")
    processes, device = accelerator.num_processes, accelerator.device
    check_writable(args)
    torch.manual_seed(args.seed)

    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    workers = default_workers(local_processes) if args.workers is None else args.workers
    dataset, train_idx, val_idx, digest = labelled_data(args, workers, show_progress=accelerator.is_main_process)
    global_batch = args.batch_size * processes * args.accumulate
    steps = steps_per_epoch(len(train_idx), global_batch)

    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, steps)
    info = run_info(args, global_batch, digest)
    history = (resume(args, info, model, optimizer, accelerator.scaler, schedule,
                      announce=accelerator.is_main_process) if args.resume else [])
    optimizer, schedule = accelerator.prepare(optimizer, schedule)
    if args.log_dir:
        accelerator.init_trackers("train_accelerate")  # on the main process only
    watch = Watch(args, optimizer, steps, args.batch_size * processes, device,
                  show=accelerator.is_main_process, log=accelerator.log if args.log_dir else None)

    accelerator.print(f"{args.arch} on {processes} x {device.type} ({accelerator.mixed_precision} "
                      f"precision): {len(train_idx)} train / {len(val_idx)} val images, batch "
                      f"{args.batch_size} x {processes}"
                      + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))
    since = time.time()
    for stage in stages(args, model, dataset, len(history), device, workers,
                        show=accelerator.is_main_process):
        net = torch.compile(stage.net) if args.compile else stage.net
        train_loader, val_loader = make_loaders(stage.data, train_idx, val_idx, args.batch_size * processes,
                                                args.seed, workers, pin_memory=device.type == "cuda",
                                                accumulate=args.accumulate, augment=args.augment,
                                                split=processes)
        net, train_loader, val_loader = accelerator.prepare(net, train_loader, val_loader)
        for epoch in stage.epochs:
            seed_epoch(args.seed, epoch, accelerator.process_index)
            train_loader.set_epoch(epoch)
            start = time.time()
            desc = f"epoch {epoch + 1}/{args.epochs}"
            train_steps = watch.steps(train_loader, f"{desc} train", epoch)
            train_sums = run_epoch(accelerator, net, train_steps, args, optimizer, schedule, stage.frozen)
            middle = time.time()
            val_sums = run_epoch(accelerator, net, watch.steps(val_loader, f"{desc} val"), args)
            history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle,
                                        train_steps.data_wait, optimizer.param_groups[0]["lr"]))
            if accelerator.is_main_process:
                is_best = save_epoch(args, history, model, optimizer, accelerator.scaler, schedule, info)
                print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
            watch.epoch_end(history[-1])  # accelerator.log writes on the main process only
            accelerator.wait_for_everyone()

    best = best_record(history, args.best_by)
    accelerator.print(f"done in {time.time() - since:.0f} s: best {args.best_by} {best[args.best_by]:.4f} "
                      f"(epoch {best['epoch']}) in {args.checkpoint}")
    del model, optimizer
    accelerator.free_memory()  # measured: releasing the model first avoids gloo aborts at exit
    accelerator.end_training()  # closes the trackers


if __name__ == "__main__":
    try:
        exit_on_error(main)
    finally:
        if torch.distributed.is_initialized():  # also after an error
            gc.collect()
            torch.distributed.destroy_process_group()
