"""The training state of a run, one object in every script: the model, optimizer, gradient scaler,
schedule and weight average, the history of the finished epochs and the place in the current one;
and its verbs, which the scripts call where the reader sees them: resume, save after an optimizer
step, save after an epoch, stop on a signal (docs/reliability.md).

Position: `epoch` epochs are finished and `step` optimizer steps of the next one are done. A step
checkpoint holds what the epoch's last.pth holds, and the steps done in the unfinished epoch, each
rank's metric sums of them and the seconds they took. Nothing random is saved: dropout and
augmentation are functions of (seed, epoch, sample), so a resumed epoch that skips the finished
steps' samples draws what an uninterrupted run draws.

A step checkpoint is written in the background: rank 0's last.pth by src/checkpoint_writer.py
(the next steps train while it goes to disk; every other write of last.pth, a stop and the end of
the training block wait for it first). Under FSDP (sharded parameters) `last` is a folder of
torch.distributed.checkpoint (DCP), last.dcp, in which each rank writes its own shards
(src/sharded_checkpoint.py), with the DCP call the script passes (`write`: dcp.async_save for step
checkpoints, dcp.save at an epoch's end); best.pth holds whole tensors, which the script gathers.
Every rank calls the saves; rank 0 alone writes the files that are not shards.
"""
import contextlib
import time
from typing import Any, Callable, Iterator, NoReturn

import torch
import torch.distributed as dist

from src import checkpoint, sharded_checkpoint
from src.checkpoint_writer import CheckpointWriter
from src.config import Config
from src.errors import Stopped
from src.fsdp import WholeModel, WholeOptimizer, broadcast_buffers, is_sharded, whole_average
from src.heartbeat import Heartbeat
from src.history import best_choice, epoch_record
from src.outputs import output_paths
from src.ranks import from_rank_0, is_first
from src.stopping import StopSignals, how_to_go_on, signal_name
from src.tracking import Tracker


class TrainingState:
    """What a run trains and where it is; see the module's docstring."""

    def __init__(self, args: Config, info: dict, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scaler, schedule, average, steps_per_epoch: int, heartbeat: Heartbeat | None = None):
        self.args, self.info = args, info
        self.model, self.optimizer, self.scaler, self.schedule, self.average = model, optimizer, scaler, schedule, average
        self.steps_per_epoch = steps_per_epoch
        self.heartbeat = heartbeat or Heartbeat()
        self.history: list[dict] = []
        self.epoch, self.step = 0, 0  # epochs finished; optimizer steps done in the next one
        self.partial: dict | None = None  # a resumed epoch's finished steps: this rank's sums, their seconds and data wait
        self.began = time.time()  # when this process began the current epoch's training
        self.data_wait = 0.0  # seconds this process waited for its training data in the current epoch
        self.signals: StopSignals | None = None
        self.tracker: Tracker | None = None  # --track: the run's Tracker
        self.tracked_ids: dict | None = None  # last.pth's ids of its tracked runs
        self.writer = CheckpointWriter()  # rank 0's step checkpoints (last.pth), in the background
        self.shard_writer = sharded_checkpoint.ShardWriter()  # FSDP's last.dcp, one save at a time

    # Resume.

    def resume(self) -> None:
        """--resume (or a worker that torchrun restarted, a requeued SLURM job): last.pth into the
        model, optimizer, scaler, schedule and weight average; the history and the place in the
        epoch it stopped in. Without last.pth, nothing."""
        model: torch.nn.Module | WholeModel = self.model
        optimizer: torch.optim.Optimizer | WholeOptimizer = self.optimizer
        shards = None
        if is_sharded(self.optimizer):  # each rank loads its pieces: of a last.dcp, or of any mode's last.pth
            model, optimizer = WholeModel(self.model), WholeOptimizer(self.model, self.optimizer)
            shards = self._load_shards
        resumed = checkpoint.load_last(self.args, self.info, model, optimizer, self.scaler, self.schedule, self.average,
                                       shards=shards)
        self.history, self.partial, self.tracked_ids = resumed.history, resumed.partial, resumed.tracked_ids
        self.epoch = len(self.history)
        self.step = self.partial["step"] if self.partial else 0

    def _load_shards(self, folder, updates: int | None) -> list[str]:
        """A last.dcp into this rank's shards (at any world size); the names of the weights that
        are not finite in them."""
        sharded_checkpoint.load_shards(folder, self.model, self.optimizer, self.average, updates)
        from src.divergence import non_finite
        return non_finite(sharded_checkpoint.local_tensors(self.model.state_dict()))

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
        return every is not None and self.run_step % every == 0 and self.step < self.steps_per_epoch

    def save_step(self, sums: torch.Tensor, write: Callable | None = None) -> None:
        """last.pth here, inside the epoch; best.pth, history.json and the plot stay those of the last
        finished epoch. Every rank calls it: each rank's sums go into the file (gathered where they
        are: no host read). Rank 0 writes last.pth in the background; under FSDP last.dcp, each rank
        writing its shards with `write` (dcp.async_save: the next steps run while they are written)."""
        partial = {"sums": _every_rank(sums), "train_seconds": self.train_seconds(),
                   "data_wait_seconds": self.data_wait}
        if is_sharded(self.optimizer):
            self._save_shards(write, step=self.step, partial=partial)
            return
        if not is_first():  # the one collective the save needs is behind: rank 0 alone builds and writes last.pth
            return
        self.heartbeat.at("saving")
        self.writer.save(self._last_state(step=self.step, partial=partial, held=True), output_paths(self.args)["last"])

    def record(self, train_sums: torch.Tensor, val_sums: torch.Tensor, average_sums: torch.Tensor | None,
               train_seconds: float, val_seconds: float) -> dict:
        """The finished epoch's history record (src.history.epoch_record): with a resumed epoch's
        earlier seconds and data wait; the learning rate after its last step."""
        earlier = self.partial["train_seconds"] if self.partial else 0.0
        return epoch_record(epoch=self.epoch, train_sums=train_sums, val_sums=val_sums, average_sums=average_sums,
                            train_seconds=earlier + train_seconds, val_seconds=val_seconds,
                            data_wait_seconds=self.data_wait, lr=self.optimizer.param_groups[0]["lr"])

    def new_best(self, record: dict) -> str | None:
        """What best.pth will hold once the finished epoch's `record` joins the history: "weights" or
        "average" where the epoch is the best so far (by --best-by), None where best.pth stays as it
        is. The same on every rank (the records' validation sums are every rank's, all-reduced): a
        gather for best.pth, a collective, is made on every rank or on none."""
        best, weights = best_choice([*self.history, record], self.args.best_by)
        return weights if best["epoch"] == record["epoch"] else None

    def save_epoch(self, record: dict, model_state: dict | None = None, write: Callable | None = None) -> bool:
        """The epoch is finished: its record joins the history, and rank 0 writes best.pth if it
        is the best so far, best.json, last.pth, history.json and the plot. Returns whether it is
        the best so far (on rank 0; False elsewhere). `model_state`: the plain model's state_dict
        where the script gathered it (FSDP: get_model_state_dict); else model.state_dict().
        Under FSDP last.dcp instead of last.pth, each rank writing its shards with `write` (dcp.save).
        Every rank calls it."""
        self.history.append(record)
        self.epoch, self.step, self.partial = self.epoch + 1, 0, None
        if is_sharded(self.optimizer):
            is_best = self._save_epoch_shards(model_state, write)
        else:
            if not is_first():  # rank 0 alone builds and writes last.pth: no collective in it
                return False
            last = self._last_state(model_state=model_state)
            self.heartbeat.at("saving")
            self.writer.wait()  # a step's last.pth still being written must not land after this one
            is_best = checkpoint.write_epoch(self.args, self.history, self.info, last["model"], last, last["average"])
        if self.tracker is not None:  # rank 0's
            self.tracker.log_epoch(record)  # after its files: a stop between them logs it at the resume
        return is_best

    def _save_epoch_shards(self, model_state: dict | None, write: Callable | None) -> bool:
        """save_epoch under FSDP: best.pth and best.json first (rank 0; the whole weights or their
        average gathered only where best.pth is to hold them: the script gathers the weights, see
        new_best), then last.dcp, then history.json and the plot: a last that has the epoch comes
        after the best.pth that weighed it."""
        model = getattr(self.model, "_orig_mod", self.model)
        best, weights = best_choice(self.history, self.args.best_by)
        new_best = best["epoch"] == self.epoch
        if new_best and weights == "weights" and model_state is None:  # each rank holds pieces: only the script's
            raise ValueError("save_epoch of a new best of a sharded model needs its whole state_dict "
                             "(get_model_state_dict)")
        average = whole_average(model, self.average) if new_best and weights == "average" else None  # every rank
        is_best = False
        if is_first():
            self.heartbeat.at("saving")
            is_best = checkpoint.write_best(self.args, self.history, self.info, model_state, average)
        self._save_shards(write)
        if is_first():
            checkpoint.write_history(self.args, self.history)
        return is_best

    def _save_shards(self, write: Callable | None, step: int = 0, partial: dict | None = None) -> None:
        """last.dcp here: each rank writes its shards with `write` (dcp.save by default), rank 0
        training.pt (last.pth's content but the tensors); an older last.pth beside it goes."""
        model = getattr(self.model, "_orig_mod", self.model)
        broadcast_buffers(model)  # rank 0's batch norm statistics, as best.pth holds them (DCP keeps one rank's)
        shards = sharded_checkpoint.shards_of(model, self.optimizer, self.average)
        training = None
        if is_first():
            self.heartbeat.at("saving")
            average = {"updates": self.average.counted()} if self.average.on else None
            # Nothing read from the device here (partial's sums, the scaler's scale): the save's staging
            # copies them with the shards, and training.pt is written after those copies (_Writer)
            training = checkpoint.last_state(self.history, None, None, average, self.scaler, self.schedule,
                                             self.info, step, partial, held=True)
            training = {key: value for key, value in training.items() if key not in ("model", "optimizer")}
        if write is None:
            import torch.distributed.checkpoint as dcp
            write = dcp.save
        self.shard_writer.save(write, sharded_checkpoint.folder_of(self.args), shards, training, self.run_step,
                               replaces=output_paths(self.args)["last"])

    def _last_state(self, step: int = 0, partial: dict | None = None, model_state: dict | None = None,
                    held: bool = False) -> dict:
        """last.pth's content now (of a model that is not sharded); `held`: the weight average's
        tensors where the device holds them, for the writer's copies (a step checkpoint: the host
        does not wait), else a host copy (an epoch's, which best.pth may take)."""
        model = getattr(self.model, "_orig_mod", self.model)  # torch.compile's wrapper: the plain names
        model_state = model.state_dict() if model_state is None else model_state
        optimizer_state = self.optimizer.state_dict()
        average_state = self.average.held() if held else self.average.state_dict()
        return checkpoint.last_state(self.history, model_state, optimizer_state, average_state, self.scaler,
                                     self.schedule, self.info, step, partial, held=held)

    # Track (--track, src/tracking.py).

    def track(self, tracker: Tracker, accelerator: Any = None) -> None:
        """Starts the run's tracked runs (rank 0's `tracker`; the others' tracks nothing), or after
        resume() continues those last.pth names, logging the resumed epochs they lack; their ids
        go into every last.pth and best.json from here on, and save_epoch logs each epoch.
        `accelerator`: under accelerate, after its init_trackers."""
        self.tracker = tracker
        # rank 0's ids on every rank, or its refusal (a saved run missing from the store): no rank trains on
        ids = from_rank_0(lambda: tracker.start(self.tracked_ids, self.info, self.history, accelerator=accelerator))
        if ids:  # the saved ids of a run not tracked now too: a later --resume --track goes on with them
            self.info = {**self.info, "tracking": ids}

    # Stop.

    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[StopSignals]:
        """The block in which SIGTERM, SIGUSR1, SIGHUP and Ctrl-C stop the run at an optimizer step that
        every rank agrees on (src/stopping.py); their handlers are put back when it ends, after the step
        checkpoint being written (rank 0's last.pth, FSDP's dcp.async_save) is on disk (however the
        block ends)."""
        self.signals = StopSignals()
        with self.signals:
            self.heartbeat.stop_pending = self.signals.pending_since  # a stop no rank can agree on ends
            try:
                yield self.signals
            except BaseException:
                for writer in (self.writer, self.shard_writer):
                    with contextlib.suppress(Exception):  # the error in flight is the one to tell
                        writer.wait()
                raise
            finally:
                self.heartbeat.stop_pending = None
            self.writer.wait()
            self.shard_writer.wait()

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
        self.shard_writer.wait()  # FSDP's step checkpoint, written while the last steps ran
        last = output_paths(self.args)["last"]
        self.writer.wait()  # the stop's step checkpoint is on disk before anyone says so
        if is_sharded(self.optimizer):
            last = sharded_checkpoint.folder_of(self.args)
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
            agreed = self.signals.agreed if self.signals is not None else 0  # stop_agreed() set them
            print(f"stopped by {signal_name(agreed)} {where}; {how_to_go_on(self.args.command)}", file=sys.stderr, flush=True)
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
