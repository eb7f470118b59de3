"""train_single.py end to end, as a user runs it, and its answers to bad input."""
import json
import os
import stat

import pytest
import torch
import torchvision

from conftest import LEARN, history, outputs, python, weights


def test_trains_learns_and_writes_every_output(small_data, tmp_path):
    out = tmp_path / "out"
    result = python("train_single.py", "--data-dir", str(small_data), *LEARN, "--epochs", "2",
                    "--batch-size", "16", *outputs(out))
    assert result.returncode == 0, result.stderr[-3000:]
    records = history(out)
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        assert {"epoch", "train_loss", "train_acc", "val_loss", "val_acc", "val_log_loss",
                "train_samples", "val_samples", "train_seconds", "val_seconds",
                "seconds"} <= record.keys()
        assert record["seconds"] == pytest.approx(record["train_seconds"] + record["val_seconds"],
                                                  abs=0.002)
        assert record["val_samples"] == 48                 # round(240 * 0.2)
        assert record["train_samples"] == 192 // 16 * 16  # full batches only
    assert records[-1]["val_acc"] >= 0.9, records
    assert "epoch 2/2" in result.stdout and "val loss" in result.stdout

    # best.pth is a plain state_dict of the torchvision model with 2 classes.
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(torch.load(out / "best.pth", weights_only=True))
    info = json.loads((out / "best.json").read_text())
    assert info["arch"] == "resnet18" and info["image_size"] == 32
    assert info["epoch"] == max(records, key=lambda r: r["val_acc"])["epoch"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(weights(out, "last.pth")) >= {"model", "optimizer", "epoch", "history", "rng"}


def test_help_lists_every_flag():
    result = python("train_single.py", "--help")
    for flag in ["--data-dir", "--epochs", "--batch-size", "--lr", "--momentum", "--image-size",
                 "--arch", "--weights", "--dropout", "--val-fraction", "--seed", "--workers",
                 "--checkpoint", "--plot", "--resume", "--amp", "--cache", "--channels-last",
                 "--compile"]:
        assert flag in result.stdout


def _fails(*args, message: str):
    result = python("train_single.py", *args)
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    last = result.stderr.strip().splitlines()[-1]
    assert message in last, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    return last


def test_missing_and_empty_data_dir(tmp_path):
    _fails("--data-dir", str(tmp_path / "nowhere"), "--weights", "none",
           message=f"data folder {tmp_path / 'nowhere'} not found")
    (tmp_path / "empty" / "train").mkdir(parents=True)
    _fails("--data-dir", str(tmp_path / "empty"), "--weights", "none", message="no labelled images")


def test_csv_naming_missing_files_and_unknown_labels(small_data, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train").symlink_to(small_data / "train")
    (data / "train.csv").write_text("filename,label\ncat.0.jpg,0\ncat.7777.jpg,0\n")
    _fails("--data-dir", str(data), "--weights", "none", message="cat.7777.jpg")
    (data / "train.csv").write_text("filename,label\ncat.0.jpg,horse\n")
    _fails("--data-dir", str(data), "--weights", "none", message="unknown label 'horse'")


def test_default_weights_offline(small_data, tmp_path):
    _fails("--data-dir", str(small_data), "--arch", "squeezenet1_1", "--image-size", "32",
           *outputs(tmp_path), message="--weights none", )


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["--epochs", "0"], "--epochs: must be at least 1"),
    (["--val-fraction", "1.5"], "--val-fraction: must be between 0 and 1"),
    (["--val-fraction", "0.001"], "--val-fraction 0.001 leaves an empty split"),
    (["--arch", "nosuchnet"], "--arch nosuchnet"),
    (["--batch-size", "500"], "--batch-size 500 x 1 process(es) = 500 is more than"),
    (["--weights", "tests/hooks/sitecustomize.py"], "is not a PyTorch state_dict"),
])
def test_bad_flags(small_data, tmp_path, flags, message):
    _fails("--data-dir", str(small_data), "--weights", "none", "--arch", "squeezenet1_1",
           "--image-size", "32", *outputs(tmp_path), *flags, message=message)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_unwritable_output_folder(small_data, tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    _fails("--data-dir", str(small_data), "--weights", "none", *outputs(folder / "sub"),
           message="--checkpoint: cannot write")


def test_output_path_under_a_file(small_data, tmp_path):
    (tmp_path / "afile").write_text("")
    _fails("--data-dir", str(small_data), "--weights", "none", "--checkpoint",
           str(tmp_path / "afile" / "best.pth"), message="--checkpoint: cannot write to folder")


def test_weights_of_another_architecture(small_data, tmp_path):
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "resnet.pth")
    _fails("--data-dir", str(small_data), "--arch", "squeezenet1_1", "--image-size", "32",
           "--weights", str(tmp_path / "resnet.pth"), *outputs(tmp_path),
           message="is not a squeezenet1_1 checkpoint with 2 or 1000 classes")
