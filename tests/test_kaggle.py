"""The Kaggle workflow: prepare -> train -> predict -> submission.csv, scored by log loss."""
import hashlib
import io
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import LEARN, fails, fails_in_process, in_process, outputs, python, run_main
from PIL import Image

import train_single
from src.datasets import open_rgb
from src.inference import load_checkpoint, submission_text
from src.tools import predict, prepare
from src.tools.synthetic import TEST_LABELS
from src.transforms import image_transform, normalize

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


def test_prepare_leaves_out_exactly_the_unreadable_files(kaggle_dir, monkeypatch, capsys):
    code, out, err = in_process(prepare.main, [str(kaggle_dir)], monkeypatch, capsys)
    assert code == 0, err
    assert "3 left out as unreadable" in out
    assert sorted(line.split(": ")[1] for line in out.splitlines() if line.startswith("left out")) == sorted(BROKEN)
    csv = pd.read_csv(kaggle_dir / "train.csv")
    assert list(csv.columns) == ["filename", "label"] and len(csv) == 243
    assert set(ODD) <= set(csv["filename"]) and not set(BROKEN) & set(csv["filename"])
    assert "cats" in out and f"{(csv['label'] == 0).sum()} cats" in out
    first = (kaggle_dir / "train.csv").read_bytes()
    assert in_process(prepare.main, [str(kaggle_dir)], monkeypatch, capsys)[0] == 0
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
        prepare.prepare(data, show_progress=False)
    a, b = pd.read_csv(flat / "train.csv"), pd.read_csv(folders / "train.csv")
    assert len(a) == len(b) == 240 and list(a["label"]) == list(b["label"])

    def digest(data, name):
        return hashlib.sha256((data / "train" / name).read_bytes()).hexdigest()
    assert [digest(flat, n) for n in a["filename"]] == [digest(folders, n) for n in b["filename"]]


def _log_loss(submission, truth):
    merged = submission.merge(truth, on="id", suffixes=("", "_true"))
    p, y = merged["label"].to_numpy(), merged["label_true"].to_numpy()
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


@pytest.fixture(scope="module")
def trained(small_data, module_tmp):
    """prepare -> train: a Kaggle-layout folder with planted bad files and the model trained on it."""
    data = module_tmp / "data"
    shutil.copytree(small_data / "train", data / "train")
    (data / "test").symlink_to(small_data / "test")
    _plant_bad_files(data / "train")
    prepare.prepare(data, show_progress=False)
    model = module_tmp / "model"
    result = run_main(train_single.main, ["--data-dir", str(data), *LEARN, "--epochs", "3", "--batch-size", "16",
                                          "--val-fraction", "0.1", *outputs(model)])
    assert result.returncode == 0, result.stderr[-3000:]
    return data, model


def _predict(data, model, out, *extra, monkeypatch=None, capsys=None):
    """src.tools.predict through the command line, or in this process given monkeypatch and capsys."""
    argv = ["--data-dir", str(data), "--checkpoint", str(model / "best.pth"), "--output", str(out), *extra]
    if monkeypatch is None:
        result = python("-m", "src.tools.predict", *argv)
        code, stdout, stderr = result.returncode, result.stdout, result.stderr
    else:
        code, stdout, stderr = in_process(predict.main, argv, monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    assert f"wrote 30 predictions to {out}" in stdout
    submission = pd.read_csv(out)
    assert list(submission.columns) == ["id", "label"]
    assert list(submission["id"]) == list(range(1, 31))
    return submission


def test_prepare_train_predict_submission_scores(trained, small_data, tmp_path):
    data, model = trained
    submission = _predict(data, model, tmp_path / "submission.csv")
    assert submission["label"].between(0.005, 0.995).all()
    assert _log_loss(submission, pd.read_csv(small_data / TEST_LABELS)) < 0.3, submission


def test_tta_averages_each_image_with_its_mirror(trained, tmp_path, monkeypatch, capsys):
    """--tta: each p(dog) is the mean of the image's and its mirror image's, computed here from
    the checkpoint and the test JPEGs; the submission differs from the plain one."""
    data, model_dir = trained
    plain = _predict(data, model_dir, tmp_path / "plain.csv", monkeypatch=monkeypatch, capsys=capsys)
    tta = _predict(data, model_dir, tmp_path / "tta.csv", "--tta", monkeypatch=monkeypatch, capsys=capsys)
    assert not np.allclose(plain["label"], tta["label"], atol=1e-4)
    model, info = load_checkpoint(model_dir / "best.pth")
    images = torch.stack([image_transform(32)(open_rgb(data / "test" / f"{i}.jpg", draft_size=32))
                          for i in range(1, 31)])
    with torch.no_grad():
        p = model(normalize(images)).softmax(dim=1)[:, 1]
        mirrored = model(normalize(images.flip(dims=[3]))).softmax(dim=1)[:, 1]
    expected = ((p + mirrored) / 2).clamp(0.005, 0.995).numpy()
    assert np.allclose(tta["label"], expected, atol=2e-6)
    assert np.allclose(plain["label"], p.clamp(0.005, 0.995).numpy(), atol=2e-6)


def test_the_submission_is_clipped_to_kaggles_bounds():
    """One confident mistake costs -log(1e-9) = 20.7 unclipped, 5.3 clipped."""
    text = submission_text([3, 1, 2], torch.tensor([1e-9, 0.5, 1.0]))
    assert text == "id,label\n3,0.005000\n1,0.500000\n2,0.995000\n"


def test_predict_errors(small_data, tmp_path, monkeypatch, capsys):
    def predict_fails(message, *argv):
        fails_in_process(predict.main, list(argv), monkeypatch, capsys, message)
    predict_fails("not found", "--data-dir", str(small_data), "--checkpoint", str(tmp_path / "none.pth"))
    import torchvision
    torch.save(torchvision.models.squeezenet1_1(num_classes=2).state_dict(), tmp_path / "best.pth")
    (tmp_path / "best.json").write_text('{"arch": "resnet18", "num_classes": 2, "image_size": 32, "classes": ["cat", '
                                        '"dog"], "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}')
    predict_fails("best.pth is not a 2-class resnet18 state_dict", "--data-dir", str(small_data),
                  "--checkpoint", str(tmp_path / "best.pth"))
    predict_fails("predict.py: error: argument --batch-size: must be at least 1", "--batch-size", "0")


def test_predict_detects_a_best_json_of_another_best_pth(trained, tmp_path):
    """best.pth and best.json are two files: a crash between their writes leaves a pair that
    predict must not mix up. best.json holds best.pth's sha256."""
    data, model_dir = trained
    shutil.copytree(model_dir, tmp_path / "model")
    state = torch.load(tmp_path / "model" / "best.pth", weights_only=True)
    state["fc.bias"] += 1
    torch.save(state, tmp_path / "model" / "best.pth")
    result = run_main(predict.main, ["--data-dir", str(data), "--checkpoint", str(tmp_path / "model" / "best.pth")])
    fails(result, "is not the file that")
