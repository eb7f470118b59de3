"""`make test-gpu`: on a machine with NVIDIA GPUs, what the CPU test suite cannot check.

    python checks/gpu_selftest.py [--quick] [--out gpu-selftest]

Each check prints its part of the report when it ends and rewrites OUT/report.md, so that a run
cut short still says what passed. Exits 1 if a check failed. On a machine without a CUDA GPU it
prints one line and exits 0, claiming nothing.

The runs train SqueezeNet 1.1 (no batch norm: a batch split over ranks computes what the whole
batch does) at 64 px on 640 synthetic images (512 train) for 2 epochs, the first with the backbone
frozen (--freeze-epochs 1), with every recipe flag on (augment, label smoothing, clipping, 2
micro-batches a step, weight decay, warm-up and cosine), --deterministic, 2 loader workers a
process and the pixel --cache. Optimizer steps 1 and 3 are skipped in every run (the hook
OVERFLOW_AT: an fp16 scaler finds an inf and halves its scale, a float32 run does not step), so
that fp16 and float32 runs take the same steps.

The checks, with their launches on one GPU (planned at START_UP s a launch, COMPILED with --compile;
`plan()` counts them, and the CPU suite holds the sums under 6 and, --quick, 3 minutes):
1. on the GPU, in this process (no launch): fused SGD after a skipped first step (and the same
   without its zero momentum, which must end NaN), fused AdamW's step count, a CPU AdamW state
   resumed into fused AdamW on the GPU, every GPU's dropout seed, DataParallel's replicas in
   bf16 (two replicas in threads on one GPU; on 2+ GPUs real DataParallel: dtype, channels-last
   weights, distinct dropout masks), pinned host copies, accelerate's TF32 switch for dynamo;
2. agreement (4 launches): train_single.py vs two DDP ranks and two FSDP2 ranks sharing GPU 0 over
   gloo (SHARE_GPUS=1) at the same global batch, within the CPU suite's TOLERANCE of the distance
   to another global batch (a fourth launch); on 2+ GPUs DDP, FSDP2, accelerate and DataParallel
   over all GPUs too;
3. fp16 learns (2 launches; AdamW 4 more, not with --quick): --amp fp16 with SGD (one device and
   two DDP ranks) ends within 0.1 of that distance from the float32 run of the same steps, and
   AdamW (one device and DDP) closer to its float32 run than its bf16 run ends;
4. no host synchronisation in a step (4 launches on one GPU, 2 of them check 3's; --quick: 1): each
   script with --amp fp16 and AdamW (accelerate: --mixed_precision fp16) runs training
   micro-batches 2 to 7 of both epochs, a --log-every report included, under
   torch.cuda.set_sync_debug_mode("error") (train_dp.py on 2+ GPUs only: on one it calls the model
   directly, as train_single.py does);
5. compile compiled (1 compiled launch, not with --quick): ResNet-18 with --compile
   --channels-last --amp bf16 learns, and the COMPILE_LOG hook counts its compiled graphs;
6. resume (2 launches, not with --quick): with dropout on, a run resumed from the straight run's
   epoch-1 last.pth ends where the straight run does (within TOLERANCE of check 2's distance).
The training modes are listed once (MODES); a new mode is one entry there and its name in AGREE
and SYNC.
"""
import argparse
import contextlib
import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
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
LAUNCH_LIMIT = 300  # seconds: a launch that hangs (a collective nobody joins) fails instead
SHM = 64 * 2**20  # Docker's default /dev/shm
IMAGES, SIZE, WORKERS, SKIPPED = 640, 64, 2, "1,3"
# Training micro-batches, of every epoch, under set_sync_debug_mode("error"). Not micro-batch 2:
# DDP rebuilds its gradient buckets in the first forward after the first synchronised backward
# (micro-batch 2 with --accumulate 2), once per wrapped model, with a blocking copy to the host.
SYNC_WINDOW = "3:8"
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
# Under set_sync_debug_mode("error"); NCCL's ranks, one GPU each (gloo copies CUDA tensors through
# the host). DataParallel on one GPU calls the model directly, as train_single.py does: not there.
SYNC = ["single", "dp", "ddp", "fsdp", "accelerate"]


def _synced(gpus: int) -> list[str]:
    """The modes whose step the sync check runs on `gpus` GPUs."""
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

    def processes(self, gpus: int) -> int:
        return MODES[self.mode].processes(gpus)

    def per_process(self, gpus: int) -> int:
        return micro_batch(gpus) // (2 if self.half_batch else 1) // self.processes(gpus)


SYNC_ENV = {"SYNC_CHECK_STEPS": SYNC_WINDOW}
ADAMW_FP16 = ["--optimizer", "adamw", "--amp", "fp16", "--log-every", "1"]
# SqueezeNet's own dropout, on; a constant rate, so that a run of 1 epoch may be resumed to 2
# Not frozen: a frozen epoch runs in eval mode and draws no dropout mask, so reseeding would not show.
RESUME = ["--dropout", "0.5", "--lr-schedule", "constant", "--warmup-epochs", "0", "--freeze-epochs", "0", "--epochs"]
RUNS = {
    "sgd-single": Run("single", ["--dropout", "0"]),
    "sgd-far": Run("single", ["--dropout", "0"], half_batch=True),
    **{f"sgd-{mode}": Run(mode, ["--dropout", "0"]) for mode in AGREE},
    "sgd-fp16-single": Run("single", ["--dropout", "0", "--amp", "fp16"]),
    "sgd-fp16-ddp-shared": Run("ddp-shared", ["--dropout", "0", "--amp", "fp16"]),
    "adamw-single": Run("single", ["--dropout", "0", "--optimizer", "adamw"]),
    "adamw-bf16-single": Run("single", ["--dropout", "0", "--optimizer", "adamw", "--amp", "bf16"]),
    **{f"adamw-fp16-{mode}": Run(mode, ["--dropout", "0", *ADAMW_FP16], SYNC_ENV) for mode in SYNC},
    "compile": Run("single", ["--arch", "resnet18", "--weights", "none", "--image-size", str(SIZE), "--lr", "0.01",
                              "--epochs", "2", "--workers", str(WORKERS), "--compile", "--channels-last", "--amp", "bf16"],
                   {"COMPILE_LOG": "{out}/compiled.txt"}, base=[], compiled=True, skips=False),
    # The straight run keeps each epoch's last.pth (the COPY_LAST hook); the resumed run starts
    # from its epoch 1, as a run stopped there would.
    "resume-straight": Run("single", [*RESUME, "2"], {"COPY_LAST": "{out}/epochs"}, skips=False),
    "resume-resumed": Run("single", [*RESUME, "2", "--resume"], start_from="resume-straight/epochs/last.1.pth",
                          skips=False),
}


class Launches:
    """Each Run launched once, on first use, with its output in OUT/name; its folder, or an error
    that names the run, its last line and its log."""

    def __init__(self, work: Path, data: Path, gpus: int):
        self.work, self.data, self.gpus, self.done = work, data, gpus, {}

    def __call__(self, name: str) -> Path:
        if name not in self.done:
            self.done[name] = self._launch(name)
        if isinstance(self.done[name], Exception):
            raise self.done[name]
        return self.done[name]

    def _launch(self, name: str) -> Path | Exception:
        run, mode = RUNS[name], MODES[RUNS[name].mode]
        out = self.work / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if run.start_from:
            source, file = run.start_from.split("/", 1)
            shutil.copy(self(source) / file, out / "last.pth")
        flags = [*run.base, *run.flags, "--batch-size", str(run.per_process(self.gpus))]
        if mode.script != "train_single.py" and mode.script != "train_dp.py":
            flags += ["--dist-timeout", "5"]  # a rank that hangs fails its collective within the launch's limit
        launcher = mode.launcher(run.processes(self.gpus))
        if run.mode == "accelerate" and "--amp" in flags:  # accelerate takes its precision from its launcher
            at = flags.index("--amp")
            launcher += ["--mixed_precision", flags[at + 1]]
            del flags[at:at + 2]
        env = {**mode.env(), "OVERFLOW_AT": SKIPPED if run.skips else "",
               **{key: value.replace("{out}", str(out)) for key, value in run.env.items()}}
        command = [*launcher, mode.script, "--data-dir", str(self.data), "--cache", str(self.work / "cache"), *flags,
                   "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")]
        log = out / f"log-{name}.txt"
        try:
            result = _run(command, out, env, log=log.name)
        except subprocess.TimeoutExpired:
            return RuntimeError(f"{name} did not end within {LAUNCH_LIMIT} s (log: {log})")
        if result.returncode != 0:
            lines = [line.split("\r")[-1] for line in result.stderr.strip().splitlines()] or ["no output"]
            # A worker's exception or one-line error, rather than torchrun's summary after it.
            said = [line for line in lines if re.search(r"(Error|Exception): |error: ", line)
                    and "ChildFailedError" not in line] or lines
            return RuntimeError(f"{name} failed: {said[-1][-300:]} (log: {log})")
        return out


def _run(command: list[str], out: Path, env: dict, log: str = "log.txt") -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [HOOKS, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "HF_HOME": str(out / "hf"), "PYTHONUNBUFFERED": "1", **env}
    # Its own process group: a launch that hangs is stopped with the workers torchrun started
    # (which would otherwise wait in a collective for the whole --dist-timeout).
    launch = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
    started, stdout, stderr = time.time(), "", ""
    try:
        stdout, stderr = launch.communicate(timeout=LAUNCH_LIMIT)
    except subprocess.TimeoutExpired:
        for signal_number in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launch.pid, signal_number)
            with contextlib.suppress(subprocess.TimeoutExpired):
                stdout, stderr = launch.communicate(timeout=10)
                break
        (out / log).write_text(" ".join(command) + "\n\n" + (stdout or "") + (stderr or ""))
        raise subprocess.TimeoutExpired(command, LAUNCH_LIMIT) from None
    (out / log).write_text(" ".join(command) + f"\n\n(ran {time.time() - started:.0f} s)\n" + stdout + stderr)
    return subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)


def _model(out: Path) -> dict:
    return torch.load(out / "last.pth", map_location="cpu", weights_only=True)["model"]


def _last(out: Path) -> dict:
    return torch.load(out / "last.pth", map_location="cpu", weights_only=True)


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


def _compared(gpus: int) -> list[str]:
    """The modes that agreement compares with single: on one GPU, those that split the batch."""
    return [mode for mode in AGREE if gpus > 1 or not MODES[mode].one_device_each]


# The checks: each returns its report lines or raises with them, and names the runs it needs.

def agreement(launch: Launches, gpus: int, quick: bool) -> list[str]:
    reference = _model(launch("sgd-single"))
    far = _distance(_model(launch("sgd-far")), reference)
    lines, failed = [f"global batch {2 * micro_batch(gpus)}; far (global batch {micro_batch(gpus)}) = {far:.4g}"], []
    for mode in _compared(gpus):
        out = launch(f"sgd-{mode}")
        share = _distance(_model(out), reference) / far
        lines.append(f"{mode} ({RUNS[f'sgd-{mode}'].processes(gpus)} processes): {share:.2e} of far "
                     f"(tolerance {TOLERANCE})")
        if not share < TOLERANCE:
            failed.append(mode)
        if MODES[mode].script == "train_fsdp.py":  # each rank held its share of the state, on the GPU
            held = re.search(r"rank 0 held .*? of the [0-9.]+ MB that each DDP process holds",
                             (out / f"log-sgd-{mode}.txt").read_text())
            expected = 1 / RUNS[f"sgd-{mode}"].processes(gpus)
            share_held = float(held.group(0).split(": ")[-1].split(" of the")[0]) if held else None
            lines.append(f"{mode}: {held.group(0) if held else 'no memory line'} (expected about {expected:.3f})")
            if share_held is None or abs(share_held - expected) > 0.02:
                failed.append(f"{mode} memory")
    if failed:
        raise AssertionError("; ".join(lines))
    return lines


def fp16_learns(launch: Launches, gpus: int, quick: bool) -> list[str]:
    """fp16 runs against the float32 run of the same steps, as a share of a scale: SGD's distance
    to another global batch, AdamW's bf16 run (see ADAMW_FP16_TOLERANCE)."""
    cases = [("sgd-single", "sgd-far", "of far", FP16_TOLERANCE, ["sgd-fp16-single", "sgd-fp16-ddp-shared"])]
    if not quick:
        cases.append(("adamw-single", "adamw-bf16-single", "of bf16's distance", ADAMW_FP16_TOLERANCE,
                      ["adamw-fp16-single", "adamw-fp16-ddp"]))
    lines, failed = [], False
    for reference, scale_run, unit, tolerance, names in cases:
        ref = _model(launch(reference))
        scale = _distance(_model(launch(scale_run)), ref)
        for name in names:
            try:
                last = _last(launch(name))
            except RuntimeError as error:
                lines.append(str(error))
                failed = True
                continue
            share, loss_scale = _distance(last["model"], ref) / scale, last["scaler"]["scale"]
            failed |= not (share < tolerance and loss_scale <= 2.0 ** 16 / 4)  # steps 1 and 3 (at least) skipped
            lines.append(f"{name}: {share:.3g} {unit} ({scale:.3g}) from {reference} (tolerance {tolerance}); "
                         f"final loss scale {loss_scale:g} (2^16 halved at each skipped step)")
    if failed:
        raise AssertionError("; ".join(lines))
    return lines


def no_syncs(launch: Launches, gpus: int, quick: bool) -> list[str]:
    lines, errors = [], []
    for mode in (["single"] if quick else _synced(gpus)):
        try:
            launch(f"adamw-fp16-{mode}")
            lines.append(f"{mode}: micro-batches {SYNC_WINDOW} of both epochs ran under set_sync_debug_mode('error')")
        except RuntimeError as error:
            errors.append(str(error))
    if errors:
        raise AssertionError("; ".join(lines + errors))
    return lines


def compiled(launch: Launches, gpus: int, quick: bool) -> list[str]:
    out = launch("compile")
    graphs = int((out / "compiled.txt").read_text())
    record = json.loads((out / "history.json").read_text())[-1]
    line = (f"{graphs} graph(s) compiled; val acc {record['val_acc']:.3f}, epoch 2 in {record['seconds']:.1f} s")
    if graphs < 1 or record["val_acc"] < 0.8:
        raise AssertionError(line)
    return [line]


def resume(launch: Launches, gpus: int, quick: bool) -> list[str]:
    far = _distance(_model(launch("sgd-far")), _model(launch("sgd-single")))
    straight = _model(launch("resume-straight"))
    share = _distance(_model(launch("resume-resumed")), straight) / far
    # Bit for bit where cuDNN's kernels are deterministic; max pooling's backward adds overlapping
    # windows' gradients atomically (warned under --deterministic), which may round in another
    # order. Dropout masks drawn anew would end as far off as another run.
    line = f"resumed vs straight: {share:.2e} of far (check 2's; tolerance {TOLERANCE})"
    if not share < TOLERANCE:
        raise AssertionError(line)
    return [line]


@dataclass
class Check:
    title: str
    function: Callable
    runs: Callable[[int, bool], list[str]]  # the launches it needs, on `gpus` GPUs, with --quick
    quick: bool = True


CHECKS = [
    Check("on the GPU, in this process", lambda launch, gpus, quick: on_the_gpu(gpus), lambda g, q: []),
    Check("agreement (--deterministic, every recipe flag)", agreement,
          lambda g, q: ["sgd-single", "sgd-far"] + [f"sgd-{m}" for m in _compared(g)]),
    Check("fp16 learns", fp16_learns, lambda g, q: ["sgd-single", "sgd-far", "sgd-fp16-single", "sgd-fp16-ddp-shared"]
          + ([] if q else ["adamw-single", "adamw-bf16-single", "adamw-fp16-single", "adamw-fp16-ddp"])),
    Check("no host synchronisation in a step", no_syncs,
          lambda g, q: [f"adamw-fp16-{m}" for m in (["single"] if q else _synced(g))]),
    Check("compile compiled", compiled, lambda g, q: ["compile"], quick=False),
    Check("resume with dropout", resume,
          lambda g, q: ["sgd-single", "sgd-far", "resume-straight", "resume-resumed"], quick=False),
]


def plan(gpus: int, quick: bool) -> list[tuple[Check, list[str], int]]:
    """(check, the launches it adds to those before it, its seconds planned by counting them)."""
    steps, launched = [], set()
    for check in CHECKS:
        if check.quick or not quick:
            new = [name for name in dict.fromkeys(check.runs(gpus, quick)) if name not in launched]
            launched.update(new)
            seconds = sum(COMPILED if RUNS[name].compiled else START_UP for name in new)
            steps.append((check, new, seconds or IN_PROCESS))
    return steps


def shared_memory(gpus: int, names: list[str]) -> int:
    """The most /dev/shm any planned run's loader workers may hold on a node (src.devices's rule)."""
    from src.devices import shared_memory_need
    return max(shared_memory_need(WORKERS, RUNS[name].per_process(gpus) * 3 * SIZE * SIZE, RUNS[name].processes(gpus))
               for name in names)


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
    ends = {}
    with _nan_empty_like():
        for name in ("plain", "ours", "no zeros"):
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).to(device)
            if name == "ours":
                optimizer = make_optimizer(model, parse_args("", ["--lr", "0.1"]), device)
            else:
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=name != "plain")
            ends[name] = _three_steps(optimizer, model, device)
        torch.manual_seed(0)
        model = nn.Linear(3, 1).to(device)
        adamw = make_optimizer(model, parse_args("", ["--optimizer", "adamw"]), device)
        _three_steps(adamw, model, device)
    off = (ends["ours"] - ends["plain"]).abs().max().item()
    steps = sorted({float(state["step"]) for state in adamw.state.values()})
    lines = [f"fused SGD, first step skipped: {off:.2g} from plain SGD; without its zero momentum: "
             f"{'NaN' if ends['no zeros'].isnan().any() else 'finite'} (NaN shows the check bites)",
             f"fused AdamW, first of 3 steps skipped: step count {steps} (expected [2.0])"]
    assert off <= 1e-5 and adamw.defaults["fused"] and steps == [2.0], lines
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


def _accelerate_tf32() -> list[str]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from src.devices import configure_numerics
    saved = os.environ.get("ACCELERATE_DYNAMO_BACKEND")
    os.environ["ACCELERATE_DYNAMO_BACKEND"] = "inductor"  # what accelerate launch --dynamo_backend sets
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        Accelerator()
        flipped = torch.backends.cuda.matmul.allow_tf32
        configure_numerics(True)
        after = torch.backends.cuda.matmul.allow_tf32
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        if saved is None:
            del os.environ["ACCELERATE_DYNAMO_BACKEND"]
        else:
            os.environ["ACCELERATE_DYNAMO_BACKEND"] = saved
    line = (f"Accelerator() with a dynamo backend set TF32 matmuls {'on' if flipped else 'off'}; "
            f"configure_numerics(True) after it: {'on' if after else 'off'}")
    assert not after, line
    return [line]


def on_the_gpu(gpus: int) -> list[str]:
    device = torch.device("cuda", torch.cuda.current_device())
    lines, failures = [], []
    for part in (lambda: _fused_optimizers(device), lambda: _resume_on_the_gpu(device),
                 lambda: _data_parallel(gpus, device), lambda: _pinned(device), _accelerate_tf32):
        try:
            lines += part()
        except Exception as error:  # each part reports; the others still run
            failures.append(str(error))
    torch.backends.cuda.matmul.allow_tf32 = False
    if failures:
        raise AssertionError("; ".join(lines + ["FAILED: " + f for f in failures]))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-selftest"))
    parser.add_argument("--quick", action="store_true", help="the checks that matter most, in under 3 minutes")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")
        return 0
    from src.tools.synthetic import write_dataset
    gpus = torch.cuda.device_count()
    work = args.out.resolve()
    data = work / "data"
    if len(list((data / "train").glob("*.jpg"))) != IMAGES:
        shutil.rmtree(data, ignore_errors=True)
        write_dataset(data, n_train=IMAGES, n_test=0, size=SIZE, seed=0)
    steps = plan(gpus, args.quick)
    names = [name for _, new, _ in steps for name in new]
    seconds = DATA + sum(planned for _, _, planned in steps)
    report = [f"# make test-gpu{' --quick' if args.quick else ''}, {date.today().isoformat()}", "",
              f"{gpus} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(gpus))}; torch {torch.__version__}, "
              f"CUDA {torch.version.cuda}", "",
              f"Planned: {len(names)} launches, {seconds} s ({START_UP} s a launch, {COMPILED} s compiled, "
              f"{IN_PROCESS + DATA} s in this process); loader workers: {WORKERS} a process, at most "
              f"{shared_memory(gpus, names) / 2**20:.1f} MB of /dev/shm (Docker's default: 64 MB)", ""]
    print("\n".join(report), flush=True)
    launch, failures, start = Launches(work, data, gpus), 0, time.time()
    for check, new, planned in steps:
        began = time.time()
        try:
            lines, verdict = check.function(launch, gpus, args.quick), "passed"
        except Exception as error:  # a failed check is reported; the others still run
            lines, verdict = [str(error)], "FAILED"
            failures += 1
        part = [f"## {check.title}: {verdict} ({time.time() - began:.0f} s; planned {planned} s, "
                f"{len(new)} launches)", ""] + [f"- {line}" for line in lines] + [""]
        report += part
        (work / "report.md").write_text("\n".join(report) + "\n")
        print("\n".join(part), flush=True)
    print(f"{len(steps) - failures} of {len(steps)} checks passed in {time.time() - start:.0f} s; "
          f"report in {work / 'report.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
