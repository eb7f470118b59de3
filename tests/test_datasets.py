"""DogCatDataset, the test-set dataset, the train/ scan and CSV checks."""
import io
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from src.datasets import (
    DogCatDataset,
    DogCatTestDataset,
    load_labels,
    natural_key,
    read_labels_csv,
    scan_train_dir,
)
from src.errors import UserError
from src.transforms import image_transform


def _save(image: Image.Image, path, fmt="JPEG"):
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, fmt)


def _odd_images(folder):
    """One image of each awkward kind, all named .jpg, plus the broken ones."""
    rgb = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8))
    _save(rgb, folder / "cat.0.jpg")
    _save(rgb.convert("L"), folder / "dog.0.jpg")                    # grayscale JPEG
    _save(rgb.convert("CMYK"), folder / "cat.1.jpg")                 # CMYK JPEG
    _save(rgb.convert("RGBA"), folder / "dog.1.jpg", fmt="PNG")      # RGBA PNG named .jpg
    _save(rgb.convert("P"), folder / "cat.2.jpg", fmt="PNG")         # palette PNG named .jpg
    (folder / "dog.2.jpg").write_bytes(b"")                          # empty
    (folder / "cat.3.jpg").write_text("not an image at all\n")       # text
    buffer = io.BytesIO()
    rgb.resize((400, 300)).save(buffer, "JPEG")
    (folder / "dog.3.jpg").write_bytes(buffer.getvalue()[:2000])     # truncated JPEG
    (folder / "notes.txt").write_text("ignored")


def test_scan_keeps_readable_odd_images_and_lists_broken_ones(tmp_path):
    _odd_images(tmp_path / "train")
    frame, rejected = scan_train_dir(tmp_path / "train", show_progress=False)
    assert list(frame["filename"]) == ["cat.0.jpg", "cat.1.jpg", "cat.2.jpg", "dog.0.jpg", "dog.1.jpg"]
    assert list(frame["label"]) == [0, 0, 0, 1, 1]
    assert sorted(rejected) == ["cat.3.jpg", "dog.2.jpg", "dog.3.jpg"]


def test_every_readable_image_becomes_rgb(tmp_path):
    _odd_images(tmp_path / "train")
    frame, _ = scan_train_dir(tmp_path / "train", show_progress=False)
    dataset = DogCatDataset(frame, tmp_path / "train", image_transform(32))
    for index in range(len(dataset)):
        image, label = dataset[index]
        assert image.shape == (3, 32, 32) and image.dtype == torch.uint8
        assert label == frame["label"][index]


def test_folder_per_class_layout_any_case(tmp_path):
    image = Image.new("RGB", (40, 30), (10, 20, 30))
    for name in ["Cat/1.jpg", "Cat/10.jpg", "Cat/2.jpg", "dogs/5.jpg", "Other/7.jpg"]:
        _save(image, tmp_path / "train" / name)
    frame, rejected = scan_train_dir(tmp_path / "train", show_progress=False)
    assert list(frame["filename"]) == ["Cat/1.jpg", "Cat/2.jpg", "Cat/10.jpg", "dogs/5.jpg"]
    assert list(frame["label"]) == [0, 0, 0, 1] and rejected == []


def test_images_at_any_depth_under_a_class_folder_are_labelled_by_it(tmp_path, capsys):
    """cats/2023/x.jpg was left out (one level under the class folder only): torchvision's
    ImageFolder takes every image under a class folder, and so does the scan. The class is the
    folder at the top (other/cats/1.jpg is no class's); hidden files and links to nothing are
    treated at depth as at the top (a hidden text file named as not used, a link to nothing
    counted as unreadable)."""
    image = Image.new("RGB", (40, 30), (10, 20, 30))
    for name in ["cats/2023/1.jpg", "cats/2023/summer/2.jpg", "Cats/3.jpg", "DOGS/a/b/c/4.jpg", "dogs/5.png",
                 "other/cats/6.jpg", "cats/.hidden/7.jpg"]:
        _save(image, tmp_path / "train" / name, "PNG" if name.endswith(".png") else "JPEG")
    (tmp_path / "train" / "cats" / "2023" / ".notes.txt").write_text("hidden")
    (tmp_path / "train" / "dogs" / "2023").mkdir()
    (tmp_path / "train" / "dogs" / "2023" / "gone.jpg").symlink_to("nowhere.jpg")
    frame = load_labels(tmp_path)
    assert dict(zip(frame["filename"], frame["label"])) == {
        "cats/.hidden/7.jpg": 0, "cats/2023/1.jpg": 0, "cats/2023/summer/2.jpg": 0, "Cats/3.jpg": 0,
        "DOGS/a/b/c/4.jpg": 1, "dogs/5.png": 1}
    out = capsys.readouterr().out
    assert "left out 1 unreadable image(s), first dogs/2023/gone.jpg" in out
    assert "that no label rule covers (cat.N / dog.N images, or images at any depth under a cat(s)/ or dog(s)/ " \
           "folder; " in out and out.rstrip().endswith(": cats/2023/.notes.txt, other/cats/6.jpg")


def test_a_linked_folder_is_followed_as_imagefolder_follows_it_each_real_folder_once(tmp_path, capsys):
    """A link to a folder of more photos under a class folder (or a class folder that is a link)
    trains, as torchvision's ImageFolder takes it; a loop of links, or a link to a folder already
    walked, lists nothing twice. predict's folder search (find_images) follows the same links."""
    from torchvision.datasets import ImageFolder

    from src.image_files import find_images
    image = Image.new("RGB", (40, 30), (10, 20, 30))
    for name in ["train/cats/1.jpg", "train/cats/2.jpg", "elsewhere/more/3.jpg", "elsewhere/more/deeper/4.jpg",
                 "elsewhere/dogs/5.jpg", "elsewhere/dogs/6.jpg"]:
        _save(image, tmp_path / name)
    (tmp_path / "train" / "cats" / "more").symlink_to(tmp_path / "elsewhere" / "more")
    (tmp_path / "train" / "dogs").symlink_to(tmp_path / "elsewhere" / "dogs")
    by_imagefolder = sorted(Path(path).relative_to(tmp_path / "train").as_posix()
                            for path, _ in ImageFolder(str(tmp_path / "train")).samples)
    assert len(by_imagefolder) == 6
    (tmp_path / "elsewhere" / "more" / "loop").symlink_to(tmp_path / "train" / "cats")  # cats/more/loop: cats
    (tmp_path / "train" / "cats" / "same").symlink_to(tmp_path / "elsewhere" / "more")  # walked as more/
    frame = load_labels(tmp_path)
    assert sorted(frame["filename"]) == by_imagefolder
    assert list(frame["label"]) == [0, 0, 0, 0, 1, 1]
    assert "not used" not in capsys.readouterr().out
    images, others = find_images([tmp_path / "train"])
    assert sorted(p.relative_to(tmp_path / "train").as_posix() for p in images) == by_imagefolder and not others


def test_no_labelled_images_names_every_layout_it_takes(tmp_path):
    """The line named Cat/ and Dog/ only: it names Kaggle's names, class folders at any depth
    and train.csv (for --val-dir, which reads no CSV, the first two)."""
    (tmp_path / "train" / "birds").mkdir(parents=True)
    _save(Image.new("RGB", (8, 8)), tmp_path / "train" / "birds" / "1.jpg")
    with pytest.raises(UserError) as error:
        load_labels(tmp_path)
    train = tmp_path / "train"
    assert str(error.value) == (
        f"no labelled images in {train}: expected Kaggle's cat.N.jpg / dog.N.jpg in {train}, or images at any "
        f"depth under a cats/ and a dogs/ folder in it (or Cat/ and Dog/, any case: {train}/cats/2023/x.jpg), "
        f"or a {tmp_path / 'train.csv'} of filename,label (0/cat, 1/dog) naming files in it")
    with pytest.raises(UserError) as error:
        scan_train_dir(train, show_progress=False, flag="--val-dir")
    assert str(error.value).startswith(f"no labelled images in --val-dir {train}: expected Kaggle's")
    assert "train.csv" not in str(error.value)


def test_dataset_reads_the_csv_and_labels(small_data):
    dataset = DogCatDataset(load_labels(small_data, show_progress=False), small_data / "train",
                            image_transform(48))
    assert len(dataset) == 240
    labels = [dataset.frame["label"][i] for i in range(len(dataset))]
    assert sum(labels) == 120
    for i in (0, 150):
        image, label = dataset[i]
        name = dataset.frame["filename"][i]
        assert label == (1 if name.startswith("dog") else 0)
        assert image.shape == (3, 48, 48)


def test_csv_from_file_with_word_labels(tmp_path, small_data):
    csv = tmp_path / "train.csv"
    csv.write_text("filename,label\ncat.0.jpg,cat\ndog.0.jpg,DOG\ncat.1.jpg,0\n")
    dataset = DogCatDataset(csv, small_data / "train")
    assert len(dataset) == 3 and [dataset[i][1] for i in range(3)] == [0, 1, 0]
    assert dataset[0][0].mode == "RGB"


@pytest.mark.parametrize("text, message", [
    ("name,label\ncat.0.jpg,0\n", "expected filename,label"),
    ("filename,label\ncat.0.jpg,bird\n", "unknown label 'bird'"),
    ("filename,label\ncat.0.jpg,0\ncat.99999.jpg,0\n", "missing from"),
    ("filename,label\n", "lists no images"),
    ("filename,label\ncat.0.jpg,0\ndog.0.jpg,1\ncat.0.jpg,cat\n", "lists cat.0.jpg more than once"),
    ("filename,label\ncat.0.jpg,0\ndog.0.jpg,1\n./cat.0.jpg,cat\n",
     r"lists cat.0.jpg more than once \(as cat.0.jpg and ./cat.0.jpg\) \(1 repeated row"),
    ("filename,label\ncat.0.jpg,0\ndog.0.jpg,1\ncats/../dog.0.jpg,1\n", r"lists dog.0.jpg more than once \(as dog"),
])
def test_bad_csv_is_a_clear_error(tmp_path, small_data, text, message):
    csv = tmp_path / "train.csv"
    csv.write_text(text)
    with pytest.raises(UserError, match=message) as error:
        read_labels_csv(csv, small_data / "train")
    assert str(csv) in str(error.value)


def test_test_dataset_yields_ids_in_numeric_order(small_data):
    dataset = DogCatTestDataset(small_data / "test", image_transform(32))
    assert dataset.ids == list(range(1, 31))
    image, image_id = dataset[9]
    assert image_id == 10 and image.shape == (3, 32, 32)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_labels(tmp_path / "nowhere")
    (tmp_path / "train").mkdir()
    with pytest.raises(UserError, match="no labelled images"):
        load_labels(tmp_path)
    with pytest.raises(UserError, match="test folder"):
        DogCatTestDataset(tmp_path / "test")


def test_natural_order():
    assert sorted(["cat.10.jpg", "cat.2.jpg", "cat.1.jpg"], key=natural_key) == \
        ["cat.1.jpg", "cat.2.jpg", "cat.10.jpg"]
    # Case does not order: a camera's IMG_2.JPG sits between img_1 and img_10, as a person reads them.
    assert sorted(["img_10.jpg", "IMG_2.JPG", "img_1.jpg", "Dog.3.jpg", "cat.4.jpg"], key=natural_key) == \
        ["cat.4.jpg", "Dog.3.jpg", "img_1.jpg", "IMG_2.JPG", "img_10.jpg"]


def test_load_labels_prefers_train_csv(tmp_path, small_data):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train").symlink_to(small_data / "train")
    pd.DataFrame({"filename": ["dog.3.jpg", "cat.4.jpg"], "label": [1, 0]}).to_csv(
        data / "train.csv", index=False)
    frame = load_labels(data, show_progress=False)
    assert list(frame["filename"]) == ["dog.3.jpg", "cat.4.jpg"]


def test_an_upper_case_suffix_is_an_image_like_its_lower_case_one(tmp_path):
    """Cameras and Windows write DOG.1.JPG and .PNG: such files are labelled and trained on, not
    left out as files that are not images."""
    train = tmp_path / "train"
    train.mkdir()
    for name in ("dog.1.JPG", "cat.2.Png", "cat.3.jpg", "notes.TXT"):
        target = train / name
        if name.endswith("TXT"):
            target.write_text("not an image")
        else:
            Image.new("RGB", (8, 8), (200, 10, 10)).save(target, format="PNG" if name.lower().endswith("png") else "JPEG")
    table, unreadable = scan_train_dir(train, show_progress=False)
    assert sorted(zip(table["filename"], table["label"])) == [("cat.2.Png", 0), ("cat.3.jpg", 0), ("dog.1.JPG", 1)]
    assert unreadable == []
