"""Write a synthetic dataset in the exact Kaggle "Dogs vs. Cats Redux" layout.

    python -m src.synthetic OUT_DIR [--train N] [--test N] [--size PX] [--seed S]

It is NOT real photographs: every image is a striped texture with noise and random blobs. In
cats the stripes run roughly horizontally, in dogs roughly vertically; that is the only
difference between the classes. Image sizes, JPEG quality, colours and file names are drawn from
the same distributions for both, so a model can only learn the class from the pixels.

Writes OUT_DIR/train/{cat,dog}.N.jpg, OUT_DIR/test/N.jpg (ids from 1, as on Kaggle),
OUT_DIR/sample_submission.csv, and the true test labels in the hidden OUT_DIR/.test_labels.csv.
The same seed gives byte-identical files.
"""
import argparse
import csv
from pathlib import Path

import numpy as np
from PIL import Image

TEST_LABELS = ".test_labels.csv"


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


def write_dataset(out_dir: Path, n_train: int = 1000, n_test: int = 200, size: int = 96,
                  seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    out_dir = Path(out_dir)
    (out_dir / "train").mkdir(parents=True, exist_ok=True)
    (out_dir / "test").mkdir(parents=True, exist_ok=True)

    def save(image: Image.Image, path: Path) -> None:
        image.save(path, "JPEG", quality=int(rng.integers(80, 96)))

    train_labels = rng.permutation(np.arange(n_train) % 2)
    counters = [0, 0]
    for label in train_labels:
        name = f"{('cat', 'dog')[label]}.{counters[label]}.jpg"
        counters[label] += 1
        save(synthetic_image(rng, int(label), size), out_dir / "train" / name)

    test_labels = rng.integers(0, 2, n_test)
    for image_id, label in enumerate(test_labels, start=1):
        save(synthetic_image(rng, int(label), size), out_dir / "test" / f"{image_id}.jpg")
    with open(out_dir / "sample_submission.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows([i, 0.5] for i in range(1, n_test + 1))
    with open(out_dir / TEST_LABELS, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["id", "label"])
        writer.writerows([i, int(label)] for i, label in enumerate(test_labels, start=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="folder to write train/, test/ and the CSVs into")
    parser.add_argument("--train", type=int, default=1000, help="labelled images, half cats, half dogs")
    parser.add_argument("--test", type=int, default=200, help="unlabelled test images")
    parser.add_argument("--size", type=int, default=96, help="typical image width in pixels")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.train < 2 or args.test < 0 or args.size < 16:
        parser.error("need --train >= 2, --test >= 0 and --size >= 16")
    write_dataset(args.out_dir, args.train, args.test, args.size, args.seed)
    print(f"wrote {args.train} training and {args.test} test images (synthetic) to {args.out_dir}")


if __name__ == "__main__":
    main()
