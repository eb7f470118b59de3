"""What a run shows and records as it trains, on rank 0: its header line, the progress bar
(images/s and a recent loss), the seconds spent waiting for the data loader, TensorBoard scalars,
the profiler, and at the end of an FSDP run the bytes rank 0 held (src/fsdp.py). The lines of
the history's records: src/history.py. A training pass also hands its optimizer steps to the run's
Stops (src/stopping.py: step checkpoints, stops on a signal, the resumed epoch's place) and tells
src/heartbeat.py where it is.

Nothing here makes the host wait for the GPU inside a step: the loss is read from copies of the
running metric sums that are started every --log-every optimizer steps without blocking and read
once the GPU has made them; data wait is host time spent in the loader's `next()`, a place where
the loop waits anyway.
"""
import argparse
import collections
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from src import heartbeat
from src.fsdp import bytes_line, is_sharded, watch_rank_bytes
from src.metrics import COUNT, LOSS
from src.profiling import Profiler
from src.ranks import is_first

Log = Callable[[dict, int], None]  # log(values, step), as accelerate's Accelerator.log


def run_header(args, data, device, processes: int = 1) -> str:
    """The line a run starts with: model, device, images and batch."""
    where = str(device) if processes == 1 else f"{processes} x {device.type}"
    return (f"{args.arch} on {where}: {len(data.train_idx)} train / {len(data.val_idx)} val images, "
            f"batch {args.batch_size}" + (f" x {processes}" if processes > 1 else "")
            + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))


class TensorBoard:
    """log(values, step) into TensorBoard event files in log_dir, from rank 0; close() flushes them.
    Without a log_dir, or on another rank, it records nothing."""

    def __init__(self, log_dir: str | None):
        self.writer = None
        if log_dir and is_first():
            from torch.utils.tensorboard import (
                SummaryWriter,  # imports tensorboard: only when asked for
            )
            self.writer = SummaryWriter(log_dir)

    def __call__(self, values: dict, step: int) -> None:
        for name, value in values.items():
            if self.writer is not None:
                self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Progress:
    """What a run shows and records as it goes; one per run, `pass_over()` for each pass over a loader."""

    def __init__(self, args: argparse.Namespace, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                 batch_images: int, device: torch.device, log: Log | None = None):
        """`batch_images`: the images of one micro-batch over all processes; `log`: where step and
        epoch scalars go (accelerate's Accelerator.log; by default TensorBoard in --log-dir)."""
        self.args, self.optimizer, self.steps_per_epoch = args, optimizer, steps_per_epoch
        self.batch_images, self.device, self.show = batch_images, device, is_first()
        self.tensorboard = TensorBoard(args.log_dir) if log is None else None
        self.log = log or self.tensorboard
        # Sharded parameters (FSDP): the bytes rank 0 holds at its fullest step, said by run_end().
        self.held = watch_rank_bytes(optimizer) if self.show and is_sharded(optimizer) else None
        self.profiler = Profiler(args, device) if args.profile and self.show else None
        # Host copies of the running sums, made once: allocating pinned memory inside a step could wait.
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(4, pin_memory=pinned) for _ in range(4)]
        self.copies = 0  # copies started: the next one goes into buffers[copies % 4]
        self.stops = None  # the run's src.stopping.Stops, which the scripts set

    def pass_over(self, loader: DataLoader, desc: str, epoch: int | None = None) -> "LoaderPass":
        """One pass over loader, shown and timed; `epoch` for training passes, None for validation."""
        return LoaderPass(self, loader, desc, epoch)

    def epoch_end(self, record: dict) -> None:
        """Every field of the epoch's history record as a TensorBoard scalar, at its epoch."""
        if self.log is not None:
            self.log({f"epoch/{name}": value for name, value in record.items() if name != "epoch"},
                     record["epoch"])


    def run_end(self) -> None:
        """The end of the run: TensorBoard's files flushed; under FSDP, rank 0 prints the bytes it held."""
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.held is not None:
            print(bytes_line(self.held))


class LoaderPass:
    """One pass over a loader: yields its batches, timing the waits for data and reporting the
    running loss and images/s as it goes."""

    def __init__(self, progress: Progress, loader: DataLoader, desc: str, epoch: int | None):
        self.progress, self.loader, self.desc, self.epoch = progress, loader, desc, epoch
        self.data_wait = 0.0  # seconds this process waited for the loader in this pass
        self.began, self.resumed_seconds = time.time(), 0.0  # and those of a resumed epoch's finished steps
        self.resumed_sums = None  # a resumed epoch's sums of its finished steps, on the host

    def resumed(self, sums: torch.Tensor, train_seconds: float, data_wait_seconds: float) -> None:
        """This pass goes on in an epoch whose first steps a stopped run took (src/stopping.py)."""
        self.resumed_sums, self.resumed_seconds, self.data_wait = sums, train_seconds, data_wait_seconds

    def seconds(self) -> float:
        """The seconds of this pass so far, with a resumed epoch's earlier ones."""
        return self.resumed_seconds + time.time() - self.began

    def batches(self, sums: torch.Tensor) -> Iterator:
        """The loader's batches; `sums` is the pass's running metric sums (batch_sums), read for
        the progress bar and TensorBoard without waiting for the device."""
        progress, training = self.progress, self.epoch is not None
        accumulate = progress.args.accumulate
        every = progress.args.log_every * accumulate  # micro-batches between reports
        stops = progress.stops if training else None
        first = stops.begin(self, sums) if stops is not None else 0  # micro-batches a resumed epoch has done
        total = first + len(self.loader)
        phase = "training" if training else "validating the average" if self.desc.endswith("average") else "validating"
        pending = collections.deque()  # copies of sums in flight: (host copy, event, step, time)
        last = (self.resumed_sums, first, None) if first else None  # the last copy that arrived: (sums, step, time)
        bar = tqdm(total=total, initial=first, desc=self.desc, leave=False, disable=not progress.show)
        profiler = progress.profiler if training and progress.profiler and not progress.profiler.done else None
        iterator = iter(self.loader)
        try:
            for step in range(first, total + 1):
                heartbeat.at(phase, self.epoch, step, step // accumulate, loading=True)
                start = time.perf_counter()
                with torch.profiler.record_function("data wait"):
                    batch = next(iterator, None)
                self.data_wait += time.perf_counter() - start
                if batch is None:
                    break
                heartbeat.at(phase, self.epoch, step, step // accumulate)
                yield batch
                bar.update()
                if profiler is not None:
                    profiler.step(self.data_wait, len(self.loader))
                if (step + 1) % every == 0 or step + 1 == total:
                    if len(pending) < len(progress.buffers):  # else skip: every buffer is still in flight
                        pending.append(self._copy(sums, step + 1))
                    while pending and (pending[0][1] is None or pending[0][1].query()):
                        host, _, done, at = pending.popleft()
                        last = self._report(bar, host.clone(), done, at, last, training)
                if stops is not None and (step + 1) % accumulate == 0:
                    where = stops.after_step(self, (step + 1) // accumulate, sums)  # may save last.pth
                    if where is not None:
                        bar.close()
                        stops.stopped(where, barrier=True)
        finally:
            bar.close()
        heartbeat.at(phase, self.epoch, heartbeat.END)
        if profiler is not None:
            profiler.finish()

    def _copy(self, sums: torch.Tensor, step: int) -> tuple:
        host = self.progress.buffers[self.progress.copies % len(self.progress.buffers)]
        self.progress.copies += 1
        host.copy_(sums.detach(), non_blocking=True)
        event = None
        if sums.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return host, event, step, time.perf_counter()

    def _report(self, bar: tqdm, sums: torch.Tensor, step: int, at: float, last: tuple | None,
                training: bool) -> tuple:
        """The loss and images/s since the last report, on the bar and (training) in TensorBoard."""
        before_sums, before_step, before_at = last if last else (torch.zeros(4), 0, None)
        seen = (sums - before_sums)[COUNT].item()
        loss = (sums - before_sums)[LOSS].item() / max(seen, 1)
        values = {"loss": loss}
        if before_at is not None and at > before_at:
            values["images_per_s"] = (step - before_step) * self.progress.batch_images / (at - before_at)
        bar.set_postfix({"loss": f"{loss:.3g}", **({"img/s": f"{values['images_per_s']:.0f}"}
                                                  if "images_per_s" in values else {})})
        if training and self.progress.log is not None:
            optimizer_step = self.epoch * self.progress.steps_per_epoch + step // self.progress.args.accumulate
            values["lr"] = self.progress.optimizer.param_groups[0]["lr"]
            self.progress.log({f"step/{name}": value for name, value in values.items()}, optimizer_step)
        return sums, step, at
