"""Stopping a run at an optimizer step and going on from there (docs/reliability.md): step
checkpoints (--save-every-steps), a stop on SIGTERM, SIGUSR1 or SIGINT that every rank agrees on,
and the place where a resumed epoch goes on.

- A signal only sets a flag (the handler). The loop looks at it after an optimizer step, never
  between the micro-batches of one (--accumulate). A second signal changes nothing: the stop's save
  goes on (atomic, src/outputs.py) and the process exits after it. DataLoader workers ignore the
  signals; their main process stops them when it ends.
- Agreement, without making the host wait inside a step: in a world of one the flag is read after
  every optimizer step (a Python value, no device work). With a process group, every K =
  --log-every optimizer steps (counted from the run's first, so every rank checks at the same step
  numbers) each rank starts an all-reduce (MAX) of a one-element tensor holding its flag (on the
  CPU under gloo, on the GPU under NCCL, copied to pinned host memory behind the collective) and
  reads the one it started K steps before: long done, so nothing waits, and every rank reads the
  same value at the same step. A signal is acted on 1 to 2K steps after it arrives. At the start of
  each epoch's training after the first (the previous epoch's end, after its save) the check is a
  plain all-reduce.
- When they agree to stop, every rank stops after that step: last.pth is written there (a step
  checkpoint: rank 0 writes, FSDP gathers on every rank), rank 0 prints one line (where, what was
  saved, the command that goes on), and every rank exits with EXIT_STOPPED (src/errors.py).
- A step checkpoint holds what save_epoch's last.pth holds (src/checkpoint.py last_state) and the
  optimizer steps done in the unfinished epoch, each rank's metric sums of them and the seconds
  they took. Nothing random: dropout and augmentation are functions of (seed, epoch, sample), so a
  resumed epoch that skips the finished steps' samples (src/loaders.py EpochSampler.start_at, no
  image read) draws what an uninterrupted run draws.
"""
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from src.errors import STOP_SIGNALS, Stopped
from src.ranks import gather, is_first

_requested = 0  # the number of the first stop signal, 0 while none came


def _note(signum, frame) -> None:
    global _requested
    _requested = _requested or signum


def requested() -> int:
    """The first stop signal's number since catch_signals(), 0 if none came."""
    return _requested


def catch_signals() -> None:
    """From now on SIGTERM, SIGUSR1 and SIGINT (Ctrl-C) ask the run to stop at its next agreed
    optimizer step instead of ending the process (src.errors.exit_on_error puts the previous
    handlers back when the run ends)."""
    global _requested
    _requested = 0
    for number in STOP_SIGNALS:
        signal.signal(number, _note)


def signal_name(number: int) -> str:
    return signal.Signals(number).name


class Stops:
    """Step checkpoints and agreed stops for one run; Progress's training passes call begin() at
    their start and after_step() after each optimizer step (src/progress.py).

    `history`: resume()'s (its `partial` says where a resumed epoch goes on); `save(partial)`:
    writes last.pth at a step (src.checkpoint.save_step; called on every rank)."""

    def __init__(self, args, history: list[dict], save: Callable[[dict], None]):
        self.args, self.save = args, save
        self.resumed = getattr(history, "partial", None)
        self.passes = 0  # training passes begun in this process
        self.distributed = dist.is_initialized() and dist.get_world_size() > 1
        self.pending = None  # the agreement's all-reduce in flight: (its tensor, what to wait for)
        self.agreed = 0  # the signal that the ranks agreed to stop on
        self.on_gpu = self.distributed and dist.get_backend() == "nccl"
        self.host = torch.zeros(1, pin_memory=True) if self.on_gpu else None

    def begin(self, loader_pass, sums: torch.Tensor) -> int:
        """At the start of an epoch's training pass: stop if asked since the previous epoch (its
        files are saved); in a resumed epoch skip the finished steps and take back their sums and
        times. Returns the micro-batches already done in this epoch."""
        if not self.passes:
            catch_signals()  # from the first step on (before it, and in --evaluate, Ctrl-C ends the run at once)
        elif self.agree_now():
            self.stopped(f"after epoch {loader_pass.epoch} of {self.args.epochs}: "
                         f"{last_path(self.args)} holds it")
        self.passes += 1
        partial, self.resumed = self.resumed, None
        if partial is None or partial["epoch"] != loader_pass.epoch:
            return 0
        from src.loaders import epoch_sampler  # here: src.loaders imports this module
        epoch_sampler(loader_pass.loader).start_at(partial["step"])
        sums += partial["sums"].to(sums.device)  # this rank's sums of the finished steps
        loader_pass.resumed(partial["sums"], partial["train_seconds"], partial["data_wait_seconds"])
        return partial["step"] * self.args.accumulate

    def after_step(self, loader_pass, step: int, sums: torch.Tensor) -> str | None:
        """After optimizer step `step` (from 1) of the epoch: write last.pth every --save-every-steps
        steps of the run, and there too if every rank agrees to stop; then where it stopped (for
        stopped(), once the progress bar is gone), else None."""
        steps = loader_pass.progress.steps_per_epoch
        done = loader_pass.epoch * steps + step  # optimizer steps of the run
        stop = self.agree_at(done)
        every = self.args.save_every_steps
        # An epoch's last step is saved by the epoch's end, after validation, unless the run stops here.
        if stop or (every and done % every == 0 and step < steps):
            rows = gather(sums.detach().float().cpu())  # each rank's own sums: a host read, at a checkpoint only
            self.save({"epoch": loader_pass.epoch, "step": step, "sums": torch.stack(rows),
                       "train_seconds": loader_pass.seconds(), "data_wait_seconds": loader_pass.data_wait})
        if stop:
            return f"at epoch {loader_pass.epoch + 1} step {step} of {steps}: {last_path(self.args)} saved there"
        return None

    def agree_at(self, done: int) -> bool:
        """Whether every rank stops after the run's optimizer step `done`: in a world of one, the
        flag; else, every --log-every steps, the all-reduce started at the check before."""
        if not self.distributed:
            self.agreed = requested()
            return bool(self.agreed)
        if done % self.args.log_every:
            return False
        self.agreed = self._read()
        tensor = self._flag()
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        if self.on_gpu:
            work.wait()  # the current stream waits for the collective; the host does not
            self.host.copy_(tensor, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.pending = (self.host, event)
        else:
            self.pending = (tensor, work)
        return bool(self.agreed)

    def _flag(self) -> torch.Tensor:
        """This rank's stop flag as the one-element tensor the ranks all-reduce (MAX)."""
        return torch.full((1,), float(requested()), device="cuda" if self.on_gpu else "cpu")

    def _read(self) -> int:
        """The value of the all-reduce in flight (0 if none): K steps old, so done already."""
        if self.pending is None:
            return 0
        tensor, waiter = self.pending
        self.pending = None
        waiter.synchronize() if self.on_gpu else waiter.wait()
        return int(tensor.item())

    def agree_now(self) -> bool:
        """Whether every rank stops here (a blocking all-reduce; the flags do not go back, so it
        covers the one in flight)."""
        if not self.distributed:
            self.agreed = requested()
            return bool(self.agreed)
        self._read()
        tensor = self._flag()
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        self.agreed = int(tensor.item())
        return bool(self.agreed)

    def stopped(self, where: str, barrier: bool = False) -> None:
        """Rank 0 says where the run stopped and how to go on; every rank ends (after rank 0's
        save, with `barrier`: no rank leaves before the file is there)."""
        if is_first():
            print(f"stopped by {signal_name(self.agreed)} {where}; {how_to_go_on()}", file=sys.stderr, flush=True)
        if barrier and self.distributed:
            dist.barrier()
        raise Stopped()


def last_path(args) -> Path:
    return Path(args.checkpoint).parent / "last.pth"


def how_to_go_on() -> str:
    """The command that goes on: this one with --resume (under a launcher: its arguments, to give
    the same launcher), and what goes on by itself."""
    arguments = [*sys.argv, *([] if "--resume" in sys.argv else ["--resume"])]
    if "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", 1)) > 1:
        how = f"to go on, launch the same way: {shlex.join(arguments)}"
    else:
        how = f"to go on: python {shlex.join(arguments)}"
    if "SLURM_JOB_ID" in os.environ:
        how += " (a SLURM requeue goes on by itself)"
    return how
