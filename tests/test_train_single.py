"""train_single.py end to end, as a user runs it, and its answers to bad input."""
import io
import json

import pytest
import torch
import torchvision
from conftest import (
    LEARN,
    fails,
    fails_in_process,
    history,
    in_process,
    outputs,
    python,
    weights,
)

import train_single
from src.history import best_record
from src.plot import history_figure, plot_history


@pytest.fixture(scope="module")
def learned(small_data, module_tmp):
    """Two epochs of ResNet-18 (lr 0.003: measured val acc 0.98 to 1.0 at epoch 2 for seeds 1-3 and
    42; at 0.01, 0.83) from the command line, as docs/inference.md shows."""
    out = module_tmp / "out"
    result = python("train_single.py", "--data-dir", str(small_data), *LEARN, "--epochs", "2",
                    "--batch-size", "16", *outputs(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


def test_trains_learns_and_writes_every_output(learned):
    out, result = learned
    records = history(out)
    assert [r["epoch"] for r in records] == [1, 2]
    for record in records:
        assert set(record) == {"epoch", "train_loss", "train_acc", "train_samples", "val_loss", "val_acc",
                               "val_log_loss", "val_samples", "lr", "train_seconds", "data_wait_seconds",
                               "val_seconds", "seconds"}
        assert record["seconds"] == pytest.approx(record["train_seconds"] + record["val_seconds"], abs=0.002)
        assert 0 <= record["data_wait_seconds"] <= record["train_seconds"]
        assert record["val_samples"] == 48                 # round(240 * 0.2)
        assert record["train_samples"] == 192 // 16 * 16  # full batches only
    assert records[-1]["val_acc"] >= 0.9, records
    assert records[-1]["val_loss"] < records[0]["val_loss"]
    assert "epoch 2/2" in result.stdout and "val loss" in result.stdout

    # best.pth is a plain state_dict of the torchvision model with 2 classes.
    model = torchvision.models.resnet18(num_classes=2)
    model.load_state_dict(torch.load(out / "best.pth", weights_only=True))
    info = json.loads((out / "best.json").read_text())
    assert info["arch"] == "resnet18" and info["image_size"] == 32
    assert info["epoch"] == best_record(records, "val_acc")["epoch"]
    assert set(weights(out, "last.pth")) == {"model", "optimizer", "scaler", "schedule", "average", "epoch",
                                             "step", "history", "info"}


def test_the_plot_holds_both_curves_of_every_epoch(learned):
    out, _ = learned
    records = history(out)
    figure = history_figure(records)
    for axes, key in zip(figure.axes, ("acc", "loss")):
        lines = axes.get_lines()
        assert [line.get_label() for line in lines] == [f"Training {'accuracy' if key == 'acc' else 'loss'}",
                                                        f"Validation {'accuracy' if key == 'acc' else 'loss'}"]
        for line, split in zip(lines, ("train", "val")):
            assert list(line.get_xdata()) == [1, 2]
            assert list(line.get_ydata()) == [r[f"{split}_{key}"] for r in records]
    # The PNG on disk is that figure, byte for byte (matplotlib's PNG has no time stamp).
    drawn = io.BytesIO()
    plot_history(records, drawn)
    assert (out / "curves.png").read_bytes() == drawn.getvalue()


FLAGS = ["--data-dir", "--epochs", "--batch-size", "--lr", "--momentum", "--image-size", "--arch", "--weights",
         "--dropout", "--val-fraction", "--val-dir", "--seed", "--workers", "--checkpoint", "--plot", "--resume",
         "--save-every-steps", "--cache",
         "--channels-last", "--compile", "--deterministic", "--augment", "--auto-augment", "--ra-magnitude",
         "--augmix-severity", "--random-erase", "--mixup-alpha", "--cutmix-alpha", "--optimizer", "--weight-decay",
         "--lr-schedule", "--warmup-epochs", "--label-smoothing", "--clip-grad-norm", "--accumulate", "--sync-bn",
         "--ema-decay", "--best-by",
         "--freeze", "--freeze-epochs", "--log-dir", "--log-every", "--profile", "--track", "--tracking-uri",
         "--evaluate", "--overwrite"]


def help_entries(text: str) -> list[str]:
    """The options that argparse's help describes: each entry's line starts with two spaces and
    its options ("  -h, --help  ...", "  --lr LR  ..."); its text, and wrapped lines, come after."""
    flags = []
    for line in text.splitlines():
        if line.startswith("  -"):
            flags += [part.split(" ")[0] for part in line[2:].split("  ")[0].split(", ")]
    return flags


@pytest.mark.parametrize("script", ["train_single", "train_dp", "train_ddp", "train_accelerate"])
def test_help_lists_every_flag(script, monkeypatch, capsys):
    """Each flag has its own entry (a search for "--freeze" in the text would also find
    "--freeze-epochs", and "--accumulate" in other flags' help)."""
    import importlib
    code, out, _ = in_process(importlib.import_module(script).main, ["--help"], monkeypatch, capsys)
    assert code == 0
    amp = [] if script == "train_accelerate" else ["--amp"]  # accelerate takes accelerate's setting
    timeout = ["--dist-timeout"] if script in ("train_ddp", "train_accelerate") else []  # distributed only
    assert sorted(help_entries(out)) == sorted(["-h", "--help", *FLAGS, *amp, *timeout])


def _main_fails(monkeypatch, capsys, *argv, message: str) -> str:
    """train_single.main() in this process, as `python train_single.py ARGV` runs it."""
    return fails_in_process(train_single.main, list(argv), monkeypatch, capsys, message)


def test_missing_and_empty_data_dir(tmp_path, monkeypatch, capsys):
    _main_fails(monkeypatch, capsys, "--data-dir", str(tmp_path / "nowhere"), "--weights", "none",
                *outputs(tmp_path), message=f"data folder {tmp_path / 'nowhere'} not found")
    (tmp_path / "empty" / "train").mkdir(parents=True)
    _main_fails(monkeypatch, capsys, "--data-dir", str(tmp_path / "empty"), "--weights", "none",
                *outputs(tmp_path), message="no labelled images")


def test_csv_naming_missing_files_unknown_labels_or_an_image_twice(small_data, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train").symlink_to(small_data / "train")
    for text, message in [("cat.0.jpg,0\ncat.7777.jpg,0\n", "cat.7777.jpg"),
                          ("cat.0.jpg,horse\n", "unknown label 'horse'"),
                          ("cat.0.jpg,0\ndog.1.jpg,1\ncat.0.jpg,0\n", "lists cat.0.jpg more than once")]:
        (data / "train.csv").write_text("filename,label\n" + text)
        _main_fails(monkeypatch, capsys, "--data-dir", str(data), "--weights", "none", *outputs(tmp_path),
                    message=message)


@pytest.mark.parametrize("flags, message", [
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["--epochs", "0"], "--epochs: must be at least 1"),
    (["--val-fraction", "1.5"], "--val-fraction: must be in (0, 1)"),
    (["--dropout", "1.5"], "--dropout: must be in [0, 1)"),
    (["--val-fraction", "0.001"], "--val-fraction 0.001 leaves an empty split"),
    (["--arch", "nosuchnet"], "--arch nosuchnet"),
    (["--batch-size", "500"], "--batch-size 500 x 1 process(es) = 500 is more than"),
    (["--batch-size", "100", "--accumulate", "2"], "--batch-size 100 x 1 process(es) x 2 (--accumulate) = 200"),
    (["--weights", "tests/hooks/sitecustomize.py"], "is not a PyTorch state_dict"),
])
def test_bad_flags(small_data, tmp_path, flags, message, monkeypatch, capsys):
    _main_fails(monkeypatch, capsys, "--data-dir", str(small_data), "--weights", "none", "--arch",
                "squeezenet1_1", "--image-size", "32", "--workers", "0", *outputs(tmp_path), *flags,
                message=message)


def test_a_bad_flag_through_the_command_line(small_data, tmp_path):
    result = python("train_single.py", "--data-dir", str(small_data), "--dropout", "1.5", *outputs(tmp_path))
    fails(result, "train_single.py: error: argument --dropout: must be in [0, 1), got 1.5")
    assert result.stderr.count("\n") == 1


_COMMON = ["--weights", "none", "--arch", "squeezenet1_1", "--image-size", "32"]


def test_a_read_only_output_folder_stops_before_training(small_data, tmpfs, monkeypatch, capsys):
    """A read-only file system stops root, where chmod would not."""
    read_only_folder = tmpfs("locked", "ro,size=1m")
    _main_fails(monkeypatch, capsys, "--data-dir", str(small_data), *_COMMON, *outputs(read_only_folder / "sub"),
                message=f"--checkpoint: cannot write to folder {read_only_folder / 'sub'} (Read-only file system)")


def test_unwritable_output_folders_stop_before_training(small_data, tmp_path, monkeypatch, capsys):
    """Checked by trying before any training: a path under a file, and /proc, where os.access
    tells root yes but nothing can be created."""
    common = ["--data-dir", str(small_data), *_COMMON]
    (tmp_path / "afile").write_text("")
    _main_fails(monkeypatch, capsys, *common, "--checkpoint", str(tmp_path / "afile" / "best.pth"),
                message="--checkpoint: cannot write to folder")
    _main_fails(monkeypatch, capsys, *common, "--checkpoint", "/proc/dogcat/best.pth",
                message="--checkpoint: cannot write to folder /proc/dogcat")
    _main_fails(monkeypatch, capsys, *common, "--plot", "/proc/curves.png", "--checkpoint",
                str(tmp_path / "out" / "best.pth"), message="--plot: cannot write to folder /proc")


def test_weights_of_another_architecture(small_data, tmp_path, monkeypatch, capsys):
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), tmp_path / "resnet.pth")
    _main_fails(monkeypatch, capsys, "--data-dir", str(small_data), "--arch", "squeezenet1_1",
                "--image-size", "32", "--weights", str(tmp_path / "resnet.pth"), *outputs(tmp_path),
                message="is not a squeezenet1_1 checkpoint with 2 or 1000 classes")
