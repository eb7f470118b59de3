"""The synthetic dataset: Kaggle layout, deterministic, and the class is in the pixels only."""
import hashlib

import numpy as np
import pandas as pd
from PIL import Image

from src.tools.synthetic import TEST_LABELS, main, write_dataset


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


def test_hard_set_kaggle_layout_and_deterministic(tmp_path):
    main([str(tmp_path / "a"), "--train", "10", "--test", "4", "--size", "40", "--seed", "3", "--hard"])
    train = sorted(p.name for p in (tmp_path / "a" / "train").iterdir())
    assert train == sorted([f"cat.{i}.jpg" for i in range(5)] + [f"dog.{i}.jpg" for i in range(5)])
    assert sorted(p.name for p in (tmp_path / "a" / "test").iterdir()) == ["1.jpg", "2.jpg", "3.jpg", "4.jpg"]
    assert list(pd.read_csv(tmp_path / "a" / "sample_submission.csv")["id"]) == [1, 2, 3, 4]
    with Image.open(tmp_path / "a" / "train" / "dog.0.jpg") as image:
        assert image.format == "JPEG" and image.mode == "RGB"
    write_dataset(tmp_path / "b", 10, 4, 40, seed=3, hard=True)
    write_dataset(tmp_path / "c", 10, 4, 40, seed=3)  # the default set, same seed
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    default, hard = _digest(tmp_path / "c"), _digest(tmp_path / "a")
    # The same training names (drawn first) but other pixels.
    assert default.keys() == hard.keys()
    assert all(default[name] != hard[name] for name in default if name.endswith(".jpg"))


def test_hard_set_is_harder_but_fair(tmp_path):
    write_dataset(tmp_path / "easy", 120, 0, 64, seed=0)
    write_dataset(tmp_path / "hard", 120, 0, 64, seed=0, hard=True)

    def separated(folder) -> float:
        """Share of images that the whole-image orientation statistic classifies right."""
        cats, dogs = sorted(folder.glob("train/cat.*.jpg")), sorted(folder.glob("train/dog.*.jpg"))
        return (sum(_orientation(p) > 0 for p in cats) + sum(_orientation(p) < 0 for p in dogs)) / 120

    easy, hard = separated(tmp_path / "easy"), separated(tmp_path / "hard")
    # The statistic that separates the default set almost perfectly does clearly worse on the hard
    # one (measured: 1.0 against 0.78 on these 120 images, 0.7 on 400), since the stripes of the
    # class fill only a part of the image and the background's have any orientation.
    assert easy > 0.9 and hard < 0.85 and easy - hard > 0.15
    # No shortcut there either: sizes, file sizes and mean colours alike in both classes.
    cats = sorted((tmp_path / "hard" / "train").glob("cat.*.jpg"))
    dogs = sorted((tmp_path / "hard" / "train").glob("dog.*.jpg"))

    def stats(paths):
        sizes = np.array([Image.open(p).size for p in paths], dtype=float)
        colour = np.array([np.asarray(Image.open(p), dtype=float).mean() for p in paths])
        return sizes.mean(axis=0), np.mean([p.stat().st_size for p in paths]), colour.mean()
    (cat_wh, cat_bytes, cat_colour), (dog_wh, dog_bytes, dog_colour) = stats(cats), stats(dogs)
    assert np.all(np.abs(cat_wh - dog_wh) < 0.1 * dog_wh)
    assert abs(cat_bytes - dog_bytes) < 0.15 * dog_bytes
    assert abs(cat_colour - dog_colour) < 10
