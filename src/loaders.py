"""The train/validation split and what the scripts' DataLoaders share, built so that every mode sees
the same batches (docs/modes.md, "The same batches", says why they are the same).

The scripts make their loaders themselves, with torch's samplers: train_single.py, train_dp.py and
train_accelerate.py a RandomSampler whose generator is seeded with seed + epoch, train_ddp.py and
train_fsdp.py a DistributedSampler(shuffle=True, seed=seed), which draws the same permutation of
the training split from seed + epoch and gives rank r every W-th sample of it from the r-th: the
k-th global batch is the same slice of the same permutation in every mode. Here: the validation
shards (ShardSampler), the loader options, the checks of a batch against the data, and the
skipping of a resumed epoch's finished steps.
"""
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import pandas as pd
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler

from src.cache import MappedArray, cached
from src.config import Config
from src.datasets import (
    DogCatDataset,
    check_both_classes,
    label_table,
    load_labels,
    load_val_labels,
    start_worker_server,
    worker_options,
)
from src.devices import check_shared_memory
from src.errors import UserError
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


class ShardSampler(Sampler[int]):
    """A contiguous, unpadded 1/num_replicas share of range(n), in order; the shares differ by up to
    one sample, and `largest` is the size of the largest.

    For validation, instead of DistributedSampler: that one pads the shares to equal sizes with
    repeated samples, which the all-reduced sums would then count twice."""

    def __init__(self, n: int, num_replicas: int = 1, rank: int = 0):
        self.start = n * rank // num_replicas
        self.stop = n * (rank + 1) // num_replicas
        self.largest = -(-n // num_replicas)

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __len__(self) -> int:
        return self.stop - self.start


def loader_options(args: Config, device: torch.device) -> dict:
    """The DataLoader options every loader of a training script shares: --workers, pinned batches
    for a GPU, where the workers start (src.datasets.worker_options).

    The workers are persistent: started once per loader, they serve every epoch (the training
    split's epoch, which their draws come from, is in shared memory: src/augment.py TrainSplit).
    The loader's own generator: drawing its workers' base seed from the global one would shift
    whatever draws from the global one after it, differently in a run that resumes.
    """
    options = {"num_workers": args.workers, "pin_memory": device.type == "cuda", "generator": torch.Generator()}
    return {**options, "persistent_workers": True, **worker_options()} if args.workers else options


def check_batches(data: "Data", args: Config, processes: int = 1) -> None:
    """Refuse, before any work, a global batch larger than the training split, fewer validation
    images than processes, or a /dev/shm too small for the loader workers' batches (each process's
    workers hold micro-batches of --batch-size, also under accelerate, which cuts each loader batch)."""
    global_batch = args.batch_size * processes * args.accumulate
    if len(data.train_idx) < global_batch:
        steps = f" x {args.accumulate} (--accumulate)" if args.accumulate > 1 else ""
        raise UserError(f"--batch-size {args.batch_size} x {processes} process(es){steps} = {global_batch} "
                        f"is more than the {len(data.train_idx)} training images; lower --batch-size",
                        quiet=not is_first())  # every rank finds it: rank 0 says it
    if len(data.val_idx) < processes:
        raise UserError(f"{processes} processes but only {len(data.val_idx)} validation images; "
                        "use fewer processes or more data", quiet=not is_first())
    check_shared_memory(args.workers, args.batch_size * data.dataset[data.train_idx[0]][0].nbytes)


class _SkipBatches(BatchSampler):
    """A batch sampler that leaves out the first `skip` batches of another: their indices are
    never handed to the workers, so no image of theirs is read."""

    def __init__(self, batches: Sampler[list[int]] | Iterable[list[int]], skip: int):
        self.batches, self.skip = batches, skip

    def __iter__(self):
        for i, batch in enumerate(self.batches):
            if i >= self.skip:
                yield batch

    def __len__(self) -> int:
        return max(0, len(self.batches) - self.skip)  # type: ignore[arg-type]  # a DataLoader's batch sampler has a length


def skip_first_batches(loader: DataLoader, batches: int) -> DataLoader:
    """`loader` without its first `batches` batches of this pass (a resumed epoch's finished steps),
    as accelerate's Accelerator.skip_first_batches does for its loaders; `loader` itself when 0.
    Its sampler stays the same object: set_epoch on it still applies."""
    if not batches:
        return loader
    if loader.batch_sampler is None:  # a loader of single samples (batch_size=None) has no batches to skip
        raise ValueError("skip_first_batches: the loader has no batch sampler")
    return DataLoader(loader.dataset, batch_sampler=_SkipBatches(loader.batch_sampler, batches),
                      num_workers=loader.num_workers, pin_memory=loader.pin_memory, generator=loader.generator,
                      **({"multiprocessing_context": loader.multiprocessing_context,
                          "worker_init_fn": loader.worker_init_fn} if loader.num_workers else {}))


def labelled_images(data_dir: Path | str, image_size: int, show_progress: bool = True,
                    labels: pd.DataFrame | None = None,
                    val: tuple[Path | str, pd.DataFrame] | None = None) -> DogCatDataset:
    """The labelled JPEGs of data_dir/train (the `labels` table, else train.csv or a scan),
    decoded and resized to image_size; with `val` (--val-dir and its table), that folder's images
    after them (named by their absolute path, which the table's folder, data_dir/train, leaves as
    it is)."""
    if labels is None:
        labels = load_labels(Path(data_dir), show_progress)
    if val is not None:
        root, val_labels = os.path.abspath(val[0]), val[1]  # each process's own: the same folder on every node
        labels = label_table([*labels["filename"], *(os.path.join(root, name) for name in val_labels["filename"])],
                             [*labels["label"], *val_labels["label"]])
    return DogCatDataset(labels, Path(data_dir) / "train", image_transform(image_size), draft_size=image_size)


def table_digest(table: pd.DataFrame) -> str:
    """The sha256 of a label table as CSV (names that are not UTF-8, read from disk that way, hash
    as their bytes): what best.json and last.pth record of the images, --resume and the report check."""
    return hashlib.sha256(table.to_csv(index=False).encode("utf-8", "surrogateescape")).hexdigest()


class Data(NamedTuple):
    dataset: Dataset
    train_idx: list[int]
    val_idx: list[int]
    digest: str  # of the label table: --resume refuses other data
    val_digest: str | None = None  # of --val-dir's table, as digest


def labelled_data(args: Config, wait_seconds: float | None = None) -> Data:
    """The labelled images of --data-dir resized to --image-size (or their --cache), and the split.

    Rank 0 reads train.csv or scans train/ (opening every image), and every rank gets its table:
    one scan instead of one per process, and the same table, so the same split, on every rank.
    With --val-dir rank 0 scans that folder too: its images are the validation set, every image
    of train/ (or train.csv) trains, and --val-fraction's split is not made (src.cli refuses it).
    --workers decode the images when the cache has to be built; `wait_seconds`: how long the
    other processes of a node wait for its first one to build it (--dist-timeout).
    """
    data_dir, show = Path(args.data_dir), is_first()
    if args.workers:  # before the label scan and the model: the workers' server imports while they are made
        start_worker_server()
    val_dir = args.val_dir

    def tables() -> tuple[pd.DataFrame, tuple[str, pd.DataFrame] | None]:
        table = load_labels(data_dir, show)
        return table, None if val_dir is None else (val_dir, load_val_labels(Path(val_dir), data_dir, table, show))

    table, val = from_rank_0(tables)
    if not args.evaluate:  # validating on one class is a fair question; training on it is not
        try:
            check_both_classes(table, data_dir)
        except UserError as error:  # every rank has the table: rank 0 says it
            raise UserError(str(error), quiet=not show) from None
    images = labelled_images(data_dir, args.image_size, show, table, val)
    dataset: DogCatDataset | MappedArray = images
    if args.cache:
        dataset = cached(images, args.image_size, Path(args.cache), args.workers, show, wait_seconds)
    if val is None:
        assert args.val_fraction is not None  # None with --val-dir only (src.cli)
        train_idx, val_idx = split_indices(len(images), args.val_fraction, args.seed)
        return Data(dataset, train_idx, val_idx, table_digest(table))
    return Data(dataset, list(range(len(table))), list(range(len(table), len(images))), table_digest(table),
                table_digest(val[1]))
