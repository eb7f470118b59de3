"""Write a synthetic dataset in the exact Kaggle "Dogs vs. Cats Redux" layout.

    python -m src.tools.synthetic OUT_DIR [--train N] [--test N] [--size PX] [--seed S] [--hard]

It is NOT real photographs: every image is a striped texture with noise and random blobs. In
cats the stripes run roughly horizontally, in dogs roughly vertically; that is the only
difference between the classes. Image sizes, JPEG quality, colours and file names are drawn from
the same distributions for both, so a model can only learn the class from the pixels.

The default set is easy on purpose (tests and demos): the stripes fill the whole image and are
within 20 degrees of horizontal or vertical, so any model reaches 1.0 accuracy in a few epochs.
`--hard` writes a set on which a recipe's effect can be measured (`python -m
src.tools.compare_recipes`): the class's stripes, now within 40 degrees of horizontal (cats) or
vertical (dogs), fill only an ellipse (the "animal") of random size (15-40% of the shorter side
as radius), shape, rotation and position, partly outside the image near the edges and partly
hidden by one to five blobs; around it, a background of two gratings of any orientation (some
as stripy as the animal), and noise of a random strength. Orientation over the whole image then
says little: the model has to find the animal, wherever and however large it is. The angles are
drawn in the image's own unit square, i.e. as a model sees them after resizing it to a square,
so that the classes stay apart by 10 degrees either side of the diagonal: the set is hard but
rarely ambiguous (an animal mostly hidden by blobs or the edge is). Sizes, colours, blobs and
background come from the same distributions in both classes.

Writes OUT_DIR/train/{cat,dog}.N.jpg, OUT_DIR/test/N.jpg (ids from 1, as on Kaggle),
OUT_DIR/sample_submission.csv, and the true test labels in the hidden OUT_DIR/.test_labels.csv.
The same seed (and --hard or not) gives byte-identical files; without --hard, the same files as
before --hard existed.

It writes the hidden file OUT_DIR/.synthetic first, and refuses a folder that holds any of what it
writes (train/, test/, train.csv, the CSVs) without that mark: a dataset of yours. A folder with
the mark it rewrites, removing what it wrote there before (and a train.csv made from that).
"""
import csv
import dataclasses
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from src.cli import IMAGE_COUNTS, IMAGE_SIZES, SEEDS, OneLineParser, between
from src.errors import UserError, exit_on_error
from src.outputs import claim_folder as claim_folder_of
from src.terminal import shown

TEST_LABELS = ".test_labels.csv"
MARK = ".synthetic"  # says that this program wrote the folder, and may write it again
WRITES = ("train", "test", "train.csv", "sample_submission.csv", TEST_LABELS)
INTERRUPTED = "interrupted: the set is incomplete; run the same command again to write it whole"


def synthetic_image(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    """One RGB image; label 0 (cat) has near-horizontal stripes, 1 (dog) near-vertical ones."""
    width = int(size * rng.uniform(0.75, 1.25))
    height = int(size * rng.uniform(0.6, 1.0))
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    tilt = np.deg2rad(rng.uniform(-20, 20))
    angle = tilt + (np.pi / 2 if label == 0 else 0.0)  # direction along which the stripes vary
    cycles = rng.uniform(3, 6)
    along = (xx * np.cos(angle) + yy * np.sin(angle)) / max(width, height)
    stripes = 0.5 + 0.5 * np.tanh(3 * np.sin(2 * np.pi * cycles * along + rng.uniform(0, 2 * np.pi)))
    dark, light = rng.uniform(0, 110, 3), rng.uniform(140, 255, 3)
    pixels = dark + (light - dark) * stripes[..., None]
    for _ in range(rng.integers(0, 4)):  # distractor blobs, the same for both classes
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        radius = rng.uniform(0.05, 0.2) * min(width, height)
        blob = ((yy - cy) ** 2 + (xx - cx) ** 2) < radius**2
        pixels[blob] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, 12, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def _grating(xx: np.ndarray, yy: np.ndarray, angle: float, cycles: float, phase: float,
             sharpness: float) -> np.ndarray:
    """Stripes in [0, 1] varying along `angle` (radians) in the unit square that xx and yy span
    (0 to 1 each): `cycles` periods across it, square-wave-like when `sharpness` is large."""
    along = xx * np.cos(angle) + yy * np.sin(angle)
    return 0.5 + 0.5 * np.tanh(sharpness * np.sin(2 * np.pi * cycles * along + phase))


def hard_image(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    """One RGB image of the --hard set: the class's stripes fill only a small ellipse (the
    "animal") at a random position, scale, shape and rotation, over a background of stripes of
    any orientation, with occluding blobs and noise; see the module docstring."""
    width = int(size * rng.uniform(0.75, 1.25))
    height = int(size * rng.uniform(0.6, 1.0))
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    # Unit-square coordinates: the training scripts resize every image to a square, and an angle
    # drawn in these is the angle the model sees. (Drawn in pixels, a 40-degree tilt would cross
    # the diagonal in the wider images once squeezed, making them truly ambiguous.)
    xu, yu = xx / width, yy / height
    short = min(width, height)

    # Background, the same for both classes: two gratings of any orientation, some as stripy as
    # the animal, so that orientation over the whole image says little about the class.
    pixels = np.empty((height, width, 3), np.float32)
    pixels[:] = rng.uniform(60, 200, 3)
    for _ in range(2):
        wave = _grating(xu, yu, rng.uniform(0, np.pi), rng.uniform(2, 8), rng.uniform(0, 2 * np.pi),
                        rng.uniform(0.5, 3))
        pixels += rng.uniform(-45, 45, 3) * (wave[..., None] - 0.5) * 2

    # The animal: an ellipse, partly outside the image near the edges.
    radius = rng.uniform(0.15, 0.4) * short
    aspect = np.exp(rng.uniform(-0.35, 0.35))
    cy, cx = rng.uniform(0.1, 0.9) * height, rng.uniform(0.1, 0.9) * width
    turn = rng.uniform(0, np.pi)
    u = ((xx - cx) * np.cos(turn) + (yy - cy) * np.sin(turn)) / (radius * aspect)
    v = (-(xx - cx) * np.sin(turn) + (yy - cy) * np.cos(turn)) / (radius / aspect)
    inside = np.clip((1 - (u**2 + v**2)) * 4, 0, 1)[..., None]  # a soft edge
    # Its stripes: cats' within 40 degrees of horizontal, dogs' within 40 of vertical (the default
    # set's 20 each), so that the classes are still separate, by 10 degrees either side of the
    # diagonal. Their period follows the animal's size: about 2.5 to 5 periods across it (fewer
    # along the image's shorter side, as the unit square is squeezed there).
    tilt = np.deg2rad(rng.uniform(-40, 40))
    angle = tilt + (np.pi / 2 if label == 0 else 0.0)  # direction along which the stripes vary
    cycles = rng.uniform(2.5, 5) * max(width, height) / (2 * radius)
    stripes = _grating(xu, yu, angle, cycles, rng.uniform(0, 2 * np.pi), 2.0)
    middle, contrast = rng.uniform(70, 190, 3), rng.uniform(40, 140)
    texture = middle + contrast * (stripes[..., None] - 0.5)
    pixels = pixels * (1 - inside) + texture * inside

    for _ in range(rng.integers(1, 6)):  # blobs, the same for both classes, may hide some of it
        by, bx = rng.uniform(0, height), rng.uniform(0, width)
        blob_radius = rng.uniform(0.05, 0.2) * short
        pixels[((yy - by) ** 2 + (xx - bx) ** 2) < blob_radius**2] = rng.uniform(0, 255, 3)
    pixels += rng.normal(0, rng.uniform(8, 25), pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8), "RGB")


def claim_folder(out_dir: Path) -> None:
    """Make out_dir ours (src.outputs.claim_folder: not a folder of someone else's), and remove
    what an earlier run of this program wrote there."""
    claim_folder_of(out_dir, MARK, WRITES, "src.tools.synthetic", "the synthetic set")
    try:
        for name in WRITES:  # our own files of an earlier run, and the train.csv prepare made of them
            if (out_dir / name).is_dir() and not (out_dir / name).is_symlink():
                shutil.rmtree(out_dir / name)
            elif os.path.lexists(out_dir / name):
                (out_dir / name).unlink()
    except OSError as error:
        raise UserError(f"cannot write the synthetic set to {out_dir} ({error.strerror or error}): "
                        "name a folder where files can be written") from None


def write_dataset(out_dir: Path, n_train: int = 1000, n_test: int = 200, size: int = 96,
                  seed: int = 0, hard: bool = False) -> None:
    """The set in out_dir (claim_folder first); a full disk is one line naming the folder."""
    out_dir = Path(out_dir)
    claim_folder(out_dir)
    try:
        _write(out_dir, n_train, n_test, size, seed, hard)
    except OSError as error:  # a full disk, a quota
        raise UserError(f"cannot write the synthetic set to {out_dir} ({error.strerror or error}): make room "
                        "or write elsewhere; rerunning the same command rewrites it") from None


def _write(out_dir: Path, n_train: int, n_test: int, size: int, seed: int, hard: bool) -> None:
    rng = np.random.default_rng(seed)
    draw = hard_image if hard else synthetic_image
    (out_dir / "train").mkdir(parents=True, exist_ok=True)
    (out_dir / "test").mkdir(parents=True, exist_ok=True)

    def save(image: Image.Image, path: Path) -> None:
        image.save(path, "JPEG", quality=int(rng.integers(80, 96)))

    train_labels = rng.permutation(np.arange(n_train) % 2)
    counters = [0, 0]
    for label in train_labels:
        name = f"{('cat', 'dog')[label]}.{counters[label]}.jpg"
        counters[label] += 1
        save(draw(rng, int(label), size), out_dir / "train" / name)

    test_labels = rng.integers(0, 2, n_test)
    for image_id, label in enumerate(test_labels, start=1):
        save(draw(rng, int(label), size), out_dir / "test" / f"{image_id}.jpg")
    with open(out_dir / "sample_submission.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows([i, 0.5] for i in range(1, n_test + 1))
    with open(out_dir / TEST_LABELS, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows([i, int(label)] for i, label in enumerate(test_labels, start=1))


@dataclasses.dataclass(kw_only=True)
class Options:
    """synthetic's flags, as main parses them."""

    out_dir: Path
    train: int
    test: int
    size: int
    seed: int
    hard: bool


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write train/, test/ and the CSVs into")
    parser.add_argument("--train", type=between(2, IMAGE_COUNTS[1]), default=1000,
                        help="labelled images, half cats, half dogs")
    parser.add_argument("--test", type=between(0, IMAGE_COUNTS[1]), default=200, help="unlabelled test images")
    # Up to the training scripts' largest --image-size: an image of --size S is up to 1.25 S wide,
    # and drawing it takes about 60 bytes a pixel (--size 100000 asked numpy for 70 GB).
    parser.add_argument("--size", type=between(16, IMAGE_SIZES[1]), default=96, help="typical image width in pixels")
    parser.add_argument("--seed", type=between(*SEEDS), default=0)
    parser.add_argument("--hard", action="store_true",
                        help="the hard set: the stripes (within 40 degrees of horizontal or vertical) "
                             "fill only an ellipse of random size, position and rotation, over "
                             "stripes of any orientation, partly hidden by blobs; see the module "
                             "docstring")
    args = Options(**vars(parser.parse_args(argv)))
    write_dataset(args.out_dir, args.train, args.test, args.size, args.seed, args.hard)
    kind = "hard synthetic" if args.hard else "synthetic"
    print(f"wrote {args.train} training and {args.test} test images ({kind}) to {shown(args.out_dir)}")


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
