"""The plain PyTorch training loop that `python -m src.tools.benchmark --reference` times against
train_single.py --augment: the loop of pytorch/examples' imagenet/main.py, written with torch and
torchvision alone, over the same images.

    python -m src.tools.plain_loop --data-dir DIR --out-dir OUT [--arch A] [--image-size S]
        [--batch-size B] [--workers N] [--epochs E] [--lr LR] [--momentum M] [--seed SEED]

As imagenet/main.py does it: the JPEGs decoded by PIL in the loader workers (forked: Linux's
default start method, started again at each pass) and taken through RandomResizedCrop(S) (scale
0.08 to 1) and RandomHorizontalFlip, ToTensor and Normalize there; shuffled batches; per step
the batch to the device, forward, cross-entropy, loss.item() and top-1 accuracy into running
averages, a line every 10 steps, zero_grad, backward, SGD's step; after each epoch a validation
pass (Resize(S * 256 / 224), CenterCrop(S)) and torch.save of the model and the optimizer into
OUT/checkpoint.pth.tar. What is train_single.py's instead, so that the two train the same model on
the same images: the model (torchvision's ARCH with 2 outputs, from random weights, as
`--weights none` builds it), SGD with --lr and --momentum and no weight decay (train_single.py's
defaults), the images (DATA_DIR's label table and train_single.py's split of it, --seed), and
the last partial batch left out (drop_last), as train_single.py leaves it out.

It ends with one line of JSON, the last epoch's figures: train_images, train_seconds (from the
start of the pass to its last step, as train_single.py's history.json times an epoch),
data_wait_seconds (in the loader's next()), val_images and val_seconds.
"""
import dataclasses
import json
import time
from pathlib import Path

import torch
import torch.nn as nn
import torchvision
from torch.utils.data import DataLoader, Dataset
from torchvision import transforms
from torchvision.datasets.folder import default_loader

from src.cli import (
    BATCH_SIZES,
    EPOCHS,
    IMAGE_SIZES,
    SEEDS,
    OneLineParser,
    _fraction,
    _non_negative,
    between,
    open_fraction,
    workers_count,
)
from src.datasets import load_labels
from src.errors import exit_on_error
from src.loaders import split_indices
from src.models import NUM_CLASSES, model_kwargs
from src.transforms import IMAGENET_MEAN, IMAGENET_STD


class Files(Dataset):
    """(transform(the RGB image), label) of each (path, label), read as ImageFolder reads it."""

    def __init__(self, files: list[tuple[Path, int]], transform):
        self.files, self.transform = files, transform

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int):
        path, label = self.files[index]
        return self.transform(default_loader(str(path))), label


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy in percent (main.py's accuracy(), k = 1)."""
    with torch.no_grad():
        return (output.argmax(1) == target).float().mean() * 100


def train(loader: DataLoader, model: nn.Module, criterion, optimizer, epoch: int, device: torch.device) -> dict:
    """One epoch, as main.py's train(); its images, seconds and seconds waiting for data."""
    model.train()
    losses, top1, images, waited = 0.0, 0.0, 0, 0.0
    start = time.perf_counter()
    batches = iter(loader)
    for i in range(len(loader)):
        asked = time.perf_counter()
        inputs, target = next(batches)
        waited += time.perf_counter() - asked
        inputs = inputs.to(device, non_blocking=True)
        target = target.to(device, non_blocking=True)
        output = model(inputs)
        loss = criterion(output, target)
        losses += loss.item() * inputs.size(0)
        top1 += accuracy(output, target).item() * inputs.size(0)
        images += inputs.size(0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 10 == 0:
            print(f"Epoch: [{epoch}][{i + 1}/{len(loader)}]\tLoss {losses / images:.4e}\tAcc@1 {top1 / images:6.2f}",
                  flush=True)
    return {"train_images": images, "train_seconds": time.perf_counter() - start, "data_wait_seconds": waited}


def validate(loader: DataLoader, model: nn.Module, criterion, device: torch.device) -> tuple[float, int, float]:
    """(top-1 accuracy, images, seconds) of a validation pass, as main.py's validate()."""
    model.eval()
    correct, images, start = 0.0, 0, time.perf_counter()
    with torch.no_grad():
        for inputs, target in loader:
            inputs, target = inputs.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(inputs)
            criterion(output, target).item()
            correct += accuracy(output, target).item() * inputs.size(0)
            images += inputs.size(0)
    return correct / max(images, 1), images, time.perf_counter() - start


@dataclasses.dataclass(kw_only=True)
class Options:
    """plain_loop's flags, as parse_args returns them."""

    data_dir: Path
    out_dir: Path
    arch: str
    image_size: int
    batch_size: int
    workers: int
    epochs: int
    lr: float
    momentum: float
    val_fraction: float
    seed: int


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--data-dir", type=Path, required=True, help="a Kaggle-layout folder, as train_single.py reads it")
    add("--out-dir", type=Path, required=True, help="where checkpoint.pth.tar goes")
    add("--arch", default="resnet18")
    add("--image-size", type=between(*IMAGE_SIZES), default=224)
    add("--batch-size", type=between(*BATCH_SIZES), default=32)
    add("--workers", type=workers_count, default=2)
    add("--epochs", type=between(*EPOCHS), default=1)
    add("--lr", type=_non_negative, default=0.001, help="train_single.py's default")
    add("--momentum", type=_fraction(False, True), default=0.9)
    add("--val-fraction", type=open_fraction, default=0.2)
    add("--seed", type=between(*SEEDS), default=42, help="the split's, as train_single.py's --seed")
    return Options(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    table = load_labels(args.data_dir, show_progress=False)
    files = [(args.data_dir / "train" / name, int(label)) for name, label in zip(table["filename"], table["label"])]
    train_idx, val_idx = split_indices(len(files), args.val_fraction, args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    model = torchvision.models.get_model(args.arch, num_classes=NUM_CLASSES, **model_kwargs(args.arch)).to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum)

    normalize = transforms.Normalize(mean=IMAGENET_MEAN, std=IMAGENET_STD)
    train_set = Files([files[i] for i in train_idx], transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_set = Files([files[i] for i in val_idx], transforms.Compose([
        transforms.Resize(args.image_size * 256 // 224), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), normalize]))
    pinned = device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                              pin_memory=pinned, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                            pin_memory=pinned)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    best_acc1, figures = 0.0, {}
    for epoch in range(args.epochs):
        figures = train(train_loader, model, criterion, optimizer, epoch, device)
        acc1, val_images, val_seconds = validate(val_loader, model, criterion, device)
        figures.update(val_images=val_images, val_seconds=val_seconds)
        best_acc1 = max(acc1, best_acc1)
        torch.save({"epoch": epoch + 1, "arch": args.arch, "state_dict": model.state_dict(), "best_acc1": best_acc1,
                    "optimizer": optimizer.state_dict()}, args.out_dir / "checkpoint.pth.tar")
    print(json.dumps(figures))


if __name__ == "__main__":
    exit_on_error(main)
