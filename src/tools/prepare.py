"""Check every labelled image once and write DATA_DIR/train.csv for the training scripts.

    python -m src.tools.prepare DATA_DIR [--val-dir DIR] [--cache DIR --image-size N]

Finds Kaggle's flat train/cat.N.jpg and train/dog.N.jpg, or one folder per class (train/Cat/,
train/Dog/, any case, as in Microsoft's PetImages; its images at any depth under it:
train/cats/2023/x.jpg), opens every image, leaves out and lists the
ones that are empty, truncated or not images, and writes train.csv (filename,label; 0 = cat,
1 = dog); files that no label rule covers (not cat.N / dog.N, not in a class folder) are named in
one line as not used. Safe to run again: it rescans and rewrites the same file (run it again after
adding images to train/: training names the files a train.csv does not list, and leaves them out). With --cache it also builds
the pixel cache that the training scripts' --cache DIR --image-size N would build on their start
(with --val-dir, that of a run with the same --val-dir, whose images it checks too; no CSV is
written for them).
train.csv is written as src/safe_csv.py writes every CSV (names quoted where a comma, quote or
line break would split them; its names start with cat., dog. or the class folder's name, so none
is taken for a spreadsheet formula).
"""
import dataclasses
from pathlib import Path

import pandas as pd

from src.cache import build_cache, cache_paths
from src.cli import IMAGE_SIZES, OneLineParser, between
from src.datasets import load_labels, load_val_labels, not_used_line, scan_train_dir
from src.devices import default_workers
from src.errors import UserError, exit_on_error
from src.loaders import labelled_images
from src.outputs import atomic_write_text, check_outputs
from src.safe_csv import csv_text
from src.terminal import shown

INTERRUPTED = "interrupted: train.csv is as it was; run the command again"


def prepare(data_dir: Path, show_progress: bool = True,
            val_dir: Path | None = None) -> tuple[int, int, list[str], str | None, pd.DataFrame | None]:
    """Write data_dir/train.csv; returns (cats, dogs, the unreadable images left out, the line that
    names the files no label rule covers or None, `val_dir`'s labelled images or None). `val_dir`
    (a training run's --val-dir) is checked against the images found before train.csv is written:
    a refused one changes nothing."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data folder {data_dir} not found")
    check_outputs([("DATA_DIR's train.csv", data_dir / "train.csv")])
    frame, rejected = scan_train_dir(data_dir / "train", show_progress)
    val = None if val_dir is None else load_val_labels(val_dir, data_dir, frame, show_progress)
    atomic_write_text(data_dir / "train.csv", csv_text(["filename", "label"], frame.itertuples(index=False)))
    dogs = int(frame["label"].sum())
    return len(frame) - dogs, dogs, rejected, not_used_line(data_dir, [*frame["filename"], *rejected]), val


@dataclasses.dataclass(kw_only=True)
class Options:
    """prepare's flags, as main parses them."""

    data_dir: Path
    val_dir: Path | None
    cache: Path | None
    image_size: int


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path, help="folder holding train/")
    parser.add_argument("--val-dir", type=Path, metavar="DIR", default=None,
                        help="also check the images of a training run's --val-dir (the cache is then that run's)")
    parser.add_argument("--cache", type=Path, metavar="DIR", help="also build the --cache of DIR")
    parser.add_argument("--image-size", type=between(*IMAGE_SIZES), default=224, help="the image size of that cache")
    args = Options(**vars(parser.parse_args(argv)))
    parser.refuse_unless(parser.given(argv), "image_size", args.cache is not None,
                         "it is the image size of the --cache to build: add --cache DIR")
    if args.cache is not None:  # where the cache goes is checked before train.csv is written
        check_outputs([], folders=[("--cache", args.cache)],
                      inputs=[("DATA_DIR's train.csv", args.data_dir / "train.csv")],
                      input_folders=[("DATA_DIR's train/", args.data_dir / "train")]
                      + ([("--val-dir", args.val_dir)] if args.val_dir is not None else []))
    cats, dogs, rejected, not_used, val_frame = prepare(args.data_dir, val_dir=args.val_dir)
    for name in rejected:
        print(f"left out (unreadable): {shown(name)}")
    if not_used:
        print(not_used)
    print(f"wrote {shown(args.data_dir / 'train.csv')}: {cats} cats, {dogs} dogs, "
          f"{len(rejected)} left out as unreadable")
    table, val = None, None
    if args.val_dir is not None and val_frame is not None:
        table = load_labels(args.data_dir, show_progress=False)  # the train.csv written above
        val = (args.val_dir, val_frame)
        dogs = int(val_frame["label"].sum())
        print(f"checked --val-dir {shown(args.val_dir)}: {len(val[1]) - dogs} cats, {dogs} dogs")
    if args.cache:
        dataset = labelled_images(args.data_dir, args.image_size, True, table, val)
        key = build_cache(dataset, args.image_size, args.cache, default_workers())
        print(f"cached {len(dataset)} images at {args.image_size} px in {cache_paths(args.cache, args.image_size, key)[0]}")


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
