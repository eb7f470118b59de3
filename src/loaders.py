"""The train/validation split and the data loaders, built so that every mode sees the same batches.

Training order: each epoch is one seeded permutation of the training split, `randperm(n)` with a
generator seeded `seed + epoch` (what `DistributedSampler` draws). With W processes of B images,
DistributedSampler gives process r the samples perm[r], perm[r + W], ...; its k-th local batch
is therefore a W-th of perm[k*W*B : (k+1)*W*B], which is exactly the k-th batch that one process
with batch size W*B sees. Incomplete last batches are dropped in every mode, so every step
averages the gradient over the same W*B samples.

Validation: each process takes a contiguous slice of the split without padding, so the summed
counts cover every validation sample exactly once, whatever the number of processes.
"""
import os
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

from src.cache import cached
from src.datasets import DogCatDataset, load_labels
from src.errors import UserError
from src.transforms import image_transform


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The seeded train/validation split of n samples; the same in every mode and on every rank."""
    n_val = round(n * val_fraction)
    if n_val < 1 or n_val >= n:
        raise UserError(f"--val-fraction {val_fraction} leaves an empty split of {n} images "
                        f"({n - n_val} train, {n_val} validation)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


class ShardSampler(Sampler[int]):
    """A contiguous, unpadded 1/num_replicas share of range(n), in order."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        self.start = n * rank // num_replicas
        self.stop = n * (rank + 1) // num_replicas

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def default_workers(local_processes: int = 1) -> int:
    """The CPUs this process may use, shared among the processes on this node."""
    return max(1, len(os.sched_getaffinity(0)) // local_processes)


def make_loaders(dataset: Dataset, train_idx: list[int], val_idx: list[int], batch_size: int,
                 seed: int, workers: int, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False) -> tuple[DataLoader, DataLoader]:
    """Loaders of this rank's share; call `train_loader.sampler.set_epoch(epoch)` every epoch."""
    global_batch = batch_size * world_size
    if len(train_idx) < global_batch:
        raise UserError(f"--batch-size {batch_size} x {world_size} process(es) = {global_batch} "
                        f"is more than the {len(train_idx)} training images; lower --batch-size")
    if len(val_idx) < world_size:
        raise UserError(f"{world_size} processes but only {len(val_idx)} validation images; "
                        "use fewer processes or more data")
    train_set, val_set = Subset(dataset, train_idx), Subset(dataset, val_idx)
    options = dict(batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                   persistent_workers=workers > 0)
    train_sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                       shuffle=True, seed=seed, drop_last=True)
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True, **options)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), world_size, rank), **options)
    return train_loader, val_loader


def labelled_images(data_dir: Path, image_size: int, show_progress: bool = True) -> DogCatDataset:
    """The labelled JPEGs of data_dir/train, decoded and resized to image_size."""
    return DogCatDataset(load_labels(data_dir, show_progress), data_dir / "train",
                         image_transform(image_size), draft_size=image_size)


def labelled_data(args, workers: int, show_progress: bool = True) -> tuple[Dataset, list[int], list[int]]:
    """The labelled images of --data-dir resized to --image-size (or their --cache), and the split.

    `workers` decode the images when the cache has to be built.
    """
    dataset = labelled_images(Path(args.data_dir), args.image_size, show_progress)
    if args.cache:
        dataset = cached(dataset, args.image_size, Path(args.cache), workers, show_progress)
    train_idx, val_idx = split_indices(len(dataset), args.val_fraction, args.seed)
    return dataset, train_idx, val_idx
