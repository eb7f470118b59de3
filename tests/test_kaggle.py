"""The Kaggle workflow: prepare -> train -> predict -> submission.csv, scored by log loss."""
import hashlib
import io
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

from conftest import LEARN, outputs, python
from src.synthetic import TEST_LABELS

BROKEN = ["dog.1000.jpg", "cat.1000.jpg", "dog.1001.jpg"]
ODD = ["cat.1001.jpg", "dog.1002.jpg", "cat.1002.jpg"]


def _plant_bad_files(train):
    """The three unreadable files of BROKEN and the three readable odd ones of ODD."""
    with Image.open(train / "cat.0.jpg") as image:
        rgb = image.convert("RGB")
    (train / "dog.1000.jpg").write_bytes(b"")
    buffer = io.BytesIO()
    rgb.save(buffer, "JPEG")
    (train / "cat.1000.jpg").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 3])
    (train / "dog.1001.jpg").write_text("this is a text file\n")
    rgb.save(train / "cat.1001.jpg", "PNG")
    rgb.convert("CMYK").save(train / "dog.1002.jpg", "JPEG")
    rgb.convert("L").save(train / "cat.1002.jpg", "JPEG")


@pytest.fixture
def kaggle_dir(small_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(small_data / "train", data / "train")
    (data / "test").symlink_to(small_data / "test")
    _plant_bad_files(data / "train")
    return data


def test_prepare_leaves_out_exactly_the_unreadable_files(kaggle_dir):
    result = python("-m", "src.prepare", str(kaggle_dir))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "3 left out as unreadable" in result.stdout
    assert sorted(line.split(": ")[1] for line in result.stdout.splitlines()
                  if line.startswith("left out")) == sorted(BROKEN)
    csv = pd.read_csv(kaggle_dir / "train.csv")
    assert list(csv.columns) == ["filename", "label"] and len(csv) == 243
    assert set(ODD) <= set(csv["filename"]) and not set(BROKEN) & set(csv["filename"])
    assert "cats" in result.stdout and f"{(csv['label'] == 0).sum()} cats" in result.stdout
    first = (kaggle_dir / "train.csv").read_bytes()
    assert python("-m", "src.prepare", str(kaggle_dir)).returncode == 0
    assert (kaggle_dir / "train.csv").read_bytes() == first, "running it again changes nothing"


def test_pet_images_layout_prepares_to_the_same_content(small_data, tmp_path):
    flat, folders = tmp_path / "flat", tmp_path / "pets"
    shutil.copytree(small_data / "train", flat / "train")
    for path in (flat / "train").iterdir():  # cat.7.jpg -> Cat/7.jpg, as in PetImages
        kind, number, _ = path.name.split(".")
        (folders / "train" / kind.capitalize()).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, folders / "train" / kind.capitalize() / f"{number}.jpg")
    (folders / "train" / "Cat" / "Thumbs.db").write_bytes(b"\0" * 10)
    for data in (flat, folders):
        assert python("-m", "src.prepare", str(data)).returncode == 0
    a, b = pd.read_csv(flat / "train.csv"), pd.read_csv(folders / "train.csv")
    assert len(a) == len(b) == 240 and list(a["label"]) == list(b["label"])

    def digest(data, name):
        return hashlib.sha256((data / "train" / name).read_bytes()).hexdigest()
    assert [digest(flat, n) for n in a["filename"]] == [digest(folders, n) for n in b["filename"]]


def _log_loss(submission, truth):
    merged = submission.merge(truth, on="id", suffixes=("", "_true"))
    p, y = merged["label"].to_numpy(), merged["label_true"].to_numpy()
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def test_prepare_train_predict_submission(kaggle_dir, small_data, tmp_path):
    assert python("-m", "src.prepare", str(kaggle_dir)).returncode == 0
    model = tmp_path / "model"
    result = python("train_single.py", "--data-dir", str(kaggle_dir), *LEARN, "--epochs", "3",
                    "--batch-size", "16", "--val-fraction", "0.1", *outputs(model))
    assert result.returncode == 0, result.stderr[-3000:]
    truth = pd.read_csv(small_data / TEST_LABELS)
    for extra in ([], ["--tta"]):
        out = tmp_path / f"submission{len(extra)}.csv"
        result = python("-m", "src.predict", "--data-dir", str(kaggle_dir), "--checkpoint",
                        str(model / "best.pth"), "--output", str(out), *extra)
        assert result.returncode == 0, result.stderr[-3000:]
        submission = pd.read_csv(out)
        assert list(submission.columns) == ["id", "label"]
        assert list(submission["id"]) == list(range(1, 31))
        assert submission["label"].between(0, 1, inclusive="neither").all()
        assert _log_loss(submission, truth) < 0.3, submission


def test_predict_errors(small_data, tmp_path):
    result = python("-m", "src.predict", "--data-dir", str(small_data), "--checkpoint",
                    str(tmp_path / "none.pth"))
    assert result.returncode == 2 and "not found" in result.stderr
    import torchvision
    torch.save(torchvision.models.squeezenet1_1(num_classes=2).state_dict(), tmp_path / "best.pth")
    (tmp_path / "best.json").write_text('{"arch": "resnet18", "num_classes": 2, "image_size": 32}')
    result = python("-m", "src.predict", "--data-dir", str(small_data), "--checkpoint",
                    str(tmp_path / "best.pth"))
    assert result.returncode == 2
    assert "best.pth is not a 2-class resnet18 state_dict" in result.stderr.strip().splitlines()[-1]
    assert "Traceback" not in result.stderr
