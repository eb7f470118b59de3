"""Resume after Ctrl-C (at a step, or during a checkpoint's rename), with dropout on; a worker
killed under torchrun --max-restarts; a dead rank; crashes during a save; a full disk; bad input
found during training. DDP's --resume on nodes without a shared disk: test_modes.py. Stops on
signals under torchrun, step checkpoints in every mode: test_stopping.py."""
import contextlib
import dataclasses
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (
    EXACT,
    HOOKS,
    LAUNCH,
    RESUMABLE,
    ROOT,
    VAL,
    B,
    assert_same_best,
    fails,
    fails_in_process,
    free_port,
    history,
    last_line,
    mode_run,
    outputs,
    python,
    remount,
    resumable_run,
    run,
    run_main,
    same_end,
    stop_line,
    stops_straight,
    weights,
)

import src.checkpoint as checkpoint
import src.outputs as atomic
import train_single
from src.cli import parse_args
from src.config import Config
from src.errors import EXIT_STOPPED, UserError

TORCHRUN = LAUNCH["ddp"]()[:-1]  # without the script
# docs/reliability.md: without restarts, one dead rank ends the whole job within this many seconds.
DEAD_RANK_BOUND = 60


def _flags(data, out, batch, epochs, *extra):
    return ["--data-dir", str(data), *RESUMABLE, *VAL, "--epochs", str(epochs), "--batch-size", str(batch),
            *outputs(out), *extra]


@pytest.fixture(scope="module")
def straight(runs):
    """Two epochs of train_single.py --batch-size 2B with dropout, never stopped."""
    return resumable_run(runs, "single")[0]


def _interrupted(result, tmp_path, epoch, step):
    """Exit 130 with its message, and last.pth as it was: at `step` optimizer steps into `epoch`."""
    assert result.returncode == 130, result.stderr[-2000:]
    assert "interrupted: the files last saved are intact; rerun with --resume" in result.stderr
    assert "Traceback" not in result.stderr
    state = weights(tmp_path, "last.pth")
    assert (state["epoch"], state["step"]) == (epoch, step) and [r["epoch"] for r in history(tmp_path)] == [1]
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"


def test_ctrl_c_anywhere_then_resume_equals_the_straight_run(exact_data, straight, tmp_path):
    """Ctrl-C (SIGINT) at step 7 (epoch 2 of 2, 5 steps an epoch), and a SIGTERM during the stop's
    save: the run stops after step 7, saves last.pth there and says how to go on; then --resume
    with --save-every-steps 3, interrupted while its first last.pth (after step 9) is renamed into
    place; then --resume, which ends exactly where the straight run does."""
    flags = _flags(exact_data, tmp_path, 2 * B, 2)
    # last.pth is written after steps 3 and 6, at epoch 1's end and at the stop: its 4th rename.
    result = python("train_single.py", *flags, "--save-every-steps", "3",
                    env={"PYTHONPATH": HOOKS, "INTERRUPT_AT_STEP": "7", "SIGNAL_AT_REPLACE": "last.pth:4"})
    assert result.returncode == EXIT_STOPPED == 75, result.stderr[-2000:]
    line = stop_line(result.stderr)
    assert line == stop_line(last_line(result)), "the last line"
    said, command = line.split("; to go on: python ")
    assert said == f"stopped by SIGINT at epoch 2 step 2 of 5: {tmp_path}/last.pth saved there"
    assert shlex.split(command) == ["train_single.py", *flags, "--save-every-steps", "3", "--resume"]
    assert "Traceback" not in result.stderr and not list(tmp_path.glob(".*.tmp"))
    state = weights(tmp_path, "last.pth")
    assert (state["epoch"], state["step"], [r["epoch"] for r in state["history"]]) == (1, 2, [1])
    assert [r["epoch"] for r in history(tmp_path)] == [1], "history.json holds the finished epochs"

    # A SIGKILL during a save leaves its temporary file (up to 1 GB): the next start removes it.
    (tmp_path / ".last.pth.abc123.tmp").write_bytes(b"half a checkpoint")
    result = run_main(train_single.main, [*flags, "--resume", "--save-every-steps", "3"],
                      env={"INTERRUPT_AT_REPLACE": "last.pth:1"})
    assert f"resumed from {tmp_path}/last.pth in epoch 2 of 2 after its step 2: going on" in result.stdout
    _interrupted(result, tmp_path, 1, 2)  # and the stale temporary file is gone

    # The epoch's seconds so far go on: 1000 s of training and 500 s of waiting, as if it had been slow.
    state["partial"].update(train_seconds=1000.0, data_wait_seconds=500.0)
    torch.save(state, tmp_path / "last.pth")
    (tmp_path / ".unrelated.tmp").write_bytes(b"not ours")
    began = time.monotonic()
    result = run_main(train_single.main, [*flags, "--resume"])
    resumed_for = time.monotonic() - began  # what the rest of the epoch can have added, at most
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "epoch 2/2" in result.stdout
    assert "epoch 1/2" not in result.stdout
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == [".run.lock", ".unrelated.tmp"]
    same_end(tmp_path, straight)
    assert_same_best(tmp_path, straight)
    epoch_2 = history(tmp_path)[1]
    assert 1000 < epoch_2["train_seconds"] < 1000 + resumed_for
    assert 500 < epoch_2["data_wait_seconds"] < epoch_2["train_seconds"] - 499


def test_killed_worker_is_restarted_and_the_job_finishes_the_same(ddp_stops, runs):
    """SIGKILL of rank 0 as its 3rd step starts (the run's 19th, epoch 2 of 2, after a resume from
    step 16; conftest.ddp_stops' last launch); torchrun restarts the workers, which resume on their
    own from the step checkpoint after step 18 (--save-every-steps 3) and redo 19."""
    out, result = ddp_stops["restarted"]
    where = out.parent / "out"
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode: -9" in result.stderr  # torchrun saw the SIGKILL
    first, restart = result.stdout.split("resumed from")[1:]
    assert first.startswith(f" {where}/last.pth in epoch 2 of 2 after its step 6: going on")
    assert restart.startswith(f" {where}/last.pth in epoch 2 of 2 after its step 8: going on")
    same_end(out, stops_straight(runs, "ddp"))


def test_a_dead_rank_ends_the_job_within_the_bound(exact_data, tmp_path):
    """Without restarts, torchrun sees rank 1 die (SIGKILL at its 3rd step) and stops the job,
    non-zero, within DEAD_RANK_BOUND seconds of the kill."""
    kill_log = tmp_path / "killed"
    result = run([*TORCHRUN, "train_ddp.py", *_flags(exact_data, tmp_path / "out", B, 2)],
                 env={"PYTHONPATH": HOOKS, "KILL_AT_STEP": "3", "KILL_RANK": "1", "KILL_LOG": str(kill_log)},
                 timeout=300)
    ended = time.time()
    assert result.returncode != 0
    assert "exitcode: -9" in result.stderr and "Signal 9 (SIGKILL)" in result.stderr, result.stderr[-2000:]
    assert ended - float(kill_log.read_text()) < DEAD_RANK_BOUND


def _resume_args(out, **changes) -> Config:
    argv = [*EXACT, *VAL, "--epochs", "2", "--batch-size", str(2 * B), *outputs(out), "--resume"]
    return dataclasses.replace(parse_args("", argv), **changes)


@pytest.mark.parametrize("change, message", [
    ({"batch_size": 10}, "was trained with --batch-size (x processes x --accumulate) 20, not 10"),
    ({"dropout": 0.3}, "was trained with --dropout torchvision's default, not 0.3"),
    ({"dropout": 0.0}, "was trained with --dropout torchvision's default, not 0.0"),
    ({"augment": True}, "was trained with --augment off, not on"),
    ({"ema_decay": 0.99}, "was trained with --ema-decay off, not 0.99"),
    ({"sync_bn": True}, "was trained with --sync-bn off, not on"),
    ({"data": "other"}, "was trained with --data-dir (its images)"),
    ({"epochs": 1}, "has finished 2 epochs, more than --epochs 1"),
])
def test_resume_refuses_another_run(change, message, runs, tmp_path):
    out = mode_run(runs, "single")[0]
    saved = weights(out, "last.pth")["info"]
    args = _resume_args(out, **{k: v for k, v in change.items() if k != "data"})
    info = checkpoint.run_info(args, args.batch_size, change.get("data", saved["data"]))
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    with pytest.raises(UserError) as caught:
        checkpoint.load_last(args, info, model, optimizer, None, schedule)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_resume_with_another_data_folder_is_refused_by_the_script(runs, small_data, tmp_path, monkeypatch,
                                                                  capsys):
    shutil.copytree(mode_run(runs, "single")[0], tmp_path / "out")
    fails_in_process(train_single.main, ["--data-dir", str(small_data), *EXACT, *VAL, "--epochs", "3",
                                         "--batch-size", str(2 * B), *outputs(tmp_path / "out"), "--resume"],
                     monkeypatch, capsys, "was trained with --data-dir (its images)")


@pytest.mark.parametrize("failure, disk", [
    (OSError(28, "No space left on device"), True),
    # Not the disk: no advice about room. (torch.save's own RuntimeError on a full disk, "unexpected
    # pos", is reported with the OSError behind it: the full tmpfs test below.)
    (RuntimeError("cannot pickle this"), False),
])
def test_crash_during_a_save_keeps_the_previous_file(tmp_path, monkeypatch, failure, disk):
    path = tmp_path / "best.pth"
    atomic.atomic_torch_save({"w": torch.ones(3)}, path)

    def dies_half_way(obj, file):
        file.write(b"half a checkpoint")
        raise failure
    monkeypatch.setattr(torch, "save", dies_half_way)  # atomic_torch_save imports torch when called
    with pytest.raises(UserError) as caught:
        atomic.atomic_torch_save({"w": torch.zeros(3)}, path)
    message = str(caught.value)
    assert message.startswith(f"cannot write {path} (") and "the previous best.pth is intact" in message
    assert ("No space left on device" in message) == disk and ("make room" in message) == disk, message
    assert "\n" not in message
    assert torch.equal(torch.load(path, weights_only=True)["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["best.pth"], "no temporary file left behind"


def test_a_checkpoint_is_on_disk_before_its_rename(tmp_path, monkeypatch):
    """The temporary file is fsynced, with every byte written, before it is renamed onto the
    checkpoint: after a power cut the name holds the old file or the whole new one. Spies on
    os.fsync and os.replace record the file each one got (its inode, which the rename keeps), and
    the order."""
    import os
    calls = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        calls.append(("fsync", os.fstat(fd).st_ino, os.fstat(fd).st_size))
        fsync(fd)

    def spy_replace(src, dst):
        calls.append(("replace", os.stat(src).st_ino, os.fspath(dst)))
        replace(src, dst)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    path, text = tmp_path / "last.pth", tmp_path / "history.json"
    for value in (1.0, 2.0):  # a new file, then one that replaces it
        for write, target in ((lambda: atomic.atomic_torch_save({"w": torch.full((1000,), value)}, path), path),
                              (lambda: atomic.atomic_write_text(text, f"[{value}]\n"), text)):
            calls.clear()
            write()
            written = target.stat()
            assert calls == [("fsync", written.st_ino, written.st_size), ("replace", written.st_ino, str(target))]
        assert torch.equal(torch.load(path, weights_only=True)["w"], torch.full((1000,), value))
        assert text.read_text() == f"[{value}]\n"


def test_a_full_disk_stops_with_one_line_and_keeps_the_last_epoch(runs, tmpfs):
    """A real full disk: epoch 2 cannot be saved; the error names the file, epoch 1's files
    (those of the shared one-epoch run) stay byte for byte, and --resume finishes once there is room."""
    disk = tmpfs("disk", "size=300m")
    for file in runs.exact("single", epochs=1)[0].iterdir():
        shutil.copy(file, disk)
    flags = ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--batch-size", str(2 * B), *outputs(disk)]
    saved = {p.name: p.read_bytes() for p in disk.iterdir() if p.name != ".run.lock"}  # the lock names its run
    remount(disk, f"size={shutil.disk_usage(disk).used + 2**20}")  # 1 MB to spare: less than any checkpoint

    result = run_main(train_single.main, [*flags, "--epochs", "2", "--resume"])
    error = fails(result, f"error: cannot write {disk}/")
    assert ".pth (No space left on device; " in error and "is intact" in error, error
    assert {p.name: p.read_bytes() for p in disk.iterdir() if p.name != ".run.lock"} == saved, "epoch 1's files changed"

    remount(disk, "size=300m")
    result = run_main(train_single.main, [*flags, "--epochs", "2", "--resume"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["epoch"] for r in history(disk)] == [1, 2]


def test_image_that_turns_unreadable_during_training(exact_data, tmp_path):
    """A loader worker fails on an image that broke after train.csv was written: one line naming
    it, exit 2, and the process ends (a true run: its loader workers, which ignore SIGTERM, are
    killed at its exit, not waited for; multiprocessing would wait for them for ever). The bound on
    its exit is derived from the run itself: ending takes no longer than everything before the
    error did (the start, torch's imports, the worker's start, the steps), on a busy machine too."""
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    names = sorted(p.name for p in (exact_data / "train").iterdir())
    for name in names:
        (data / "train" / name).symlink_to(exact_data / "train" / name)
    (data / "train.csv").write_text("filename,label\n" + "".join(
        f"{n},{int(n.startswith('dog'))}\n" for n in names))
    (data / "train" / names[5]).unlink()
    (data / "train" / names[5]).write_bytes(b"\xff\xd8 broken since the CSV was made")
    command = [sys.executable, "train_single.py", "--data-dir", str(data), *EXACT, *VAL, "--batch-size", "20",
               *outputs(tmp_path / "out"), "--workers", "1"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    with subprocess.Popen(command, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
        try:
            lines = []
            for line in process.stderr:  # up to the error line (or the end of a run that never fails)
                lines.append(line)
                if line.startswith("error: "):
                    break
            before_error = time.monotonic() - began
            try:
                process.wait(timeout=before_error)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the process did not end {before_error:.0f} s after its error line "
                            f"(as long as it took to get there): {''.join(lines)[-2000:]}")
            lines += process.stderr.readlines()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # a hung run's process and its loader worker
    last = fails(subprocess.CompletedProcess(command, process.returncode, "", "".join(lines)),
                 "error: cannot read image")
    assert names[5] in last and "src.tools.prepare" in last


def test_the_loader_workers_end_with_a_killed_training_process(exact_data, tmp_path):
    """SIGKILL of train_single.py in its 2nd step, with a loader worker: the worker (a child of the
    fork server, not of the training process) and the fork server end with it, so nothing is left
    holding the output that the user's shell or launcher waits on (the command's pipes here: run()
    returns once every holder has closed them)."""
    kill_log = tmp_path / "killed"
    start = time.time()
    result = run([sys.executable, "train_single.py", *_flags(exact_data, tmp_path / "out", 2 * B, 1)],
                 env={"PYTHONPATH": HOOKS, "KILL_AT_STEP": "2", "KILL_RANK": "0", "KILL_LOG": str(kill_log)},
                 timeout=120)
    ended = time.time()
    assert result.returncode == -9, result.stderr[-3000:]
    killed = float(kill_log.read_text())
    # The worker's watch wakes when the process ends (a pidfd; else it looks every second): the
    # pipes close at once, not after the test's timeout. 30 s covers a loaded machine.
    assert start < killed and ended - killed < 30


def test_an_error_ends_the_loader_workers_through_their_queues_before_the_process_group(monkeypatch):
    """A rank's error leaves its loader's iterator in a reference cycle (the traceback holds the
    training loop's frames). end_process_group ends its workers as the iterator's own end does,
    through the index queue, so each worker exits 0; the garbage collection alone would first close
    the queues, then send a stop the worker never gets, wait, and leave it running (it ignores the
    stop signals: src/datasets.py)."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from src.datasets import worker_options
    from src.errors import end_process_group
    for name, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        loader = DataLoader(list(range(8)), batch_size=2, num_workers=1, persistent_workers=True, **worker_options())
        cycle = {"iterator": iter(loader)}
        cycle["cycle"] = cycle
        assert next(cycle["iterator"]).tolist() == [0, 1]
        workers = list(cycle["iterator"]._workers)
        del loader, cycle
    finally:
        end_process_group()
    assert not dist.is_initialized()
    assert [worker.exitcode for worker in workers] == [0]


def test_ending_the_loader_workers_passes_over_objects_that_cannot_say_their_class():
    """The search for live loader iterators looks at every object of the process: a weak proxy
    whose object is gone raises ReferenceError when asked its __class__ (as isinstance asks), and
    the error's clean-up must not end in a traceback of its own."""
    import weakref

    from src.errors import end_loader_workers

    class Gone:
        pass
    thing = Gone()
    kept = [weakref.proxy(thing)]
    del thing
    end_loader_workers()
    assert len(kept) == 1
