"""SIGHUP (the terminal of a run closed, an SSH connection dropped) stops a run as SIGTERM does: after
an optimizer step, last.pth saved there, exit code 75 (issue 47). Its default action ended the run
where it was, with no line and nothing saved. Once a terminal has hung up every write to it fails,
so the run's output goes nowhere from then on, and the run still stops cleanly. Signals need a
process of their own: these run the script as a command."""
import fcntl
import os
import select
import shutil
import struct
import subprocess
import sys
import termios
import time

import pytest
import torch
from conftest import BIN, HOOKS, ROOT, TINY, history, outputs, run, stop_line

import train_single
from src.errors import run_command


def test_sighup_stops_the_run_at_a_step_and_resume_goes_on(tiny_data, tmp_path, capsys):
    """kill -HUP of a run (its terminal still open): the stop line, exit 75, last.pth at the step;
    the command it names goes on to the end."""
    out = tmp_path / "out"
    argv = [*TINY, "--data-dir", str(tiny_data), *outputs(out), "--epochs", "2"]
    result = run([sys.executable, "train_single.py", *argv],
                 env={"PYTHONPATH": HOOKS, "SIGNAL_AT_STEP": "2", "SIGNAL_NAME": "SIGHUP"})
    assert result.returncode == 75, result.stderr[-3000:]
    line = stop_line(result.stderr)
    assert line.startswith(f"stopped by SIGHUP at epoch 1 step 2 of 4: {out / 'last.pth'} saved there; to go on: "
                           "python train_single.py "), line
    saved = torch.load(out / "last.pth", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (0, 2)
    assert run_command(train_single.main, [*argv, "--resume"]) == 0, capsys.readouterr().err[-3000:]
    assert [record["epoch"] for record in history(out)] == [1, 2]


def test_closing_the_terminal_of_a_run_stops_it_at_a_step(tiny_data, tmp_path):
    """The run's terminal (a pseudo-terminal, its controlling terminal) closes while it trains: the
    kernel sends SIGHUP, and every later write to the terminal fails with EIO. The run stops at an
    optimizer step with last.pth saved there and exit code 75, its output gone to /dev/null (before,
    SIGHUP ended it at once, nothing saved)."""
    if shutil.which("setsid") is None:
        pytest.skip("util-linux's setsid is not installed")
    out = tmp_path / "out"
    argv = [*TINY, "--data-dir", str(tiny_data), *outputs(out), "--epochs", "2"]
    master, terminal = os.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a terminal's size: tqdm draws bars
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": HOOKS,
           "SLOW_ITEM": "0.2"}  # each step of 8 images takes 1.6 s or more: the terminal closes in the first epoch
    # setsid --ctty: a session of its own whose controlling terminal is the one on its standard input.
    process = subprocess.Popen(["setsid", "--ctty", sys.executable, "train_single.py", *argv], cwd=ROOT,
                               stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    try:
        shown, deadline = b"", time.monotonic() + 300
        while b"epoch 1/2 train:" not in shown:  # the progress bar of the first epoch: training has begun
            assert time.monotonic() < deadline and process.poll() is None, shown.decode(errors="replace")
            if select.select([master], [], [], 1)[0]:
                shown += os.read(master, 4096)
    finally:
        os.close(master)  # the terminal hangs up
    assert process.wait(timeout=300) == 75
    saved = torch.load(out / "last.pth", weights_only=True)
    assert saved["epoch"] * 4 + saved["step"] < 8, "stopped before the run's end"
    assert saved["step"] > 0 or saved["epoch"] > 0
