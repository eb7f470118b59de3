"""The synthetic dataset: Kaggle layout, deterministic, and the class is in the pixels only."""
import hashlib

import numpy as np
import pandas as pd
from PIL import Image

from src.synthetic import TEST_LABELS, main, write_dataset


def _digest(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_kaggle_layout(tmp_path):
    main([str(tmp_path), "--train", "10", "--test", "4", "--size", "40", "--seed", "3"])
    train = sorted(p.name for p in (tmp_path / "train").iterdir())
    assert train == sorted([f"cat.{i}.jpg" for i in range(5)] + [f"dog.{i}.jpg" for i in range(5)])
    assert sorted(p.name for p in (tmp_path / "test").iterdir()) == ["1.jpg", "2.jpg", "3.jpg", "4.jpg"]
    sample = pd.read_csv(tmp_path / "sample_submission.csv")
    assert list(sample.columns) == ["id", "label"] and list(sample["id"]) == [1, 2, 3, 4]
    truth = pd.read_csv(tmp_path / TEST_LABELS)
    assert set(truth["label"]) <= {0, 1} and len(truth) == 4
    with Image.open(tmp_path / "train" / "cat.0.jpg") as image:
        assert image.format == "JPEG" and image.mode == "RGB"


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    write_dataset(tmp_path / "a", 8, 2, 40, seed=5)
    write_dataset(tmp_path / "b", 8, 2, 40, seed=5)
    write_dataset(tmp_path / "c", 8, 2, 40, seed=6)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")


def _orientation(path) -> float:
    """Positive when pixels vary more from row to row than along rows (horizontal stripes)."""
    pixels = np.asarray(Image.open(path).convert("L").resize((64, 64)), dtype=np.float32)
    return np.abs(np.diff(pixels, axis=0)).mean() - np.abs(np.diff(pixels, axis=1)).mean()


def test_classes_differ_in_pixels_not_in_sizes(tmp_path):
    write_dataset(tmp_path, 120, 0, 64, seed=0)
    cats = sorted((tmp_path / "train").glob("cat.*.jpg"))
    dogs = sorted((tmp_path / "train").glob("dog.*.jpg"))
    # The learnable signal: stripe orientation separates the classes almost perfectly.
    correct = sum(_orientation(p) > 0 for p in cats) + sum(_orientation(p) < 0 for p in dogs)
    assert correct / 120 > 0.9
    # No shortcut: image and file sizes come from the same distribution in both classes.
    def stats(paths):
        sizes = np.array([Image.open(p).size for p in paths], dtype=float)
        return sizes.mean(axis=0), np.mean([p.stat().st_size for p in paths])
    (cat_wh, cat_bytes), (dog_wh, dog_bytes) = stats(cats), stats(dogs)
    assert np.all(np.abs(cat_wh - dog_wh) < 0.1 * dog_wh)
    assert abs(cat_bytes - dog_bytes) < 0.15 * dog_bytes
