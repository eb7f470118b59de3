"""Resume after a stop, a worker killed under torchrun --max-restarts, crashes during a save,
Ctrl-C, and bad input found during training."""
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import src.checkpoint as checkpoint
from src.errors import UserError
from conftest import (EXACT, LEARN, ROOT, history, max_relative_difference, outputs, python, run,
                      weights)

TOLERANCE = 1e-5  # as in test_modes.py: DDP agrees with one process to about 1e-7
HOOKS = {"PYTHONPATH": str(ROOT / "tests" / "hooks")}
TORCHRUN = ["torchrun", "--standalone", "--nproc_per_node=2"]


def _flags(data, out, batch, epochs):
    return ["--data-dir", str(data), *EXACT, "--val-fraction", "0.5025", "--epochs", str(epochs),
            "--batch-size", str(batch), *outputs(out)]


TIMINGS = {"train_seconds", "val_seconds", "seconds"}


def _without_seconds(records):
    return [{k: v for k, v in r.items() if k not in TIMINGS} for r in records]


def _assert_same_end(out, reference):
    assert max_relative_difference(weights(out), weights(reference)) < TOLERANCE
    assert max_relative_difference(weights(out, "last.pth")["model"],
                                   weights(reference, "last.pth")["model"]) < TOLERANCE
    got, want = _without_seconds(history(out)), _without_seconds(history(reference))
    assert [r["epoch"] for r in got] == [1, 2]
    for a, b in zip(got, want):
        assert a == pytest.approx(b, rel=TOLERANCE)


@pytest.fixture(scope="module")
def straight(exact_data, module_tmp):
    """Two epochs of train_single.py --batch-size 20, never stopped."""
    out = module_tmp / "straight"
    result = python("train_single.py", *_flags(exact_data, out, 20, 2))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_single_resume_equals_straight_run(exact_data, straight, tmp_path):
    assert python("train_single.py", *_flags(exact_data, tmp_path, 20, 1)).returncode == 0
    result = python("train_single.py", *_flags(exact_data, tmp_path, 20, 2), "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "epoch 2/2" in result.stdout
    assert "epoch 1/2" not in result.stdout
    _assert_same_end(tmp_path, straight)


def test_ddp_resume_equals_straight_run(exact_data, straight, tmp_path):
    assert run([*TORCHRUN, "train_ddp.py", *_flags(exact_data, tmp_path, 10, 1)]).returncode == 0
    result = run([*TORCHRUN, "train_ddp.py", *_flags(exact_data, tmp_path, 10, 2), "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("resumed from") == 1
    _assert_same_end(tmp_path, straight)


def test_resume_with_other_flags_is_refused(exact_data, straight, tmp_path):
    assert python("train_single.py", *_flags(exact_data, tmp_path, 20, 1)).returncode == 0
    result = python("train_single.py", *_flags(exact_data, tmp_path, 10, 2), "--resume")
    assert result.returncode == 2
    assert "--batch-size (x processes) 20, not 10" in result.stderr


def test_killed_worker_is_restarted_and_the_job_finishes_the_same(exact_data, straight, tmp_path):
    """SIGKILL rank 1 at its 7th step (epoch 2 of 2, 5 steps an epoch); torchrun restarts the
    workers, which resume from last.pth of epoch 1 on their own."""
    restartable = [*TORCHRUN, "--max-restarts=1"]
    result = run([*restartable, "train_ddp.py", *_flags(exact_data, tmp_path, 10, 2)],
                 env={**HOOKS, "KILL_AT_STEP": "7", "KILL_RANK": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "after epoch 1" in result.stdout
    assert "exitcode: -9" in result.stderr  # torchrun saw the SIGKILL
    _assert_same_end(tmp_path, straight)


def test_a_dead_rank_ends_the_job_within_the_bound(exact_data, tmp_path):
    """Without restarts, one rank's death ends the whole job, non-zero, within 60 s."""
    start = time.time()
    result = run([*TORCHRUN, "train_ddp.py", *_flags(exact_data, tmp_path, 10, 2)],
                 env={**HOOKS, "KILL_AT_STEP": "3", "KILL_RANK": "1"}, timeout=300)
    assert result.returncode != 0
    assert time.time() - start < 60 + 30  # 30 s of start-up on a loaded 2-core machine


@pytest.mark.parametrize("failure", [
    OSError(28, "No space left on device"),
    # what torch.save raised when the CI machine's disk filled up
    RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 9882688 vs 9882576"),
])
def test_crash_during_a_save_keeps_the_previous_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "best.pth"
    checkpoint.atomic_torch_save({"w": torch.ones(3)}, path)

    def dies_half_way(obj, file):
        file.write(b"half a checkpoint")
        raise failure
    monkeypatch.setattr(checkpoint.torch, "save", dies_half_way)
    with pytest.raises(UserError) as caught:
        checkpoint.atomic_torch_save({"w": torch.zeros(3)}, path)
    message = str(caught.value)
    assert message.startswith(f"cannot write {path} (") and "the previous best.pth is intact" in message
    assert ("No space left on device" if isinstance(failure, OSError) else "unexpected pos") in message
    assert "\n" not in message
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["best.pth"], "no temporary file left behind"


@pytest.fixture
def small_disk(tmp_path):
    """A 300 MB tmpfs; resize(n) changes its size. Needs root with mount rights, as on CI."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=300m", "tmpfs", str(disk)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount rights)")

    def resize(size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
    yield disk, resize
    subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_epoch(small_data, small_disk):
    """A real full disk: epoch 2 cannot be saved; the error names the file, epoch 1's files
    stay byte for byte, and --resume finishes once there is room."""
    disk, resize = small_disk
    flags = ["--data-dir", str(small_data), *LEARN, "--batch-size", "40", *outputs(disk)]
    assert python("train_single.py", *flags, "--epochs", "1").returncode == 0
    saved = {p.name: p.read_bytes() for p in disk.iterdir()}
    resize(shutil.disk_usage(disk).used + 2**20)  # 1 MB to spare: less than any checkpoint

    result = python("train_single.py", *flags, "--epochs", "2", "--resume")
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: cannot write {disk}/"), error
    assert ".pth (No space left on device; " in error and "is intact" in error, error
    assert "Traceback" not in result.stderr
    assert {p.name: p.read_bytes() for p in disk.iterdir()} == saved, "epoch 1's files changed"

    resize(300 * 2**20)
    result = python("train_single.py", *flags, "--epochs", "2", "--resume")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["epoch"] for r in history(disk)] == [1, 2]


def test_ctrl_c_stops_cleanly_and_keeps_the_last_epoch(exact_data, tmp_path):
    command = [sys.executable, "train_single.py", *_flags(exact_data, tmp_path, 2, 50)]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.time() + 300
    while not (tmp_path / "history.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr and "Traceback" not in stderr
    state = weights(tmp_path, "last.pth")
    assert state["epoch"] == len(history(tmp_path)) >= 1


def test_image_that_turns_unreadable_during_training(exact_data, tmp_path):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    names = sorted(p.name for p in (exact_data / "train").iterdir())
    for name in names:
        (data / "train" / name).symlink_to(exact_data / "train" / name)
    (data / "train.csv").write_text("filename,label\n" + "".join(
        f"{n},{int(n.startswith('dog'))}\n" for n in names))
    (data / "train" / names[5]).unlink()
    (data / "train" / names[5]).write_bytes(b"\xff\xd8 broken since the CSV was made")
    result = python("train_single.py", *_flags(data, tmp_path / "out", 20, 1), "--workers", "1")
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read image") and names[5] in last
    assert "src.prepare" in last


def test_more_processes_than_validation_images(exact_data, tmp_path):
    flags = _flags(exact_data, tmp_path, 10, 1)
    flags[flags.index("0.5025")] = "0.004"  # 1 validation image for 2 ranks
    result = run([*TORCHRUN, "train_ddp.py", *flags])
    assert result.returncode != 0
    assert "error: 2 processes but only 1 validation images" in result.stderr
    assert "exitcode  : 2" in result.stderr  # each rank, as torchrun reports it
