"""--profile: torch.profiler over a few training steps on rank 0, a trace that TensorBoard or
Perfetto opens, and a one-screen table of where the steps' time went.

The profiler skips the first steps of the first training pass (allocator, cuDNN autotuning and the
loader's first batches), warms itself up, then records a few steps ("ProfilerStep#N" ranges, each
one loop iteration: the progress report, the wait for the batch, its forward, backward and,
on a step's last micro-batch, the optimizer). It writes, into `<--log-dir or the checkpoint's
folder>/profile/`: rank0.pt.trace.json (Perfetto, chrome://tracing, or TensorBoard's profiler
plugin: `tensorboard --logdir that/folder`), profile.md (the table) and profile.json (the same
figures, for src.tools.benchmark).

What the table's numbers mean (`breakdown` computes them from the profiler's events):

Host columns: the recorded steps' wall time on rank 0, cut into parts that add up to it. The
"training threads" are the main thread and autograd's threads (on a CPU, backward runs on the
main thread; on a GPU on one autograd thread per device). At each instant the part is the first
of these that applies:
  data wait      inside the loop's "data wait" range (src/progress.py): waiting for the loader.
  communication  a training thread is inside a collective (c10d::*, gloo:*, nccl:*, DDP's buffer
                 broadcast in its forward, DataParallel's Broadcast/Scatter/Gather/
                 ReduceAddCoalesced), or no training thread is running an op while a
                 collective is in flight on the backend's own threads (gloo runs DDP's bucket
                 all-reduces there, overlapping backward; only the time the training thread
                 then waits for them is counted, so nothing is counted twice). Its rows under it
                 split it by collective.
  optimizer      inside Optimizer.step#... or Optimizer.zero_grad#....
  backward       inside an autograd node (autograd::engine::evaluate_function: ...), or between
                 the step's first autograd node and the end of its last one or of DDP's reducer
                 copies (the engine's own overhead).
  forward        from the end of the data wait to the first autograd node: the batch's copy to
                 the device and normalisation, the model's forward and the loss.
  other          the rest: the progress bar and metric sums, gradient clipping, the LR schedule,
                 the profiler's own step.
The line under the table gives the time any collective was in flight on the backend's threads
(overlapping the parts above, so not a part of its own).

GPU columns (CUDA runs): what rank 0's GPU did during the same wall time. Each kernel, memcpy and
memset is put in the part of the host op that launched it (found through the runtime call that
launched it); NCCL kernels are communication. Where kernels overlap, compute (backward, forward,
optimizer, other) wins over communication, so GPU "communication" is the time the GPU did
nothing but communicate (the all-reduce not hidden behind backward); "idle" is the time no
kernel ran (e.g. waiting for data). On a GPU the host columns are mostly launch time: the host runs
ahead of the GPU, so the GPU columns say where the time went.
"""
import bisect
import collections
import json
import os
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerAction, ProfilerActivity

from src.config import Config
from src.errors import UserError

WAIT, WARMUP, ACTIVE = 2, 2, 6  # steps skipped, warmed up (profiled but discarded), recorded
CATEGORIES = ("data wait", "forward", "backward", "optimizer", "communication", "other")
TRACE, TABLE, FIGURES = "rank0.pt.trace.json", "profile.md", "profile.json"

# DataParallel's autograd Functions (torch/nn/parallel/_functions.py) appear under their class names.
DATA_PARALLEL = {"Broadcast": "broadcast", "Scatter": "scatter", "Gather": "gather",
                 "ReduceAddCoalesced": "reduce"}
BACKWARD = "autograd::engine::evaluate_function:"
OPTIMIZER = ("Optimizer.step#", "Optimizer.zero_grad#")
REDUCER = ("torch.distributed.ddp.reducer::", "torch::distributed::reducer::")  # DDP's bucket copies
DEVICE_WORK = {"kernel", "gpu_memcpy", "gpu_memset"}  # kineto activity types that occupy the GPU
LAUNCHES = {"cuda_runtime", "cuda_driver"}


def schedule_for(cycles: int | None) -> tuple[int, int, int] | None:
    """(wait, warmup, active) steps for a pass with `cycles` whole steps after the profiler
    starts (None: unknown, the defaults); None when there is no whole step to record.

    A short epoch gets a shorter profile rather than none: the recorded steps shrink first (to
    cycles - 2), then the warm-up, then the skipped steps.
    """
    if cycles is None or cycles >= WAIT + WARMUP + ACTIVE:
        return WAIT, WARMUP, ACTIVE
    if cycles < 1:
        return None
    active = max(1, min(ACTIVE, cycles - 2))
    warmup = max(0, min(WARMUP, cycles - active - 1))
    wait = max(0, min(WAIT, cycles - active - warmup))
    return wait, warmup, active


def collective(name: str) -> str | None:
    """The kind of collective an op or kernel name is ("all-reduce", "broadcast", ...), or None."""
    if name in DATA_PARALLEL:
        return DATA_PARALLEL[name]
    lower = name.lower()
    if not (lower.startswith(("c10d::", "gloo:", "nccl:")) or "nccl" in lower):
        return None
    flat = lower.replace("_", "").replace("-", "")
    for key, kind in (("allreduce", "all-reduce"), ("reducescatter", "reduce-scatter"),
                      ("allgather", "all-gather"), ("alltoall", "all-to-all"),
                      ("broadcast", "broadcast"), ("barrier", "barrier"), ("sendrecv", "send/recv"),
                      ("send", "send/recv"), ("recv", "send/recv"), ("reduce", "reduce"),
                      ("scatter", "scatter"), ("gather", "gather")):
        if key in flat:
            return kind
    return "other collective"


def _role(name: str) -> str:
    """What a host op is for the breakdown: a category, "reducer", "step" or "busy"."""
    if name == "data wait":
        return "data wait"
    if collective(name):
        return "communication"
    if name.startswith(OPTIMIZER):
        return "optimizer"
    if name.startswith(BACKWARD):
        return "backward"
    if name.startswith(REDUCER):
        return "reducer"
    if name.startswith("ProfilerStep"):
        return "step"
    return "busy"


def _is_cpu(event) -> bool:
    return event.device_type == torch.autograd.DeviceType.CPU


def _sweep(window: tuple[float, float], spans: Iterable[tuple[float, float, tuple]]) -> list:
    """[(start, end, active keys)] covering `window`: the keys of the spans active in each piece."""
    low, high = window
    changes = collections.defaultdict(list)
    for start, end, key in spans:
        start, end = max(start, low), min(end, high)
        if start < end:
            changes[start].append((key, 1))
            changes[end].append((key, -1))
    changes.setdefault(low, [])
    changes.setdefault(high, [])
    active: collections.Counter = collections.Counter()
    pieces = []
    times = sorted(changes)
    for time, following in zip(times, times[1:]):
        for key, delta in changes[time]:
            active[key] += delta
        pieces.append((time, following, [key for key, count in active.items() if count > 0]))
    return pieces


def _phases(step: tuple[float, float], host: list, training: set) -> list[tuple[float, float, str]]:
    """The step's forward phase (end of its data wait to its first autograd node) and backward
    phase (first autograd node to the end of the last one or of DDP's reducer copies)."""
    low, high = step
    inside = [e for e in host if low <= e.time_range.start < high]
    waits = [e.time_range.end for e in inside if e.name == "data wait"]
    backward = [e for e in inside if e.thread in training and _role(e.name) == "backward"]
    forward_start = max(waits) if waits else low
    if not backward:
        return [(forward_start, high, "forward")]
    backward_start = min(e.time_range.start for e in backward)
    backward_end = max([e.time_range.end for e in backward]
                       + [e.time_range.end for e in inside if e.thread in training
                          and _role(e.name) == "reducer" and e.time_range.start >= backward_start])
    return [(forward_start, backward_start, "forward"), (backward_start, min(backward_end, high), "backward")]


def breakdown(events: list, device_index: int | None = None) -> dict | None:
    """Where the recorded steps' time went, from the profiler's events (`profile.events()`).

    Returns {"steps", "wall_seconds", "backend", "host": {"seconds": {category: s},
    "communication": {kind: s}, "in_flight_seconds"}, "device": the same with "idle", or None}
    (see the module's docstring), or None when no step was recorded. `device_index`: the GPU
    whose kernels make the device columns (None: no device columns).
    """
    steps = [e for e in events if _is_cpu(e) and e.name.startswith("ProfilerStep")]
    if not steps:
        return None
    main = steps[0].thread
    windows = sorted((e.time_range.start, e.time_range.end) for e in steps if e.thread == main)
    host = [e for e in events if _is_cpu(e) and getattr(e, "activity_type", None) not in LAUNCHES]
    training = {main} | {e.thread for e in host if _role(e.name) == "backward"}
    # A profile cut short by the end of the pass (Profiler.finish) ends with the loop's tail, a
    # "step" without training in it: left out, as long as some step trained.
    starts = sorted(e.time_range.start for e in host if e.thread in training and _role(e.name) == "backward")
    windows = [(low, high) for low, high in windows
               if bisect.bisect_left(starts, low) < bisect.bisect_left(starts, high)] or windows
    backends = sorted({e.name.split(":")[0] for e in host if e.name.startswith(("gloo:", "nccl:"))})

    phases = sorted(phase for window in windows for phase in _phases(window, host, training))
    rank = {"data wait": 0, "communication": 1, "optimizer": 2, "backward": 3, "busy": 4, "reducer": 4}
    # 7: below everything; a communication key holds collective()'s kind, None where it knows none
    spans: list[tuple[float, float, tuple[int, str | None]]] = [(start, end, (7, phase)) for start, end, phase in phases]
    for e in host:
        role = _role(e.name)
        if role == "step":
            continue
        if e.thread in training and not e.is_async:
            key = (rank[role], collective(e.name) if role == "communication" else role)
        elif role == "communication":  # on the backend's threads, or an async range
            key = (5, collective(e.name))
        else:
            continue  # other threads: the pin-memory thread, DataParallel's replica threads
        spans.append((e.time_range.start, e.time_range.end, key))

    seconds: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    in_flight = 0.0
    for window in windows:
        for start, end, keys in _sweep(window, spans):
            length = (end - start) / 1e6
            phase = next((label for level, label in keys if level == 7), "other")
            work = [key for key in keys if key[0] < 7]
            if any(level == 5 for level, _ in work):
                in_flight += length
            level, label = min(work) if work else (7, phase)
            if level == 1 or level == 5:
                seconds["communication"] += length
                kinds[label] += length
            elif level in (0, 2, 3):
                seconds[label] += length
            else:  # an uncategorised op on a training thread, or none running
                seconds[phase] += length
    result = {"steps": len(windows), "wall_seconds": sum(end - start for start, end in windows) / 1e6,
              "backend": ", ".join(backends),
              "host": {"seconds": {c: seconds[c] for c in CATEGORIES}, "communication": dict(kinds),
                       "in_flight_seconds": in_flight},
              "device": None}
    if device_index is not None:
        result["device"] = _device_breakdown(events, host, windows, phases, device_index)
    return result


def _device_breakdown(events: list, host: list, windows: list, phases: list, index: int) -> dict | None:
    """The GPU columns: each kernel in the category of the host op that launched it."""
    work = [e for e in events if not _is_cpu(e) and e.device_index == index
            and getattr(e, "activity_type", None) in DEVICE_WORK | {None}]
    if not work:
        return None
    # Kernels and the runtime calls that launched them share a correlation id; a kernel also
    # names the host op around its launch (linked_correlation_id), which may have been merged into
    # its parent by the profiler's post-processing, hence the runtime call first.
    launches = {e.id: e for e in events if _is_cpu(e) and getattr(e, "activity_type", None) in LAUNCHES}
    ops = {e.id: e for e in host if not getattr(e, "linked_correlation_id", 0)}
    starts = [start for start, _, _ in phases]

    def phase_at(time: float) -> str:
        i = bisect.bisect_right(starts, time) - 1
        return phases[i][2] if i >= 0 and time < phases[i][1] else "other"

    def category(kernel) -> tuple[str, str | None]:
        kind = collective(kernel.name)
        if kind:
            return "communication", kind
        launch = launches.get(kernel.id) or ops.get(getattr(kernel, "linked_correlation_id", 0))
        if launch is None:
            return "other", None
        roles, node = [], launch
        while node is not None:
            roles.append((_role(node.name), node.name))
            node = node.cpu_parent
        for wanted in ("communication", "optimizer", "backward"):
            for role, name in roles:
                if role == wanted:
                    return wanted, collective(name) if wanted == "communication" else None
        if any(role == "data wait" for role, _ in roles):
            return "other", None
        return phase_at(launch.time_range.start), None

    order = {"backward": 0, "forward": 1, "optimizer": 2, "other": 3, "communication": 4}
    spans = []
    for kernel in work:
        label, kind = category(kernel)
        spans.append((kernel.time_range.start, kernel.time_range.end, (order[label], kind or label)))
    seconds: collections.Counter[str] = collections.Counter()
    kinds: collections.Counter[str] = collections.Counter()
    in_flight = 0.0
    for window in windows:
        for start, end, keys in _sweep(window, spans):
            length = (end - start) / 1e6
            if any(level == 4 for level, _ in keys):
                in_flight += length
            if not keys:
                seconds["idle"] += length
                continue
            level, label = min(keys)
            if level == 4:
                seconds["communication"] += length
                kinds[label] += length
            else:
                seconds[label] += length
    return {"seconds": {c: seconds[c] for c in CATEGORIES if c != "data wait"} | {"idle": seconds["idle"]},
            "communication": dict(kinds), "in_flight_seconds": in_flight}


def table(result: dict, where: str) -> str:
    """The breakdown as a Markdown table with a header line and notes (one screen)."""
    wall = result["wall_seconds"] or 1e-12
    host, device = result["host"], result["device"]

    def cells(view: dict | None, key: str, kinds: bool = False) -> str:
        if view is None:
            return ""
        value = (view["communication"] if kinds else view["seconds"]).get(key)
        return "| | " if value is None else f"| {value:.3f} | {100 * value / wall:.1f}% "

    head = "| where the time went | host s | host % " + ("| GPU s | GPU % " if device else "") + "|"
    steps = f"{result['steps']} training step" + ("s" if result["steps"] != 1 else "")
    lines = [f"--profile: {steps} on {where}, {result['wall_seconds']:.3f} s of wall time",
             "", head, "|---|---|---" + ("|---|---" if device else "") + "|"]
    for category in CATEGORIES:
        device_cells = "" if not device else "| | " if category == "data wait" else cells(device, category)
        lines.append(f"| {category} {cells(host, category)}{device_cells}|")
        if category == "communication":
            names = sorted(set(host["communication"]) | set(device["communication"] if device else ()))
            for kind in names:
                lines.append(f"| - {kind} {cells(host, kind, True)}"
                             f"{cells(device, kind, True) if device else ''}|")
    if device:
        lines.append(f"| idle (GPU) | | {cells(device, 'idle')}|")
    lines.append("")
    note = ("Host: the training thread(s)' wall time, partitioned; communication = inside a collective "
            "or waiting while one is in flight.")
    if result["backend"]:
        note += (f" {result['backend']} collectives were in flight on their own threads for "
                 f"{host['in_flight_seconds']:.3f} s ({100 * host['in_flight_seconds'] / wall:.1f}%), "
                 "overlapping the rows above.")
    lines.append(note)
    if device:
        lines.append(f"GPU: kernels by the host op that launched them; communication = NCCL kernels running "
                     f"with no compute beside them; NCCL kernels ran {device['in_flight_seconds']:.3f} s "
                     "in all.")
    return "\n".join(lines) + "\n"


def profile_folder(args: Config) -> Path:
    """Where --profile writes: `profile/` in --log-dir, or in the checkpoint's folder."""
    return (Path(args.log_dir) if args.log_dir else Path(args.checkpoint).parent) / "profile"


def is_profile(folder: Path) -> bool:
    """Whether profile.json in `folder` is one that --profile wrote (its trace's name and schedule)."""
    try:
        figures = json.loads((folder / FIGURES).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(figures, dict) and figures.get("trace") == TRACE and isinstance(figures.get("schedule"), dict)


def check_profile_folder(args: Config) -> None:
    """Refuse, at the start of a run with --profile, a profile folder that is not a folder (the
    profile was written after its steps, and failed there, the epoch's work lost), or one holding
    the files --profile writes that an earlier profile did not write (a user's profile.md would be
    replaced). An earlier profile is replaced, as the plot is: a view of a run. Only looks."""
    folder = profile_folder(args)
    if os.path.lexists(folder) and not os.path.isdir(folder):
        raise UserError(f"--profile writes into the folder {folder}, which is a file: move it away, or pass "
                        "--log-dir (the profile goes to its profile/)")
    found = [name for name in (TRACE, TABLE, FIGURES) if os.path.lexists(folder / name)]
    if found and not is_profile(folder):
        raise UserError(f"--profile's folder {folder} holds {', '.join(found)}, which --profile did not write: "
                        "move them away, or pass another --log-dir (the profile goes to its profile/)")


class Profiler:
    """Profiles a few training steps of the first training pass; one per run, on rank 0."""

    def __init__(self, args: Config, device: torch.device):
        self.folder = profile_folder(args)
        self.device = device
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        if not torch.cuda.is_available():
            # A CUDA build of torch on a machine without a GPU: kineto logs "gpuGetDeviceCount
            # failed with code 35" (and its start/stop lines) when a trace stops; level 6 is
            # above all of them. Read when the first trace starts; a value the user set is kept.
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self.profile: torch.profiler.profile | None = None
        self.plan: tuple[int, int, int] | None = None  # (wait, warmup, active) of the profiler's schedule
        self.waits: list[float] = []  # the loop's data-wait clock at each step boundary, for profile.json
        self.done, self.stopped = False, False

    def step(self, data_wait: float, batches: int | None = None) -> None:
        """After each training micro-batch; `data_wait`: the pass's seconds of data wait so far;
        `batches`: the micro-batches in the pass, to fit the schedule into a short epoch."""
        if self.done:
            return
        self.waits.append(data_wait)
        if self.profile is None:  # the profiler's step 0 is the loop's second batch
            self.plan = schedule_for(None if batches is None else batches - 1)
            if self.plan is None:
                print(f"--profile: a pass of {batches} batch(es) has no whole step to record; no profile")
                self.done = True
                return
            self.profile = torch.profiler.profile(activities=self.activities, schedule=self._action,
                                                  on_trace_ready=self._ready)
            self.profile.start()
            return
        self.profile.step()

    def finish(self) -> None:
        """At the end of a training pass: a profile cut short by the pass's end is written as it is."""
        if self.profile is not None and not self.stopped:
            self.stopped = True
            recording = self.profile.current_action in (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)
            self.profile.stop()  # while recording, calls _ready with the steps recorded so far
            if not recording and not self.done:
                print("--profile: the pass ended before a step was recorded; no profile")
        self.done = True

    def _action(self, step: int) -> ProfilerAction:
        if self.plan is None:  # the profiler that calls it is made after the plan
            raise RuntimeError("--profile: the schedule is read before it is planned")
        wait, warmup, active = self.plan
        if step < wait:
            return ProfilerAction.NONE
        if step < wait + warmup:
            return ProfilerAction.WARMUP
        if step < wait + warmup + active - 1:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == wait + warmup + active - 1 else ProfilerAction.NONE

    def _ready(self, profile: torch.profiler.profile) -> None:
        self.done = True
        try:
            self._write(profile)
        except OSError as error:
            raise UserError(f"--profile: cannot write {self.folder} ({error.strerror or error})") from None

    def _write(self, profile: torch.profiler.profile) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / TRACE
        profile.export_chrome_trace(str(trace))
        index = (self.device.index if self.device.index is not None else torch.cuda.current_device()) \
            if self.device.type == "cuda" else None
        result = breakdown(list(profile.events()), index)
        if result is None:
            print(f"--profile: no step recorded; trace {trace}")
            return
        if self.plan is None:
            raise RuntimeError("--profile: a trace is written before the schedule is planned")
        wait, warmup, _ = self.plan
        first = wait + warmup  # the waits list holds the clock at the start of each profiler step
        if len(self.waits) > first:
            result["data_wait_by_clock_seconds"] = self.waits[-1] - self.waits[first]
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        where = f"rank {rank} of {world} ({self.device.type})"
        text = table(result, where)
        text += (f"Trace: {trace} (ui.perfetto.dev, chrome://tracing, or "
                 f"tensorboard --logdir {self.folder}); figures in {self.folder / FIGURES}.\n")
        (self.folder / TABLE).write_text(text)
        schedule = dict(zip(("wait", "warmup", "active"), self.plan))
        (self.folder / FIGURES).write_text(json.dumps(
            {**result, "rank": rank, "world_size": world, "device_type": self.device.type,
             "trace": TRACE, "schedule": schedule}, indent=2) + "\n")
        print(text, flush=True)
