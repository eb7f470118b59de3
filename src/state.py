"""The training state of a run, one object in every script: the model, optimizer, gradient scaler,
schedule and weight average, the history of the finished epochs and the place in the current one;
and its verbs, which the scripts call where the reader sees them: resume, save after an optimizer
step, save after an epoch, stop on a signal (docs/reliability.md).

Position: `epoch` epochs are finished and `step` optimizer steps of the next one are done. A step
checkpoint holds what the epoch's last.pth holds, and the steps done in the unfinished epoch, each
rank's metric sums of them and the seconds they took. Nothing random is saved: dropout and
augmentation are functions of (seed, epoch, sample), so a resumed epoch that skips the finished
steps' samples draws what an uninterrupted run draws.

A step checkpoint is written in the background (src/checkpoint_writer.py): the next steps train
while it goes to disk; every other write of last.pth, a stop and the end of the training block
wait for it first. Under FSDP (sharded parameters) every save gathers the whole tensors onto rank
0 first (src/fsdp.py), so every rank calls the saves; rank 0 alone writes, there in the training
thread.
"""
import contextlib
import time
from typing import Iterator, NoReturn

import torch
import torch.distributed as dist

from src import checkpoint
from src.checkpoint_writer import CheckpointWriter
from src.errors import Stopped
from src.fsdp import is_sharded, whole_average, whole_model, whole_optimizer
from src.heartbeat import Heartbeat
from src.history import epoch_record
from src.outputs import atomic_torch_save, output_paths
from src.ranks import is_first
from src.stopping import StopSignals, how_to_go_on, signal_name


class TrainingState:
    """What a run trains and where it is; see the module's docstring."""

    def __init__(self, args, info: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler, schedule, average, steps_per_epoch: int, heartbeat: Heartbeat | None = None):
        self.args, self.info = args, info
        self.model, self.optimizer, self.scaler, self.schedule, self.average = model, optimizer, scaler, schedule, average
        self.steps_per_epoch = steps_per_epoch
        self.heartbeat = heartbeat or Heartbeat()
        self.history: list[dict] = []
        self.epoch, self.step = 0, 0  # epochs finished; optimizer steps done in the next one
        self.partial = None  # a resumed epoch's finished steps: this rank's sums, their seconds and data wait
        self.began = time.time()  # when this process began the current epoch's training
        self.data_wait = 0.0  # seconds this process waited for its training data in the current epoch
        self.signals: StopSignals | None = None
        self.writer = CheckpointWriter()  # rank 0's step checkpoints, in the background

    # Resume.

    def resume(self) -> None:
        """--resume (or a worker that torchrun restarted, a requeued SLURM job): last.pth into the
        model, optimizer, scaler, schedule and weight average; the history and the place in the
        epoch it stopped in. Without last.pth, nothing."""
        model = self.model
        if is_sharded(self.optimizer):  # each rank loads its pieces of the whole tensors
            from src.fsdp import WholeModel, WholeOptimizer
            model, optimizer = WholeModel(self.model), WholeOptimizer(self.model, self.optimizer)
        else:
            optimizer = self.optimizer
        resumed = checkpoint.load_last(self.args, self.info, model, optimizer, self.scaler, self.schedule, self.average)
        self.history, self.partial = resumed.history, resumed.partial
        self.epoch = len(self.history)
        self.step = self.partial["step"] if self.partial else 0

    def epoch_sums(self, device: torch.device) -> torch.Tensor:
        """The metric sums (src.metrics.batch_sums) an epoch's training starts from: zeros, or in a
        resumed epoch this rank's sums of its finished steps. Starts the epoch's clocks."""
        sums = torch.zeros(4, device=device)
        self.began, self.data_wait = time.time(), 0.0
        if self.partial is not None:
            sums += self.partial["sums"].to(device)
            self.data_wait = self.partial["data_wait_seconds"]
        return sums

    def train_seconds(self) -> float:
        """The seconds of the current epoch's training so far, with a resumed epoch's earlier ones."""
        return (self.partial["train_seconds"] if self.partial else 0.0) + time.time() - self.began

    # Save.

    @property
    def run_step(self) -> int:
        """The optimizer steps of the run so far."""
        return self.epoch * self.steps_per_epoch + self.step

    def checkpoint_due(self) -> bool:
        """Whether --save-every-steps asks for last.pth after this step (an epoch's last step is
        saved by the epoch's end, after validation)."""
        every = self.args.save_every_steps
        return bool(every) and self.run_step % every == 0 and self.step < self.steps_per_epoch

    def save_step(self, sums: torch.Tensor) -> None:
        """last.pth here, inside the epoch; best.pth, history.json and the plot stay those of the last
        finished epoch. Every rank calls it: each rank's sums go into the file (gathered where they
        are: no host read), and FSDP's shards are gathered. Rank 0 writes it in the background."""
        partial = {"sums": _every_rank(sums), "train_seconds": self.train_seconds(),
                   "data_wait_seconds": self.data_wait}
        last = self._last_state(step=self.step, partial=partial)
        if is_first():
            self.heartbeat.at("saving")
            if is_sharded(self.optimizer):  # gathered into new host tensors: written here, as at an epoch's end
                self.writer.wait()
                atomic_torch_save(last, output_paths(self.args)["last"])
            else:
                self.writer.save(last, output_paths(self.args)["last"])

    def record(self, train_sums: torch.Tensor, val_sums: torch.Tensor, average_sums: torch.Tensor | None,
               train_seconds: float, val_seconds: float) -> dict:
        """The finished epoch's history record (src.history.epoch_record): with a resumed epoch's
        earlier seconds and data wait; the learning rate after its last step."""
        earlier = self.partial["train_seconds"] if self.partial else 0.0
        return epoch_record(epoch=self.epoch, train_sums=train_sums, val_sums=val_sums, average_sums=average_sums,
                            train_seconds=earlier + train_seconds, val_seconds=val_seconds,
                            data_wait_seconds=self.data_wait, lr=self.optimizer.param_groups[0]["lr"])

    def save_epoch(self, record: dict, model_state: dict | None = None) -> bool:
        """The epoch is finished: its record joins the history, and rank 0 writes best.pth if it
        is the best so far, best.json, last.pth, history.json and the plot. Returns whether it is
        the best so far (on rank 0; False elsewhere). `model_state`: the plain model's state_dict
        where the script gathered it (FSDP: get_model_state_dict); else model.state_dict().
        Every rank calls it."""
        self.history.append(record)
        self.epoch, self.step, self.partial = self.epoch + 1, 0, None
        last = self._last_state(model_state=model_state)
        if not is_first():
            return False
        self.heartbeat.at("saving")
        self.writer.wait()  # a step's last.pth still being written must not land after this one
        return checkpoint.write_epoch(self.args, self.history, self.info, last["model"], last, last["average"])

    def _last_state(self, step: int = 0, partial: dict | None = None, model_state: dict | None = None) -> dict:
        """last.pth's content now (whole tensors: gathered on every rank under FSDP; rank 0 has them)."""
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile's wrapper: the plain names
        if is_sharded(self.optimizer):
            model_state = whole_model(model) if model_state is None else model_state
            optimizer_state, average_state = whole_optimizer(model, self.optimizer), whole_average(model, self.average)
        else:
            model_state = model.state_dict() if model_state is None else model_state
            optimizer_state, average_state = self.optimizer.state_dict(), self.average.state_dict()
        return checkpoint.last_state(self.history, model_state, optimizer_state, average_state, self.scaler,
                                     self.schedule, self.info, step, partial)

    # Stop.

    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[StopSignals]:
        """The block in which SIGTERM, SIGUSR1 and Ctrl-C stop the run at an optimizer step that every
        rank agrees on (src/stopping.py); their handlers are put back when it ends, after the step
        checkpoint being written is on disk (however the block ends)."""
        self.signals = StopSignals()
        with self.signals:
            self.heartbeat.stop_pending = self.signals.pending_since  # a stop no rank can agree on ends
            try:
                yield self.signals
            except BaseException:
                with contextlib.suppress(Exception):  # the error in flight is the one to tell
                    self.writer.wait()
                raise
            finally:
                self.heartbeat.stop_pending = None
            self.writer.wait()

    def stop_agreed(self, now: bool = False) -> bool:
        """Whether a stop signal came to any rank and every rank stops here: after an optimizer step
        (every few steps, without waiting: src/stopping.py), or `now` (a blocking agreement, at the
        start of an epoch). Every rank calls it at the same places."""
        if self.signals is None:
            return False
        return self.signals.agreed_now() if now else self.signals.agreed_at(self.run_step)

    def stop(self) -> NoReturn:
        """Every rank ends here, after the step or epoch last.pth holds: rank 0 says where and how to
        go on, and no rank leaves before the file is there (exit code 75, src/errors.py)."""
        last = output_paths(self.args)["last"]
        self.writer.wait()  # the stop's step checkpoint is on disk before anyone says so
        if self.step:
            where = f"at epoch {self.epoch + 1} step {self.step} of {self.steps_per_epoch}: {last} saved there"
        elif self.epoch:
            where = f"after epoch {self.epoch} of {self.args.epochs}: {last} holds it"
        else:
            where = "before its first epoch: nothing to save"
        if is_first():
            import sys

            from src.progress import close_bars
            close_bars()
            print(f"stopped by {signal_name(self.signals.agreed)} {where}; {how_to_go_on(self.args.command)}", file=sys.stderr, flush=True)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
        raise Stopped()


def _every_rank(sums: torch.Tensor) -> torch.Tensor:
    """Every rank's metric sums, one row per rank, on every rank, where they are (all_gather: no
    host read; the checkpoint's copy brings them to the host)."""
    mine = sums.detach().float().clone()  # the loop goes on adding to `sums`
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine.unsqueeze(0)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    return torch.stack(rows)
