"""What guards Ray Train's calls in train_ray.py's workers: the processes Ray Train starts, one per
--num-workers, each running train_loop_per_worker in a thread of a Ray actor, in the process group
Ray made (the driver's side is src/ray_driver.py).

- A stop or bad input ends a worker's loop without an exception: an exception is a failed worker,
  which Ray Train answers by restarting the group (FailureConfig), and bad input would fail the
  same way each time. A worker whose collective fails because another ended on bad input ends
  quietly (src.errors: the note in the process group's store).
- The driver's stop request reaches rank 0 through the RunControl actor, read in a thread.
- The heartbeat's line that names a worker that stopped answering goes to RunControl before its
  worker ends: the driver ends the run with it where Ray Train gives up on the group.
- Each checkpoint is reported to Ray Train (ray.train.report with rank 0's folder holding the
  last.pth just written); Ray keeps it in storage_path, where every node sees it. When Ray
  restarts the workers after a lost one, ray.train.get_checkpoint() is the last one reported:
  rank 0 puts its last.pth beside --checkpoint where it is newer than the one there (a new pod
  has an empty disk), and every rank resumes from it as after a torchrun restart.
"""
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from src.config import Config
from src.errors import (
    EXIT_STOPPED,
    Stopped,
    UserError,
    another_rank_said_why,
    end_group_after_the_note,
    end_process_group,
    ignore_pillow_warnings,
    mark_ended,
    one_line,
    tell_the_other_ranks,
)

if TYPE_CHECKING:
    from src.heartbeat import Heartbeat
    from src.state import TrainingState
    from src.stopping import StopSignals

POLL = 0.5  # seconds between rank 0's reads of the driver's stop request


def on_this_worker(args: Config, control: Any, checkpoint: Any) -> Config:
    """The driver's flags as this worker runs them: --workers counted on this worker's node (the
    driver's node may have other CPUs), torch's threads those Ray gives it. When Ray Train
    restarted the workers (the driver's RunControl counts the groups; or Ray hands back a
    checkpoint, `checkpoint`) the run resumes
    as after a torchrun restart (src.ranks.restarted: from the newest last.pth, which --overwrite
    does not remove again, with or without --resume). A checkpoint that rank 0 reported just
    before it died may not have reached Ray Train: the count says it all the same. Every rank calls it."""
    import ray
    import torch

    from src.cli import cap_workers
    from src.devices import available_cpus, default_workers
    from src.ranks import from_rank_0, mark_restarted_by_ray
    # The threads Ray gives the worker (OMP_NUM_THREADS: its CPUs, 1 by default, as torchrun's
    # processes have): a worker process that started before Ray set it (one Ray reuses after a
    # restart) would keep torch's default, the node's CPUs, and sum in another order.
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    given = any(word == "--workers" or word.startswith("--workers=") for word in args.command)
    args = dataclasses.replace(args, workers=cap_workers(args.workers if given else default_workers(), available_cpus()))
    if from_rank_0(lambda: ray.get(control.group_started.remote())) or checkpoint is not None:
        mark_restarted_by_ray()
    return args


@contextlib.contextmanager
def worker_outcome() -> Iterator[dict]:
    """The block of a worker's run; the dict it yields is what the worker returns to the driver:
    {} finished, {"exit": 75} stopped, {"exit": 2, "error": line} bad input said here (rank 0's
    reaches the driver, which prints it; another rank prints its own), {"exit": 2} bad input said
    by another rank. Anything else is raised: a failed worker, for Ray Train's FailureConfig."""
    outcome: dict = {}
    try:
        with warnings.catch_warnings():  # as src.errors.run_command: Pillow's warnings filtered once, for the worker
            ignore_pillow_warnings()
            yield outcome
    except Stopped:
        outcome["exit"] = EXIT_STOPPED
    except UserError as error:
        outcome["exit"] = 2
        if error.quiet:  # another rank said it (or says it now): it may end its store once this one has ended
            mark_ended()
            end_process_group()
        else:
            tell_the_other_ranks()
            outcome["error"] = one_line(error)
            if os.environ.get("RANK", "0") != "0":
                print(f"error: {outcome['error']}", file=sys.stderr, flush=True)
            end_group_after_the_note()  # the others, waiting in a collective, fail now and find the note
    except Exception:
        if not another_rank_said_why():
            raise
        outcome["exit"] = 2
        mark_ended()  # the note is read: the rank that left it may end its store
        end_process_group()


@contextlib.contextmanager
def driver_link(control: Any, signals: "StopSignals", heartbeat: "Heartbeat") -> Iterator[None]:
    """The worker's side of RunControl. Within the block, rank 0 reads the driver's stop request
    every POLL seconds in a thread and raises its own stop flag (`signals`, the run's
    src.stopping.StopSignals): the ranks' agreement carries it to every rank at an optimizer step.
    And the line of `heartbeat` that ends this worker for a rank that stopped answering goes to the
    driver (RunControl.hung) too, delivered before the worker ends (at most 30 s)."""
    import ray
    heartbeat.tell = lambda line: ray.get(control.hung.remote(line), timeout=30)
    done = threading.Event()

    def listen() -> None:
        while not done.wait(POLL):
            try:
                number = ray.get(control.requested.remote(), timeout=60)
            except ray.exceptions.GetTimeoutError:  # a busy machine: ask again
                continue
            except Exception:  # the driver is gone (its actor with it): Ray ends the workers
                return
            if number:
                signals.requested = signals.requested or number
                return
    thread = None
    if os.environ.get("RANK", "0") == "0":
        thread = threading.Thread(target=listen, name="driver stops", daemon=True)
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread is not None:
            thread.join()


@contextlib.contextmanager
def saved_last(state: "TrainingState") -> Iterator[str | None]:
    """On rank 0, a folder holding the last.pth just saved (once its background write is on disk:
    a hard link where the file system allows it, else a copy), for ray.train.report's checkpoint,
    which Ray copies into storage_path; None on the other ranks, which report no checkpoint.

    Every rank first hears from rank 0 through the process group (its folder, or the error of its
    write), and only then calls ray.train.report: the report is a barrier of Ray's own, outside the
    process group and without a timeout (Ray 2.60: RAY_TRAIN_COLLECTIVE_TIMEOUT_S unset), that
    src.errors' end of the group does not reach. A rank 0 that failed before (its save: a full
    disk) or here leaves the others in this collective, which fails with its group, not in
    Ray's barrier until --dist-timeout."""
    from src.ranks import from_rank_0, is_first
    folder = from_rank_0(lambda: _linked_last(state))
    try:
        yield folder if is_first() else None
    finally:
        if is_first():
            shutil.rmtree(folder, ignore_errors=True)


def _linked_last(state: "TrainingState") -> str:
    """Rank 0: a new folder beside last.pth holding it, once its background write is on disk."""
    from src.outputs import cannot_write, output_paths
    state.writer.wait()
    last = output_paths(state.args)["last"]
    folder = tempfile.mkdtemp(prefix=".ray-report-", dir=last.parent)
    try:
        try:
            os.link(last, Path(folder) / last.name)
        except OSError:
            shutil.copy2(last, Path(folder) / last.name)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        raise UserError(cannot_write(Path(folder) / last.name, error)) from None
    return folder


def restore_last(args: Config, folder: str) -> None:
    """Rank 0: Ray Train's last reported last.pth (in `folder`) beside --checkpoint, where it is
    newer than the last there (or there is none: a new node, an emptied disk)."""
    from src.checkpoint import last_position
    from src.outputs import atomic_write, output_paths
    from src.ranks import is_first
    if not is_first():
        return
    reported = last_position(Path(folder))
    here = output_paths(args)["last"]
    if reported is None or (last_position(here.parent) or (-1, -1)) >= reported:
        return
    with open(Path(folder) / here.name, "rb") as source:
        atomic_write(here, lambda file: shutil.copyfileobj(source, file))
