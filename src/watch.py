"""Watching a run while it trains: the progress bar (images/s and a recent loss), the seconds spent
waiting for the data loader, TensorBoard scalars and the profiler, on rank 0.

Nothing here makes the host wait for the GPU inside a step: the loss is read from copies of the
running metric sums that are started every --log-every optimizer steps without blocking and read
once the GPU has made them; data wait is host time spent in the loader's `next()`, a place where
the loop waits anyway.
"""
import argparse
import collections
import os
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from src.metrics import COUNT, LOSS
from src.profiling import Profiler

Log = Callable[[dict, int], None]  # log(values, step), as accelerate's Accelerator.log


def tensorboard(log_dir: str) -> tuple[Log, Callable[[], None]]:
    """log(values, step) into TensorBoard event files in log_dir, and a close() that flushes them."""
    from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when asked for
    writer = SummaryWriter(log_dir)

    def log(values: dict, step: int) -> None:
        for name, value in values.items():
            writer.add_scalar(name, value, step)
    return log, writer.close


class Watch:
    """What a run shows and records as it goes; one per run, `steps()` per pass over a loader."""

    def __init__(self, args: argparse.Namespace, optimizer: torch.optim.Optimizer, steps_per_epoch: int,
                 batch_images: int, device: torch.device, show: bool = True, log: Log | None = None):
        """`batch_images`: the images of one micro-batch over all processes; `show`: this is rank 0."""
        self.args, self.optimizer, self.steps_per_epoch = args, optimizer, steps_per_epoch
        self.batch_images, self.device, self.show, self.log = batch_images, device, show, log
        self.profiler = Profiler(args, device) if args.profile and show else None
        # Host copies of the running sums, made once: allocating pinned memory inside a step could wait.
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(4, pin_memory=pinned) for _ in range(4)]
        self.copies = 0  # copies started: the next one goes into buffers[copies % 4]
        # SYNC_CHECK_STEPS=a:b (the GPU self-test): any host synchronisation between training
        # micro-batches a and b of the first epoch raises, through torch.cuda.set_sync_debug_mode.
        window = os.environ.get("SYNC_CHECK_STEPS")
        self.sync_check = tuple(map(int, window.split(":"))) if window and device.type == "cuda" else None

    def steps(self, loader: DataLoader, desc: str, epoch: int | None = None) -> "Steps":
        """The batches of loader, watched; `epoch` for training passes, None for validation."""
        return Steps(self, loader, desc, epoch)

    def epoch_end(self, record: dict) -> None:
        """Every field of the epoch's history record as a TensorBoard scalar, at its epoch."""
        if self.log is not None:
            self.log({f"epoch/{name}": value for name, value in record.items() if name != "epoch"},
                     record["epoch"])


class Steps:
    """One pass over a loader: yields its batches, timing the waits and reporting as it goes."""

    def __init__(self, watch: Watch, loader: DataLoader, desc: str, epoch: int | None):
        self.watch, self.loader, self.desc, self.epoch = watch, loader, desc, epoch
        self.data_wait = 0.0  # seconds this process waited for the loader in this pass

    def track(self, sums: torch.Tensor) -> Iterator:
        """The loader's batches; `sums` is the pass's running metric sums (batch_sums), read for
        the progress bar and TensorBoard without waiting for the device."""
        watch, training = self.watch, self.epoch is not None
        every = watch.args.log_every * watch.args.accumulate  # micro-batches between reports
        pending = collections.deque()  # copies of sums in flight: (host copy, event, step, time)
        last = None  # the last copy that arrived: (sums, step, time)
        bar = tqdm(total=len(self.loader), desc=self.desc, leave=False, disable=not watch.show)
        profiler = watch.profiler if training and watch.profiler and not watch.profiler.done else None
        iterator = iter(self.loader)
        for step in range(len(self.loader) + 1):
            self._check_syncs(step, training)
            start = time.perf_counter()
            with torch.profiler.record_function("data wait"):
                batch = next(iterator, None)
            self.data_wait += time.perf_counter() - start
            if batch is None:
                break
            yield batch
            bar.update()
            if profiler is not None:
                profiler.step(self.data_wait, len(self.loader))
            if (step + 1) % every == 0 or step + 1 == len(self.loader):
                if len(pending) < len(watch.buffers):  # else skip: every buffer is still in flight
                    pending.append(self._copy(sums, step + 1))
                while pending and (pending[0][1] is None or pending[0][1].query()):
                    host, _, done, at = pending.popleft()
                    last = self._report(bar, host.clone(), done, at, last, training)
        self._check_syncs(None, training)
        bar.close()
        if profiler is not None:
            profiler.finish()

    def _copy(self, sums: torch.Tensor, step: int) -> tuple:
        host = self.watch.buffers[self.watch.copies % len(self.watch.buffers)]
        self.watch.copies += 1
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
            values["images_per_s"] = (step - before_step) * self.watch.batch_images / (at - before_at)
        bar.set_postfix({"loss": f"{loss:.3g}", **({"img/s": f"{values['images_per_s']:.0f}"}
                                                  if "images_per_s" in values else {})})
        if training and self.watch.log is not None:
            optimizer_step = self.epoch * self.watch.steps_per_epoch + step // self.watch.args.accumulate
            values["lr"] = self.watch.optimizer.param_groups[0]["lr"]
            self.watch.log({f"step/{name}": value for name, value in values.items()}, optimizer_step)
        return sums, step, at

    def _check_syncs(self, step: int | None, training: bool) -> None:
        window = self.watch.sync_check
        if window is None or not training or self.epoch != 0:
            return
        if step == window[0]:
            torch.cuda.set_sync_debug_mode("error")
        elif step == window[1] or step is None:
            torch.cuda.set_sync_debug_mode("default")
