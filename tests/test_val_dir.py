"""Your own photos: class folders with images at any depth under them (torchvision's ImageFolder
rule), --val-dir's validation folder (every image of train/ trains, every image of the folder
validates: no split), what reads it after training (--resume, --evaluate, the report, --cache,
prepare), and the refusals (--val-fraction beside it, an image on both sides)."""
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, fails_in_process, history, in_process, outputs, run_main, val_folder, validation_pass
from PIL import Image

import train_single
from src.cli import defaults
from src.datasets import load_labels, load_val_labels
from src.loaders import labelled_data
from src.metrics import EPS
from src.tools import prepare, report


@pytest.fixture(scope="module")
def val_run(module_tmp, tiny_data):
    """One epoch of train_single.py on tiny_data's 40 images, validated on its 6 test images
    laid out in class folders (--val-dir)."""
    val, files = val_folder(tiny_data, module_tmp / "val")
    out = module_tmp / "run"
    argv = [*TINY, "--data-dir", str(tiny_data), "--val-dir", str(val), *outputs(out)]
    result = run_main(train_single.main, argv)
    assert result.returncode == 0, result.stderr
    return out, val, files, argv, result.stdout


def test_the_val_dir_is_the_validation_set_and_every_train_image_trains(val_run):
    """Without --val-dir a split holds out 8 of the 40 images; with it the 40 train and the folder's
    6 images, two levels under cats/ and Dogs/, validate. The recorded accuracy and log loss are
    those of best.pth on those 6 files, computed apart from training's loaders."""
    out, val, files, _, stdout = val_run
    assert "40 train / 6 val images" in stdout, stdout
    assert f"not used: 1 file(s) in {val} that no label rule covers" in stdout
    record = history(out)[0]
    assert record["train_samples"] == 40 and record["val_samples"] == 6
    p_dog, bound = validation_pass(out / "best.pth", list(files))
    labels = np.array(list(files.values()))
    assert sorted(labels.tolist()) == [0, 1, 1, 1, 1, 1]
    assert record["val_acc"] == pytest.approx(float(np.mean((p_dog > 0.5) == labels)))
    clipped = np.clip(np.where(labels == 1, p_dog, 1 - p_dog), EPS, 1 - EPS)
    assert record["val_log_loss"] == pytest.approx(float(-np.log(clipped).mean()), abs=1e-5 + float(bound.max()))
    info = json.loads((out / "best.json").read_text())
    assert info["val_fraction"] is None and isinstance(info["val_data"], str) and info["val_data"] != info["data"]


def test_every_rank_and_the_cache_see_the_same_validation_images(val_run, tmp_path, tiny_data, monkeypatch, capsys):
    """labelled_data: rank 0's tables, the same split on every rank (val_idx: the folder's images,
    in natural order, after the 40 of train/); the pixel cache that prepare --val-dir builds ahead
    is the one a run with that --val-dir reads, holding the same pixels."""
    _, val, files, _, _ = val_run
    args = defaults(["--data-dir", str(tiny_data), "--val-dir", str(val), "--image-size", "32", "--seed", "0"])
    plain = labelled_data(args)
    assert plain.train_idx == list(range(40)) and plain.val_idx == list(range(40, 46))
    names = [plain.dataset.frame["filename"][i] for i in plain.val_idx]
    assert sorted(names) == sorted(str(path.resolve()) for path in files)
    assert [plain.dataset[i][1] for i in plain.val_idx] == [files[Path(name)] for name in names]
    data, cache = tmp_path / "data", tmp_path / "cache"
    shutil.copytree(tiny_data / "train", data / "train")
    code, out, err = in_process(prepare.main, [str(data), "--val-dir", str(val), "--cache", str(cache),
                                               "--image-size", "32"], monkeypatch, capsys)
    assert code == 0 and f"checked --val-dir {val}: 1 cats, 5 dogs" in out.splitlines(), (out, err)
    cached = labelled_data(dataclasses.replace(args, data_dir=str(data), cache=str(cache)))
    assert "reading images from the cache" in capsys.readouterr().out
    for i in (*cached.val_idx, 0):
        assert torch.equal(cached.dataset[i][0], plain.dataset[i][0])
    assert cached.val_digest == plain.val_digest


def test_resume_refuses_another_val_dir_or_none(val_run, tmp_path, monkeypatch, capsys):
    """--resume with another validation folder (one image fewer) is refused as another split is,
    and without --val-dir too: last.pth's epochs were validated on other images."""
    out, val, files, argv, _ = val_run
    other = tmp_path / "other"
    shutil.copytree(val, other)
    next(iter(other.rglob("*.jpg"))).unlink()
    resumed = [*argv, "--resume", "--epochs", "2"]
    fails_in_process(train_single.main, [*resumed[: resumed.index("--val-dir") + 1], str(other),
                                         *resumed[resumed.index("--val-dir") + 2:]], monkeypatch, capsys,
                     "was trained with --val-dir (its images) ")
    without = [word for i, word in enumerate(resumed) if word != "--val-dir" and resumed[i - 1] != "--val-dir"]
    fails_in_process(train_single.main, without, monkeypatch, capsys,
                     "was trained with --val-fraction none (--val-dir), not 0.2")
    assert len(history(out)) == 1


def test_evaluate_and_the_report_validate_on_the_val_dir(val_run, tmp_path, monkeypatch, capsys):
    """--evaluate of best.pth and the report's validation pass rebuild the same validation set
    from --val-dir (the report from the flags best.json records) and find the epoch's record."""
    out, val, files, argv, _ = val_run
    record = history(out)[0]
    code, stdout, err = in_process(train_single.main, [*argv, "--evaluate"], monkeypatch, capsys)
    assert code == 0, err
    evaluated = json.loads(stdout.strip().splitlines()[-1])
    assert evaluated["val_samples"] == 6 and evaluated["val_acc"] == record["val_acc"]
    other = tmp_path / "other-val"  # the folder less one image: not the validation set best.pth was chosen on
    shutil.copytree(val, other)
    next(other.rglob("*.jpg")).unlink()
    switched = [str(other) if word == str(val) else word for word in argv]
    fails_in_process(train_single.main, [*switched, "--evaluate"], monkeypatch, capsys,
                     "was trained with --val-dir (its images) ")
    result = run_main(report.main, [str(out), "--output", str(tmp_path / "report.html")])
    assert result.returncode == 0, result.stderr
    assert "validated best.pth on 6 images" in result.stdout
    assert f"accuracy {record['val_acc']:.4f}" in result.stdout


def test_val_dir_refuses_val_fraction_and_an_image_it_trains_on(tiny_data, tmp_path, monkeypatch, capsys):
    """--val-fraction beside --val-dir (even its default's value, given) is refused in one line;
    a validation folder holding an image of train/ (here: train/ itself) too, before any work."""
    argv = [*TINY, "--data-dir", str(tiny_data), *outputs(tmp_path / "out")]
    fails_in_process(train_single.main, [*argv, "--val-dir", str(tmp_path), "--val-fraction", "0.2"], monkeypatch,
                     capsys, "--val-dir's images are the validation set, --val-fraction splits --data-dir's: pass one")
    data = tmp_path / "data"
    (data / "train" / "cats").mkdir(parents=True)
    for source in sorted((tiny_data / "train").glob("*.jpg")):
        kind = "cats" if source.name.startswith("cat") else "dogs"
        (data / "train" / kind).mkdir(exist_ok=True)
        shutil.copy(source, data / "train" / kind / source.name)
    line = fails_in_process(train_single.main, [*TINY, "--data-dir", str(data), "--val-dir",
                                                str(data / "train" / "cats" / ".."), *outputs(tmp_path / "out")],
                            monkeypatch, capsys, "holds 40 image(s) that")
    assert "a validation image must not be a training one" in line
    assert not (tmp_path / "out" / "history.json").exists()


def test_prepare_refuses_a_val_dir_of_training_images_before_it_writes_train_csv(tiny_data, tmp_path, monkeypatch,
                                                                                 capsys):
    """prepare --val-dir DATA/train (the folder it trains on) was refused only after it had
    rewritten train.csv: a refused command changes nothing, a train.csv there before is as it was
    (here: one with a row less than a scan would write), none is made where there was none."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data / "train", data / "train")
    argv = [str(data), "--val-dir", str(data / "train")]
    code, out, err = in_process(prepare.main, argv, monkeypatch, capsys)
    assert code == 2 and err.count("\n") == 1 and "holds 40 image(s) that" in err, (out, err)
    assert not (data / "train.csv").exists(), out
    code, out, err = in_process(prepare.main, [str(data)], monkeypatch, capsys)
    assert code == 0, err
    before = "".join((data / "train.csv").read_text().splitlines(keepends=True)[:-1])
    (data / "train.csv").write_text(before)
    code, out, err = in_process(prepare.main, argv, monkeypatch, capsys)
    assert code == 2 and "a validation image must not be a training one" in err, (out, err)
    assert (data / "train.csv").read_text() == before and "wrote" not in out


def test_val_dir_refuses_a_hard_link_or_a_copy_of_a_training_image_and_keeps_an_equal_sized_other(
        tiny_data, tmp_path, monkeypatch, capsys):
    """The overlap is by content: a hard link to a train/ image and a byte copy of another (under new
    names) are refused, named; a BMP of train/'s size with other pixels is not an overlap."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    train = sorted((data / "train").glob("*.jpg"))
    Image.new("RGB", (40, 40), (200, 10, 10)).save(data / "train" / "cat.900.bmp")
    val = tmp_path / "val"
    val.mkdir()
    for source in sorted((tiny_data / "train").glob("*.jpg"))[:3] + sorted((tiny_data / "train").glob("dog*.jpg"))[:3]:
        shutil.copy(source, val / f"{source.stem.split('.')[0]}.{700 + len(list(val.iterdir()))}.jpg")
    for name in list(val.iterdir()):  # other images of the same classes: not train/'s bytes
        Image.open(name).transpose(Image.Transpose.FLIP_TOP_BOTTOM).save(name, quality=90)
    Image.new("RGB", (40, 40), (10, 200, 10)).save(val / "cat.901.bmp")  # train/'s BMP's size, other pixels
    table = load_labels(data, show_progress=False)
    assert (val / "cat.901.bmp").stat().st_size == (data / "train" / "cat.900.bmp").stat().st_size
    assert len(load_val_labels(val, data, table, show_progress=False)) == 7
    (val / "dog.800.jpg").hardlink_to(train[-1])
    argv = [*TINY, "--data-dir", str(data), "--val-dir", str(val), *outputs(tmp_path / "out")]
    line = fails_in_process(train_single.main, argv, monkeypatch, capsys, "holds 1 image(s) that")
    assert "(dog.800.jpg)" in line
    shutil.copyfile(train[0], val / "cat.801.jpg")
    line = fails_in_process(train_single.main, argv, monkeypatch, capsys, "holds 2 image(s) that")
    assert "cat.801.jpg" in line and "dog.800.jpg" in line and "a validation image must not be a training one" in line
    assert not (tmp_path / "out").exists() or not (tmp_path / "out" / "history.json").exists()
