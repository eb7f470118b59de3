"""--cache DIR: every labelled image decoded and resized once, kept as uint8 pixels on disk.

DIR/train_{size}px.{key}.u8 holds N x 3 x size x size uint8 pixels in the order of the label
table, made by the same JPEG path as training without the cache (so the tensors are identical),
and read back memory-mapped; DIR/train_{size}px.{key}.json records it. The key (its first 16 hex
digits in the names) is a hash of the data folder, every file's name, label, byte size and
modification time, and the image size: when any of them changes, the next run builds a cache of
its own (the old files stay until DIR is deleted). The first process of each node builds it
(LOCAL_RANK 0, as torchrun and accelerate number them), the others wait for it, as long as
--dist-timeout (60 minutes by default); `python -m src.tools.prepare DATA_DIR --cache DIR
--image-size N` builds it ahead of time.

Several builders may meet in one folder (nodes sharing an NFS or Lustre home). Nodes whose copies
of the images differ (another path, or copied without their modification times) have different
keys, so different files: none overwrites what another node's processes wait for or read. Nodes
with the same key each write their own temporary file, the first complete build is renamed into
place and the others reuse it. A data file whose size does not match its recorded shape
(truncated, deleted) is rebuilt. `ensure_array` does all this for any array; the frozen
backbone's feature cache uses it too.
"""
import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from src.datasets import DogCatDataset, worker_options
from src.errors import UserError
from src.outputs import atomic_write_text

FORMAT = 2  # bump when the layout or the decoding changes (2: EXIF orientation, 16-bit grayscale)
WAIT_SECONDS = 3600  # how long the other processes of a node wait for its first one to build,
# unless told otherwise (the training scripts pass --dist-timeout)


def cache_paths(cache_dir: Path, image_size: int, key: str) -> tuple[Path, Path]:
    """The data and record files of the pixel cache with this key."""
    stem = f"train_{image_size}px.{key[:16]}"
    return Path(cache_dir) / f"{stem}.u8", Path(cache_dir) / f"{stem}.json"


def cache_key(dataset: DogCatDataset, image_size: int) -> str:
    """Changes when the data folder, a file (name, label, size, mtime) or the image size does."""
    digest = hashlib.sha256(f"{FORMAT} {image_size} {dataset.root_dir.resolve()}\n".encode())
    for name, label in zip(dataset.frame["filename"], dataset.frame["label"]):
        stat = (dataset.root_dir / name).stat()
        digest.update(f"{name}\t{label}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def _status(data_path: Path, meta_path: Path, key: str, nbytes: int) -> str:
    """'ok' (this key, complete), 'damaged' (this key, wrong data size) or 'missing'."""
    try:
        if json.loads(meta_path.read_text())["key"] != key:
            return "missing"
    except (OSError, ValueError, KeyError, TypeError):
        return "missing"
    try:
        return "ok" if data_path.stat().st_size == nbytes else "damaged"
    except OSError:
        return "damaged"


def ensure_array(data_path: Path, meta_path: Path, key: str, shape: tuple, dtype,
                 fill: Callable[[np.ndarray], None], flag: str, what: str,
                 show_progress: bool = True, wait_seconds: float | None = None) -> None:
    """Make data_path hold the array that fill(array) writes, recorded under `key` in meta_path.

    Reused when complete; otherwise built by the first process of each node while the others
    wait (no collective, so no process-group timeout; a deadline instead). `flag` names the
    option in messages, `what` the content ("images"); `wait_seconds`: how long the others wait
    (WAIT_SECONDS by default).
    """
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    status = _status(data_path, meta_path, key, nbytes)
    if status == "ok":
        if show_progress:
            print(f"reading {what} from the cache {data_path}")
        return
    if int(os.environ.get("LOCAL_RANK", 0)) != 0:
        _wait_for(data_path, meta_path, key, nbytes, flag, WAIT_SECONDS if wait_seconds is None else wait_seconds)
        return
    if status == "damaged":
        print(f"{data_path} does not match its {meta_path.name} (truncated or deleted): rebuilding it")
    try:
        data_path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(data_path.parent).free
    except OSError as error:
        raise UserError(f"{flag} {data_path.parent}: cannot create it ({error.strerror})") from None
    if nbytes > free:
        raise UserError(f"{flag} {data_path.parent} needs {nbytes / 1e9:.2f} GB for {data_path.name} "
                        f"but its disk has {free / 1e9:.2f} GB free")
    # A name no other builder has: the process id alone repeats across identical containers.
    tmp = data_path.with_name(f".{data_path.name}.{socket.gethostname()}.{os.getpid()}."
                              f"{uuid.uuid4().hex[:8]}.tmp")
    try:
        array = np.memmap(tmp, dtype=dtype, mode="w+", shape=shape)
        fill(array)
        array.flush()
        del array
        if _status(data_path, meta_path, key, nbytes) == "ok":
            return  # another builder finished first: use its file (finally removes ours)
        os.replace(tmp, data_path)
    finally:
        tmp.unlink(missing_ok=True)
    atomic_write_text(meta_path, json.dumps({"key": key, "shape": list(shape),
                                             "dtype": np.dtype(dtype).name, "format": FORMAT}, indent=2))


def _wait_for(data_path: Path, meta_path: Path, key: str, nbytes: int, flag: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while _status(data_path, meta_path, key, nbytes) != "ok":
        if time.monotonic() > deadline:
            raise UserError(f"waited {seconds // 60:.0f} min for {data_path}, which the first process "
                            f"of this node builds, and it is not there: see that process's error, or "
                            f"build it ahead with python -m src.tools.prepare (pixel cache) or a one-process run")
        time.sleep(0.5)


class MappedArray(Dataset):
    """A cache file read back memory-mapped, as `(tensor of one row, label)` items: the pixels of
    --cache (uint8, 3 x size x size, like DogCatDataset's images) or a frozen backbone's outputs
    (float32 vectors). `key` identifies what it holds (the feature cache's key includes it)."""

    def __init__(self, path: Path, labels: list[int], row_shape: tuple, dtype, key: str = ""):
        self.path, self.labels, self.key = Path(path), list(labels), key
        self.shape, self.dtype = (len(self.labels), *row_shape), np.dtype(dtype)
        self._array: np.memmap | None = None  # opened lazily in each loader worker

    def __getstate__(self) -> dict:  # a memmap would be pickled as a full copy of the data
        return {**self.__dict__, "_array": None}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self._array is None:
            self._array = np.memmap(self.path, dtype=self.dtype, mode="r", shape=self.shape)
        return torch.from_numpy(np.array(self._array[index])), self.labels[index]


def _decode_into(pixels: np.ndarray, dataset: Dataset, workers: int, desc: str, show_progress: bool) -> None:
    # Its own generator: drawing the workers' seed from the global one would change what the
    # run does next (the new head's initial weights) compared with a run that finds the cache.
    loader = DataLoader(dataset, batch_size=64, num_workers=workers, generator=torch.Generator(),
                        **(worker_options() if workers else {}))
    start = 0
    for images, _ in tqdm(loader, desc=desc, disable=not show_progress, leave=False):
        pixels[start:start + len(images)] = images.numpy()
        start += len(images)


def build_cache(dataset: DogCatDataset, image_size: int, cache_dir: Path, workers: int,
                show_progress: bool = True, wait_seconds: float | None = None) -> str:
    """Decode every image of `dataset` (which must resize to image_size) into the cache files,
    unless they are there already; returns the cache's key. `python -m src.tools.prepare --cache`
    calls it ahead of training."""
    # The key is taken before decoding: a file that changes during the build makes the next run rebuild.
    key = cache_key(dataset, image_size)
    data_path, meta_path = cache_paths(cache_dir, image_size, key)
    desc = f"caching {len(dataset)} images at {image_size} px"
    ensure_array(data_path, meta_path, key, (len(dataset), 3, image_size, image_size), np.uint8,
                 lambda pixels: _decode_into(pixels, dataset, workers, desc, show_progress),
                 "--cache", "images", show_progress, wait_seconds)
    return key


def cached(dataset: DogCatDataset, image_size: int, cache_dir: Path, workers: int,
           show_progress: bool = True, wait_seconds: float | None = None) -> MappedArray:
    """The cache of `dataset` in cache_dir, built first if it is missing, out of date or damaged
    (`wait_seconds`: see ensure_array)."""
    key = build_cache(dataset, image_size, cache_dir, workers, show_progress, wait_seconds)
    return MappedArray(cache_paths(cache_dir, image_size, key)[0], dataset.frame["label"].tolist(),
                       (3, image_size, image_size), np.uint8, key)
