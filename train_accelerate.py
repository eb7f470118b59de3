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
from tqdm import tqdm

from src.checkpoint import check_writable, resume, save_epoch
from src.cli import parse_args
from src.errors import UserError, exit_on_error
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.transforms import memory_format, normalize


def run_epoch(accelerator, model, loader, args, desc, optimizer=None) -> torch.Tensor:
    """One pass over `loader`, training if an optimizer is given; returns the metric sums."""
    training = optimizer is not None
    model.train(training)
    sums = torch.zeros(4, device=accelerator.device)
    for images, labels in tqdm(loader, desc=desc, leave=False, disable=not accelerator.is_main_process):
        images = normalize(images, args.channels_last)  # the prepared loader put it on the device
        with torch.set_grad_enabled(training):
            logits = model(images)  # the prepared model applies the mixed-precision setting
            loss = F.cross_entropy(logits, labels)
        if training:
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)
            optimizer.step()
        # Every process's samples, less those accelerate repeated to fill the last batch.
        logits, labels = accelerator.gather_for_metrics((logits.detach(), labels))
        sums += batch_sums(logits, labels)
    return sums.cpu()  # waits for the device, so the epoch timings are true


def main() -> None:
    args = parse_args(__doc__, amp=False)
    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,
    # so the global batches are those of train_single.py --batch-size (batch_size x processes).
    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=True))
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched > 1 and accelerator.num_processes == 1:
        raise UserError(f"launched as {launched} processes but accelerate sees one, so each would "
                        "train alone on all the data; without GPUs run ACCELERATE_USE_CPU=1 "
                        f"accelerate launch --multi_gpu --num_processes {launched} train_accelerate.py")
    processes = accelerator.num_processes
    check_writable(args)
    torch.manual_seed(args.seed)

    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    workers = default_workers(local_processes) if args.workers is None else args.workers
    dataset, train_idx, val_idx = labelled_data(args, workers, show_progress=accelerator.is_main_process)
    global_batch = args.batch_size * processes
    train_loader, val_loader = make_loaders(dataset, train_idx, val_idx, global_batch, args.seed,
                                            workers, pin_memory=accelerator.device.type == "cuda")

    model = build_model(args.arch, args.weights, args.dropout).to(memory_format=memory_format(args))
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    history = (resume(args, model, optimizer, accelerator.scaler, global_batch,
                      announce=accelerator.is_main_process) if args.resume else [])
    model, optimizer, train_loader, val_loader = accelerator.prepare(
        model, optimizer, train_loader, val_loader)

    accelerator.print(f"{args.arch} on {processes} x {accelerator.device.type} "
                      f"({accelerator.mixed_precision} precision): {len(train_idx)} train / "
                      f"{len(val_idx)} val images, batch {args.batch_size} x {processes}")
    since = time.time()
    for epoch in range(len(history), args.epochs):
        train_loader.set_epoch(epoch)
        start = time.time()
        desc = f"epoch {epoch + 1}/{args.epochs}"
        train_sums = run_epoch(accelerator, model, train_loader, args, f"{desc} train", optimizer)
        middle = time.time()
        val_sums = run_epoch(accelerator, model, val_loader, args, f"{desc} val")
        history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle))
        if accelerator.is_main_process:
            is_best = save_epoch(args, history, accelerator.unwrap_model(model), optimizer,
                                 accelerator.scaler, global_batch)
            print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
        accelerator.wait_for_everyone()

    best = max(history, key=lambda record: record["val_acc"])
    accelerator.print(f"done in {time.time() - since:.0f} s: best val acc {best['val_acc']:.4f} "
                      f"(epoch {best['epoch']}) in {args.checkpoint}")
    del model, optimizer
    accelerator.free_memory()  # measured: releasing the model first avoids gloo aborts at exit
    accelerator.end_training()


if __name__ == "__main__":
    try:
        exit_on_error(main)
    finally:
        if torch.distributed.is_initialized():  # also after an error
            gc.collect()
            torch.distributed.destroy_process_group()
