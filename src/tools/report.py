"""One HTML page of one or several training runs: what was run, its curves, and what its best.pth
gets right and wrong on the run's validation split; several runs (the five modes, two recipes)
side by side: curves overlaid, final metrics, the distance between their weights, their speed.

    python -m src.tools.report RUN_DIR... [--output FILE] [--predictions predictions.csv] [--data-dir DIR]

A run folder is where its best.pth is, with best.json, history.json and last.pth beside it. The
page is one file (default: report.html in the first run's folder): plots (SVG) and thumbnails
(JPEG) are embedded in it as data: URIs, so it opens from disk in any browser and requests
nothing. Everything that comes from the disk (folder and file names, labels, flags) is escaped.

For each run, best.pth is validated again on the run's own validation split, rebuilt from
best.json (seed, --val-fraction, and the digest of the data folder's labels, which must match):
confusion matrix, accuracy, log loss, a reliability diagram, and the images with the highest
loss and the most uncertain ones. With --predictions (predict's CSV), the user's images, the most
uncertain first: thumbnails only of images inside the CSV's folder, the current folder or a run's
data folder (a CSV from elsewhere cannot put any image of the disk into a page that gets
shared). Runs of the same job (the same flags but for the mode, processes and batch
split) get a table of the distances between their final weights, judged as docs/modes.md does:
as a share of the distance to a run of the same job with another global batch, when one is given.

Every field of best.json and history.json that the page reads is checked first (check_run): a
hand-edited or older file is one line naming the file and the field. --output replaces a report
of this tool's (its GENERATOR mark), any other file with --overwrite only, never a training run's
files nor a file in the folder of a run in progress (src.outputs.check_tool_output).
"""
import base64
import csv
import dataclasses
import io
import json
import math
import os
import shlex
import sys
import time
from datetime import datetime
from itertools import combinations
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import matplotlib
import torch
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import RcKeyType
from PIL import Image

from src.checkpoint import RESUME_KEYS, flag_of, read_last
from src.cli import BATCH_SIZES, OneLineParser, between, defaults, workers_count
from src.datasets import CLASSES, DogCatDataset
from src.devices import default_workers, hardware, training_device
from src.errors import UserError, exit_on_error, one_line
from src.history import AVERAGE, best_record
from src.image_files import to_rgb
from src.inference import load_checkpoint, predict_files, read_info
from src.loaders import labelled_data
from src.metrics import EPS, batch_sums, summarize
from src.outputs import atomic_write_text, check_tool_output, input_problem
from src.plot import plt
from src.safe_csv import original
from src.sharded_checkpoint import NAME, whole_folder
from src.tools.agreement import TOLERANCE, distance

GALLERY = 24  # validation images in each gallery: the highest loss, the most uncertain
PREDICTED = 48  # of --predictions, the most uncertain first
THUMBNAIL = 96  # px, a thumbnail's longer side
BINS = 10  # of the reliability diagram, equal widths of p(dog)
TEMPLATE = "report.html.jinja"
# What the page reads of each history.json record.
HISTORY_KEYS = ("epoch", "train_loss", "train_acc", "train_samples", "train_seconds", "val_loss", "val_acc",
                "val_log_loss", "val_samples", "lr", "seconds")
# The report's own mark: --output replaces a file that has it, and no other (without --overwrite).
GENERATOR = "src.tools.report"
INTERRUPTED = "interrupted: no report written (an earlier --output file is as it was); run the command again"


@dataclasses.dataclass(kw_only=True)
class Options:
    """report's flags, as parse_args returns them (--output's and --workers's defaults filled in)."""

    runs: list[Path]
    output: Path
    overwrite: bool
    predictions: Path | None
    data_dir: Path | None
    val_dir: Path | None
    batch_size: int
    workers: int


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("runs", nargs="+", type=Path, metavar="RUN_DIR", help="folders holding a run's best.pth")
    add("--output", type=Path, default=None, help="the HTML file (default: report.html in the first RUN_DIR)")
    add("--overwrite", action="store_true",
        help="replace an --output file that is not a report of this tool (never a training run's files)")
    add("--predictions", type=Path, default=None,
        help="predict's CSV (path,p_dog,label): a gallery of those images, the most uncertain first")
    add("--data-dir", type=Path, default=None,
        help="the data folder of the runs (default: the --data-dir each was trained with)")
    add("--val-dir", type=Path, default=None,
        help="the validation folder of runs trained with --val-dir (default: the one each was trained with)")
    add("--batch-size", type=between(*BATCH_SIZES), default=100, help="images per forward pass of the validation")
    add("--workers", type=workers_count, default=None,
        help="image decoding processes (default: this machine's CPUs)")
    args = parser.parse_args(argv)
    if len({run.resolve() for run in args.runs}) < len(args.runs):
        parser.error("a RUN_DIR is given twice")
    if args.output is None:
        args.output = args.runs[0] / "report.html"
    if args.workers is None:
        args.workers = default_workers(1)
    return Options(**vars(args))


class Run(NamedTuple):
    folder: Path
    label: str  # in plots and tables: its number and mode
    info: dict  # best.json
    history: list[dict]  # history.json


def read_run(folder: Path, number: int, data_dir: Path | None = None, val_dir: Path | None = None) -> Run:
    """A run folder's best.json (checked against its best.pth) and history.json, every field the
    page reads checked (check_run)."""
    if not folder.is_dir():
        raise UserError(f"RUN_DIR {folder}: no such folder (a run folder is where its best.pth is)")
    if not (folder / "best.pth").is_file():
        raise UserError(f"RUN_DIR {folder} holds no best.pth: name the folder of a training run (its "
                        "--checkpoint's folder), after its first epoch")
    info = read_info(folder / "best.pth")
    try:
        if input_problem(folder / "history.json") is not None:  # a named pipe would wait for a writer
            raise OSError
        history = json.loads((folder / "history.json").read_text())
    except (OSError, ValueError):
        raise UserError(f"{folder / 'history.json'} is missing or unreadable: the training scripts "
                        "write it beside best.pth") from None
    check_run(folder, info, history, data_dir, val_dir)
    return Run(folder, f"{number} {info.get('mode', 'run')}", info, history)


def _whole(value, low: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# What the page reads of best.json beyond what predict checks (src.inference.check_info): each
# field's test, what it must be, and whether it must be there (older runs lack the optional ones).
INFO_FIELDS = {
    "seed": (lambda v: _whole(v, -2**63) and v < 2**64, "a whole number (the split is rebuilt from it)", True),
    "val_fraction": (lambda v: v is None or (_finite(v) and 0 < v < 1),
                     "a number in (0, 1) (the split is rebuilt from it), or null (--val-dir)", True),
    "data": (lambda v: isinstance(v, str), "the digest of the labelled images, a string", True),
    "val_data": (lambda v: v is None or isinstance(v, str), "the digest of --val-dir's images, a string, or null", False),
    "batch_size": (lambda v: _whole(v, 1), "a whole number of at least 1", True),
    "best_by": (lambda v: v in ("val_acc", "val_log_loss"), "val_acc or val_log_loss", False),
    "mode": (lambda v: isinstance(v, str), "a string (the training script)", False),
    "flags": (lambda v: isinstance(v, dict), "an object of the run's flags", False),
}


def check_run(folder: Path, info: dict, history, data_dir: Path | None, val_dir: Path | None = None) -> None:
    """Refuse, in one line naming the file and the field, a best.json or history.json (hand-edited,
    or from an older version) with a field the page reads that is missing or of the wrong kind:
    each was a traceback somewhere in the page's making."""
    best_json, history_json = folder / "best.json", folder / "history.json"

    def bad(path: Path, what: str) -> UserError:
        return UserError(f"{path}: {what}; the training scripts write it so: retrain, or fix it by hand")

    for key, (test, must, required) in INFO_FIELDS.items():
        if key not in info:
            if required:
                raise bad(best_json, f"{key} is missing (it must be {must})")
        elif not test(info[key]):
            raise bad(best_json, f"{key} {info[key]!r} must be {must}")
    if data_dir is None:
        flags = info.get("flags")
        if flags is None or not isinstance(flags.get("data_dir"), str):
            raise UserError(f"{best_json} does not say which data folder the run was trained on (its "
                            "flags' data_dir): pass --data-dir")
    if info["val_fraction"] is None and val_dir is None and not isinstance((info.get("flags") or {}).get("val_dir"), str):
        raise UserError(f"{best_json} says the run validated on a --val-dir but not which one (its flags' "
                        "val_dir): pass --val-dir")
    if not isinstance(history, list) or not history:
        raise bad(history_json, "it must be a list of one record per epoch, and holds " + (
            "no epoch" if isinstance(history, list) else f"a {type(history).__name__}"))
    for number, record in enumerate(history, start=1):
        if not isinstance(record, dict):
            raise bad(history_json, f"record {number} is not an object")
        for key in HISTORY_KEYS + tuple(key for key in AVERAGE.values() if key in record):
            value = record.get(key)
            ok = _whole(value, 1) if key == "epoch" else _whole(value) if key.endswith("_samples") else _finite(value)
            if not ok:
                kind = ("a whole number from 1" if key == "epoch" else "a whole number" if key.endswith("_samples")
                        else "a finite number")
                said = "is missing" if key not in record else f"{value!r} is not {kind}"
                raise bad(history_json, f"record {number}: {key} {said}" + (f" (it must be {kind})"
                                                                             if key not in record else ""))


def is_report(path: Path) -> bool:
    """Whether the file is a report of this tool (its mark near the start)."""
    try:
        with open(path, "rb") as file:
            return GENERATOR.encode() in file.read(4096)
    except OSError:
        return False


def check_output(path: Path, overwrite: bool = False) -> None:
    """--output: src.outputs.check_tool_output's rule, a report of this tool being the file it
    may replace (checked after the kind of file: a named pipe is never opened)."""
    check_tool_output("--output", path, is_report, "a report of this tool", overwrite)


# Validation of best.pth on its run's split.

class Validation(NamedTuple):
    names: list[str]  # the images, relative to the data folder's train/
    folder: Path  # that train/
    labels: torch.Tensor  # 0 cat, 1 dog
    p_dog: torch.Tensor  # float32
    loss: torch.Tensor  # cross-entropy of each image: -log p(its class)
    metrics: dict  # summarize(): loss, acc, log_loss, samples
    confusion: list[list[int]]  # [true class][predicted class]
    seconds: float


def data_folder(run: Run, data_dir: Path | None) -> Path:
    """--data-dir, else the one the run was trained with (check_run made sure best.json says it)."""
    return data_dir if data_dir is not None else Path(run.info["flags"]["data_dir"])


def validate(run: Run, data_dir: Path | None, device: torch.device, batch_size: int, workers: int,
             val_dir: Path | None = None) -> Validation:
    """best.pth's predictions on its run's validation split: the split (or its --val-dir) rebuilt
    as training built it (src.loaders.labelled_data), each image decoded as training decodes it
    (src.inference)."""
    info, folder = run.info, data_folder(run, data_dir)
    if info["val_fraction"] is None:  # check_run made sure the flags say it where --val-dir does not
        val_dir = val_dir if val_dir is not None else Path(info["flags"]["val_dir"])
    else:
        val_dir = None
    start = time.perf_counter()
    data = labelled_data(defaults(data_dir=str(folder), val_dir=None if val_dir is None else str(val_dir),
                                  image_size=info["image_size"], cache=None, val_fraction=info["val_fraction"],
                                  seed=info["seed"], workers=workers))
    for key, digest, where in (("data", data.digest, folder), ("val_data", data.val_digest, val_dir)):
        if digest != info.get(key):
            raise UserError(f"the labelled images of {where} are not those {run.folder / 'best.pth'} was "
                            f"trained on (best.json's digest of them differs): pass its {flag_of(key)}")
    if not isinstance(data.dataset, DogCatDataset):  # without --cache: the images themselves
        raise TypeError(f"validate: labelled_data without a cache gave a {type(data.dataset).__name__}")
    frame, train, split = data.dataset.frame, data.dataset.root_dir, data.val_idx
    names = [frame["filename"].iloc[i] for i in split]
    labels = torch.tensor([int(frame["label"].iloc[i]) for i in split])
    model, _ = load_checkpoint(run.folder / "best.pth")
    found = predict_files(model.to(device), info, [train / name for name in names], device, batch_size, workers)
    if found is None:  # None on the ranks but 0 of a launched job: the report runs alone
        raise RuntimeError("validate: predict_files ran as a rank other than 0")
    probabilities, broken = found
    if broken:
        first = min(broken)
        raise UserError(f"cannot read validation image {train / names[first]} ({broken[first]}; "
                        f"{len(broken)} unreadable): it was read in training; restore it")
    log_p = probabilities.double().log()  # log-probabilities are logits: softmax gives them back
    predicted = probabilities.argmax(dim=1)
    counts = torch.bincount(labels * 2 + predicted, minlength=4).view(2, 2).tolist()
    return Validation(names, train, labels, probabilities[:, 1], -log_p.gather(1, labels[:, None])[:, 0],
                      summarize(batch_sums(log_p, labels)), counts, time.perf_counter() - start)


def highest_loss(validation: Validation) -> list[int]:
    """Positions of the GALLERY images with the highest loss, highest first."""
    return validation.loss.argsort(descending=True, stable=True)[:GALLERY].tolist()


def most_uncertain(validation: Validation) -> list[int]:
    """Positions of the GALLERY images whose p(dog) is closest to 0.5, closest first."""
    return (validation.p_dog - 0.5).abs().argsort(stable=True)[:GALLERY].tolist()


def reliability(p_dog: torch.Tensor, labels: torch.Tensor) -> list[dict]:
    """Per equal-width bin of p(dog) that holds images: how many, their mean p(dog), and the share
    that are dogs (a calibrated model's share equals its mean p(dog))."""
    bins = (p_dog * BINS).long().clamp(max=BINS - 1)
    rows = []
    for b in range(BINS):
        inside = bins == b
        if inside.any():
            rows.append({"low": b / BINS, "high": (b + 1) / BINS, "count": int(inside.sum()),
                         "mean_p": float(p_dog[inside].mean()), "dogs": float(labels[inside].float().mean())})
    return rows


def calibration_error(rows: list[dict]) -> float:
    """Expected calibration error: the count-weighted mean of |share of dogs - mean p(dog)|."""
    total = sum(row["count"] for row in rows)
    return sum(row["count"] * abs(row["dogs"] - row["mean_p"]) for row in rows) / total


def thumbnail(path: Path) -> str | None:
    """A small JPEG of the image as a data: URI, or None where it cannot be read (or is not a
    regular file: a named pipe would wait for a writer)."""
    if input_problem(path) is not None:
        return None
    try:
        with Image.open(path) as image:
            image.draft("RGB", (THUMBNAIL, THUMBNAIL))  # JPEG: decoded at 1/2 to 1/8 scale
            rgb = to_rgb(image)  # as training sees it: EXIF's orientation, 16 bits to 8
            rgb.thumbnail((THUMBNAIL, THUMBNAIL))
            buffer = io.BytesIO()
            rgb.save(buffer, "JPEG", quality=85)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def gallery(validation: Validation, positions: list[int]) -> list[dict]:
    return [{"name": validation.names[i], "label": CLASSES[int(validation.labels[i])],
             "p_dog": float(validation.p_dog[i]), "loss": float(validation.loss[i]),
             "thumbnail": thumbnail(validation.folder / validation.names[i])} for i in positions]


# --predictions: predict's CSV.

def read_predictions(path: Path) -> list[dict]:
    """predict's rows (path, p_dog, label), the most uncertain first."""
    if input_problem(path) is not None:
        raise UserError(f"--predictions {path}: {input_problem(path)}")
    try:
        with open(path, newline="") as file:
            rows = list(csv.reader(file))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise UserError(f"--predictions {path}: cannot read it ({error})") from None
    if not rows or rows[0] != ["path", "p_dog", "label"]:
        raise UserError(f"--predictions {path}: expected predict's CSV, with columns path,p_dog,label")
    images: list[dict[str, Any]] = []
    for number, row in enumerate(rows[1:], start=2):
        try:
            name, p_text, label = row
            p_dog = float(p_text)
            if not 0 <= p_dog <= 1:
                raise ValueError
        except ValueError:
            raise UserError(f"--predictions {path}: line {number} is not path,p_dog,label with p_dog "
                            "in [0, 1]") from None
        images.append({"name": original(name), "p_dog": p_dog, "label": label})  # as predict's CSV guarded it
    images.sort(key=lambda image: abs(image["p_dog"] - 0.5))
    return images


def image_file(name: str, csv_file: Path, folders: list[Path]) -> tuple[Path | None, str]:
    """A CSV row's image: the path as written (from where predict ran), else from the CSV's
    folder; (None, why) where there is none, or where it lies (links followed) outside the
    `folders` the page may show images of: the CSV's folder, the current one, the data folders."""
    path = Path(name) if Path(name).exists() else csv_file.parent / name
    if not path.exists():
        return None, "file not found"
    real = os.path.realpath(path)
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep)
               for root in (os.path.realpath(folder) for folder in folders)):
        return None, "outside the CSV's folder, the current folder and the data folders"
    return path, ""


def prediction_thumbnails(images: list[dict], csv_file: Path, folders: list[Path]) -> list[dict]:
    """The rows the page shows, each with its thumbnail, or why it has none; one line says how
    many lie outside the folders (image_file)."""
    shown_rows, outside = [], 0
    for image in images:
        path, why = image_file(image["name"], csv_file, folders)
        outside += why.startswith("outside")
        shown_rows.append({**image, "thumbnail": thumbnail(path) if path else None, "why": why or "cannot decode it"})
    if outside:
        print(f"--predictions {csv_file}: {outside} of the {len(images)} images shown lie outside the CSV's folder, "
              "the current folder and the data folders: listed without a thumbnail (the page embeds no file "
              "from elsewhere)")
    return shown_rows


# Several runs: speed and agreement.

def speed(run: Run) -> dict:
    """Median seconds per epoch and training images/s over the epochs (the median leaves out a
    slow first epoch: workers starting, kernels being chosen)."""
    def median(values: list[float]) -> float:
        values = sorted(values)
        return (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2
    return {"seconds": median([r["seconds"] for r in run.history]),
            "images": median([r["train_samples"] / max(r["train_seconds"], 1e-9) for r in run.history])}


def job_of(run: Run) -> str:
    """What runs must share to end with the same weights, but for the global batch: the flags
    that --resume compares, and the epochs done."""
    return json.dumps([run.info.get(key) for key in RESUME_KEYS if key != "batch_size"] + [len(run.history)])


def final_weights(run: Run) -> dict[str, torch.Tensor]:
    """The weights after the run's last epoch: last.pth's model (memory-mapped) or FSDP's last.dcp's
    (whichever is newer), else best.pth.

    The final weights, not best.pth's: a run of another global batch (the yardstick) may pick
    another best epoch, and the tolerance was measured on the final weights.
    """
    last, best = run.folder / "last.pth", run.folder / "best.pth"
    try:
        found = read_last(run.folder) if whole_folder(run.folder / NAME) is not None else None
        if found is not None:
            return found["model"]
        if last.exists():
            return torch.load(last, map_location="cpu", weights_only=True, mmap=True)["model"]
        return torch.load(best, map_location="cpu", weights_only=True, mmap=True)
    except UserError as error:  # a last that cannot be read says why (src.checkpoint.read_last)
        raise UserError(f"cannot read the weights of {run.folder}: {one_line(error)}") from None
    except Exception as error:  # a truncated or foreign file: many exception types
        raise UserError(f"cannot read the weights of {run.folder} ({type(error).__name__}: {one_line(error)})") from None


class Agreement(NamedTuple):
    runs: list[Run]  # the same job and global batch
    far: tuple[Run, float] | None  # the yardstick: a run of the job with another global batch, its distance
    pairs: list[dict]  # a, b, distance, share (of far, or None), relative (to a's weights' norm)


def agreements(runs: list[Run]) -> list[Agreement]:
    """For each group of two or more runs of the same job and global batch, the distance between
    every two of them; as a share of far when the job has a run with another global batch."""
    weights, norms = {}, {}

    def of(run: Run) -> dict:
        if run.folder not in weights:
            weights[run.folder] = final_weights(run)
        return weights[run.folder]

    def norm(run: Run) -> float:
        if run.folder not in norms:
            norms[run.folder] = math.sqrt(sum(float((t.double() ** 2).sum()) for t in of(run).values()))
        return norms[run.folder]

    jobs: dict[str, dict[int, list[Run]]] = {}
    for run in runs:
        jobs.setdefault(job_of(run), {}).setdefault(run.info["batch_size"], []).append(run)
    found = []
    for batches in jobs.values():
        for batch, group in batches.items():
            if len(group) < 2:
                continue
            other = next((run for b, members in batches.items() if b != batch for run in members), None)
            far = (other, distance(of(group[0]), of(other))) if other is not None else None
            pairs = []
            for a, b in combinations(group, 2):
                d = distance(of(a), of(b))
                pairs.append({"a": a, "b": b, "distance": d, "relative": d / norm(a) if norm(a) else None,
                              "share": d / far[1] if far and far[1] > 0 else None})
            found.append(Agreement(group, far, pairs))
    return found


# Plots: SVG, text kept as text, names never read as mathtext.

STYLE: dict[RcKeyType, Any] = {"text.parse_math": False, "svg.fonttype": "none", "svg.hashsalt": GENERATOR}


def svg_uri(figure: plt.Figure) -> str:
    buffer = io.BytesIO()
    try:
        with matplotlib.rc_context(STYLE):
            figure.savefig(buffer, format="svg", bbox_inches="tight")
    finally:
        plt.close(figure)
    return "data:image/svg+xml;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def curves_figure(runs: list[Run]) -> plt.Figure:
    """Loss, accuracy (training dashed, validation solid) and learning rate per epoch, one colour a
    run; each line's SVG id is RUN-KEY (run1-val_loss)."""
    with matplotlib.rc_context(STYLE):
        figure, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for number, run in enumerate(runs, start=1):
            epochs = [r["epoch"] for r in run.history]
            color = f"C{(number - 1) % 10}"
            for ax, key in ((axes[0], "loss"), (axes[1], "acc")):
                ax.plot(epochs, [r[f"train_{key}"] for r in run.history], "--", color=color, gid=f"run{number}-train_{key}")
                ax.plot(epochs, [r[f"val_{key}"] for r in run.history], "o-", color=color, gid=f"run{number}-val_{key}",
                        label=run.label)
            axes[2].plot(epochs, [r["lr"] for r in run.history], "o-", color=color, gid=f"run{number}-lr",
                         label=run.label)
        for ax, title in zip(axes, ("loss (dashed: training, solid: validation)",
                                    "accuracy (dashed: training, solid: validation)", "learning rate after the epoch")):
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
        axes[1].legend(fontsize=8)
        figure.tight_layout()
    return figure


def speed_figure(runs: list[Run], speeds: list[dict]) -> plt.Figure:
    with matplotlib.rc_context(STYLE):
        figure, axes = plt.subplots(1, 2, figsize=(11, 0.5 + 0.4 * len(runs)))
        labels = [run.label for run in runs]
        for ax, key, title in ((axes[0], "seconds", "seconds per epoch (median)"),
                               (axes[1], "images", "training images/s (median over epochs)")):
            values = [s[key] for s in speeds]
            bars = ax.barh(labels, values, color=[f"C{i % 10}" for i in range(len(runs))])
            ax.bar_label(bars, fmt="%.3g", fontsize=8)
            ax.invert_yaxis()
            ax.set_title(title, fontsize=10)
            ax.margins(x=0.15)
        figure.tight_layout()
    return figure


def reliability_figure(rows: list[dict]) -> plt.Figure:
    with matplotlib.rc_context(STYLE):
        figure, ax = plt.subplots(figsize=(4.2, 3.6))
        ax.plot([0, 1], [0, 1], ":", color="gray", label="calibrated")
        ax.plot([r["mean_p"] for r in rows], [r["dogs"] for r in rows], "o-", label="this model", gid="reliability")
        for r in rows:
            ax.annotate(str(r["count"]), (r["mean_p"], r["dogs"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=7)
        ax.set_xlabel("mean p(dog) in the bin")
        ax.set_ylabel("share of dogs")
        ax.set_xlim(0, 1)
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
        figure.tight_layout()
    return figure


# The page.

def run_section(run: Run, validation: Validation) -> dict:
    best = best_record(run.history, run.info.get("best_by", "val_acc"))
    rows = reliability(validation.p_dog, validation.labels)
    info = run.info
    return {"run": run, "best": best, "last": run.history[-1],
            "total_seconds": sum(r["seconds"] for r in run.history),
            "flags": sorted((info.get("flags") or {}).items()),
            "validation": validation, "reliability": svg_uri(reliability_figure(rows)),
            "calibration_error": calibration_error(rows),
            "highest_loss": gallery(validation, highest_loss(validation)),
            "uncertain": gallery(validation, most_uncertain(validation))}


def render(context: dict) -> str:
    environment = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent), autoescape=True,
                                     undefined=jinja2.StrictUndefined)
    return environment.get_template(TEMPLATE).render(context)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    runs = [read_run(folder, number, args.data_dir, args.val_dir) for number, folder in enumerate(args.runs, start=1)]
    check_output(args.output, args.overwrite)
    predictions = read_predictions(args.predictions) if args.predictions else None
    start = time.perf_counter()
    device = training_device(False, None)
    sections = []
    for run in runs:
        validation = validate(run, args.data_dir, device, args.batch_size, args.workers, args.val_dir)
        print(f"{run.label} ({run.folder}): validated best.pth on {validation.metrics['samples']} images in "
              f"{validation.seconds:.1f} s: accuracy {validation.metrics['acc']:.4f}, "
              f"log loss {validation.metrics['log_loss']:.4f}", flush=True)
        sections.append(run_section(run, validation))
    speeds = [speed(run) for run in runs]
    shown = None
    if predictions is not None and args.predictions is not None:  # the one read from the other
        folders = [args.predictions.parent, Path.cwd(), *{data_folder(run, args.data_dir) for run in runs}]
        shown = prediction_thumbnails(predictions[:PREDICTED], args.predictions, folders)
    html = render({
        "generator": GENERATOR, "written": datetime.now().isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "src.tools.report", *sys.argv[1:]]),
        "machine": hardware(), "device": str(device), "cwd": os.getcwd(),
        "runs": runs, "sections": sections, "speeds": speeds,
        "curves": svg_uri(curves_figure(runs)),
        "speed": svg_uri(speed_figure(runs, speeds)) if len(runs) > 1 else None,
        "agreements": agreements(runs) if len(runs) > 1 else [], "tolerance": TOLERANCE,
        "predictions": shown, "predicted": len(predictions or []), "predicted_cap": PREDICTED, "predictions_file": args.predictions,
        "gallery_size": GALLERY, "eps": EPS, "bins": BINS, "classes": CLASSES})
    atomic_write_text(args.output, html)
    print(f"wrote {args.output} ({len(html) / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s; "
          f"open {args.output.resolve().as_uri()} in a browser")


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
