"""The Dogs vs. Cats images: finding them, labelling them (0 = cat, 1 = dog), reading them as RGB, and
the processes of the DataLoader workers that read them."""
import atexit
import functools
import multiprocessing
import os
import re
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from PIL import Image
from torch.utils.data import Dataset
from tqdm import tqdm

from src.errors import STOP_SIGNALS, UserError, ignore_pillow_warnings
from src.image_files import IMAGE_SUFFIXES, files_under, natural_key, some, to_rgb
from src.outputs import input_problem, sha256_of
from src.terminal import shown

CLASSES = ("cat", "dog")
_KAGGLE_NAME = re.compile(r"^(cat|dog)\.\d+\.[a-z]+$", re.IGNORECASE)
_FOLDER_LABELS = {"cat": 0, "cats": 0, "dog": 1, "dogs": 1}
LABEL_RULES = "cat.N / dog.N images, or images at any depth under a cat(s)/ or dog(s)/ folder"


def layouts(folder: Path, csv_file: Path | None = None) -> str:
    """Every layout of labelled images that `folder` may hold, for the line that finds none there
    (`csv_file`: the filename,label table that may list them instead, for DATA_DIR/train)."""
    text = (f"Kaggle's cat.N.jpg / dog.N.jpg in {shown(folder)}, or images at any depth under a cats/ and a "
            f"dogs/ folder in it (or Cat/ and Dog/, any case: {shown(Path(folder) / 'cats' / '2023' / 'x.jpg')})")
    return text + (f", or a {shown(csv_file)} of filename,label (0/cat, 1/dog) naming files in it" if csv_file else "")


def open_rgb(path: Path, draft_size: int | None = None) -> Image.Image:
    """Decode any image (grayscale, 16-bit, CMYK, RGBA, palette, PNG named .jpg) as RGB, turned
    by its EXIF orientation (src.image_files.to_rgb, which predict's decode shares).

    With `draft_size`, JPEGs are decoded by libjpeg at the smallest 1/2, 1/4 or 1/8 scale that
    still covers draft_size x draft_size, which is much faster than a full decode then resize.
    """
    try:  # Pillow's warnings about odd EXIF data: src.errors.ignore_pillow_warnings
        image = Image.open(path)
        if draft_size:
            image.draft("RGB", (draft_size, draft_size))
        return to_rgb(image)
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise UserError(f"cannot read image {path} ({error}); "
                        "run `python -m src.tools.prepare DATA_DIR` to leave out broken files") from None


def _label_of(relative: Path) -> int | None:
    """An image's label from its path in the folder: a Kaggle name at the top, or the class folder
    at the top that holds it at any depth (torchvision's ImageFolder rule: cats/2023/x.jpg)."""
    if len(relative.parts) == 1 and _KAGGLE_NAME.match(relative.name):
        return CLASSES.index(relative.name.split(".")[0].lower())
    if len(relative.parts) >= 2:
        return _FOLDER_LABELS.get(relative.parts[0].lower())
    return None


def scan_train_dir(train_dir: Path, show_progress: bool = True,
                   flag: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """Find the labelled images under train_dir and open each one.

    Accepts Kaggle's flat `cat.N.jpg` / `dog.N.jpg` and one folder per class (`Cat/`, `dogs/`, any
    case, as in Microsoft's PetImages), its images at any depth under it. Returns the
    `filename,label` table of the readable images, in natural filename order, and the names of the
    unreadable ones (empty, truncated, not images). `flag`: the option that named the folder
    (--val-dir), for the messages; None for DATA_DIR/train, which a train.csv beside it may replace.
    """
    train_dir = Path(train_dir)
    csv_file = None if flag else train_dir.with_name("train.csv")
    if not train_dir.is_dir():
        archive = train_dir.with_name(train_dir.name + ".zip")
        if archive.is_file():
            raise UserError(f"{(flag + ' ') if flag else ''}{train_dir} is not a folder, but {archive} is there: "
                            f"unzip it first (unzip -q {archive} -d {train_dir.parent})")
        if flag:
            raise UserError(f"{flag} {train_dir} is not a folder: name a folder of labelled images ("
                            f"{layouts(train_dir)})")
        raise UserError(f"{train_dir} is not a folder: put your labelled images there ({layouts(train_dir, csv_file)}), "
                        "or make a synthetic set with `python -m src.tools.synthetic DATA_DIR`")
    candidates = []
    for name in train_files(train_dir):
        # A link to nothing or a loop of links is a file that cannot be read: counted with those below.
        label = _label_of(Path(name)) if Path(name).suffix.lower() in IMAGE_SUFFIXES else None
        if label is not None:
            candidates.append((name, label))
    candidates.sort(key=lambda row: natural_key(row[0]))
    if not candidates:
        raise UserError(f"no labelled images in {(flag + ' ') if flag else ''}{train_dir}: expected "
                        f"{layouts(train_dir, csv_file)}")
    rows, rejected = [], []
    for name, label in tqdm(candidates, desc=f"checking {train_dir}", disable=not show_progress,
                            leave=False):
        if input_problem(train_dir / name) is not None:  # not opened: a named pipe would wait for a writer
            rejected.append(name)
            continue
        try:
            with Image.open(train_dir / name) as image:
                image.draft("RGB", (64, 64))
                image.load()
            rows.append((name, label))
        except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
            rejected.append(name)
    if not rows:
        raise UserError(f"none of the {len(candidates)} images in {train_dir} can be read")
    return label_table([name for name, _ in rows], [label for _, label in rows]), rejected


def train_files(train_dir: Path) -> list[str]:
    """Every file under train_dir (src.image_files.files_under), as paths relative to it with /
    separators."""
    try:
        return files_under(Path(train_dir))
    except OSError as error:
        raise UserError(f"cannot list {train_dir} ({error.strerror or type(error).__name__}): make it readable") from None


def not_used_line(data_dir: Path, listed: list[str], csv_file: Path | None = None,
                  folder: Path | None = None) -> str | None:
    """The line that names the files of data_dir/train (or `folder`: --val-dir's) that the label
    table leaves out (those not in `listed`): no label rule covers them, or (csv_file) train.csv
    does not list them, as when images were added after `prepare` wrote it. None when every file
    is used."""
    train_dir = Path(data_dir) / "train" if folder is None else Path(folder)
    known = {Path(name).as_posix() for name in listed}
    unused = sorted((name for name in train_files(train_dir) if name not in known), key=natural_key)
    if not unused:
        return None
    if csv_file is not None:
        return (f"not used: {len(unused)} file(s) in {shown(train_dir)} that {shown(csv_file)} does not list "
                f"({some(unused)}); to train on them too, rerun `python -m src.tools.prepare {shown(data_dir)}`, "
                "which rewrites it")
    return (f"not used: {len(unused)} file(s) in {shown(train_dir)} that no label rule covers ({LABEL_RULES}; "
            f"{', '.join(sorted(IMAGE_SUFFIXES))}): {some(unused)}")


def label_table(names: list[str], labels: list[int]) -> pd.DataFrame:
    """The `filename,label` table. The names are Python strings (object dtype), not pandas' string
    dtype: with pyarrow installed (mlflow brings it) pandas 3 stores those as UTF-8, which refuses
    a name read from disk that is not UTF-8 (a surrogate-escaped byte)."""
    return pd.DataFrame({"filename": pd.Series(names, dtype=object),
                         "label": pd.Series(labels, dtype="int64")})


def read_labels_csv(csv_file: Path, root_dir: Path) -> pd.DataFrame:
    """Read and check a `filename,label` CSV; labels may be 0/1 or cat/dog. Bytes that are not
    UTF-8 are read as the file names on disk hold them (prepare writes such names back as they were)."""
    try:
        frame = pd.read_csv(csv_file, dtype=object, keep_default_na=False, encoding="utf-8",
                            encoding_errors="surrogateescape")
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {csv_file} ({error}): expected a CSV with columns "
                        "filename,label") from None
    if list(frame.columns) != ["filename", "label"]:
        raise UserError(f"{csv_file} has columns {','.join(frame.columns)}; expected filename,label "
                        "(rebuild it with `python -m src.tools.prepare DATA_DIR`)")
    if frame.empty:
        raise UserError(f"{csv_file} lists no images")
    # The same file under two spellings (./cat.0.jpg, sub/../cat.0.jpg, a link) is repeated too.
    # (a list, not a pandas column: names that are not UTF-8 hold surrogates, which arrow refuses)
    first_of: dict[str, str] = {}
    repeated = []
    for name in frame["filename"]:
        file = os.path.realpath(Path(root_dir) / name)
        if file in first_of:
            repeated.append((first_of[file], name))
        first_of.setdefault(file, name)
    if repeated:
        # The same image could land in both the training and the validation split.
        first, again = repeated[0]
        spelled = "" if first == again else f" (as {first} and {again})"
        raise UserError(f"{csv_file} lists {first} more than once{spelled} ({len(repeated)} repeated "
                        "row(s)); list each image once, or rebuild it with `python -m src.tools.prepare DATA_DIR`")
    names = {"0": 0, "1": 1, "cat": 0, "dog": 1}
    labels = frame["label"].str.strip().str.lower().map(names)
    bad = frame.loc[labels.isna(), "label"]
    if len(bad):
        raise UserError(f"{csv_file} has unknown label {bad.iloc[0]!r} ({len(bad)} rows); "
                        "labels must be 0/cat or 1/dog")
    missing = [(name, problem) for name in frame["filename"] if (problem := input_problem(Path(root_dir) / name))]
    if missing:
        raise UserError(f"{csv_file} names {len(missing)} file(s) missing from {root_dir} or not files there, "
                        f"first {missing[0][0]} ({missing[0][1]}); fix the CSV or rerun `python -m src.tools.prepare`")
    return label_table(list(frame["filename"]), list(labels.astype(int)))


def load_labels(data_dir: Path, show_progress: bool = True) -> pd.DataFrame:
    """DATA_DIR/train.csv if it exists, else the same scan that `python -m src.tools.prepare` does."""
    data_dir = Path(data_dir)
    if os.path.lexists(data_dir) and not data_dir.is_dir():
        raise UserError(f"data folder {data_dir}: {input_problem(data_dir, folder=True) or 'a file, not a folder'}: "
                        "pass --data-dir, the folder holding train/")
    if not data_dir.is_dir():
        raise UserError(f"data folder {data_dir} not found: pass --data-dir, put Kaggle's train/ "
                        f"there, or run `python -m src.tools.synthetic {data_dir}` for a synthetic set")
    csv_file = data_dir / "train.csv"
    if os.path.lexists(csv_file) and input_problem(csv_file):  # a named pipe would wait for a writer
        raise UserError(f"{csv_file}: {input_problem(csv_file)}: remove it, or make it a CSV of filename,label")
    if csv_file.exists():
        frame = read_labels_csv(csv_file, data_dir / "train")
        if show_progress:
            said = not_used_line(data_dir, list(frame["filename"]), csv_file)
            if said:
                print(said)
        return frame
    frame, rejected = scan_train_dir(data_dir / "train", show_progress)
    if show_progress:
        if rejected:
            print(f"left out {len(rejected)} unreadable image(s), first {shown(rejected[0])}")
        said = not_used_line(data_dir, [*frame["filename"], *rejected])
        if said:
            print(said)
    return frame


def load_val_labels(val_dir: Path, data_dir: Path, train_table: pd.DataFrame,
                    show_progress: bool = True) -> pd.DataFrame:
    """--val-dir's labelled images, found by the rules of train/'s scan (every image opened, the
    unreadable ones left out and counted, the files no rule covers named; no CSV), their names
    relative to val_dir. An image that is also in the training table (the same file by its real
    path, a hard link to it, or a copy of its bytes) is refused: it would be trained on and validated."""
    val_dir = Path(val_dir)
    frame, rejected = scan_train_dir(val_dir, show_progress, flag="--val-dir")
    if show_progress:
        if rejected:
            print(f"left out {len(rejected)} unreadable image(s) of --val-dir {shown(val_dir)}, first {shown(rejected[0])}")
        said = not_used_line(data_dir, [*frame["filename"], *rejected], folder=val_dir)
        if said:
            print(said)
    train_dir = Path(data_dir) / "train"
    names = list(frame["filename"])
    both = [names[i] for i in same_bytes([val_dir / name for name in names],
                                         [train_dir / name for name in train_table["filename"]])]
    if both:
        raise UserError(f"--val-dir {shown(val_dir)} holds {len(both)} image(s) that {shown(Path(data_dir) / 'train')} "
                        f"trains on ({some(both)}): a validation image must not be a training one; name a folder "
                        "apart from it")
    return frame


def same_bytes(files: list[Path], others: list[Path]) -> list[int]:
    """The indices of `files` whose bytes are those of one of `others` (the same file, a link to it,
    or a copy). Only files of equal size are read, each at most once: at most both lists' bytes."""
    def size(path: Path) -> int | None:
        try:
            return path.stat().st_size
        except OSError:  # gone since the scan: the loader names it
            return None

    by_size: dict[int, list[Path]] = {}
    for other in others:
        if (length := size(other)) is not None:
            by_size.setdefault(length, []).append(other)

    @functools.cache
    def digest(path: Path) -> str | None:
        try:
            return sha256_of(path)
        except OSError:
            return None

    found = []
    for i, file in enumerate(files):
        length = size(file)
        candidates = by_size.get(length, []) if length is not None else []
        if candidates and digest(file) is not None and any(digest(other) == digest(file) for other in candidates):
            found.append(i)
    return found


def check_both_classes(frame: pd.DataFrame, data_dir: Path) -> None:
    """Refuse a label table of one class: a model trained on it learns nothing (every image of
    the class is right: validation accuracy 1.0)."""
    counts = frame["label"].value_counts()
    if len(counts) < 2:
        only = CLASSES[int(counts.index[0])]
        raise UserError(f"{data_dir} holds {only}s only ({int(counts.iloc[0])} images, no "
                        f"{CLASSES[1 - CLASSES.index(only)]}): training needs both classes")


class DogCatDataset(Dataset):
    """Labelled images listed in a `filename,label` CSV (or a table of the same shape).

    Yields `(transform(image), label)` with label 0 = cat, 1 = dog.
    """

    def __init__(self, csv_file: Path | pd.DataFrame, root_dir: Path,
                 transform: Callable | None = None, draft_size: int | None = None):
        self.root_dir = Path(root_dir)
        if isinstance(csv_file, pd.DataFrame):
            self.frame = csv_file.reset_index(drop=True)
        else:
            self.frame = read_labels_csv(Path(csv_file), self.root_dir)
        self.transform = transform
        self.draft_size = draft_size

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | Image.Image, int]:  # a PIL image without a transform
        row = self.frame.iloc[index]
        image = open_rgb(self.root_dir / row["filename"], self.draft_size)
        if self.transform is not None:
            image = self.transform(image)
        return image, int(row["label"])


class DogCatTestDataset(Dataset):
    """The unlabelled Kaggle test images `N.jpg`, in numeric order; yields `(image, id)`."""

    def __init__(self, root_dir: Path, transform: Callable | None = None,
                 draft_size: int | None = None):
        self.root_dir = Path(root_dir)
        if not self.root_dir.is_dir():
            raise UserError(f"test folder {self.root_dir} not found: put Kaggle's test/ images there")
        self.files: dict[int, str] = {}  # id -> its file's name
        self.others: list[str] = []  # what is not an N.jpg image
        for path in sorted(self.root_dir.iterdir(), key=lambda p: natural_key(p.name)):
            if not (path.suffix.lower() in IMAGE_SUFFIXES and path.stem.isdigit() and path.stem.isascii()):
                self.others.append(path.name + ("/" if path.is_dir() else ""))
            elif int(path.stem) in self.files:  # 1.jpg and 1.png, or 1.jpg and 01.jpg
                raise UserError(f"{self.root_dir} holds two images of id {int(path.stem)} "
                                f"({shown(self.files[int(path.stem)])} and {shown(path.name)}): a submission has "
                                "one row per id; remove one of them")
            else:
                self.files[int(path.stem)] = path.name
        if not self.files:
            raise UserError(f"no N.jpg images in {self.root_dir}")
        self.ids = sorted(self.files)
        self.transform = transform
        self.draft_size = draft_size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | Image.Image, int]:  # a PIL image without a transform
        image_id = self.ids[index]
        image = open_rgb(self.root_dir / self.files[image_id], self.draft_size)
        if self.transform is not None:
            image = self.transform(image)
        return image, image_id


# The modules a loader worker needs to unpickle its dataset: the fork server imports them once,
# and each worker forked from it starts with them loaded.
WORKER_MODULES = ["torch", "torchvision", "src.augment", "src.cache", "src.datasets"]
# What else the training process has loaded that its workers load again: multiprocessing runs the
# main script anew in each worker (as __mp_main__), and its imports then cost 1 to 2 s a worker
# unless the fork server holds them already.
ALSO_PRELOADED = ("accelerate", "matplotlib")


def worker_options() -> dict:
    """The DataLoader options of every loader with workers: where they start and how they treat
    the stop signals.

    The workers start from a fork server, not as forks of the training process: that process runs
    Python threads (the heartbeat, the pinned-memory thread, tqdm's monitor, TensorBoard's
    writer), and a fork taken while another thread holds one of the interpreter's locks hangs in
    the child (CPython gh-112275, fixed in 3.11.8; seen here in a DataLoader worker of a
    torchrun restart). The fork server is a process with one thread, started once per process
    (start_worker_server), so a worker costs a fork of it. The workers of a loader stay for the
    loader's life (persistent: src/loaders.py)."""
    return {"multiprocessing_context": _fork_server(), "worker_init_fn": functools.partial(start_worker, os.getpid())}


def start_worker_server() -> None:
    """Start this process's fork server for the loader workers now, if it has none (worker_options
    starts it otherwise, at the first loader). Call it as early as the workers are known to be
    needed: the server, a fresh interpreter, imports on another core while this process goes on."""
    _fork_server()


def _fork_server() -> multiprocessing.context.BaseContext:
    """multiprocessing's forkserver context, its server started with the stop signals ignored: it
    is in the training process's process group, which torchrun and SLURM signal as a whole, and it
    must outlive a SIGTERM that stops the run a few steps later (the loaders it still starts need
    it). An ignored signal stays ignored across a fork and across the exec of a fresh server; a
    handler would not.

    The server is multiprocessing's own, a fresh interpreter that imports the modules below first
    (3.6 to 3.9 s of CPU on the 2-core AMD EPYC): the scripts start it in their first data call
    (start_worker_server), so that it imports while the labels are scanned and the model is built
    (docs/performance.md#loader-workers-a-fork-server)."""
    from multiprocessing import forkserver
    context = multiprocessing.get_context("forkserver")
    loaded = [name for name in sys.modules if name.startswith("src.") or name in ALSO_PRELOADED]
    # read when a fresh server starts: the workers' modules, the src modules loaded here, the main script's
    context.set_forkserver_preload(sorted(set(WORKER_MODULES + loaded)) + main_module())
    if threading_main():
        handlers = {number: signal.signal(number, signal.SIG_IGN) for number in STOP_SIGNALS}
        try:
            forkserver.ensure_running()  # a server there and alive: nothing; else a fresh one
        finally:
            for number, handler in handlers.items():
                signal.signal(number, handler)
    end_workers_at_exit()  # they ignore SIGTERM (ignore_stop_signals)
    return context


def main_module() -> list[str]:
    """The main module's name, for the fork server to import once ([] where there is none to
    import). A worker started from the fork server runs the main script again (multiprocessing's
    spawn preparation, as __mp_main__), and with it the script's imports (matplotlib, the src
    modules). Imported once in the server, they are there in every worker forked from it (what a
    worker's start costs: docs/performance.md#loader-workers-a-fork-server). Not a package's __main__ (`python
    -m pytest`): importing that runs it."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = spec.name if spec is not None else os.path.splitext(os.path.basename(getattr(main, "__file__", "") or ""))[0]
    return [name] if name.isidentifier() and not name.endswith("__main__") and name != "__mp_main__" else []


def threading_main() -> bool:
    """Whether this is the main thread (the only one that may set signal handlers)."""
    return threading.current_thread() is threading.main_thread()


def start_worker(training_pid: int, worker_id: int) -> None:
    """A DataLoader worker's worker_init_fn: it ignores the stop signals (ignore_stop_signals) and
    ends when the training process that owns it ends, however that ends. A worker's parent is the
    fork server, not the training process, so torch's own watch (the worker's parent pid) would
    keep it alive after a SIGKILL of the training process, holding the fork server and the
    launcher's output pipes open for ever."""
    ignore_stop_signals()
    ignore_pillow_warnings()
    threading.Thread(target=_end_with, args=(training_pid,), name="end with the training process",
                     daemon=True).start()


def _end_with(pid: int) -> None:
    try:
        handle = os.pidfd_open(pid)  # readable once the process has ended (Linux 5.3 and later)
        select.select([handle], [], [])
    except OSError:  # no pidfd here: look every second whether the process is there
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            except PermissionError:  # there, under another user: not ours any more
                break
            time.sleep(1)
    os._exit(0)


def ignore_stop_signals(worker_id: int | None = None) -> None:
    """A DataLoader worker's worker_init_fn: the stop signals are its main process's to act on
    (Ctrl-C in a terminal reaches the workers too, torchrun signals a worker's process group,
    SLURM every process of the job step), and the steps before the stop need the workers."""
    for number in STOP_SIGNALS:
        signal.signal(number, signal.SIG_IGN)


_ending_workers = False


def end_workers_at_exit() -> None:
    """Once per process: at exit, SIGKILL the daemonic children still alive (DataLoader workers
    whose loader was not shut down, after an error). multiprocessing's own exit ends them with
    SIGTERM, which they ignore, and then waits for them: forever. atexit runs this before it
    (registered later)."""
    global _ending_workers
    if not _ending_workers:
        _ending_workers = True
        atexit.register(_kill_daemonic_children)


def _kill_daemonic_children() -> None:
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()
