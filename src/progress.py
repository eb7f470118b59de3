"""What a run shows and records as it trains, on rank 0: its header line, the progress bar
(images/s and a recent loss), the seconds spent waiting for the data loader, TensorBoard scalars
and --track's step metrics (the state's Tracker, src/tracking.py; its epochs: TrainingState.save_epoch),
the profiler, and at the end of an FSDP run the bytes rank 0 held (src/fsdp.py). The lines of
the history's records: src/history.py. Each pass tells the run's heartbeat where it is
(src/heartbeat.py). It only shows and times: the scripts save and stop (src/state.py).

Nothing here makes the host wait for the GPU inside a step: the loss is read from copies of the
running metric sums that are started every --log-every optimizer steps without blocking and read
once the GPU has made them; data wait is host time spent in the loader's `next()`, a place where
the loop waits anyway.
"""
import collections
import time
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from src.config import Config
from src.fsdp import bytes_line, is_sharded, watch_rank_bytes
from src.heartbeat import END
from src.metrics import COUNT, LOSS
from src.profiling import Profiler
from src.ranks import is_first

Log = Callable[[dict, int], None]  # log(values, step), as accelerate's trackers' log


def run_header(args: Config, data, device, processes: int = 1) -> str:
    """The line a run starts with: model, device, images and batch."""
    where = str(device) if processes == 1 else f"{processes} x {device.type}"
    return (f"{args.arch} on {where}: {len(data.train_idx)} train / {len(data.val_idx)} val images, "
            f"batch {args.batch_size}" + (f" x {processes}" if processes > 1 else "")
            + (f" x {args.accumulate} micro-batches" if args.accumulate > 1 else ""))


def close_bars() -> None:
    """Close the progress bars on screen (rank 0's), so that a line printed next is whole and the
    last one (a stop's line, src/state.py)."""
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


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
    """What a run shows and records as it goes; one per run. Its training() and validation() iterate
    over a loader's batches, timing the waits for data and showing the running loss and images/s."""

    def __init__(self, args: Config, state, batch_images: int, device: torch.device,
                 log: Log | None = None, bars: bool = True):
        """`state`: the run's src.state.TrainingState (the optimizer, the steps of an epoch, where a
        resumed epoch goes on, the heartbeat, the epoch's data-wait clock); `batch_images`: the
        images of one micro-batch over all processes; `log`: where TensorBoard's step and epoch
        scalars go (accelerate's TensorBoard tracker's log; by default TensorBoard in --log-dir);
        the step metrics go to the state's tracker too (--track). `bars`: draw progress bars (rank
        0's; not where the output is forwarded line by line, as Ray forwards its workers')."""
        self.args, self.state, self.batch_images, self.device, self.show = args, state, batch_images, device, is_first()
        self.tensorboard = TensorBoard(args.log_dir) if log is None else None
        self.log = log or self.tensorboard
        # Sharded parameters (FSDP): the bytes rank 0 holds at its fullest step, said by run_end().
        self.held = watch_rank_bytes(state.optimizer) if self.show and is_sharded(state.optimizer) else None
        self.profiler = Profiler(args, device) if args.profile and self.show else None
        # Host copies of the running sums, made once: allocating pinned memory inside a step could wait.
        pinned = device.type == "cuda"
        self.buffers = [torch.zeros(4, pin_memory=pinned) for _ in range(4)]
        self.copies = 0  # copies started: the next one goes into buffers[copies % 4]
        self.title = ""
        self.bars = bars

    def training(self, loader: DataLoader, epoch: int, sums: torch.Tensor) -> Iterator[tuple[int, tuple]]:
        """(micro-batch index in the epoch, batch) for the epoch's training micro-batches from the
        state's place on (a resumed epoch's finished steps are not in `loader`: skip_first_batches),
        up to the epoch's last whole optimizer step; `sums`: the running metric sums, read for the
        bar and TensorBoard without waiting for the device."""
        self.title = f"epoch {epoch + 1}/{self.args.epochs}"
        accumulate = self.args.accumulate
        first, total = self.state.step * accumulate, self.state.steps_per_epoch * accumulate
        profiler = self.profiler if self.profiler and not self.profiler.done else None
        yield from self._pass(loader, f"{self.title} train", sums, first, total, epoch, profiler)
        if profiler is not None:
            profiler.finish()

    def validation(self, loader: DataLoader, what: str, sums: torch.Tensor) -> Iterator[tuple]:
        """The batches of a validation pass: `what` is "val", "average" (the weight average's) or, for
        --evaluate, "validation"."""
        desc = f"{self.title} {what}" if self.title else what
        for _, batch in self._pass(loader, desc, sums, 0, len(loader), None, None):
            yield batch

    def _pass(self, loader, desc: str, sums: torch.Tensor, first: int, total: int, epoch: int | None,
              profiler) -> Iterator[tuple[int, tuple]]:
        training, state, heartbeat = epoch is not None, self.state, self.state.heartbeat
        accumulate = self.args.accumulate if training else 1
        every = self.args.log_every * accumulate  # micro-batches between reports
        phase = "training" if training else "validating the average" if desc.endswith("average") else "validating"
        pending: collections.deque[tuple] = collections.deque()  # copies of sums in flight: (host copy, event, micro-batch, time)
        # the last copy that arrived: (sums, micro-batch, time); a resumed epoch's finished steps' sums
        last = (state.partial["sums"], first, None) if training and first and state.partial else None
        bar = tqdm(total=total, initial=first, desc=desc, leave=False, disable=not (self.show and self.bars))
        iterator = iter(loader)
        try:
            for index in range(first, total):
                heartbeat.at(phase, epoch, index, index // accumulate, loading=True)
                start = time.perf_counter()
                with torch.profiler.record_function("data wait"):
                    batch = next(iterator, None)
                if training:
                    state.data_wait += time.perf_counter() - start
                if batch is None:
                    break
                heartbeat.at(phase, epoch, index, index // accumulate)
                yield index, batch
                bar.update()
                if profiler is not None:
                    profiler.step(state.data_wait, total - first)
                if (index + 1) % every == 0 or index + 1 == total:
                    if len(pending) < len(self.buffers):  # else skip: every buffer is still in flight
                        pending.append(self._copy(sums, index + 1))
                    while pending and (pending[0][1] is None or pending[0][1].query()):
                        host, _, done, at = pending.popleft()
                        last = self._report(bar, host.clone(), done, at, last, epoch)
        finally:
            bar.close()
        heartbeat.at(phase, epoch, END)

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

    def _copy(self, sums: torch.Tensor, index: int) -> tuple:
        host = self.buffers[self.copies % len(self.buffers)]
        self.copies += 1
        host.copy_(sums.detach(), non_blocking=True)
        event = None
        if sums.is_cuda:
            event = torch.cuda.Event()
            event.record()
        return host, event, index, time.perf_counter()

    def _report(self, bar: tqdm, sums: torch.Tensor, index: int, at: float, last: tuple | None,
                epoch: int | None) -> tuple:
        """The loss and images/s since the last report, on the bar and (training) in TensorBoard."""
        before_sums, before_index, before_at = last if last else (torch.zeros(4), 0, None)
        seen = (sums - before_sums)[COUNT].item()
        loss = (sums - before_sums)[LOSS].item() / max(seen, 1)
        values = {"loss": loss}
        if before_at is not None and at > before_at:
            values["images_per_s"] = (index - before_index) * self.batch_images / (at - before_at)
        bar.set_postfix({"loss": f"{loss:.3g}", **({"img/s": f"{values['images_per_s']:.0f}"}
                                                  if "images_per_s" in values else {})})
        if epoch is not None and self.log is not None:
            optimizer_step = epoch * self.state.steps_per_epoch + index // self.args.accumulate
            values["lr"] = self.state.optimizer.param_groups[0]["lr"]
            self.log({f"step/{name}": value for name, value in values.items()}, optimizer_step)
            if self.state.tracker is not None:  # --track's runs (rank 0's), each step once across a resume
                self.state.tracker.log_step(values, optimizer_step)
        return sums, index, at
