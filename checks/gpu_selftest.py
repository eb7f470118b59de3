"""`make test-gpu`: on a machine with NVIDIA GPUs, what the CPU test suite cannot check.

    python checks/gpu_selftest.py [--quick] [--only KEY,...] [--out gpu-selftest]

Each check prints its part of the report when it ends and rewrites OUT/report.md and
OUT/report.json (per check: its verdict, the modes that failed, its lines and figures; torch,
CUDA and the GPUs), so that a run cut short still says what passed. Exits 1 if a check failed. On
a machine without a CUDA GPU it prints one line and exits 0, claiming nothing.

The runs train SqueezeNet 1.1 (no batch norm: a batch split over ranks computes what the whole
batch does) at 64 px on 640 synthetic images (512 train) for 2 epochs, the first with the backbone
frozen (--freeze-epochs 1), with every recipe flag on (augment, label smoothing, clipping, 2
micro-batches a step, weight decay, warm-up and cosine), --deterministic, 2 loader workers a
process and the pixel --cache (built once, before the launches). Optimizer steps 1 and 3 are
skipped in every run (the hook OVERFLOW_AT: an fp16 scaler finds an inf and halves its scale, a
float32 run does not step), so that fp16 and float32 runs take the same steps. The launches run
PARALLEL at a time (the GPU and the 16 cores of the machine it was planned for hold that many
small runs); each gets --dist-timeout 1 (3 compiled), so that a collective nobody joins fails with
its own error well before the launch's limit.

The checks (KEY: what), with their launches on one GPU (planned at START_UP s a launch, COMPILED
with --compile, PARALLEL at once; `plan()` counts them, and the CPU suite holds the sums under 6
and, --quick, 3 minutes):
1. gpu: on the GPU, in this process: fused SGD (both optimizers' kernel asserted) after a skipped
   first step (and the same without its zero momentum, which must end NaN), fused AdamW's step
   count, a CPU AdamW state resumed into fused AdamW, every GPU's dropout seed, DataParallel's
   replicas in bf16 (two replicas in threads on one GPU; on 2+ GPUs real DataParallel: dtype,
   channels-last weights, distinct dropout masks), pinned host copies, --sync-bn's layer against
   torch's SyncBatchNorm (the same results; no host synchronisation in its training step, where
   torch's mask makes some); FSDP's peak memory under --amp (a figure); and one launch:
   train_accelerate.py --deterministic with a dynamo backend, which must find TF32 matmuls turned
   on by Accelerator() and off at its first step;
2. agreement (4 launches): train_single.py vs two DDP ranks and two FSDP2 ranks sharing GPU 0 over
   gloo (SHARE_GPUS=1) at the same global batch, within the CPU suite's TOLERANCE of the distance
   to another global batch (a fourth launch); on 2+ GPUs DDP, FSDP2, accelerate and DataParallel
   over all GPUs too; every leg runs even when one fails;
3. fp16: --amp fp16 with SGD (one device, two DDP ranks and two FSDP ranks sharing the GPU) ends
   within 0.1 of that distance from the float32 run of the same steps with its logits in float16,
   and AdamW (one device and DDP; 4 more launches, not with --quick) closer to its float32 run
   than its bf16 run ends;
4. sync: no host synchronisation in a step: each mode with --amp fp16 and AdamW (accelerate:
   --mixed_precision fp16), and with SGD one device and two DDP and two FSDP ranks sharing the
   GPU (check 3's runs), runs training micro-batches SYNC_WINDOW of both epochs, a --log-every
   report included, under torch.cuda.set_sync_debug_mode("warn"): the hook records where each
   synchronisation came from, and a read-back of its own (the control) must be among them.
   FSDP's SGD steps unfused (no fused SGD for DTensors), so its gradient scaler reads the
   overflow flag on the host once a step: allowed there alone (docs/gpus.md);
5. compile (2 compiled launches, not with --quick): ResNet-18 with --compile --channels-last
   --amp bf16 learns; it and two FSDP ranks sharing the GPU with --compile run every convolution
   and Linear layer of every forward inside compiled graphs (the COMPILE_OPS_LOG hook counts);
6. resume (2 launches, not with --quick): with dropout on, a run resumed from the straight run's
   epoch-1 last.pth ends where the straight run does (within TOLERANCE of check 2's distance).
The training modes are listed once (MODES); a new mode is one entry there and its name in AGREE
and SYNC.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HOOKS = str(ROOT / "tests" / "hooks")
TOLERANCE = 1e-3  # the CPU suite's (tests/conftest.py): modes agree to this share of `far`
# fp16 keeps 11 significant bits where bfloat16 keeps 8, so an fp16 run must end at least as close
# to float32 as the CPU suite holds bf16 to (0.1 of far; measured 0.025 there). Momentum made of
# uninitialised memory ends non-finite or orders of magnitude away.
FP16_TOLERANCE = 0.1
# AdamW's first steps move each weight by about +-lr whatever its gradient's size, so a rounding
# that flips a small gradient's sign moves that weight by 2 lr: the distance from float32 grows
# with the share of flipped signs, which grows with the unit roundoff. fp16's is 1/8 of bf16's,
# so an fp16 run ends closer to float32 than the bf16 run of the same steps (on the CPU: 0.48 of
# it, and SGD 0.05; a share of `far` would not do: 0.12 for AdamW there).
ADAMW_FP16_TOLERANCE = 1.0
START_UP, COMPILED, IN_PROCESS, DATA = 20, 40, 20, 5  # seconds planned a launch, a compiled one, check 1, the data
PARALLEL = 4  # launches at once
# Minutes a rank waits in a collective (--dist-timeout), and the seconds after which a launch is
# stopped: a hung collective fails first, with its own error, and torchrun has time to end the others.
DIST_TIMEOUT, COMPILED_DIST_TIMEOUT, TEARDOWN = 1, 3, 90
SHM = 64 * 2**20  # Docker's default /dev/shm
IMAGES, SIZE, WORKERS, SKIPPED = 640, 64, 2, "1,3"
# Training micro-batches, of every epoch, under set_sync_debug_mode. Not micro-batch 2:
# DDP rebuilds its gradient buckets in the first forward after the first synchronised backward
# (micro-batch 2 with --accumulate 2), once per wrapped model, with a blocking copy to the host.
SYNC_WINDOW = "3:8"
# The one host read allowed in a step, and where: FSDP's SGD is foreach (torch 2.14.1 has no fused
# SGD for DTensors), so GradScaler reads the overflow flag before stepping it (docs/gpus.md).
SCALER_READ = "_maybe_opt_step"
RECIPE = ["--augment", "--label-smoothing", "0.1", "--clip-grad-norm", "1.0", "--accumulate", "2",
          "--weight-decay", "0.01", "--lr-schedule", "cosine", "--warmup-epochs", "0.5", "--freeze-epochs", "1"]
BASE = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", str(SIZE), "--epochs", "2",
        "--lr", "0.001", "--deterministic", "--workers", str(WORKERS), *RECIPE]


def _python(processes: int) -> list[str]:
    return [sys.executable]


def _torchrun(processes: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]


def _accelerate(processes: int) -> list[str]:
    more = ["--multi_gpu", "--main_process_port", "0"] if processes > 1 else []  # port 0: a free one
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), *more]


def _first_gpu() -> str:
    return (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]


def _shared_gpu() -> dict:
    """Two ranks on the first GPU, over gloo on the loopback (one machine: no interface to guess)."""
    return {"SHARE_GPUS": "1", "CUDA_VISIBLE_DEVICES": _first_gpu(), "GLOO_SOCKET_IFNAME": "lo"}


@dataclass
class Mode:
    """A way to train: its script, how many processes on `gpus` GPUs, the launcher of that many."""
    script: str
    processes: Callable[[int], int]
    launcher: Callable[[int], list[str]]
    env: Callable[[], dict] = dict
    one_device_each: bool = True  # one GPU per process (or all GPUs in one process): on 1 GPU, single's computation


# The training modes; a new one is an entry here and its name in AGREE and SYNC.
MODES = {
    "single": Mode("train_single.py", lambda gpus: 1, _python),
    "dp": Mode("train_dp.py", lambda gpus: 1, _python),
    "ddp": Mode("train_ddp.py", lambda gpus: gpus, _torchrun),
    # Two ranks on one GPU, over gloo (NCCL refuses two ranks on one device): a real batch split on one GPU.
    "ddp-shared": Mode("train_ddp.py", lambda gpus: 2, _torchrun,
                       _shared_gpu, one_device_each=False),
    "fsdp": Mode("train_fsdp.py", lambda gpus: gpus, _torchrun),
    # FSDP2 over two ranks on one GPU: each holds half of every weight (gloo, as ddp-shared).
    "fsdp-shared": Mode("train_fsdp.py", lambda gpus: 2, _torchrun,
                        _shared_gpu, one_device_each=False),
    "accelerate": Mode("train_accelerate.py", lambda gpus: gpus, _accelerate),
}
# Compared with single (on 1 GPU: the shared ones alone).
AGREE = ["ddp-shared", "fsdp-shared", "ddp", "fsdp", "accelerate", "dp"]
# With AdamW and fp16 under the sync check. On one GPU ddp and fsdp are worlds of one over NCCL
# (FSDP then copies where it would reduce-scatter), the shared ones two ranks over gloo, whose own
# threads copy through the host (they are not this process's Python: the hook does not count
# them). DataParallel on one GPU calls the model directly, as train_single.py does: not there.
SYNC = ["single", "dp", "ddp", "fsdp", "accelerate", "ddp-shared", "fsdp-shared"]
# With SGD and fp16 (check 3's runs) under the sync check too.
SYNC_SGD = ["single", "ddp-shared", "fsdp-shared"]


def _synced(gpus: int) -> list[str]:
    """The modes whose AdamW step the sync check runs on `gpus` GPUs."""
    return [mode for mode in SYNC if gpus > 1 or mode != "dp"]


def micro_batch(gpus: int) -> int:
    """The global micro-batch: divisible by every mode's processes (up to `gpus`, and 2)."""
    return 8 * max(2, gpus)


@dataclass
class Run:
    """One launch: a mode with flags (its --batch-size from the global micro-batch), in OUT/name."""
    mode: str
    flags: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    half_batch: bool = False  # half the global micro-batch: another run's `far`
    base: list = field(default_factory=lambda: BASE)
    start_from: str | None = None  # "RUN/FILE": a file of another run, copied to last.pth here first
    compiled: bool = False
    skips: bool = True  # OVERFLOW_AT: steps 1 and 3 skipped (a resumed process would count anew)
    launcher_flags: list = field(default_factory=list)

    def processes(self, gpus: int) -> int:
        return MODES[self.mode].processes(gpus)

    def per_process(self, gpus: int) -> int:
        return micro_batch(gpus) // (2 if self.half_batch else 1) // self.processes(gpus)

    def dist_timeout(self) -> int:
        return COMPILED_DIST_TIMEOUT if self.compiled else DIST_TIMEOUT

    def limit(self) -> int:
        """Seconds after which the launch is stopped: its collectives time out well before."""
        return 60 * self.dist_timeout() + TEARDOWN + (COMPILED if self.compiled else START_UP)


SYNC_ENV = {"SYNC_CHECK_STEPS": SYNC_WINDOW, "SYNC_LOG": "{out}/syncs.json"}
DTYPE_ENV = {"DTYPE_LOG": "{out}/dtypes.txt"}
ADAMW_FP16 = ["--optimizer", "adamw", "--amp", "fp16", "--log-every", "1"]
# SqueezeNet's own dropout, on; a constant rate, so that a run of 1 epoch may be resumed to 2
# Not frozen: a frozen epoch runs in eval mode and draws no dropout mask, so reseeding would not show.
RESUME = ["--dropout", "0.5", "--lr-schedule", "constant", "--warmup-epochs", "0", "--freeze-epochs", "0", "--epochs"]
COMPILE = ["--arch", "resnet18", "--weights", "none", "--image-size", str(SIZE), "--lr", "0.01", "--epochs", "2",
           "--workers", str(WORKERS), "--compile", "--amp", "bf16"]
RUNS = {
    # Check 1's launch: accelerate with a dynamo backend ("eager": dynamo traces, nothing is
    # generated; the launcher sets ACCELERATE_DYNAMO_BACKEND from it) and no mixed precision turns
    # TF32 matmuls on in Accelerator(); --deterministic must have them off when training starts.
    "accelerate-tf32": Run("accelerate", ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", str(SIZE),
                                          "--epochs", "1", "--deterministic", "--workers", str(WORKERS)],
                           {"TF32_LOG": "{out}/tf32.txt"}, base=[], skips=False,
                           launcher_flags=["--dynamo_backend", "eager"]),
    "sgd-single": Run("single", ["--dropout", "0"], DTYPE_ENV),
    "sgd-far": Run("single", ["--dropout", "0"], half_batch=True),
    **{f"sgd-{mode}": Run(mode, ["--dropout", "0"]) for mode in AGREE},
    **{f"sgd-fp16-{mode}": Run(mode, ["--dropout", "0", "--amp", "fp16", "--log-every", "1"], {**DTYPE_ENV, **SYNC_ENV})
       for mode in SYNC_SGD},
    "adamw-single": Run("single", ["--dropout", "0", "--optimizer", "adamw"], DTYPE_ENV),
    "adamw-bf16-single": Run("single", ["--dropout", "0", "--optimizer", "adamw", "--amp", "bf16"], DTYPE_ENV),
    **{f"adamw-fp16-{mode}": Run(mode, ["--dropout", "0", *ADAMW_FP16], {**DTYPE_ENV, **SYNC_ENV}) for mode in SYNC},
    "compile": Run("single", [*COMPILE, "--channels-last"],
                   {"COMPILE_LOG": "{out}/compiled.txt", "COMPILE_OPS_LOG": "{out}/compiled.json"},
                   base=[], compiled=True, skips=False),
    # FSDP shards contiguous weights only: no --channels-last.
    "compile-fsdp-shared": Run("fsdp-shared", COMPILE, {"COMPILE_OPS_LOG": "{out}/compiled.json"},
                               base=[], compiled=True, skips=False),
    # The straight run keeps each epoch's last.pth (the COPY_LAST hook); the resumed run starts
    # from its epoch 1, as a run stopped there would.
    "resume-straight": Run("single", [*RESUME, "2"], {"COPY_LAST": "{out}/epochs"}, skips=False),
    "resume-resumed": Run("single", [*RESUME, "2", "--resume"], start_from="resume-straight/epochs/last.1.pth",
                          skips=False),
}


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, grandchildren...), from /proc."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # The command name (in parentheses) may hold spaces: the fields after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop(launch: subprocess.Popen, wait: float = 10) -> None:
    """Stop a launch and every process below it. torchrun starts each worker in a session (and
    process group) of its own (start_new_session=True), which a signal to the launcher's group
    misses: the process group of each process found below the launcher is signalled (a worker's
    holds its loader workers), and the launcher's own; SIGTERM first, SIGKILL to what is left
    after `wait` s. The processes are listed before the first signal: a worker whose launcher has
    died is no longer below it."""
    pids = [launch.pid, *descendants(launch.pid)]
    for signal_number in (signal.SIGTERM, signal.SIGKILL):
        pids += [pid for pid in descendants(launch.pid) if pid not in pids]
        groups = set()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal_number)
        deadline = time.time() + wait
        while time.time() < deadline and any(map(_running, pids)):
            launch.poll()  # reaps the launcher
            time.sleep(0.1)
        if not any(map(_running, pids)):
            return


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _run(command: list[str], out: Path, env: dict, limit: float, log: str = "log.txt") -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [HOOKS, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "HF_HOME": str(out / "hf"), "PYTHONUNBUFFERED": "1", **env}
    # Its own session: stop() finds what it started from the launcher down.
    launch = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    started, stdout, stderr = time.time(), "", ""
    try:
        stdout, stderr = launch.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        stop(launch)
        with contextlib.suppress(subprocess.TimeoutExpired):
            stdout, stderr = launch.communicate(timeout=10)
        (out / log).write_text(" ".join(command) + f"\n\n(stopped after {limit:.0f} s)\n"
                               + (stdout or "") + (stderr or ""))
        raise subprocess.TimeoutExpired(command, limit) from None
    (out / log).write_text(" ".join(command) + f"\n\n(ran {time.time() - started:.0f} s)\n" + stdout + stderr)
    return subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)


def failure_line(stderr: str) -> str:
    """The line that says why a launch failed: a worker's exception or one-line error, rather
    than torchrun's summary after it."""
    lines = [line.split("\r")[-1] for line in stderr.strip().splitlines()] or ["no output"]
    said = [line for line in lines if re.search(r"(Error|Exception): |error: ", line)
            and "ChildFailedError" not in line] or lines
    return said[-1][-300:]


def command_of(name: str, work: Path, data: Path, gpus: int) -> tuple[list[str], dict]:
    """The command line and the environment of the launch `name`, its outputs in work/name."""
    run, mode, out = RUNS[name], MODES[RUNS[name].mode], work / name
    flags = [*run.base, *run.flags, "--batch-size", str(run.per_process(gpus))]
    if mode.script != "train_single.py" and mode.script != "train_dp.py":
        flags += ["--dist-timeout", str(run.dist_timeout())]
    launcher = [*mode.launcher(run.processes(gpus)), *run.launcher_flags]
    if run.mode == "accelerate" and "--amp" in flags:  # accelerate takes its precision from its launcher
        at = flags.index("--amp")
        launcher += ["--mixed_precision", flags[at + 1]]
        del flags[at:at + 2]
    env = {**mode.env(), "OVERFLOW_AT": SKIPPED if run.skips else "",
           **{key: value.replace("{out}", str(out)) for key, value in run.env.items()}}
    command = [*launcher, mode.script, "--data-dir", str(data), "--cache", str(work / "cache"), *flags,
               "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")]
    return command, env


class Launches:
    """Each Run launched once, PARALLEL at a time (start() submits them ahead of the checks);
    calling it gives the run's folder (OUT/name) or raises the error that names the run, its
    last line and its log."""

    def __init__(self, work: Path, data: Path, gpus: int, parallel: int = PARALLEL, deadline: float = math.inf):
        self.work, self.data, self.gpus, self.deadline = work, data, gpus, deadline
        self.pool = ThreadPoolExecutor(parallel)
        self.futures: dict[str, Future] = {}

    def start(self, names: list[str]) -> None:
        """Submit these launches, each after the one it starts from."""
        for name in names:
            if RUNS[name].start_from:
                self.start([RUNS[name].start_from.split("/", 1)[0]])
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self._launch, name)

    def __call__(self, name: str) -> Path:
        self.start([name])
        outcome = self.futures[name].result()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _launch(self, name: str) -> Path | Exception:
        run, out = RUNS[name], self.work / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if run.start_from:
            source, file = run.start_from.split("/", 1)
            try:
                shutil.copy(self(source) / file, out / "last.pth")
            except (RuntimeError, OSError) as error:
                return RuntimeError(f"{name} did not start: {error}")
        command, env = command_of(name, self.work, self.data, self.gpus)
        log = out / f"log-{name}.txt"
        limit = min(run.limit(), self.deadline - time.time())
        if limit < (COMPILED if run.compiled else START_UP):
            return RuntimeError(f"{name} not run: {max(limit, 0):.0f} s left before the --deadline")
        try:
            result = _run(command, out, env, limit, log=log.name)
        except subprocess.TimeoutExpired:
            return RuntimeError(f"{name} did not end within {limit:.0f} s (log: {log})")
        if result.returncode != 0:
            return RuntimeError(f"{name} failed: {failure_line(result.stderr)} (log: {log})")
        return out


def _model(out: Path) -> dict:
    return _last(out)["model"]


def _last(out: Path) -> dict:
    """A run's last: last.pth, or train_fsdp.py's last.dcp read whole (src.checkpoint.read_last)."""
    from src.checkpoint import read_last
    return read_last(out)


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


def _compared(gpus: int) -> list[str]:
    """The modes that agreement compares with single: on one GPU, those that split the batch."""
    return [mode for mode in AGREE if gpus > 1 or not MODES[mode].one_device_each]


@dataclass
class Result:
    """What a check found: its report lines, its figures (numbers, for report.json), and what
    failed (the modes or parts, by name): it passed if that is empty."""
    lines: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)

    def add(self, line: str, failed: str | None = None) -> None:
        self.lines.append(line if failed is None else f"FAILED {failed}: {line}")
        if failed is not None:
            self.failed.append(failed)


def _legs(result: Result, launch: Launches, names: list[str]) -> dict[str, Path]:
    """The folders of these launches, every one waited for: a launch that failed is a failed leg
    of `result`, named, and the others still count."""
    done = {}
    for name in names:
        try:
            done[name] = launch(name)
        except RuntimeError as error:
            result.add(str(error), failed=name)
    return done


# The checks: each returns a Result and names the launches it needs.

def agreement(launch: Launches, gpus: int, quick: bool) -> Result:
    result = Result()
    legs = _legs(result, launch, ["sgd-single", "sgd-far", *(f"sgd-{mode}" for mode in _compared(gpus))])
    if "sgd-single" not in legs or "sgd-far" not in legs:
        return result
    reference = _model(legs["sgd-single"])
    far = _distance(_model(legs["sgd-far"]), reference)
    result.figures["far"] = far
    result.lines.insert(0, f"global batch {2 * micro_batch(gpus)}; far (global batch {micro_batch(gpus)}) = {far:.4g}")
    for mode in _compared(gpus):
        out = legs.get(f"sgd-{mode}")
        if out is None:
            continue
        share = _distance(_model(out), reference) / far
        result.figures[f"{mode} share of far"] = share
        result.add(f"{mode} ({RUNS[f'sgd-{mode}'].processes(gpus)} processes): {share:.2e} of far "
                   f"(tolerance {TOLERANCE})", None if share < TOLERANCE else mode)
        if MODES[mode].script == "train_fsdp.py":  # each rank held its share of the state, on the GPU
            held = re.search(r"rank 0 held .*? of the [0-9.]+ MB that each DDP process holds",
                             (out / f"log-sgd-{mode}.txt").read_text())
            expected = 1 / RUNS[f"sgd-{mode}"].processes(gpus)
            share_held = float(held.group(0).split(": ")[-1].split(" of the")[0]) if held else None
            result.figures[f"{mode} share held"] = share_held
            result.add(f"{mode}: {held.group(0) if held else 'no memory line'} (expected about {expected:.3f})",
                       None if share_held is not None and abs(share_held - expected) <= 0.02 else f"{mode} memory")
    return result


def logits_dtypes(out: Path) -> set[str]:
    """The dtypes of the logits every rank's loss was computed from (the DTYPE_LOG hook)."""
    log = out / "dtypes.txt"
    return {line.split()[1] for line in log.read_text().splitlines()} if log.exists() else set()


def fp16_learns(launch: Launches, gpus: int, quick: bool) -> Result:
    """fp16 runs against the float32 run of the same steps, as a share of a scale: SGD's distance
    to another global batch, AdamW's bf16 run (see ADAMW_FP16_TOLERANCE); the logits of every
    fp16 run in float16 (and of its float32 reference in float32: the hook sees)."""
    cases = [("sgd-single", "sgd-far", "of far", FP16_TOLERANCE, [f"sgd-fp16-{mode}" for mode in SYNC_SGD])]
    if not quick:
        cases.append(("adamw-single", "adamw-bf16-single", "of bf16's distance", ADAMW_FP16_TOLERANCE,
                      ["adamw-fp16-single", "adamw-fp16-ddp"]))
    result = Result()
    for reference, scale_run, unit, tolerance, names in cases:
        legs = _legs(result, launch, [reference, scale_run, *names])
        if reference not in legs or scale_run not in legs:
            continue
        ref = _model(legs[reference])
        scale = _distance(_model(legs[scale_run]), ref)
        seen = logits_dtypes(legs[reference])
        result.add(f"{reference}: logits in {sorted(seen)}", None if seen == {"float32"} else f"{reference} dtype")
        for name in names:
            if name not in legs:
                continue
            last = _last(legs[name])
            share, loss_scale = _distance(last["model"], ref) / scale, last["scaler"]["scale"]
            dtypes = logits_dtypes(legs[name])
            result.figures[f"{name} share of {scale_run}"] = share
            result.figures[f"{name} loss scale"] = loss_scale
            # Steps 1 and 3 (at least) skipped: the scale halved twice.
            ok = share < tolerance and loss_scale <= 2.0 ** 16 / 4 and dtypes == {"float16"}
            result.add(f"{name}: {share:.3g} {unit} ({scale:.3g}) from {reference} (tolerance {tolerance}); "
                       f"final loss scale {loss_scale:g} (2^16 halved at each skipped step); logits in "
                       f"{sorted(dtypes)} on every rank", None if ok else name)
    return result


def sync_records(out: Path) -> list[dict]:
    """Each rank's record of the synchronisations in its sync windows (the SYNC_LOG hook)."""
    return [json.loads(path.read_text()) for path in sorted(out.glob("syncs.json.*"))]


def judge_syncs(name: str, records: list[dict], processes: int, allowed: set[str]) -> tuple[str, bool]:
    """One run's line and whether it passed: every rank ran its windows (2 epochs), saw its own
    control read-back in each (else it could not have seen anything), and no other host
    synchronisation but those allowed (their function in the call stack)."""
    if len(records) != processes:
        return f"{name}: {len(records)} of {processes} ranks wrote their record", False
    ok, parts = True, []
    for record in records:
        windows, controls = record["windows"], record["control"]
        other = {where: count for where, count in record["syncs"].items()
                 if not any(function in where for function in allowed)}
        kept = sum(count for where, count in record["syncs"].items() if where not in other)
        ok &= windows == 2 and controls == windows and not other
        parts.append(f"rank {record['rank']}: {windows} windows, control seen {controls}x, "
                     + (f"{kept} allowed reads ({', '.join(sorted(allowed))})" if kept else "no allowed read")
                     + (f"; OTHER: {json.dumps(other)}" if other else "; nothing else"))
    return f"{name}: " + "; ".join(parts), ok


def no_syncs(launch: Launches, gpus: int, quick: bool) -> Result:
    result = Result()
    names = _sync_runs(gpus, quick)
    for name, out in _legs(result, launch, names).items():
        allowed = {SCALER_READ} if name == "sgd-fp16-fsdp-shared" else set()
        line, ok = judge_syncs(name, sync_records(out), RUNS[name].processes(gpus), allowed)
        result.add(line, None if ok else name)
        for record in sync_records(out):
            result.figures[f"{name} rank {record['rank']} syncs"] = record["syncs"]
    return result


def _sync_runs(gpus: int, quick: bool) -> list[str]:
    if quick:
        return ["adamw-fp16-single"]
    return [f"adamw-fp16-{mode}" for mode in _synced(gpus)] + [f"sgd-fp16-{mode}" for mode in SYNC_SGD]


def compiled_ops(out: Path) -> list[dict]:
    """Each rank's count of the convolutions and Linear layers run inside compiled graphs (the
    COMPILE_OPS_LOG hook)."""
    return [json.loads(path.read_text()) for path in sorted(out.glob("compiled.json.*"))]


def judge_compiled(name: str, records: list[dict], processes: int) -> tuple[str, bool]:
    """Every forward of the compiled model ran each of its convolutions and Linear layers inside
    a compiled graph, on every rank."""
    if len(records) != processes:
        return f"{name}: {len(records)} of {processes} ranks wrote their count", False
    ok, parts = True, []
    for record in records:
        expected = {kind: record["forwards"] * record[f"{kind} modules"] for kind in ("conv2d", "linear")}
        ok &= record["forwards"] > 0 and all(record[kind] == expected[kind] for kind in expected)
        parts.append(f"rank {record['rank']}: {record['graphs']} graphs; in {record['forwards']} forwards "
                     + ", ".join(f"{record[kind]} {kind} calls compiled of {expected[kind]}" for kind in expected))
    return f"{name}: " + "; ".join(parts), ok


def compiled(launch: Launches, gpus: int, quick: bool) -> Result:
    result = Result()
    legs = _legs(result, launch, ["compile", "compile-fsdp-shared"])
    if "compile" in legs:
        graphs = int((legs["compile"] / "compiled.txt").read_text())
        record = json.loads((legs["compile"] / "history.json").read_text())[-1]
        result.figures.update({"single graphs": graphs, "single val acc": record["val_acc"],
                               "single epoch 2 seconds": record["seconds"]})
        result.add(f"single: {graphs} graph(s) compiled; val acc {record['val_acc']:.3f} (at least 0.8), "
                   f"epoch 2 in {record['seconds']:.1f} s",
                   None if graphs >= 1 and record["val_acc"] >= 0.8 else "single")
    for name, out in legs.items():
        line, ok = judge_compiled(name, compiled_ops(out), RUNS[name].processes(gpus))
        result.add(line, None if ok else f"{name} graphs")
    return result


def resume(launch: Launches, gpus: int, quick: bool) -> Result:
    result = Result()
    legs = _legs(result, launch, ["sgd-single", "sgd-far", "resume-straight", "resume-resumed"])
    if len(legs) == 4:
        far = _distance(_model(legs["sgd-far"]), _model(legs["sgd-single"]))
        share = _distance(_model(legs["resume-resumed"]), _model(legs["resume-straight"])) / far
        result.figures["resumed share of far"] = share
        # Bit for bit where cuDNN's kernels are deterministic; max pooling's backward adds overlapping
        # windows' gradients atomically (warned under --deterministic), which may round in another
        # order. Dropout masks drawn anew would end as far off as another run.
        result.add(f"resumed vs straight: {share:.2e} of far (check 2's; tolerance {TOLERANCE})",
                   None if share < TOLERANCE else "resume")
    return result


@dataclass
class Check:
    key: str
    title: str
    function: Callable
    runs: Callable[[int, bool], list[str]]  # the launches it needs, on `gpus` GPUs, with --quick
    quick: bool = True
    in_process: int = 0  # seconds planned for what it does in this process


CHECKS = [
    Check("gpu", "on the GPU, in this process (and accelerate's TF32)",
          lambda launch, gpus, quick: on_the_gpu(launch, gpus), lambda g, q: ["accelerate-tf32"],
          in_process=IN_PROCESS),
    Check("agreement", "agreement (--deterministic, every recipe flag)", agreement,
          lambda g, q: ["sgd-single", "sgd-far"] + [f"sgd-{m}" for m in _compared(g)]),
    Check("fp16", "fp16 learns", fp16_learns,
          lambda g, q: ["sgd-single", "sgd-far"] + [f"sgd-fp16-{m}" for m in SYNC_SGD]
          + ([] if q else ["adamw-single", "adamw-bf16-single", "adamw-fp16-single", "adamw-fp16-ddp"])),
    Check("sync", "no host synchronisation in a step", no_syncs, lambda g, q: _sync_runs(g, q)),
    Check("compile", "compile compiled", compiled, lambda g, q: ["compile", "compile-fsdp-shared"], quick=False),
    Check("resume", "resume with dropout", resume,
          lambda g, q: ["sgd-single", "sgd-far", "resume-straight", "resume-resumed"], quick=False),
]


def plan(gpus: int, quick: bool, only: list[str] | None = None) -> list[tuple[Check, list[str], int]]:
    """(check, the launches it adds to those before it, its seconds planned): its launches' seconds
    shared among the PARALLEL that run at once (check 1's in-process part runs beside them)."""
    steps, launched = [], set()
    for check in CHECKS:
        if (check.quick or not quick) and (only is None or check.key in only):
            new = [name for name in dict.fromkeys(check.runs(gpus, quick)) if name not in launched]
            launched.update(new)
            seconds = sum(COMPILED if RUNS[name].compiled else START_UP for name in new)
            steps.append((check, new, math.ceil(seconds / PARALLEL) + check.in_process))
    return steps


def shared_memory(gpus: int, names: list[str]) -> int:
    """The most /dev/shm the loader workers of the runs that may run at once hold on a node
    (src.devices's rule for each; the PARALLEL largest together)."""
    from src.devices import shared_memory_need
    needs = sorted((shared_memory_need(WORKERS, RUNS[name].per_process(gpus) * 3 * SIZE * SIZE,
                                       RUNS[name].processes(gpus)) for name in names), reverse=True)
    return sum(needs[:PARALLEL])


# Check 1, in this process.

@contextlib.contextmanager
def _nan_empty_like():
    """torch.empty_like hands out NaN: uninitialised memory that cannot pass for zeros."""
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        tensor = empty_like(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
    torch.empty_like = poisoned
    try:
        yield
    finally:
        torch.empty_like = empty_like


def _three_steps(optimizer, model, device) -> torch.Tensor:
    """An inf gradient, then two finite steps, under the fp16 scaler; the weights after."""
    scaler = torch.amp.GradScaler(device.type)
    for scale in (float("inf"), 1.0, 1.0):
        scaler.scale(model(torch.ones(2, 3, device=device)).sum() * scale).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


def _fused_optimizers(device) -> list[str]:
    from src.cli import parse_args
    from src.recipe import make_optimizer
    ends, optimizers = {}, {}
    with _nan_empty_like():
        for name in ("plain", "ours", "no zeros"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).to(device)
            if name == "ours":
                optimizer = optimizers["sgd"] = make_optimizer(model, parse_args("", ["--lr", "0.1"]), device)
            else:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=name != "plain")
            ends[name] = _three_steps(optimizer, model, device)
        torch.manual_seed(0)
        model = nn.Linear(3, 1).to(device)
        adamw = optimizers["adamw"] = make_optimizer(model, parse_args("", ["--optimizer", "adamw"]), device)
        _three_steps(adamw, model, device)
    off = (ends["ours"] - ends["plain"]).abs().max().item()
    steps = sorted({float(state["step"]) for state in adamw.state.values()})
    kernels = {name: optimizer.defaults["fused"] for name, optimizer in optimizers.items()}
    lines = [f"fused SGD, first step skipped: {off:.2g} from plain SGD; without its zero momentum: "
             f"{'NaN' if ends['no zeros'].isnan().any() else 'finite'} (NaN shows the check bites)",
             f"fused AdamW, first of 3 steps skipped: step count {steps} (expected [2.0])",
             f"make_optimizer's kernels: fused {kernels} (both must be True: the fused ones take the fp16 scaler's "
             "overflow flag as a tensor, the others read it on the host)"]
    assert off <= 1e-5 and all(kernels.values()) and steps == [2.0], lines
    return lines


def _resume_on_the_gpu(device) -> list[str]:
    from src.checkpoint import load_optimizer
    torch.manual_seed(0)
    cpu = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(cpu.parameters())
    cpu(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    outcome = {}
    for name in ("ours", "loaded, then fused"):
        model = nn.Linear(4, 2).to(device)
        fused = torch.optim.AdamW(model.parameters(), fused=True)
        if name == "ours":
            load_optimizer(fused, copy.deepcopy(saved))
        else:  # the old order: load_state_dict places `step` by the saved (CPU) groups
            fused.load_state_dict(copy.deepcopy(saved))
            for group in fused.param_groups:
                group["fused"] = True
        places = sorted({state["step"].device.type for state in fused.state.values()})
        model(torch.randn(3, 4, device=device)).sum().backward()
        try:
            fused.step()
            outcome[name] = f"steps on {places}, a step runs"
        except RuntimeError as error:
            outcome[name] = f"steps on {places}, a step raises {str(error).splitlines()[0][:80]}"
    line = f"CPU AdamW state into fused AdamW on {device}: ours {outcome['ours']}; old order {outcome['loaded, then fused']}"
    assert outcome["ours"] == "steps on ['cuda'], a step runs", line
    return [line]


class _Probe(nn.Module):
    """Records, in whichever thread runs it, the dtype of what it sees."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(x.dtype)
        return x


def _data_parallel(gpus: int, device) -> list[str]:
    from torch.nn.parallel import parallel_apply

    from src.data_parallel import AutocastDataParallel, AutocastReplica
    from src.seeds import derive_seed, seed_epoch
    lines = []
    seen = {"plain": [], "ours": []}
    x = torch.ones(2, 3, 8, 8, device=device)
    with torch.autocast("cuda", torch.bfloat16):
        for name in seen:
            model = nn.Sequential(nn.Conv2d(3, 4, 3), _Probe(seen[name])).to(device)
            replicas = [copy.deepcopy(model) for _ in range(2)]
            if name == "ours":  # made in this thread, as AutocastDataParallel.replicate makes them
                replicas = [AutocastReplica(replica, "cuda") for replica in replicas]
            parallel_apply(replicas, [(x,), (x,)], devices=[device.index, device.index])  # two threads
    lines.append(f"--amp bf16, two replicas in DataParallel's threads on one GPU: ours {sorted(set(map(str, seen['ours'])))}, "
                 f"plain replicas {sorted(set(map(str, seen['plain'])))}")
    assert set(seen["ours"]) == {torch.bfloat16}, lines
    seed_epoch(42, 0)
    seeds = [g.initial_seed() for g in torch.cuda.default_generators]
    lines.append(f"seed_epoch: {len(set(seeds))} distinct dropout seeds on {gpus} GPU(s)")
    assert seeds == [derive_seed(42, 0, 0, gpu) for gpu in range(gpus)], lines
    if gpus > 1:
        formats = []
        # A 3x3 kernel: a 1x1 convolution's weight has the same layout in both memory formats.
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _Probe(seen["ours"]), nn.Flatten(), nn.Dropout(0.5))
        model[0].register_forward_pre_hook(lambda module, inputs: formats.append(
            module.weight.is_contiguous(memory_format=torch.channels_last)))
        dp = AutocastDataParallel(model.to(device, memory_format=torch.channels_last))
        seen["ours"].clear()
        with torch.autocast("cuda", torch.bfloat16):
            out = dp(torch.ones(2 * gpus, 3, 4, 4, device=device).to(memory_format=torch.channels_last))
        masks = (out != 0).view(gpus, 2, -1)
        distinct = len({tuple(mask.flatten().tolist()) for mask in masks})
        lines.append(f"DataParallel over {gpus} GPUs: replicas ran in {sorted(set(map(str, seen['ours'])))}, "
                     f"channels-last weights in {sum(formats)} of {len(formats)}, {distinct} distinct dropout masks")
        assert set(seen["ours"]) == {torch.bfloat16} and all(formats) and distinct == gpus, lines
    return lines


def _pinned(device) -> list[str]:
    """What the project pins on a GPU: the training loaders' batches (run_loaders), the progress
    bar's host copies of the running sums (Progress), the feature cache's host copies (_to_host)."""
    from argparse import Namespace

    from src.freeze import _to_host
    from src.loaders import Data, run_loaders
    from src.progress import Progress
    args = Namespace(batch_size=4, seed=0, workers=0, accumulate=1, augment=False, log_every=10, profile=False,
                     log_dir=None)
    data = Data([(torch.zeros(3, 8, 8, dtype=torch.uint8), 0) for _ in range(8)], list(range(6)), [6, 7], "")
    loader, _ = run_loaders(data.dataset, data, args, device)
    loader.sampler.set_epoch(0)
    batch_pinned = next(iter(loader))[0].is_pinned()
    sums_pinned = all(buffer.is_pinned() for buffer in Progress(args, None, 1, 4, device).buffers)
    copy_pinned = _to_host(torch.ones(4, device=device))[0].is_pinned()
    line = (f"training batches pinned: {batch_pinned}; the progress bar's host sums: {sums_pinned}; "
            f"the feature cache's host copies: {copy_pinned}")
    assert batch_pinned and sums_pinned and copy_pinned, line
    return [line]


def judge_tf32(log: str) -> tuple[str, bool]:
    """What the TF32_LOG hook saw in train_accelerate.py --deterministic with a dynamo backend:
    Accelerator() turned TF32 matmuls on (so the check can bite), and the script's own settings,
    made after it, had them off at the first optimizer step."""
    seen = {}
    for line in log.splitlines():
        rank, when, value = line.split()
        seen.setdefault(when, value == "True")
    ok = seen.get("accelerator") is True and seen.get("step") is False
    said = {True: "on", False: "off", None: "not seen"}
    return (f"train_accelerate.py --deterministic, dynamo backend set: TF32 matmuls {said[seen.get('accelerator')]} "
            f"after Accelerator() (accelerate turns them on), {said[seen.get('step')]} at the first optimizer step"), ok


def _accelerate_tf32(launch: Launches) -> list[str]:
    out = launch("accelerate-tf32")
    log = out / "tf32.txt"
    line, ok = judge_tf32(log.read_text() if log.exists() else "")
    assert ok, line
    return [line]


SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10's warning, once per host synchronisation


def _sync_batch_norm(device) -> list[str]:
    """--sync-bn's layer (src/batch_norm.py) against torch's SyncBatchNorm function (what
    nn.SyncBatchNorm's training forward calls), in a world of one over NCCL, two training steps in
    float32 and in fp16 channels-last with momentum=None (a cumulative average). Both run torch's
    kernels on the same numbers: the outputs, gradients and running statistics agree to a rounding
    (momentum=None's average is a float32 lerp in ours, the kernel's (1 - f) r + f m in torch's: a
    few roundings of the largest value, 4 u). Our second step runs under
    set_sync_debug_mode("error"): a host synchronisation raises; torch's runs under "warn", its
    synchronisations counted (its mask: a figure); a read-back under "error" must raise (the control)."""
    import warnings

    import torch.distributed as dist
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm

    from src.batch_norm import synced_batch_norm
    lines = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        torch.ones(1, device=device).sum().item()
        control = "did not raise"
    except RuntimeError:
        control = "raised"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=device)
    try:
        for case, dtype, layout, momentum in (("float32", torch.float32, torch.contiguous_format, 0.1),
                                              ("fp16 channels-last, momentum=None", torch.float16, torch.channels_last, None)):
            torch.manual_seed(0)
            x = (torch.randn(16, 8, 6, 6, device=device) * 3 + 1).to(dtype=dtype, memory_format=layout)
            grads = [torch.randn_like(x) for _ in range(2)]
            ends, syncs = {}, 0
            for kind in ("torch", "ours"):
                bn = nn.BatchNorm2d(8, momentum=momentum).to(device).train()
                with torch.no_grad():
                    bn.weight.copy_(torch.linspace(0.5, 2.0, 8))
                    bn.bias.copy_(torch.linspace(-0.3, 0.3, 8))
                for step in range(2):  # the first sets up NCCL's communicator and the kernels: not watched
                    mine = x.clone().requires_grad_()
                    bn.zero_grad()
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        torch.cuda.set_sync_debug_mode(("warn" if kind == "torch" else "error") if step else "default")
                        try:
                            if kind == "torch":
                                factor = momentum if momentum is not None else 1 / (step + 1)
                                y = TorchSyncBatchNorm.apply(mine, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                             bn.eps, factor, dist.group.WORLD, 1)
                            else:
                                y = synced_batch_norm(bn, mine)
                            y.backward(grads[step])
                        finally:
                            torch.cuda.set_sync_debug_mode("default")
                    if kind == "torch" and step:
                        syncs = sum(SYNC_MESSAGE in str(warning.message) for warning in caught)
                ends[kind] = {"y": y, "dx": mine.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
                              "running mean": bn.running_mean, "running var": bn.running_var}
            off = {name: ((ends["ours"][name].float() - ref.float()).abs().max()
                          / (4 * torch.finfo(ref.dtype).eps / 2 * ref.float().abs().max())).item()  # 4 u
                   for name, ref in ends["torch"].items()}
            line = (f"--sync-bn's layer against torch's SyncBatchNorm ({case}, a world of one over NCCL): "
                    f"the largest difference {max(off.values()):.3g} of its bound ({max(off, key=off.get)}); "
                    f"our training step ran under set_sync_debug_mode('error'), torch's made {syncs} host "
                    f"synchronisation(s) (its mask); a read-back under 'error' {control} (the control)")
            lines.append(line)
            assert max(off.values()) <= 1 and control == "raised", lines
    finally:
        dist.destroy_process_group()
    return lines


MEMORY_BATCH, MEMORY_SIZE = 8, 32  # VGG16 at 32 px: its weights, not its activations, fill the memory


def _fsdp_amp_memory(device) -> tuple[list[str], dict]:
    """The memory of one FSDP training step of VGG16, rank 0 of two (torch's fake process group:
    the gathers allocate what a real one does, nothing is sent), without autocast and under
    --amp bf16 and fp16. Autocast casts each gathered float32 weight to half precision; the cast
    is saved for the backward and kept in autocast's cache until the autocast region ends, while
    FSDP frees the gathered float32 weights after each unit's forward: at the end of the forward
    a rank may hold a half-precision copy of every weight (VGG16: 268 MB) besides its shards."""
    import torch.distributed as dist
    import torchvision

    from src.cli import parse_args
    from src.fsdp import shard_model
    from src.recipe import make_optimizer
    figures = {}
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        for amp, dtype in (("no", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()
            start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            with torch.device("meta"):  # uninitialised weights: the bytes do not depend on them
                model = torchvision.models.vgg16(num_classes=2)
            model.to_empty(device=device)
            shard_model(model, device)
            optimizer = make_optimizer(model, parse_args("", []), device)
            held = torch.cuda.memory_allocated(device) - start
            with torch.autocast("cuda", dtype, enabled=dtype is not None):
                loss = model(torch.randn(MEMORY_BATCH, 3, MEMORY_SIZE, MEMORY_SIZE, device=device)).float().sum()
            forward = torch.cuda.memory_allocated(device) - start
            loss.backward()
            optimizer.step()
            torch.cuda.synchronize(device)
            figures[amp] = {"shards MB": held / 1e6, "end of forward MB": forward / 1e6,
                            "peak MB": (torch.cuda.max_memory_allocated(device) - start) / 1e6}
            del model, optimizer, loss
    finally:
        dist.destroy_process_group()
        torch.cuda.empty_cache()
    with torch.device("meta"):
        whole = sum(p.numel() for p in torchvision.models.vgg16(num_classes=2).parameters()) * 4 / 1e6
    line = (f"FSDP --amp memory (VGG16, {MEMORY_SIZE} px, batch {MEMORY_BATCH}, rank 0 of 2, MB): "
            + "; ".join(f"{amp}: {f['shards MB']:.0f} with its shards and their optimizer, "
                        f"{f['end of forward MB']:.0f} "
                        f"at the end of the forward, {f['peak MB']:.0f} at the peak" for amp, f in figures.items())
            + f" (the whole float32 weights: {whole:.0f}; a half-precision copy of them: {whole / 2:.0f})")
    return [line], {"fsdp amp memory": figures, "vgg16 float32 weights MB": whole}


def on_the_gpu(launch: Launches, gpus: int) -> Result:
    device = torch.device("cuda", torch.cuda.current_device())
    result = Result()
    parts = {"fused optimizers": lambda: _fused_optimizers(device), "resume": lambda: _resume_on_the_gpu(device),
             "DataParallel": lambda: _data_parallel(gpus, device), "pinned": lambda: _pinned(device),
             "accelerate's TF32": lambda: _accelerate_tf32(launch), "--sync-bn's layer": lambda: _sync_batch_norm(device)}
    for name, part in parts.items():
        try:
            result.lines += part()
        except Exception as error:  # each part reports; the others still run
            result.add(str(error), failed=name)
    try:  # a figure: reported, not judged
        lines, figures = _fsdp_amp_memory(device)
        result.lines += lines
        result.figures.update(figures)
    except Exception as error:
        result.lines.append(f"FSDP --amp memory: not measured ({type(error).__name__}: {str(error)[:200]})")
    torch.backends.cuda.matmul.allow_tf32 = False
    return result


# The report: OUT/report.md to read, OUT/report.json to compare runs.

def entry_markdown(entry: dict) -> str:
    """A check's part of report.md: its verdict and the modes or parts that failed, its lines."""
    failed = f" ({', '.join(entry['failed'])})" if entry["failed"] else ""
    return "\n".join([f"## {entry['number']}. {entry['title']}: {entry['verdict']}{failed}, {entry['seconds']:.0f} s "
                      f"(planned {entry['planned']} s, {len(entry['launches'])} launches)", "",
                      *(f"- {line}" for line in entry["lines"])]) + "\n"


def write_report(work: Path, header: dict, entries: list[dict]) -> str:
    """Write report.md and report.json into `work`; returns the Markdown."""
    lines = [f"# make test-gpu{' --quick' if header['quick'] else ''}, {header['date']}", "",
             f"{len(header['gpus'])} GPU(s): {', '.join(header['gpus'])}; torch {header['torch']}, "
             f"CUDA {header['cuda']}", "",
             f"Planned: {header['launches']} launches, {header['parallel']} at a time, "
             f"{header['planned seconds']} s", ""]
    for entry in entries:
        lines.append(entry_markdown(entry))
    passed = sum(entry["verdict"] == "passed" for entry in entries)
    lines.append(f"{passed} of {len(entries)} checks passed.")
    markdown = "\n".join(lines) + "\n"
    (work / "report.md").write_text(markdown)
    (work / "report.json").write_text(json.dumps({**header, "passed": passed, "checks": entries}, indent=1,
                                                 default=str) + "\n")
    return markdown


def run_check(check: Check, number: int, launch: Launches, gpus: int, quick: bool, new: list[str],
              planned: int) -> dict:
    """Run one check; its report entry. An exception of its own is a failed check, named."""
    began = time.time()
    try:
        result = check.function(launch, gpus, quick)
    except Exception as error:  # a failed check is reported; the others still run
        result = Result()
        result.add(f"{type(error).__name__}: {error}", failed=check.key)
    return {"number": number, "key": check.key, "title": check.title,
            "verdict": "FAILED" if result.failed else "passed", "failed": result.failed,
            "seconds": time.time() - began, "planned": planned, "launches": new,
            "lines": result.lines, "figures": result.figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-selftest"))
    parser.add_argument("--quick", action="store_true", help="the checks that matter most, in under 3 minutes")
    parser.add_argument("--only", help="comma-separated keys of the checks to run: " + ", ".join(c.key for c in CHECKS))
    parser.add_argument("--deadline", type=float, help="seconds from now: a launch that would end later is not "
                        "started (a failed leg, named), one still running is stopped")
    args = parser.parse_args()
    deadline = time.time() + args.deadline if args.deadline else math.inf
    only = args.only.split(",") if args.only else None
    if only and not set(only) <= {check.key for check in CHECKS}:
        parser.error(f"--only: unknown check {sorted(set(only) - {check.key for check in CHECKS})[0]!r}")
    if not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")
        return 0
    from src.cache import cached
    from src.loaders import labelled_images
    from src.tools.synthetic import write_dataset
    gpus = torch.cuda.device_count()
    work = args.out.resolve()
    data = work / "data"
    if len(list((data / "train").glob("*.jpg"))) != IMAGES:
        shutil.rmtree(data, ignore_errors=True)
        write_dataset(data, n_train=IMAGES, n_test=0, size=SIZE, seed=0)
    cached(labelled_images(data, SIZE, show_progress=False), SIZE, work / "cache", WORKERS, show_progress=False)
    steps = [(check, new, planned) for check, new, planned in plan(gpus, args.quick, only)]
    names = [name for _, new, _ in steps for name in new]
    header = {"date": date.today().isoformat(), "quick": args.quick, "only": only,
              "gpus": [torch.cuda.get_device_name(i) for i in range(gpus)], "torch": torch.__version__,
              "cuda": torch.version.cuda, "launches": len(names), "parallel": PARALLEL,
              "planned seconds": DATA + sum(planned for _, _, planned in steps),
              "dev shm MB": shared_memory(gpus, names) / 2**20}
    print(f"make test-gpu: {header['gpus']}, torch {header['torch']}, CUDA {header['cuda']}; {len(names)} launches, "
          f"{PARALLEL} at a time, {header['planned seconds']} s planned; at most {header['dev shm MB']:.1f} MB "
          "of /dev/shm (Docker's default: 64 MB)", flush=True)
    launch, entries, start = Launches(work, data, gpus, deadline=deadline), [], time.time()
    launch.start(names)  # every launch, in the order of the checks; each check waits for its own
    try:
        for check, new, planned in steps:
            entries.append(run_check(check, CHECKS.index(check) + 1, launch, gpus, args.quick, new, planned))
            write_report(work, header, entries)
            print(entry_markdown(entries[-1]), flush=True)
    finally:
        launch.close()
    failures = sum(entry["verdict"] != "passed" for entry in entries)
    print(f"{len(entries) - failures} of {len(entries)} checks passed in {time.time() - start:.0f} s; "
          f"report in {work / 'report.md'} and {work / 'report.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
