"""Predict cat or dog for image files and folders with a trained checkpoint (or its ONNX export).

    python -m src.tools.predict PATH... [--checkpoint model/best.pth] [--output predictions.csv] [--tta]
    torchrun --nproc_per_node=N -m src.tools.predict PATH...       (the images shared out over N GPUs)
    python -m src.tools.predict --onnx model/best.onnx PATH...     (onnxruntime, without torch)
    python -m src.tools.predict [--data-dir data] [--tta]          (Kaggle's test/ -> submission.csv)

Folders are searched recursively. Files named .jpg .jpeg .png .bmp .gif .webp .tif .tiff (any
case) are images; other files are skipped, counted and named (the first few), and an image that
cannot be decoded is named in one line and left out. Under torchrun rank 0 lists the files and
every rank takes its share of that one list. The CSV has a row `path,p_dog,label` for every other image, in
the order of the paths given (a folder's files in natural order), and the same rows whatever the
number of processes. The architecture, image size and normalisation come from best.json, which
every training script writes beside best.pth. `--output -` writes the CSV to standard output (and
what predict says to standard error). The CSV is safe to open in a spreadsheet: a name that a
spreadsheet would take for a formula (starting with = + - @, a tab or a carriage return), or one
starting with ', is written with a ' in front; drop one leading ' to read it back (src/safe_csv.py).
--output replaces a CSV that predict wrote (its header says so), any other file with --overwrite
only, and never a training run's files nor a file in the folder of a training run in progress
(src.outputs.check_tool_output).
"""
import dataclasses
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np

from src.cli import AMP_DTYPES, BATCH_SIZES, DefaultsHelp, OneLineParser, add_dist_timeout, between, cap_workers, workers_count
from src.errors import UserError, exit_on_error
from src.image_files import find_images, some, try_decode
from src.outputs import atomic_write_text, check_room, check_tool_output, starts_with
from src.safe_csv import csv_text
from src.terminal import shown

# The headers of the CSVs predict writes: the one mark of a file that --output may replace.
HEADERS = ("path,p_dog,label\n", "id,label\n")
INTERRUPTED = "interrupted: no CSV written (an earlier --output file is as it was); run the command again"

SHOWN = 10  # rows of the table printed


@dataclasses.dataclass(kw_only=True)
class Options:
    """predict's flags, as parse_args returns them (--output's default filled in)."""

    paths: list[Path]
    data_dir: Path
    checkpoint: Path | None
    onnx: Path | None
    output: Path
    batch_size: int
    workers: int | None  # capped to the CPUs; None: the default
    overwrite: bool
    tta: bool
    amp: str
    channels_last: bool
    dist_timeout: float


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelp)
    parser.ranks = True  # it runs under torchrun too: rank 0 says a bad flag
    parser.add_argument("paths", nargs="*", type=Path, metavar="PATH",
                        help="image files and folders (default: Kaggle's DATA_DIR/test, written as submission.csv)")
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="folder holding test/ (without PATH)")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="best.pth, with its best.json beside it (default: model/best.pth; with --onnx, "
                             "whose best.json the ONNX file must come from)")
    parser.add_argument("--onnx", type=Path, default=None, help="run this export of best.pth with onnxruntime")
    parser.add_argument("--output", type=Path, default=None,
                        help="the CSV (default: predictions.csv, without PATH submission.csv); - for "
                             "standard output")
    parser.add_argument("--batch-size", type=between(*BATCH_SIZES), default=100,
                        help="images per forward pass (each process's under torchrun; --tta adds one of their mirror images)")
    parser.add_argument("--workers", type=workers_count, default=None,
                        help="image decoding processes (--onnx: threads); default: this machine's CPUs "
                             "over its processes")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --output file that predict did not write (never a training run's files)")
    parser.add_argument("--tta", action="store_true", help="average over the image and its mirror")
    parser.add_argument("--amp", choices=list(AMP_DTYPES), default="no", help="bf16 or fp16 autocast")
    parser.add_argument("--channels-last", action="store_true", help="channels-last batches and weights")
    add_dist_timeout(parser, "under torchrun, in a collective")
    args = parser.parse_args(argv)
    given = parser.given(argv)
    parser.refuse_unless(given, "data_dir", not args.paths,
                         "it names the folder of Kaggle's test/, which predict reads without PATH: give no PATH")
    parser.refuse_unless(given, "overwrite", str(args.output) != "-",
                         "--output - writes to standard output, which replaces no file: name an --output file")
    if args.onnx and (args.amp != "no" or args.channels_last):
        parser.error("--amp and --channels-last set up the torch model; --onnx runs in float32 on the CPU")
    if args.onnx and not args.paths:
        parser.error("--onnx predicts PATH...; the Kaggle submission (no PATH) uses --checkpoint")
    if args.onnx and int(os.environ.get("WORLD_SIZE", 1)) > 1:
        parser.error("--onnx runs in one process (onnxruntime uses every core itself): drop the launcher")
    if args.output is None:
        args.output = Path("predictions.csv" if args.paths else "submission.csv")
    if args.workers is not None:
        args.workers = cap_workers(args.workers, len(os.sched_getaffinity(0)))
    return Options(**vars(args))


# What only rank 0 uses (it writes the CSV), and the node's CPUs: the flags that may differ between
# the ranks under a launcher (src.process_group.check_same_values compares the others).
PER_NODE = ("output", "overwrite", "workers")


def checkpoint_of(args: Options) -> Path:
    """The checkpoint predict loads (with torch): --checkpoint, by default model/best.pth."""
    return args.checkpoint or Path("model/best.pth")


def check_ranks_agree(args: Options) -> None:
    """Under a launcher, before any work: every rank predicts with the same flags and the same
    checkpoint (by content: each node may read its own copy), or none does (rank 1 with --tta
    wrote half the CSV with it); PER_NODE may differ."""
    from src.process_group import by_content, check_same_values
    flags = {key: value for key, value in dataclasses.asdict(args).items() if key not in PER_NODE}
    check_same_values(by_content({**flags, "checkpoint": checkpoint_of(args)}, ("checkpoint",)),
                      "--output and --workers")


def to_stdout(args: Options) -> bool:
    """--output -: the CSV goes to standard output, what predict says to standard error."""
    return str(args.output) == "-"


def is_predict_csv(path: Path) -> bool:
    """Whether the file starts with a header predict writes."""
    return starts_with(path, tuple(header.encode() for header in HEADERS))


def check_output(args: Options, files: list[Path]) -> None:
    """Before any work: --output is a file predict may write (src.outputs.check_tool_output: a
    regular file or nothing yet, its names can be made, a CSV of predict's or --overwrite, not a
    training run's file nor in the folder of one in progress), is none of the files this command
    reads (the checkpoint, its best.json, the ONNX file, an image to predict), and its folder has
    room for the CSV."""
    if to_stdout(args):
        return
    checkpoint = checkpoint_of(args) if args.checkpoint or not args.onnx else None
    inputs = [("an image to predict", file) for file in files]
    if checkpoint is not None:
        inputs += [("--checkpoint", checkpoint), ("its best.json", checkpoint.with_suffix(".json"))]
    if args.onnx:
        inputs += [("--onnx", args.onnx), ("its weights", Path(f"{args.onnx}.data")),
                   ("its best.json", args.onnx.with_suffix(".json"))]
    check_tool_output("--output", args.output, is_predict_csv, "a CSV of predict (a path,p_dog,label or "
                      "id,label header)", args.overwrite, inputs=inputs,
                      advice="name a new file or a regular one (for standard output: --output -)")
    # A row is the name, p(dog) (12 characters at most), the label and the separators; quotes or
    # a formula's ' take a few more. Checked now, not after the pass over every image.
    check_room(args.output, 100 + sum(len(os.fsencode(file)) + 32 for file in files), "--output")


class Predictions(NamedTuple):
    files: list[Path]
    probabilities: np.ndarray  # (files, classes); NaN rows for the files that cannot be decoded
    broken: dict[int, str]  # index in files -> why it cannot be decoded
    classes: list[str]
    seconds: float  # of the prediction pass


def predictions_text(result: Predictions) -> str:
    """The CSV: `path,p_dog,label` for each file that could be decoded (src.safe_csv: names quoted
    where they must be, and kept from being read as formulas)."""
    dog = result.classes.index("dog")
    return csv_text(["path", "p_dog", "label"],
                    ([str(file), f"{p[dog]:.6g}", result.classes[int(p.argmax())]]
                     for i, (file, p) in enumerate(zip(result.files, result.probabilities)) if i not in result.broken))


def check_finite(result: Predictions) -> None:
    """Refuse probabilities that are not numbers (finite weights whose outputs overflow, as in
    fp16): no CSV with such rows, and no image silently missing from it."""
    bad = [i for i, p in enumerate(result.probabilities) if i not in result.broken and not np.isfinite(p).all()]
    if bad:
        raise UserError(f"the model's probabilities are not finite for {len(bad)} of {len(result.files)} "
                        f"images, first {result.files[bad[0]]}: its outputs overflow (retrain with a lower "
                        "--lr, or predict without --amp fp16); nothing written")


def write_output(args: Options, text: str) -> None:
    """The CSV into --output (whole or not at all), or onto standard output for `-`."""
    if not to_stdout(args):
        atomic_write_text(args.output, text)
        return
    sys.stdout.flush()
    # surrogateescape: names that are not UTF-8 are written back as the bytes they were on disk
    sys.stdout.buffer.write(text.encode("utf-8", "surrogateescape"))
    sys.stdout.buffer.flush()


def report(result: Predictions, others: list[Path], output: Path) -> str:
    """What predict prints: the files that cannot be decoded, one line each, a short table, the
    counts and the speed."""
    files, classes = result.files, result.classes
    lines = [f"left out {shown(files[i])}: cannot decode it ({shown(why)})" for i, why in sorted(result.broken.items())]
    done = [(shown(file), p) for i, (file, p) in enumerate(zip(files, result.probabilities)) if i not in result.broken]
    width = min(60, max(len(name) for name, _ in done)) if done else 4
    dog = classes.index("dog")
    lines.append(f"{'path':<{width}}  p(dog)  label")
    for file, p in done[:SHOWN]:
        name = file if len(file) <= width else "..." + file[3 - width:]
        lines.append(f"{name:<{width}}  {p[dog]:.4f}  {classes[int(p.argmax())]}")
    if len(done) > SHOWN:
        lines.append(f"... {len(done) - SHOWN} more rows")
    counts = ", ".join(f"{sum(int(p.argmax()) == c for _, p in done)} {name}" for c, name in enumerate(classes))
    lines.append(f"predicted {len(done)} images ({counts}) in {result.seconds:.1f} s "
                 f"({len(done) / max(result.seconds, 1e-9):.1f} images/s); skipped {len(others)} file(s) that "
                 f"are not images{f' ({some(others)})' if others else ''}; left out {len(result.broken)} that "
                 "cannot be decoded; wrote "
                 + ("standard output" if str(output) == "-" else shown(output)))
    return "\n".join(lines)


def predict_onnx(args: Options, files: list[Path]) -> Predictions:
    """With onnxruntime: numpy, Pillow and onnxruntime, no torch. Decoding threads prepare the next
    batch while onnxruntime runs one."""
    from src.tools.onnx_model import open_session
    if args.onnx is None:  # main calls it with --onnx alone
        raise ValueError("predict_onnx runs the --onnx file")
    described = (args.checkpoint or args.onnx).with_suffix(".json")
    # an ONNX file alone describes itself
    best_json = None if args.checkpoint is None and not described.is_file() else described
    session, meta = open_session(args.onnx, best_json)
    size, classes = int(meta["image_size"]), json.loads(meta["classes"])
    start = time.time()
    probabilities = np.full((len(files), len(classes)), np.nan, dtype=np.float32)
    broken = {}
    chunks = [range(i, min(i + args.batch_size, len(files))) for i in range(0, len(files), args.batch_size)]
    with ThreadPoolExecutor(max(1, args.workers or len(os.sched_getaffinity(0)))) as pool:
        def decoding(chunk):  # Pillow decodes without holding the GIL: threads run in parallel
            return chunk, [pool.submit(try_decode, files[i], size) for i in chunk]
        ahead = decoding(chunks[0])
        for k in range(len(chunks)):
            chunk, futures = ahead
            if k + 1 < len(chunks):
                ahead = decoding(chunks[k + 1])
            decoded = [future.result() for future in futures]
            broken.update({i: why for i, (_, why) in zip(chunk, decoded) if why})
            rows = [i for i, (image, _) in zip(chunk, decoded) if image is not None]
            if rows:
                batch = np.stack([image for image, _ in decoded if image is not None])
                p = session.run(None, {"images": batch})[0]
                if args.tta:  # the class does not change under a horizontal flip
                    p = (p + session.run(None, {"images": np.ascontiguousarray(batch[..., ::-1])})[0]) / 2
                probabilities[rows] = p
    return Predictions(files, probabilities, broken, classes, time.time() - start)


def listed(args: Options) -> tuple[list[Path], list]:
    """The files to predict and what else is there (names, for the line that says so): the images
    under PATH..., or Kaggle's test/N.jpg without PATH."""
    if args.paths:
        return find_images(args.paths)
    from src.inference import kaggle_test_files
    return kaggle_test_files(args.data_dir / "test")[1:]


def predict_torch(args: Options) -> tuple[Predictions, list] | None:
    """With the checkpoint and torch, the files shared out over the processes of a launcher: rank
    0 lists them and every rank takes its share of that list (ranks listing the folder each, a
    file that appeared between their listings shifted every later row to another name); rank 0
    gets the predictions and what else was there, the others None."""
    from src.cli import amp_dtype
    from src.devices import default_workers
    from src.errors import end_process_group
    from src.inference import load_checkpoint, predict_files
    from src.process_group import join_process_group
    from src.ranks import from_rank_0, is_first
    from src.transforms import memory_format

    rank, world_size, device, heartbeat = join_process_group(args.dist_timeout, args.amp)
    try:
        with heartbeat:  # under torchrun: names a rank that stops answering
            try:
                check_ranks_agree(args)
                files, others = from_rank_0(lambda: listed(args))
                from_rank_0(lambda: check_output(args, files))
                model, info = load_checkpoint(checkpoint_of(args))
            except UserError as error:  # every rank finds it: the first says it
                raise UserError(str(error), quiet=error.quiet or not is_first()) from None
            model.to(device).to(memory_format=memory_format(args.channels_last))
            workers = default_workers() if args.workers is None else args.workers
            start = time.time()
            result = predict_files(model, info, files, device, args.batch_size, workers, args.tta,
                                   amp_dtype(args.amp), args.channels_last, rank, world_size)
    finally:
        end_process_group()
    if result is None:
        return None
    return Predictions(files, result[0].numpy(), result[1], info["classes"], time.time() - start), others


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.onnx:  # one process (parse_args): no ranks to agree
        files, others = find_images(args.paths)
        check_output(args, files)
        result = predict_onnx(args, files)
    else:
        predicted = predict_torch(args)
        if predicted is None:  # a rank other than 0
            return
        result, others = predicted
    check_finite(result)
    said = sys.stderr if to_stdout(args) else sys.stdout
    if args.paths:
        write_output(args, predictions_text(result))
        print(report(result, others, args.output), file=said)
    else:  # Kaggle's test/N.jpg: a submission needs every image
        from src.inference import check_complete, submission_text
        check_complete(result.files, result.broken)
        ids = [int(file.stem) for file in result.files]
        write_output(args, submission_text(ids, result.probabilities[:, result.classes.index("dog")]))
        print(f"wrote {len(ids)} predictions to " + ("standard output" if to_stdout(args) else shown(args.output))
              + (f"; not predicted: {len(others)} entries of {shown(args.data_dir / 'test')} that are not N.jpg "
                 f"images ({some(others)})" if others else ""), file=said)


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
