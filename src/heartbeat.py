"""Naming the rank that stopped answering: when a collective waits for a rank that never comes (killed
without torchrun noticing, stopped with SIGSTOP, stuck in a disk read), the others end within
--dist-timeout with one line that says which rank, where it was and when it was last heard from,
instead of a timeout traceback that names no one (docs/reliability.md).

Every rank of a process group keeps where its main thread is (Heartbeat.at(): the phase, the
epoch, the micro-batch; a Python assignment, no device work), and a daemon thread writes it with
the time into the store of the launcher's rendezvous when it changed (looking every LOOK seconds)
and at least every BEAT seconds: a rank that is stopped or dead stops writing, a rank stuck in its
main thread keeps writing the same place. On a GPU the host runs ahead of the device (NCCL's
collectives do not make it wait), so the place written is the device's: at() also records a CUDA
event, and the thread writes the place of the last event the GPU has reached (query(), no wait),
or the host's where the GPU has done everything queued. The thread makes this rank's GPU its own
before it asks any event (torch.cuda.set_device, as torch's pin-memory thread does): a new thread's
CUDA calls go to GPU 0, where every rank would otherwise open a CUDA context of its own (hundreds of
MB each on GPU 0). When this rank's place has not changed for
nearly --dist-timeout (it waits in a collective), the thread reads every rank's beat: the ranks
whose beat is stale, or whose place is behind this rank's, did not arrive. The lowest rank among
the others says so in one line, and they end with exit code 1 before the collective's own timeout
(gloo's raises a traceback; NCCL's watchdog aborts the process), each first dumping its flight
recorder (torch's record of its last collectives: dump_flight_recorder).

A stop on a signal that cannot be agreed (src/stopping.py: the agreement needs every rank) ends
the same way: when a stop signal has been pending for STALE seconds and a rank has not been heard
from for as long, the others end at once instead of waiting for the launcher's SIGKILL (torchrun
waits 30 s after its SIGTERM). The signal is seen here even while the main thread waits in a
collective, where Python's handler cannot run (StopSignals.pending_since).
"""
import collections
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:  # torch is imported where a GPU is watched: the heartbeat of a CPU run does without it
    import torch

BEAT = 2.0  # seconds between two writes of a rank's place, at most
LOOK = 0.25  # seconds: the thread looks at the place this often, and writes it when it changed
STALE = 3 * BEAT + 1  # a rank not heard from for this long has stopped answering
EXIT_HUNG = 1
# The order of the phases inside an epoch, for "behind": every rank goes through them in turn.
ORDER = {"starting": 0, "training": 1, "validating": 2, "validating the average": 3, "saving": 4}
END = 10 ** 9  # the index of a pass that has ended
# CUDA events in flight at most (places the host is ahead of the GPU): older ones are dropped.
RECORDED = 4096
# Where a flight recorder's dump goes, as torch's own dump on a timeout writes it: this + the rank.
DUMP_PREFIX = "/tmp/nccl_trace_rank_"

def described(place: tuple) -> dict:
    """A place as a beat holds it: its order among the places of a run and its words."""
    phase, epoch, index, step, loading = place
    if phase == "starting":
        where = "its start, before training"
    elif phase == "training" and index < END:
        where = f"epoch {epoch + 1} step {step + 1} ({'loading its data' if loading else 'training'})"
    else:
        where = f"epoch {epoch + 1} ({phase}" + (f", batch {index + 1})" if index < END else ", done)")
    return {"order": [epoch, ORDER[phase], index, 0 if loading else 1], "where": where}


class Heartbeat:
    """This rank's beat in the launcher's store, and the watch for a collective that waits for a
    rank that does not come (see the module's docstring). Use it as a context manager: the thread
    runs inside the block. In a world of one (or without a store) it only keeps the place."""

    def __init__(self, store=None, rank: int = 0, world_size: int = 1, timeout_s: float = 0.0, device=None):
        self.store, self.rank, self.world_size, self.timeout_s = store, rank, world_size, timeout_s
        self.place = ("starting", -1, 0, 0, False)  # (phase, epoch, index, step, loading)
        self.changed = time.monotonic()
        self.epoch = -1  # the epoch of the last training pass: a validation pass belongs to it
        self.thread: threading.Thread | None = None
        self.done = threading.Event()
        self.cuda = getattr(device, "type", None) == "cuda"
        self.device = device  # this rank's GPU: the thread's CUDA calls go there
        self.recording = False  # CUDA events are recorded while the thread reads them
        # (place, its event), oldest first: places the GPU has not reached
        self.recorded: collections.deque[tuple[tuple, torch.cuda.Event]] = collections.deque()
        self.reached = self.place  # the last place the GPU has reached
        # When a stop signal came (time.monotonic()), None before: StopSignals.pending_since.
        self.stop_pending: Callable[[], float | None] | None = None
        # Where the line that ends the process goes besides stderr, before it ends (train_ray.py's
        # workers: to the driver, which ends the run with it), None: stderr only.
        self.tell: Callable[[str], None] | None = None

    def at(self, phase: str, epoch: int | None = None, index: int = 0, step: int = 0, loading: bool = False) -> None:
        """The main thread is now in `phase` ("training": micro-batch `index`, optimizer step `step`
        of `epoch`, counted from 0; `loading`: waiting for that batch's data; index END: the pass is
        over). Two assignments: cheap enough for every micro-batch."""
        if phase == "training" and epoch is not None:
            self.epoch = epoch
        self.place = place = (phase, self.epoch if epoch is None else epoch, index, step, loading)
        self.changed = time.monotonic()
        if self.recording:  # the GPU gets here once it has done what the host queued before
            import torch
            event = torch.cuda.Event()
            event.record()
            self.recorded.append((place, event))
            if len(self.recorded) > RECORDED:
                self.recorded.popleft()

    def __enter__(self) -> "Heartbeat":
        if self.store is not None and self.world_size > 1:
            self.at("starting")
            self.done.clear()
            self.recording = self.cuda
            if self.cuda and self.device.index is None:  # "cuda": the GPU this (main) thread uses
                import torch
                self.device = torch.device("cuda", torch.cuda.current_device())
            self.thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        """Stop the thread (before the process group ends)."""
        if self.thread is not None:
            self.done.set()
            self.thread.join(timeout=2 * BEAT)
            self.thread = None

    def where(self) -> tuple:
        """The place to tell: on a GPU, the last place whose event the GPU has reached (asked, not
        waited for), or the host's once the GPU has done all it was given; else the host's."""
        while self.recorded:
            place, event = self.recorded[0]
            if not event.query():
                return self.reached
            self.reached = place
            self.recorded.popleft()
        return self.place

    def _run(self) -> None:
        store, rank, timeout_s = self.store, self.rank, self.timeout_s
        written, when, moved, looked = None, 0.0, time.monotonic(), 0.0
        if self.cuda:  # before the first event is asked: this thread's CUDA calls on this rank's GPU
            import torch
            torch.cuda.set_device(self.device)
        try:
            while not self.done.is_set():
                place, now = self.where(), time.monotonic()
                if place is not written or now - when >= BEAT:
                    store.set(f"beat/{rank}", json.dumps({**described(place), "time": time.time()}))
                    moved = now if place is not written else moved
                    written, when = place, now
                if now - moved > timeout_s - margin(timeout_s):
                    line, printer = judge(read_beats(store, self.world_size), rank, time.time(), timeout_s)
                    if line is not None:
                        _end(line if printer else None, rank, self.tell)
                        return
                pending = self.stop_pending() if self.stop_pending is not None else None
                if pending is not None and now - pending > STALE and now - looked >= BEAT:
                    looked = now
                    line, printer = judge_stop(read_beats(store, self.world_size), rank, time.time())
                    if line is not None:
                        _end(line if printer else None, rank, self.tell)
                        return
                self.done.wait(LOOK)
        except Exception:  # the store went away (the launcher ended): nothing left to watch
            return
        finally:
            self.recording = False
            self.recorded.clear()


def margin(timeout_s: float) -> float:
    """How long before the collective's timeout the thread looks: a tenth of it, 5 s to 60 s."""
    return min(60.0, max(5.0, timeout_s / 10))


def read_beats(store, world_size: int) -> list[dict | None]:
    """Every rank's last beat (None for a rank never heard from)."""
    beats = []
    for rank in range(world_size):
        key = f"beat/{rank}"
        beats.append(json.loads(store.get(key)) if store.check([key]) else None)
    return beats


def _silent(other: int, beat: dict | None, now: float) -> str | None:
    """What is known of a rank not heard from for STALE seconds, or None where it answers."""
    if beat is None:
        return f"rank {other} never answered"
    if now - beat["time"] > STALE:
        return f"rank {other} stopped answering at {beat['where']}; last heard {now - beat['time']:.0f} s ago"
    return None


def judge(beats: list[dict | None], rank: int, now: float, timeout_s: float) -> tuple[str | None, bool]:
    """(the line naming the ranks that did not arrive, whether this rank prints it), or (None, False)
    when every rank is where this one is and answering (then the wait is not theirs to explain)."""
    mine = beats[rank]
    if mine is None:
        raise ValueError(f"judge: rank {rank}'s own beat is missing")  # every rank writes its own before judging
    missing = {}  # rank: what is known of it
    for other, beat in enumerate(beats):
        if other == rank:
            continue
        said = _silent(other, beat, now)
        if said is None and beat is not None and beat["order"] < mine["order"]:
            said = f"rank {other} did not arrive: it is still at {beat['where']}, last heard {now - beat['time']:.0f} s ago"
        if said is not None:
            missing[other] = said
    if not missing:
        return None, False
    printer = min(r for r in range(len(beats)) if r not in missing)
    line = (f"timeout: {'; '.join(missing.values())} (the others wait at {mine['where']}; "
            f"--dist-timeout {timeout_s / 60:g} min)")
    return line, printer == rank


def judge_stop(beats: list[dict | None], rank: int, now: float) -> tuple[str | None, bool]:
    """With a stop signal pending: (the line naming the ranks not heard from for STALE seconds,
    without which no step can be agreed, whether this rank prints it), or (None, False)."""
    missing = {other: said for other, beat in enumerate(beats)
               if other != rank and (said := _silent(other, beat, now)) is not None}
    if not missing:
        return None, False
    printer, mine = min(r for r in range(len(beats)) if r not in missing), beats[rank]
    line = (f"stop: {'; '.join(missing.values())}: no step can be agreed without it, so the others end now, "
            f"last.pth as last saved (the others were at {mine['where'] if mine else 'their start'})")
    return line, printer == rank


def dump_flight_recorder(rank: int) -> str | None:
    """This process's flight recorder, torch's record of its last collectives (NCCL's under NCCL;
    gloo's where torch keeps one), pickled as torch's own dump on a timeout writes it, to
    TORCH_FR_DUMP_TEMP_FILE (or TORCH_NCCL_DEBUG_INFO_TEMP_FILE, or DUMP_PREFIX) + the rank:
    `python -m torch.distributed.flight_recorder.fr_trace FOLDER` reads them. The path written, or
    None where there is nothing to dump (no process group, a torch without the call)."""
    import torch._C._distributed_c10d as c10d
    import torch.distributed as dist
    if not dist.is_initialized():
        return None
    # torch 2.11 and 2.14 name them so (the generic one is newer: a torch without it dumps nothing).
    dump = getattr(c10d, "_dump_nccl_trace" if dist.get_backend() == "nccl" else "_dump_fr_trace", None)
    if dump is None:
        return None
    prefix = (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
              or DUMP_PREFIX)
    try:
        data = dump()
        path = f"{prefix}{rank}"
        with open(path, "wb") as file:
            file.write(data)
    except Exception:  # a dump that fails must not keep the process from ending
        return None
    return path


def _end(line: str | None, rank: int, tell: Callable[[str], None] | None = None) -> None:
    """Print the line (on the rank that says it; and tell() it), dump this rank's flight recorder
    and end the process."""
    if line is not None:
        print(f"\n{line}", file=sys.stderr, flush=True)  # on a line of its own: a progress bar may be drawn
        if tell is not None:
            tell(line)
    path = dump_flight_recorder(rank)
    if path is not None and line is not None:
        print(f"each rank's last collectives: {os.path.dirname(path) or '.'}/{os.path.basename(path)[:-len(str(rank))]}N "
              "(python -m torch.distributed.flight_recorder.fr_trace reads them)", file=sys.stderr, flush=True)
    if line is None:
        time.sleep(3)  # the rank that says it says it first: the launcher stops the others when one ends
    os._exit(EXIT_HUNG)
