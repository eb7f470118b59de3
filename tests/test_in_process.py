"""A script's main(argv) runs in the caller's process as `python SCRIPT ARGV` runs alone: twice in a
row it writes what two fresh processes write, and it leaves the process as it found it (the stop
signals' handlers, the environment, threads, open files, the process group, torch's numerics)."""
import json
import os
import shlex
import signal
import threading

import pytest
import torch
import torch.distributed as dist
from conftest import EXACT, VAL, history, outputs, python, stop_line, weights

import train_accelerate
import train_ddp
import train_single
from src.errors import UserError, end_process_group, run_command

FLAGS = [*EXACT, *VAL, "--epochs", "2", "--batch-size", "20", "--ema-decay", "0.9"]
TIMINGS = {"train_seconds", "data_wait_seconds", "val_seconds", "seconds"}


def process_state() -> dict:
    """What a run could leave changed in its process."""
    files = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            files[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed already
            pass
    # A closed multiprocessing queue's feeder thread ends on its own shortly after the loader shut
    # its workers down (torch cancels the join): wait for it rather than race it. One that never
    # ends is still there after the wait, and still counted.
    for thread in threading.enumerate():
        if thread.name == "QueueFeederThread":
            thread.join(timeout=10)
    backends = torch.backends
    return {"handlers": {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1,
                                                                          signal.SIGINT, signal.SIGHUP)},
            "environ": dict(os.environ), "cwd": os.getcwd(),
            "threads": sorted(thread.name for thread in threading.enumerate()),
            "files": sorted(target for target in files.values() if target.startswith("/")),
            "process group": dist.is_initialized(),
            "numerics": (backends.cudnn.benchmark, backends.cudnn.deterministic, backends.cudnn.allow_tf32,
                         backends.cuda.matmul.allow_tf32, torch.are_deterministic_algorithms_enabled())}


def _without_timings(records: list[dict]) -> list[dict]:
    return [{key: value for key, value in record.items() if key not in TIMINGS} for record in records]


def _same_files(a, b) -> None:
    """Two runs' files hold the same weights, average, history and best epoch."""
    assert _without_timings(history(a)) == _without_timings(history(b))
    for name in ("best.pth", "last.pth"):
        first, second = weights(a, name), weights(b, name)
        model_a, model_b = (first, second) if name == "best.pth" else (first["model"], second["model"])
        assert model_a.keys() == model_b.keys() and all(torch.equal(model_a[k], model_b[k]) for k in model_a), name
    infos = []
    for folder in (a, b):  # but when it started and where its files went
        info = json.loads((folder / "best.json").read_text())
        infos.append({**{k: v for k, v in info.items() if k != "started"},
                      "flags": {k: v for k, v in info["flags"].items() if k not in ("checkpoint", "plot")}})
    assert infos[0] == infos[1]


@pytest.mark.parametrize("script, name", [(train_single, "train_single.py"), (train_ddp, "train_ddp.py"),
                                          (train_accelerate, "train_accelerate.py")])
def test_main_twice_in_one_process_writes_what_two_processes_write(script, name, exact_data, tmp_path, monkeypatch,
                                                                   capsys):
    """train_ddp.py and train_accelerate.py without a launcher are a world of one; --ema-decay and one
    loader worker (started from the fork server, which stays for the next run) are in the run."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no accelerate config file
    argv = ["--data-dir", str(exact_data), *FLAGS, "--workers", "1"]
    alone = python(name, *argv, *outputs(tmp_path / "alone"))
    assert alone.returncode == 0, alone.stderr[-3000:]
    before = None
    for run in ("first", "second"):
        if run == "second":
            before = process_state()
        assert run_command(script.main, [*argv, *outputs(tmp_path / run)]) == 0, capsys.readouterr().err[-3000:]
        if script is train_accelerate:
            from accelerate.state import AcceleratorState, GradientState
            AcceleratorState._reset_state(True)  # accelerate's own singletons: a new Accelerator() next
            GradientState._reset_state()
    assert process_state() == before
    _same_files(tmp_path / "first", tmp_path / "alone")
    _same_files(tmp_path / "second", tmp_path / "alone")


def test_a_stopped_run_gives_back_the_signal_handlers(exact_data, tmp_path, capsys):
    """run_command(main) of a run stopped on SIGTERM: exit code 75, last.pth saved, and the handlers
    the process had before (the training state's StopSignals put them back)."""
    before = process_state()["handlers"]

    def main(argv):
        import src.state as state
        save_step = state.TrainingState.save_step

        def signalled(self, sums):  # the first step checkpoint: SIGTERM arrives as it is written
            save_step(self, sums)
            os.kill(os.getpid(), signal.SIGTERM)
        try:
            state.TrainingState.save_step = signalled
            train_single.main(argv)
        finally:
            state.TrainingState.save_step = save_step
    argv = ["--data-dir", str(exact_data), *FLAGS, "--workers", "0", "--save-every-steps", "2", "--overwrite",
            *outputs(tmp_path)]
    code = run_command(main, argv)
    err = capsys.readouterr().err
    assert code == 75, err[-3000:]
    assert process_state()["handlers"] == before
    # the command that goes on continues this run: --resume in place of --overwrite, which would refuse it
    going_on = shlex.join(["train_single.py", *argv[:-5], *argv[-4:], "--resume"])  # argv[-5] is --overwrite
    assert stop_line(err).endswith(f"to go on: python {going_on}")
    saved = weights(tmp_path, "last.pth")
    assert (saved["epoch"], saved["step"]) == (0, 3), "the stop at the step after the signal"


def test_a_command_that_fails_on_bad_input_ends_the_process_group_it_started(capsys):
    """run_command(main) of a main that has a process group when it meets bad input: exit code 2,
    its line on stderr, and the group ended (a next main can start its own in the same process)."""
    def main(argv):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        raise UserError("--data-dir /nowhere does not exist: give the folder of the images")
    try:
        code = run_command(main, [])
        assert code == 2
        assert capsys.readouterr().err == "error: --data-dir /nowhere does not exist: give the folder of the images\n"
        assert not dist.is_initialized(), "the group the failed command started is still there"
    finally:
        end_process_group()  # when the assertion failed: the next tests start with no group
