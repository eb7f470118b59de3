"""The train/validation split and the data loaders, built so that every mode sees the same batches
(docs/modes.md, "The same batches", says why they are the same): EpochSampler gives each process
its share of each epoch's seeded permutation, cut to whole global batches; ShardSampler gives it
a contiguous, unpadded slice of the validation split.

The sampler yields (epoch, position) pairs rather than positions: loader workers keep their own
copy of the dataset for the whole run (persistent workers), so the epoch that --augment draws
from has to travel with each index.
"""
import atexit
import hashlib
import multiprocessing
import os
import signal
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from src.augment import augment, crop_params
from src.cache import cached
from src.datasets import DogCatDataset, check_both_classes, load_labels
from src.devices import available_cpus, check_shared_memory
from src.dropout import sample_key
from src.errors import STOP_SIGNALS, UserError
from src.ranks import from_rank_0, is_first
from src.transforms import image_transform


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The seeded train/validation split of n samples; the same in every mode and on every rank."""
    n_val = round(n * val_fraction)
    if n_val < 1 or n_val >= n:
        raise UserError(f"--val-fraction {val_fraction} leaves an empty split of {n} images "
                        f"({n - n_val} train, {n_val} validation)")
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


class EpochSampler(Sampler[tuple[int, int]]):
    """This rank's share of each epoch's seeded permutation of range(n), cut to whole global batches.

    Yields (epoch, position); call set_epoch(epoch) before each epoch, and start_at(steps) after it
    to go on inside the epoch (a resumed one).
    """

    def __init__(self, n: int, global_batch: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n, self.seed, self.rank, self.world_size = n, seed, rank, world_size
        self.global_batch = global_batch
        self.used = n // global_batch * global_batch
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # accelerate's loader sets the same epoch again as it begins the pass
            self.epoch, self.start = epoch, 0

    def start_at(self, steps: int) -> None:
        """Leave out this epoch's first `steps` optimizer steps: each took global_batch / world_size
        of this rank's samples. They are never handed to the loader, so no image of theirs is read."""
        self.start = steps * self.global_batch // self.world_size

    def __iter__(self):
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        return iter([(self.epoch, i) for i in perm[:self.used].tolist()[self.rank::self.world_size][self.start:]])

    def __len__(self) -> int:
        return self.used // self.world_size - self.start


def epoch_sampler(loader) -> EpochSampler | None:
    """The EpochSampler under a training loader, also one that accelerate has wrapped (its batch
    sampler holds the original batch sampler, which holds ours); None if there is none."""
    found = [loader]
    for _ in range(4):
        for item in found:
            if isinstance(item, EpochSampler):
                return item
        found = [getattr(item, name) for item in found for name in ("sampler", "batch_sampler")
                 if getattr(item, name, None) is not None]
    return None


class TrainSplit(Dataset):
    """The training images, indexed by (epoch, position in the split); each item is (image, label,
    the sample's dropout key: src.dropout.sample_key); augmented with `augment`."""

    def __init__(self, dataset: Dataset, indices: list[int], seed: int, augment: bool = False):
        self.dataset, self.indices, self.seed, self.augment = dataset, indices, seed, augment

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: tuple[int, int]):
        epoch, position = key
        index = self.indices[position]
        image, label = self.dataset[index]
        if self.augment:
            image = augment(image, crop_params(self.seed, epoch, index, image.shape[-1]))
        return image, label, sample_key(self.seed, epoch, index)


class ShardSampler(Sampler[int]):
    """A contiguous, unpadded 1/num_replicas share of range(n), in order; the shares differ by up to
    one sample, and `largest` is the size of the largest."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        self.start = n * rank // num_replicas
        self.stop = n * (rank + 1) // num_replicas
        self.largest = -(-n // num_replicas)

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


_ending_workers = False


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader worker's worker_init_fn: the stop signals are its main process's to act on
    (Ctrl-C in a terminal reaches the workers too, torchrun signals a worker's process group,
    SLURM every process of the job step), and the steps before the stop need the workers."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def end_workers_at_exit() -> None:
    """Once per process (make_loaders calls it): at exit, SIGKILL the daemonic children still alive
    (DataLoader workers whose loader was not shut down, after an error). multiprocessing's own exit
    ends them with SIGTERM, which they ignore, and then waits for them: forever. atexit runs this
    before it (registered later)."""
    global _ending_workers
    if not _ending_workers:
        _ending_workers = True
        atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def default_workers(local_processes: int | None = None) -> int:
    """The CPUs this process may use, shared among the processes on this node (LOCAL_WORLD_SIZE,
    which torchrun and accelerate set, unless given)."""
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, available_cpus() // local_processes)


def make_loaders(dataset: Dataset, train_idx: list[int], val_idx: list[int], batch_size: int,
                 seed: int, workers: int, rank: int = 0, world_size: int = 1,
                 pin_memory: bool = False, accumulate: int = 1, augment: bool = False,
                 split: int = 1) -> tuple[DataLoader, DataLoader]:
    """Loaders of this rank's share; call `train_loader.sampler.set_epoch(epoch)` every epoch.

    `split`: the processes that share each batch (accelerate's split_batches), each loading its own
    part of it.
    """
    global_batch = batch_size * world_size * accumulate
    if len(train_idx) < global_batch:
        steps = f" x {accumulate} (--accumulate)" if accumulate > 1 else ""
        raise UserError(f"--batch-size {batch_size} x {world_size} process(es){steps} = {global_batch} "
                        f"is more than the {len(train_idx)} training images; lower --batch-size",
                        quiet=rank != 0)  # every rank finds it: rank 0 says it
    if len(val_idx) < world_size:
        raise UserError(f"{world_size} processes but only {len(val_idx)} validation images; "
                        "use fewer processes or more data", quiet=rank != 0)
    check_shared_memory(workers, batch_size // split * dataset[train_idx[0]][0].nbytes)
    if workers:
        end_workers_at_exit()  # they ignore SIGTERM (ignore_stop_signals)
    train_set = TrainSplit(dataset, train_idx, seed, augment)
    val_set = Subset(dataset, val_idx)
    # Their own generator: drawing the workers' base seed from the global one would shift what
    # dropout draws after it, differently in a run that resumes.
    # The workers ignore the stop signals: the main process acts on them (src/stopping.py) and
    # still needs its workers for the steps before it stops.
    options = dict(batch_size=batch_size, num_workers=workers, pin_memory=pin_memory,
                   persistent_workers=workers > 0, generator=torch.Generator(), worker_init_fn=ignore_stop_signals)
    train_sampler = EpochSampler(len(train_set), global_batch, seed, rank, world_size)
    train_loader = DataLoader(train_set, sampler=train_sampler, drop_last=True, **options)
    val_loader = DataLoader(val_set, sampler=ShardSampler(len(val_set), world_size, rank), **options)
    return train_loader, val_loader


def labelled_images(data_dir: Path, image_size: int, show_progress: bool = True,
                    labels: pd.DataFrame | None = None) -> DogCatDataset:
    """The labelled JPEGs of data_dir/train (the `labels` table, else train.csv or a scan),
    decoded and resized to image_size."""
    if labels is None:
        labels = load_labels(data_dir, show_progress)
    return DogCatDataset(labels, data_dir / "train", image_transform(image_size), draft_size=image_size)


class Data(NamedTuple):
    dataset: Dataset
    train_idx: list[int]
    val_idx: list[int]
    digest: str  # of the label table: --resume refuses other data


def labelled_data(args) -> Data:
    """The labelled images of --data-dir resized to --image-size (or their --cache), and the split.

    Rank 0 reads train.csv or scans train/ (opening every image), and every rank gets its table:
    one scan instead of one per process, and the same table, so the same split, on every rank.
    --workers decode the images when the cache has to be built.
    """
    data_dir, show = Path(args.data_dir), is_first()
    table = from_rank_0(lambda: load_labels(data_dir, show))
    if not getattr(args, "evaluate", False):  # validating on one class is a fair question; training on it is not
        try:
            check_both_classes(table, data_dir)
        except UserError as error:  # every rank has the table: rank 0 says it
            raise UserError(str(error), quiet=not show) from None
    dataset = labelled_images(data_dir, args.image_size, show, table)
    if args.cache:
        dataset = cached(dataset, args.image_size, Path(args.cache), args.workers, show)
    train_idx, val_idx = split_indices(len(dataset), args.val_fraction, args.seed)
    # surrogateescape: names that are not UTF-8 (read from disk that way) hash as their bytes
    digest = hashlib.sha256(table.to_csv(index=False).encode("utf-8", "surrogateescape")).hexdigest()
    return Data(dataset, train_idx, val_idx, digest)


def run_loaders(dataset: Dataset, data: Data, args, device: torch.device, rank: int = 0,
                world_size: int = 1, split: int = 1) -> tuple[DataLoader, DataLoader]:
    """make_loaders for a training run's flags: `dataset` holds the images (or a frozen stage's
    backbone outputs) of `data`'s split; `split`: the processes that cut each loader batch
    (accelerate), so a loader batch is --batch-size x split."""
    return make_loaders(dataset, data.train_idx, data.val_idx, args.batch_size * split, args.seed,
                        args.workers, rank, world_size, pin_memory=device.type == "cuda",
                        accumulate=args.accumulate, augment=args.augment, split=split)
