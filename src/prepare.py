"""Check every labelled image once and write DATA_DIR/train.csv for the training scripts.

    python -m src.prepare DATA_DIR

Finds Kaggle's flat train/cat.N.jpg and train/dog.N.jpg, or one folder per class (train/Cat/,
train/Dog/, any case, as in Microsoft's PetImages), opens every image, leaves out and lists the
ones that are empty, truncated or not images, and writes train.csv (filename,label; 0 = cat,
1 = dog). Safe to run again: it rescans and rewrites the same file.
"""
import argparse
from pathlib import Path

from src.checkpoint import atomic_write_text
from src.datasets import scan_train_dir
from src.errors import UserError, exit_on_error


def prepare(data_dir: Path, show_progress: bool = True) -> tuple[int, int, list[str]]:
    """Write data_dir/train.csv; returns (cats, dogs, names left out)."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise UserError(f"data folder {data_dir} not found")
    frame, rejected = scan_train_dir(data_dir / "train", show_progress)
    atomic_write_text(data_dir / "train.csv", frame.to_csv(index=False))
    dogs = int(frame["label"].sum())
    return len(frame) - dogs, dogs, rejected


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("data_dir", type=Path, help="folder holding train/")
    args = parser.parse_args()
    cats, dogs, rejected = prepare(args.data_dir)
    for name in rejected:
        print(f"left out (unreadable): {name}")
    print(f"wrote {args.data_dir / 'train.csv'}: {cats} cats, {dogs} dogs, "
          f"{len(rejected)} left out as unreadable")


if __name__ == "__main__":
    exit_on_error(main)
