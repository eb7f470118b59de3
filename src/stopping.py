"""Stopping a run at an optimizer step on SIGTERM, SIGUSR1, Ctrl-C or SIGHUP (its terminal closed), at
the same step on every rank (docs/reliability.md); the training state (src/state.py) saves last.pth
there.

- StopSignals is a context manager: inside it a stop signal only sets a flag (the handler), and the
  handlers that were there before come back when it ends, however it ends. A second signal
  changes nothing: the stop's save goes on (atomic) and the process exits after it. DataLoader
  workers ignore the signals (src.datasets.ignore_stop_signals); their main process stops them.
- SIGHUP after the terminal hung up: every write to it fails (EIO), and the next line of the
  progress bar would end the run with a traceback before its stop. So the output that went to
  that terminal goes to /dev/null from then on (detach_from_closed_terminal); output to a file or a
  pipe, and a terminal still open (a `kill -HUP`), are left as they are.
- Agreement, without making the host wait inside a step: in a world of one the flag is read after
  every optimizer step (a Python value, no device work). With a process group, every CHECK_EVERY
  optimizer steps of the run (the same step numbers on every rank) each rank starts an all-reduce
  (MAX) of a one-element tensor holding its flag (on the CPU under gloo; on the GPU under NCCL,
  copied to pinned host memory behind the collective), and reads the one it started at the check
  before: CHECK_EVERY steps old, done by then (asked with the event's query() or the work's
  is_completed(), which wait for nothing; one not done is waited for, counted and, under the sync
  debug mode, warned of), and every rank reads the same value at the same step. A signal is acted
  on CHECK_EVERY to 2 x CHECK_EVERY steps after it arrives. At the start of an epoch the check is
  a plain (blocking) all-reduce: the previous epoch is saved, and nothing runs on the GPU.
- A stop that cannot be agreed (a rank died or stopped: the agreement waits for it) ends at once
  instead of waiting for the launcher's SIGKILL: with a process group the signal is also written
  to a pipe (signal.set_wakeup_fd, by Python's C-level handler, even while the main thread waits in
  a collective and its Python handler cannot run), and the heartbeat's thread (src/heartbeat.py)
  reads it there (pending_since) and ends the process when a rank has not been heard from for as
  long as the stop has been pending.
- When they agree, every rank stops after that step; rank 0 prints one line (where, what was saved,
  the command that goes on), and every rank exits with EXIT_STOPPED (src/errors.py).
"""
import collections
import contextlib
import os
import shlex
import signal
import threading
import time
import warnings

import torch
import torch.distributed as dist

from src import errors
from src.errors import STOP_SIGNALS

# Optimizer steps between two agreement checks: a constant, not --log-every, so that the checks
# cost the same whatever the display asks for, and read results that are long done.
CHECK_EVERY = 4


class StopSignals:
    """Within the block, SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) ask the run to stop at its next agreed
    optimizer step instead of ending the process; `requested` is the first one's number (0: none)."""

    def __init__(self):
        self.requested = 0
        self.handlers = {}
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.on_gpu = self.distributed and dist.get_backend() == "nccl"
        # Host copies for the agreements in flight, made once: allocating pinned memory in a step could wait.
        self.hosts = [torch.zeros(1, pin_memory=True) for _ in range(2)] if self.on_gpu else []
        self.checks = 0
        # Agreements in flight, oldest first: (tensor, what to wait for: the copy's event or the all-reduce).
        self.pending: collections.deque[tuple[torch.Tensor, torch.cuda.Event | dist.Work]] = collections.deque()
        self.agreed = 0  # the signal every rank agreed to stop on
        self.terminals: list[int] = []  # the descriptors of the output that went to a terminal
        self.waits = 0  # agreements read before they were done (waited for)
        self.wakeup: tuple[int, int, int] | None = None  # (read end, write end, the wakeup fd before)
        self.since: float | None = None  # when a stop signal was first seen in the pipe (time.monotonic())

    def _note(self, signum, frame) -> None:
        self.requested = self.requested or signum
        errors.signalled = True
        if signum == signal.SIGHUP:
            detach_from_closed_terminal(self.terminals)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.terminals = [fd for fd in (1, 2) if os.isatty(fd)]  # standard output and error on a terminal
            self.handlers = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}
            errors.signalled = False
            if self.distributed:
                read, write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
                self.wakeup = (read, write, signal.set_wakeup_fd(write))
        return self

    def __exit__(self, *exc) -> None:
        if self.wakeup is not None:
            read, write, before = self.wakeup
            signal.set_wakeup_fd(before)
            self.wakeup = None
            os.close(read)
            os.close(write)
        for number, handler in self.handlers.items():
            signal.signal(number, handler)
        self.handlers = {}

    def pending_since(self) -> float | None:
        """When a stop signal came (time.monotonic() when first seen here), None if none has: read
        from the wakeup pipe without waiting, by the heartbeat's thread."""
        if self.since is None and self.wakeup is not None:
            with contextlib.suppress(OSError):  # empty (BlockingIOError), or closed as the block ended
                if set(os.read(self.wakeup[0], 512)) & set(STOP_SIGNALS):
                    self.since = time.monotonic()
        if self.since is None and self.requested:
            self.since = time.monotonic()
        return self.since

    def agreed_at(self, done: int) -> bool:
        """Whether every rank stops after the run's optimizer step `done`: in a world of one, the
        flag; else, every CHECK_EVERY steps, the agreement started at the check before."""
        if not self.distributed:
            self.agreed = self.requested
            return bool(self.agreed)
        if done % CHECK_EVERY:
            return False
        if self.pending:
            self.agreed = self._read(*self.pending.popleft())
        tensor = self._flag()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        if self.on_gpu:
            work.wait()  # the current stream waits for the collective; the host does not
            host = self.hosts[self.checks % len(self.hosts)]
            host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending.append((host, event))
        else:
            self.pending.append((tensor, work))
        self.checks += 1
        return bool(self.agreed)

    def agreed_now(self) -> bool:
        """Whether every rank stops here (a blocking all-reduce; the flags never go back, so it
        covers the ones in flight)."""
        if not self.distributed:
            self.agreed = self.requested
            return bool(self.agreed)
        self.pending.clear()
        tensor = self._flag()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        self.agreed = int(tensor.item())
        return bool(self.agreed)

    def _flag(self) -> torch.Tensor:
        """This rank's stop flag as the one-element tensor the ranks all-reduce (MAX)."""
        return torch.full((1,), float(self.requested), device="cuda" if self.on_gpu else "cpu")

    def _read(self, tensor: torch.Tensor, waiter) -> int:
        """An agreement's value. Started a check before (CHECK_EVERY steps), so done as a rule: its
        event (NCCL) or work (gloo) is asked, which waits for nothing, and the value read. Only one
        not done yet (the host ran more than CHECK_EVERY steps ahead of the GPU) is waited for, since
        every rank must read the same value at the same step: an event's wait, which
        set_sync_debug_mode does not see, so it is counted (`waits`) and warned of under that mode."""
        done = waiter.query() if self.on_gpu else waiter.is_completed()
        if not done:
            self.waits += 1
            if self.on_gpu and torch.cuda.is_available() and torch.cuda.get_sync_debug_mode():
                warnings.warn("the stop agreement waited for the GPU: the host ran more than "
                              f"{CHECK_EVERY} optimizer steps ahead of it")
            waiter.synchronize() if self.on_gpu else waiter.wait()
        return int(tensor.item())


def detach_from_closed_terminal(terminals: list[int]) -> None:
    """Point each of the descriptors `terminals` (standard output, error) whose terminal has hung
    up (it is no terminal any more: isatty is false once it has) at /dev/null, so that the run's
    progress and its stop line do not fail on it."""
    closed = [fd for fd in terminals if not os.isatty(fd)]
    if not closed:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in closed:
            os.dup2(null, fd)
    finally:
        os.close(null)


def signal_name(number: int) -> str:
    return signal.Signals(number).name


# The scripts whose processes run under a driver started with python (Ray Train's workers).
PYTHON_DRIVEN = ("train_ray.py",)


def how_to_go_on(command: list[str]) -> str:
    """The command that goes on: `command` (the script and its arguments) with --resume in place of
    --overwrite (under a launcher: its arguments, to give the same launcher), and what goes on by
    itself."""
    arguments = [argument for argument in command if argument != "--overwrite"]
    arguments += [] if "--resume" in arguments else ["--resume"]
    # Under a launcher (torchrun's variable), or in a process group of several: not a WORLD_SIZE
    # left in the environment of a one-process script. Not train_ray.py's workers, in Ray Train's
    # group: the command that goes on is their driver's, `python train_ray.py`.
    launched = "TORCHELASTIC_RUN_ID" in os.environ or (dist.is_initialized() and dist.get_world_size() > 1)
    if launched and os.path.basename(arguments[0]) not in PYTHON_DRIVEN:
        how = f"to go on, launch the same way: {shlex.join(arguments)}"
    else:
        how = f"to go on: python {shlex.join(arguments)}"
    if "SLURM_JOB_ID" in os.environ:
        how += " (a SLURM requeue goes on by itself)"
    return how
