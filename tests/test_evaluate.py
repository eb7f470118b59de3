"""--evaluate in each of the four scripts: the checkpoint of a shared run, validated again on the
same split without training, reproduces history.json's figures of that epoch (exact distributed
validation under torchrun and accelerate), prints its record once and writes nothing."""
import json
import os
import shutil
import subprocess

import pytest
import torch
import torchvision
from conftest import (
    BIN,
    HOOKS,
    LAUNCH,
    ROOT,
    assert_reproduces,
    copy_run,
    evaluate_flags,
    evaluated_record,
    fails_in_process,
    files_and_times,
    history,
    in_process,
    mode_run,
)

import train_dp
import train_single

# A training command's recipe, given beside --evaluate
RECIPE = ["--lr", "0.5", "--epochs", "3", "--augment", "--mixup-alpha", "0.2", "--label-smoothing", "0.1",
          "--ema-decay", "0.9", "--optimizer", "adamw", "--lr-schedule", "cosine"]


@pytest.fixture(scope="module")
def epochs_differ(runs):
    """best.pth is epoch 1 and last.pth epoch 2 in the shared runs, with other validation figures:
    a test that loads the wrong one fails."""
    for mode in ("single", "dp", "ddp", "accelerate"):
        out = mode_run(runs, mode)[0]
        assert json.loads((out / "best.json").read_text())["epoch"] == 1
        first, second = history(out)
        assert first["val_log_loss"] != pytest.approx(second["val_log_loss"], rel=1e-3)


@pytest.mark.parametrize("script, weights, epoch", [(train_single, "best.pth", 1),
                                                    (train_single, "last.pth", 2),
                                                    (train_dp, "best.pth", 1)])
def test_evaluate_reproduces_the_epoch_and_writes_nothing(script, weights, epoch, runs, epochs_differ,
                                                          tmp_path, monkeypatch, capsys):
    """In this process (the same one-process computation as the script's): --checkpoint
    best.pth (checked against best.json), or --weights last.pth; the training command's recipe
    flags beside --evaluate change nothing (docs/inference.md)."""
    mode = "single" if script is train_single else "dp"
    out = copy_run(mode, runs, tmp_path / "out")
    before, cwd_before = files_and_times(out), tmp_path.stat().st_mtime_ns
    extra = ["--weights", str(out / "last.pth")] if weights == "last.pth" else []
    extra += RECIPE
    monkeypatch.chdir(tmp_path)  # where the plot would land (training_results.png)
    code, stdout, stderr = in_process(script.main, ["--data-dir", str(runs.exact_data),
                                                    *evaluate_flags(mode, out, *extra)], monkeypatch, capsys)
    assert code == 0, stderr
    assert f"validated {out / weights}" + (" (epoch 1)" if weights == "best.pth" else ":") in stdout
    assert_reproduces(evaluated_record(stdout), out, epoch)
    assert files_and_times(out) == before and sorted(os.listdir(tmp_path)) == ["out"]
    assert tmp_path.stat().st_mtime_ns == cwd_before


def test_evaluate_under_torchrun_and_accelerate_is_exact_and_rank_0_alone_speaks(runs, epochs_differ, tmp_path):
    """Two processes each, the real launchers, run at the same time: DDP validates best.pth,
    accelerate last.pth (--weights); each rank takes its shard and the sums are exact, so the
    figures are those of the run's own epoch; one rank prints; no process renames a file into
    place (WRITE_LOG logs every os.replace) and the folders are unchanged."""
    started = {}
    for mode, extra in (("ddp", []), ("accelerate", ["--weights", "{out}/last.pth"])):
        out = copy_run(mode, runs, tmp_path / mode)
        env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": HOOKS,
               "WRITE_LOG": str(tmp_path / f"{mode}.writes"), "HF_HOME": str(tmp_path / "hf"),
               "ACCELERATE_USE_CPU": "1", "PYTHONUNBUFFERED": "1"}
        flags = [flag.replace("{out}", str(out)) for flag in evaluate_flags(mode, out, *extra)]
        started[mode] = (out, files_and_times(out), subprocess.Popen(
            [*LAUNCH[mode](), "--data-dir", str(runs.exact_data), *flags, "--plot", str(tmp_path / "plot.png")],
            cwd=ROOT, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for mode, (out, before, process) in started.items():
        stdout, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
        weights, epoch = ("best.pth", 1) if mode == "ddp" else ("last.pth", 2)
        assert f"validated {out / weights}" + (" (epoch 1)" if weights == "best.pth" else ":") in stdout
        assert "on 2 x cpu" in stdout
        assert_reproduces(evaluated_record(stdout), out, epoch)
        assert files_and_times(out) == before
    assert set(os.listdir(tmp_path)) <= {"accelerate", "ddp", "hf"}  # no plot, no log of a write


@pytest.fixture
def single_out(runs, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(mode_run(runs, "single")[0], out)
    return out


def _fails(runs, out, monkeypatch, capsys, message, *extra):
    argv = ["--data-dir", str(runs.exact_data), *evaluate_flags("single", out), *extra]
    return fails_in_process(train_single.main, argv, monkeypatch, capsys, message)


def test_evaluate_refuses_a_checkpoint_of_other_flags(runs, single_out, monkeypatch, capsys):
    """best.json says what the checkpoint is and which split it was validated on."""
    line = _fails(runs, single_out, monkeypatch, capsys, "was trained with --arch squeezenet1_1, not resnet18",
                  "--arch", "resnet18")
    assert "pass the flags it was trained with" in line
    _fails(runs, single_out, monkeypatch, capsys, "was trained with --seed 42, not 7", "--seed", "7")
    _fails(runs, single_out, monkeypatch, capsys, "was trained with --image-size 64, not 32", "--image-size", "32")
    # Another split of the same images, or other images: the validation set would hold training images.
    _fails(runs, single_out, monkeypatch, capsys, "was trained with --val-fraction 0.5025, not 0.3",
           "--val-fraction", "0.3")


def test_evaluate_refuses_a_checkpoint_of_other_images(runs, single_out, small_data, monkeypatch, capsys):
    argv = ["--data-dir", str(small_data), *evaluate_flags("single", single_out)]
    fails_in_process(train_single.main, argv, monkeypatch, capsys, "was trained with --data-dir (its images) ")


def test_evaluate_refuses_a_best_json_of_another_best_pth(runs, single_out, monkeypatch, capsys):
    state = torch.load(single_out / "best.pth", weights_only=True)
    state["classifier.1.bias"] += 1
    torch.save(state, single_out / "best.pth")
    _fails(runs, single_out, monkeypatch, capsys, "is not the file that")


def test_evaluate_refuses_weights_of_another_class_count_or_arch(runs, single_out, monkeypatch, capsys):
    """ImageNet's 1000 classes would get a new, random head: nothing to validate."""
    torch.save(torchvision.models.squeezenet1_1(num_classes=1000).state_dict(), single_out / "imagenet.pth")
    torch.save(torchvision.models.resnet18(num_classes=2).state_dict(), single_out / "resnet.pth")
    for name in ("imagenet.pth", "resnet.pth"):
        _fails(runs, single_out, monkeypatch, capsys, f"{name} is not a 2-class squeezenet1_1 state_dict",
               "--weights", str(single_out / name))
    _fails(runs, single_out, monkeypatch, capsys, "--weights " + str(single_out / "none.pth") + ": no such file",
           "--weights", str(single_out / "none.pth"))


@pytest.mark.parametrize("flag", [["--resume"], ["--log-dir", "logs"], ["--cache", "cache"], ["--profile"],
                                  ["--track", "mlflow"]])
def test_evaluate_refuses_flags_that_write(flag, runs, single_out, monkeypatch, capsys):
    _fails(runs, single_out, monkeypatch, capsys, f"--evaluate trains nothing and writes nothing: drop {flag[0]}",
           *flag)
