"""--cache DIR: every labelled image decoded and resized once, kept as uint8 pixels on disk.

DIR/train_{size}px.u8 holds N x 3 x size x size uint8 pixels in the order of the label table,
made by the same JPEG path as training without the cache (so the tensors are identical), and
read back memory-mapped. DIR/train_{size}px.json holds its key, a hash of the data folder, every
file's name, label, byte size and modification time, and the image size: when any of them
changes, the next run rebuilds the cache. The first process of each node builds it (LOCAL_RANK
0, as torchrun and accelerate number them), the others wait for it; `python -m src.prepare
DATA_DIR --cache DIR --image-size N` builds it ahead of time.
"""
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from src.checkpoint import atomic_write_text
from src.datasets import DogCatDataset
from src.errors import UserError

FORMAT = 1  # bump when the layout or the decoding changes


def cache_paths(cache_dir: Path, image_size: int) -> tuple[Path, Path]:
    stem = Path(cache_dir) / f"train_{image_size}px"
    return stem.with_suffix(".u8"), stem.with_suffix(".json")


def cache_key(dataset: DogCatDataset, image_size: int) -> str:
    """Changes when the data folder, a file (name, label, size, mtime) or the image size does."""
    digest = hashlib.sha256(f"{FORMAT} {image_size} {dataset.root_dir.resolve()}\n".encode())
    for name, label in zip(dataset.frame["filename"], dataset.frame["label"]):
        stat = (dataset.root_dir / name).stat()
        digest.update(f"{name}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _saved_key(meta_path: Path) -> str | None:
    try:
        return json.loads(meta_path.read_text())["key"]
    except (OSError, ValueError, KeyError):
        return None


def build_cache(dataset: DogCatDataset, image_size: int, cache_dir: Path, workers: int,
                show_progress: bool = True, key: str | None = None) -> None:
    """Decode every image of `dataset` (which must resize to image_size) into the cache files.

    `key` is cache_key(dataset, image_size) if the caller has it already.
    """
    data_path, meta_path = cache_paths(cache_dir, image_size)
    # Taken before decoding: a file that changes during the build makes the next run rebuild.
    key = key or cache_key(dataset, image_size)
    try:
        data_path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(data_path.parent).free
    except OSError as error:
        raise UserError(f"--cache {cache_dir}: cannot create it ({error.strerror})") from None
    shape = (len(dataset), 3, image_size, image_size)
    needed = int(np.prod(shape))
    if needed > free:
        raise UserError(f"--cache {cache_dir} needs {needed / 1e9:.2f} GB for {len(dataset)} images "
                        f"at {image_size} px but its disk has {free / 1e9:.2f} GB free")
    meta_path.unlink(missing_ok=True)  # from here on, no key matches until the new data is complete
    tmp = data_path.with_name(f".{data_path.name}.{os.getpid()}.tmp")
    try:
        pixels = np.memmap(tmp, dtype=np.uint8, mode="w+", shape=shape)
        # Its own generator: drawing the workers' seed from the global one would change what the
        # run does next (the new head's initial weights) compared with a run that finds the cache.
        loader = DataLoader(dataset, batch_size=64, num_workers=workers, generator=torch.Generator())
        start = 0
        for images, _ in tqdm(loader, desc=f"caching {len(dataset)} images at {image_size} px",
                              disable=not show_progress, leave=False):
            pixels[start:start + len(images)] = images.numpy()
            start += len(images)
        pixels.flush()
        del pixels
        os.replace(tmp, data_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {"key": key, "shape": list(shape), "format": FORMAT}
    atomic_write_text(meta_path, json.dumps(meta, indent=2))


class CachedImages(Dataset):
    """The cached pixels as `(uint8 tensor (3, size, size), label)`, like DogCatDataset's items."""

    def __init__(self, data_path: Path, labels: list[int], image_size: int):
        self.data_path, self.labels = Path(data_path), list(labels)
        self.shape = (len(self.labels), 3, image_size, image_size)
        self._pixels = None  # opened lazily in each loader worker

    def __getstate__(self) -> dict:  # a memmap would be pickled as a full copy of the data
        return {**self.__dict__, "_pixels": None}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._pixels is None:
            self._pixels = np.memmap(self.data_path, dtype=np.uint8, mode="r", shape=self.shape)
        return torch.from_numpy(np.array(self._pixels[index])), self.labels[index]


def cached(dataset: DogCatDataset, image_size: int, cache_dir: Path, workers: int,
           show_progress: bool = True) -> CachedImages:
    """The cache of `dataset` in cache_dir, built first if it is missing or out of date."""
    data_path, meta_path = cache_paths(cache_dir, image_size)
    key = cache_key(dataset, image_size)
    if _saved_key(meta_path) != key:
        if int(os.environ.get("LOCAL_RANK", 0)) == 0:
            build_cache(dataset, image_size, cache_dir, workers, show_progress, key)
        else:  # the node's first process is building it; no collective, so no process-group timeout
            while _saved_key(meta_path) != key:
                time.sleep(0.5)
    elif show_progress:
        print(f"reading images from the cache {data_path}")
    return CachedImages(data_path, dataset.frame["label"].tolist(), image_size)
