"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats on one device."""
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from src.checkpoint import check_writable, resume, save_epoch
from src.cli import amp_dtype, parse_args
from src.errors import exit_on_error
from src.history import epoch_record, format_record
from src.loaders import default_workers, labelled_data, make_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.transforms import memory_format, normalize


def run_epoch(model, loader, device, args, desc, optimizer=None, scaler=None) -> torch.Tensor:
    """One pass over `loader`, training if an optimizer is given; returns the metric sums."""
    training, amp = optimizer is not None, amp_dtype(args)
    model.train(training)
    sums = torch.zeros(4, device=device)
    for images, labels in tqdm(loader, desc=desc, leave=False):
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
    return sums.cpu()  # waits for the device, so the epoch timings are true


def main() -> None:
    args = parse_args(__doc__)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_writable(args)
    torch.manual_seed(args.seed)

    workers = default_workers() if args.workers is None else args.workers
    dataset, train_idx, val_idx = labelled_data(args, workers)
    train_loader, val_loader = make_loaders(dataset, train_idx, val_idx, args.batch_size, args.seed,
                                            workers, pin_memory=device.type == "cuda")

    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    history = resume(args, model, optimizer, scaler, args.batch_size) if args.resume else []

    print(f"{args.arch} on {device}: {len(train_idx)} train / {len(val_idx)} val images, "
          f"batch {args.batch_size}")
    since = time.time()
    for epoch in range(len(history), args.epochs):
        train_loader.sampler.set_epoch(epoch)
        start = time.time()
        desc = f"epoch {epoch + 1}/{args.epochs}"
        train_sums = run_epoch(model, train_loader, device, args, f"{desc} train", optimizer, scaler)
        middle = time.time()
        val_sums = run_epoch(model, val_loader, device, args, f"{desc} val")
        history.append(epoch_record(epoch, train_sums, val_sums, middle - start, time.time() - middle))
        is_best = save_epoch(args, history, model, optimizer, scaler, args.batch_size)
        print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))

    best = max(history, key=lambda record: record["val_acc"])
    print(f"done in {time.time() - since:.0f} s: best val acc {best['val_acc']:.4f} "
          f"(epoch {best['epoch']}) in {args.checkpoint}")


if __name__ == "__main__":
    exit_on_error(main)
