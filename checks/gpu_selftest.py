"""`make test-gpu`: on a machine with NVIDIA GPUs, what the CPU test suite cannot check.

    python checks/gpu_selftest.py [--quick] [--only KEY,...] [--out gpu-selftest] [--deadline SECONDS]
    python checks/gpu_selftest.py --device cpu --out /tmp/gpu-selftest-cpu   # every check, tiny, on the CPU

Each check prints its part of the report when it ends (its lines and figures, on stdout) and
rewrites OUT/report.md and OUT/report.json (per check: its verdict, the modes or parts that
failed, those skipped and why, its lines and figures; torch, CUDA and the GPUs), so that a run cut
short still says what passed. Exits 1 if a check failed. On a machine without a CUDA GPU it prints
one line and exits 0, claiming nothing; `--device cpu` runs every check there instead, tiny (a
dry run of this script: every launch, hook record, reading, comparison and report), each
comparison that means something only on a GPU reported skipped with its reason.

The runs train SqueezeNet 1.1 (no batch norm: a batch split over ranks computes what the whole
batch does) at 64 px on 640 synthetic images (512 train) for 2 epochs, the first with the backbone
frozen (--freeze-epochs 1), with every recipe flag on (augment, label smoothing, clipping, 2
micro-batches a step, weight decay, warm-up and cosine), --deterministic, 2 loader workers a
process and the pixel --cache (built once, before the launches); the agreement's runs draw too
(SqueezeNet's dropout, per sample, and the augmentation recipe: TrivialAugment, random erasing,
MixUp and CutMix). Optimizer steps 1 and 3 are skipped in every run (the hook OVERFLOW_AT: an fp16
scaler finds an inf and halves its scale, a float32 run does not step), so that fp16 and float32
runs take the same steps. The launches run PARALLEL at a time (the GPU and the 16 cores of the
machine it was planned for hold that many small runs); each gets --dist-timeout 1 (3 compiled), so
that a collective nobody joins fails with its own error well before the launch's limit.

The checks (KEY: what), with their launches on one GPU (planned at START_UP s a launch, COMPILED
with --compile or gigabytes to write, PARALLEL at once; `plan()` counts them, and the CPU suite
holds the sums under 7 and, --quick, 3 minutes):
1. gpu: on the GPU, in this process: fused SGD (both optimizers' kernel asserted) after a skipped
   first step (and the same without its zero momentum, which must end NaN), fused AdamW's step
   count, a CPU AdamW state resumed into fused AdamW, every GPU's dropout seed, DataParallel's
   replicas in bf16 (two replicas in threads on one GPU; on 2+ GPUs real DataParallel: dtype,
   channels-last weights, distinct dropout masks), pinned host copies (the loaders' batches, the
   progress bar's sums, the feature cache's copies, the step checkpoint writer's buffers, whose
   file holds the state at its step whatever the GPU does next), --sync-bn's layer against torch's
   SyncBatchNorm (the same results; no host synchronisation in its training step, where torch's
   mask makes some); FSDP's peak memory under --amp (a figure); and one launch:
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
6. resume (2 launches, not with --quick): a run with dropout, --amp fp16, fused AdamW and
   --ema-decay that writes last.pth after every step (STEPS), resumed from its step checkpoint in
   the middle of epoch 1, ends where it ends: weights and average within TOLERANCE of how far the
   straight run moved after that step;
7. steps (2 launches writing gigabytes, not with --quick): --save-every-steps: that run's step
   checkpoints (written by the background writer from pinned buffers), one after every step, in
   order; FSDP (VGG11, AdamW, --ema-decay, a world of one over NCCL) resumed from its last.dcp
   written by dcp.async_save in the middle of the epoch ends where the straight run ends; and that
   run's peak GPU memory through an epoch with a step checkpoint is its peak before it (the
   MEMORY_LOG hook): FSDP stages the shards in host memory, not in a second copy on the GPU;
8. ema (check 6's runs): --ema-decay computed again from the run's step checkpoints: each step's
   average is the last one moved toward that step's weights by 1 - min(D, (1 + t) / (10 + t)),
   a step the fp16 scaler skipped leaves it and its count as they were;
9. track (check 6's runs): --track mlflow's store holds every epoch's history record and step
   metrics, and the run FINISHED;
10. syncbn (2 launches): ResNet-18 in float64, --sync-bn, two DDP ranks sharing the GPU (and on 2+
   GPUs DDP over all of them, NCCL) end where train_single.py at the same global batch ends,
   within TOLERANCE of how far its second epoch moved;
11. stop (2 launches): SIGTERM to torchrun's two ranks (check 2's flags): they stop at one agreed
   step, and their last.pth is the straight run's at that step (check 2's DDP leg keeps it); a
   stop no rank can agree on (rank 1 stopped with SIGSTOP) ends rank 0 with its line and its
   flight recorder's dump, the collective it waited in last; on 2+ GPUs both over NCCL too, whose
   agreement runs on the GPU (pinned flags, CUDA events): on one GPU it cannot, reported skipped;
12. draws (check 2's runs): dropout's masks from Triton's kernel on the GPU are the CPU's, bit for
   bit (several shapes, rates and units); every rank of the agreement's runs trained on MixUp's
   and CutMix's soft targets (the TARGETS_LOG hook);
13. gpu0 (no launch of its own; 2+ GPUs): each process of the launches over NCCL holds a CUDA
   context on its own GPU only, none on GPU 0 but rank 0's (the MEMORY_LOG hook asks CUDA which
   primary contexts the process holds; nvidia-smi's memory per process where it lists them).
The training modes are listed once (MODES); a new mode is one entry there and its name in AGREE
and SYNC.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import pickle
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Callable

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
# Seconds planned a launch, a compiled one (or one writing gigabytes of checkpoints), check 1, the data.
START_UP, COMPILED, IN_PROCESS, DATA = 20, 40, 20, 5
PARALLEL = 4  # launches at once
# Minutes a rank waits in a collective (--dist-timeout), and the seconds after which a launch is
# stopped: a hung collective fails first, with its own error, and torchrun has time to end the others.
DIST_TIMEOUT, COMPILED_DIST_TIMEOUT, CPU_DIST_TIMEOUT, TEARDOWN = 1, 3, 10, 90
SHM = 64 * 2**20  # Docker's default /dev/shm
IMAGES, SIZE, WORKERS, SKIPPED = 640, 64, 2, "1,3"
# --device cpu: tiny, on the CPU's cores: 100 images (80 train: 5 optimizer steps an epoch at a
# global batch of 16), and for the agreement's runs and the stops 400 (320 train, 10 steps an epoch at
# the recipe's global batch of 32, so that a stop agreed at step 8 falls inside an epoch as on a GPU).
CPU_IMAGES, CPU_LARGE, CPU_SIZE, CPU_WORKERS, CPU_PARALLEL = 100, 400, 32, 0, 2
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
# The agreement's runs draw per sample: SqueezeNet's own dropout (torchvision's 0.5, on) and the
# augmentation recipe, the same for every sample in every mode (src/dropout.py, src/augment.py).
DRAWS = ["--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]
# Rank 0 and rank 1 stop at the run's step 8 after SIGTERM in step 1 (src.stopping.CHECK_EVERY = 4:
# the check after step 4 carries the flag, the one after step 8 reads it); the straight run keeps
# its last.pth of that step.
STOP_STEP = 8


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


Driver = Callable[[subprocess.Popen, Path, Path, float], None]


@dataclass
class Run:
    """One launch: a mode with flags (its --batch-size from the global micro-batch), in OUT/name."""
    mode: str
    flags: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    half_batch: bool = False  # half the global micro-batch: another run's `far`
    base: list = field(default_factory=lambda: BASE)
    start_from: str | None = None  # "RUN/FILE": a file or folder of another run, copied to last.pth (last.dcp) here first
    compiled: bool = False
    skips: bool = True  # OVERFLOW_AT: steps 1 and 3 skipped (a resumed process would count anew)
    launcher_flags: list = field(default_factory=list)
    heavy: bool = False  # planned as a compiled launch: gigabytes of checkpoints, or a wait built in
    gpus: int = 1  # the GPUs it needs (NCCL between two ranks needs two): planned only where there are as many
    expect: int = 0  # the launcher's exit code when the run does what it should (torchrun after a stop: 1)
    driver: Driver | None = None  # what the self-test does to the launch while it runs (a signal)
    # --device cpu: the launch that stands in for this one on the CPU (of the same script but check
    # 5's FSDP leg, which the compiled one-device run stands in for: tests/test_fsdp.py counts FSDP's
    # compiled units on the CPU; what differs, fp16 or a world of one, is what only a GPU checks),
    # and the flags changed there (a value None: the flag added alone).
    cpu_as: str | None = None
    cpu_flags: dict = field(default_factory=dict)
    cpu_large: bool = False  # on the CPU its data is the larger set (CPU_LARGE images)
    cpu_launcher_flags: list | None = None  # on the CPU, its launcher's flags instead of launcher_flags

    def processes(self, gpus: int) -> int:
        return MODES[self.mode].processes(gpus)

    def per_process(self, gpus: int) -> int:
        return micro_batch(gpus) // (2 if self.half_batch else 1) // self.processes(gpus)

    def dist_timeout(self, cpu: bool = False) -> int:
        """--dist-timeout's minutes; on the CPU (--device cpu) CPU_DIST_TIMEOUT: there the check is
        of the code, not of its speed, and a busy machine may starve a rank for a minute."""
        return CPU_DIST_TIMEOUT if cpu else COMPILED_DIST_TIMEOUT if self.compiled else DIST_TIMEOUT

    def planned(self) -> int:
        """Its seconds in the plan, one at a time."""
        return COMPILED if self.compiled or self.heavy else START_UP

    def limit(self, cpu: bool = False) -> int:
        """Seconds after which the launch is stopped: its collectives time out well before."""
        return 60 * self.dist_timeout(cpu) + TEARDOWN + self.planned()


def _unagreed_stop(launch: subprocess.Popen, out: Path, stderr: Path, limit: float) -> None:
    """The launch `hung-*`: once rank 1 has stopped itself with SIGSTOP (its STOP_LOG, `stopped`),
    SIGTERM to the launcher, which forwards it; rank 0, waiting in a collective for rank 1, can
    agree on no step: its heartbeat ends it with the "stop:" line and its flight recorder's dump.
    The stopped rank is killed once that line is there (torchrun would wait 30 s more)."""
    stopped, deadline = out / "stopped", time.time() + limit
    while time.time() < deadline and _running(launch.pid) and not stopped.exists():
        time.sleep(0.2)
    try:
        if _running(launch.pid) and stopped.exists():
            time.sleep(2)  # rank 0 reaches the collective that waits for rank 1
            launch.send_signal(signal.SIGTERM)
            while time.time() < deadline and _running(launch.pid) and "stop:" not in stderr.read_text(errors="replace"):
                time.sleep(0.5)
    finally:
        with contextlib.suppress(OSError, ValueError, IndexError):
            os.kill(int(stopped.read_text().split()[0]), signal.SIGKILL)


SYNC_ENV = {"SYNC_CHECK_STEPS": SYNC_WINDOW, "SYNC_LOG": "{out}/syncs.json"}
DTYPE_ENV = {"DTYPE_LOG": "{out}/dtypes.txt"}
TARGETS_ENV = {"TARGETS_LOG": "{out}/targets.txt"}
MEMORY_ENV = {"MEMORY_LOG": "{out}/memory.json"}  # every launch: its processes' CUDA contexts and peak memory
COPY_ENV = {"COPY_LAST": "{out}/epochs"}
ADAMW_FP16 = ["--optimizer", "adamw", "--amp", "fp16", "--log-every", "1"]
COMPILE = ["--arch", "resnet18", "--weights", "none", "--image-size", str(SIZE), "--lr", "0.01", "--epochs", "2",
           "--workers", str(WORKERS), "--compile", "--amp", "bf16"]
# Check 6's run: dropout on (SqueezeNet's own), fp16 with fused AdamW and skipped steps, --ema-decay,
# last.pth after every step (each kept by COPY_LAST), --track mlflow (its store beside the run).
STEPS = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", str(SIZE), "--epochs", "2", "--lr", "0.001",
         "--deterministic", "--workers", str(WORKERS), "--optimizer", "adamw", "--amp", "fp16", "--ema-decay", "0.9",
         "--save-every-steps", "1"]
RESUMED_AT = "last.3.pth"  # the straight run's 3rd step checkpoint: epoch 1, step 3
# Check 7's FSDP run: VGG11 at 32 px, whose weights, AdamW state and average (2 GB) fill the GPU's
# memory, not its activations; a step checkpoint after step 16 of 32 (1 of 8 on the CPU's data).
FSDP_STEPS = ["--arch", "vgg11", "--weights", "none", "--image-size", "32", "--epochs", "1", "--lr", "0.001",
              "--deterministic", "--workers", str(WORKERS), "--optimizer", "adamw", "--ema-decay", "0.9",
              "--save-every-steps", "16"]
FSDP_CPU = {"--arch": "squeezenet1_1", "--save-every-steps": "4"}
# Check 10's runs: ResNet-18 (batch norm) in float64 (the FLOAT64 hook: a last-bit difference cannot
# flip a max-pool's choice, tests/test_sync_bn.py), 2 epochs.
SYNC_BN = ["--arch", "resnet18", "--weights", "none", "--image-size", str(SIZE), "--epochs", "2", "--lr", "0.003",
           "--deterministic", "--workers", str(WORKERS)]
STOP_ENV = {"SIGNAL_AT_STEP": "1", "SIGNAL_TO": "parent", "SIGNAL_NAME": "SIGTERM"}
HUNG_ENV = {"STOP_AT_STEP": "3", "STOP_RANK": "1", "STOP_LOG": "{out}/stopped", "TORCH_FR_DUMP_TEMP_FILE": "{out}/trace_",
            "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}
# The agreement's runs keep their last.pth at the stop's step (check 11 compares a stopped run with it).
AGREE_ENV = {**TARGETS_ENV, **COPY_ENV}
RUNS = {
    # Check 1's launch: accelerate with a dynamo backend ("eager": dynamo traces, nothing is
    # generated; the launcher sets ACCELERATE_DYNAMO_BACKEND from it) and no mixed precision turns
    # TF32 matmuls on in Accelerator(); --deterministic must have them off when training starts.
    "accelerate-tf32": Run("accelerate", ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", str(SIZE),
                                          "--epochs", "1", "--deterministic", "--workers", str(WORKERS)],
                           {"TF32_LOG": "{out}/tf32.txt"}, base=[], skips=False,
                           launcher_flags=["--dynamo_backend", "eager"], cpu_launcher_flags=[]),
    "sgd-single": Run("single", DRAWS, {**DTYPE_ENV, **TARGETS_ENV}, cpu_large=True),
    "sgd-far": Run("single", DRAWS, half_batch=True, cpu_large=True),
    **{f"sgd-{mode}": Run(mode, DRAWS, TARGETS_ENV, cpu_large=True) for mode in AGREE},
    **{f"sgd-{mode}": Run(mode, [*DRAWS, "--save-every-steps", str(STOP_STEP)], AGREE_ENV, cpu_large=True)
       for mode in ("ddp-shared", "ddp")},
    **{f"sgd-fp16-{mode}": Run(mode, [*DRAWS, "--amp", "fp16", "--log-every", "1"], {**DTYPE_ENV, **SYNC_ENV},
                               cpu_as=f"sgd-{mode}") for mode in SYNC_SGD},
    "adamw-single": Run("single", ["--dropout", "0", "--optimizer", "adamw"], DTYPE_ENV, cpu_as="sgd-single"),
    "adamw-bf16-single": Run("single", ["--dropout", "0", "--optimizer", "adamw", "--amp", "bf16"], DTYPE_ENV,
                             cpu_as="sgd-single"),
    **{f"adamw-fp16-{mode}": Run(mode, ["--dropout", "0", *ADAMW_FP16], {**DTYPE_ENV, **SYNC_ENV},
                                 cpu_as={"single": "sgd-single", "accelerate": "accelerate-tf32",
                                         "ddp": "sgd-ddp-shared", "fsdp": "sgd-fsdp-shared"}.get(mode, f"sgd-{mode}"))
       for mode in SYNC},
    # On the CPU SqueezeNet (no batch norm) with a counting eager backend (COMPILE_BACKEND).
    "compile": Run("single", [*COMPILE, "--channels-last"],
                   {"COMPILE_LOG": "{out}/compiled.txt", "COMPILE_OPS_LOG": "{out}/compiled.json"},
                   base=[], compiled=True, skips=False, cpu_flags={"--arch": "squeezenet1_1"}),
    # FSDP shards contiguous weights only: no --channels-last.
    "compile-fsdp-shared": Run("fsdp-shared", COMPILE, {"COMPILE_OPS_LOG": "{out}/compiled.json"},
                               base=[], compiled=True, skips=False, cpu_as="compile"),
    # Checks 6, 8 and 9: the straight run keeps each last.pth (COPY_LAST); the resumed run starts from
    # its step checkpoint in the middle of epoch 1, as a run stopped there would (without --track:
    # its store is the straight run's).
    "steps-single": Run("single", [*STEPS, "--track", "mlflow"], COPY_ENV, base=[]),
    "steps-single-resumed": Run("single", [*STEPS, "--resume"], base=[], skips=False,
                                start_from=f"steps-single/epochs/{RESUMED_AT}"),
    # Check 7: on one GPU a world of one over NCCL, its mesh on the GPU (where a staging that moved
    # the shards back to the mesh's device would hold a second copy of them).
    "steps-fsdp": Run("fsdp", FSDP_STEPS, COPY_ENV, base=[], skips=False, heavy=True, cpu_flags=FSDP_CPU),
    "steps-fsdp-resumed": Run("fsdp", [*FSDP_STEPS, "--resume"], base=[], skips=False, heavy=True,
                              start_from="steps-fsdp/epochs/last.1.dcp", cpu_flags=FSDP_CPU),
    # Check 10.
    "syncbn-single": Run("single", SYNC_BN, {"FLOAT64": "1", **COPY_ENV}, base=[], skips=False),
    **{f"syncbn-{mode}": Run(mode, [*SYNC_BN, "--sync-bn"], {"FLOAT64": "1"}, base=[], skips=False,
                             gpus=2 if mode == "ddp" else 1) for mode in ("ddp-shared", "ddp")},
    # Check 11: the agreement's DDP flags, SIGTERM to torchrun in step 1; and a stop that cannot be agreed.
    **{f"stop-{mode}": Run(mode, [*DRAWS, "--save-every-steps", str(STOP_STEP)], STOP_ENV, expect=1,
                           gpus=2 if mode == "ddp" else 1, cpu_large=True) for mode in ("ddp-shared", "ddp")},
    **{f"hung-{mode}": Run(mode, DRAWS, HUNG_ENV, expect=1, heavy=True, driver=_unagreed_stop,
                           gpus=2 if mode == "ddp" else 1, cpu_large=True) for mode in ("ddp-shared", "ddp")},
}


def descendants(pid: int) -> list[int]:
    """The processes below `pid` (children, grandchildren...), from /proc."""
    children: dict[int, list[int]] = {}
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


def _run(command: list[str], out: Path, env: dict, limit: float, log: str = "log.txt",
         driver: Driver | None = None) -> subprocess.CompletedProcess:
    """Run `command` in its own session for at most `limit` s (then stop it and all it started);
    its output in out/log, after the command line. `driver(launch, out, stderr file, seconds)`, if
    given, runs while the launch does (a signal to send it)."""
    path = os.pathsep.join(filter(None, [HOOKS, os.environ.get("PYTHONPATH")]))
    environment = {**os.environ, "PYTHONPATH": path, "HF_HOME": str(out / "hf"), "PYTHONUNBUFFERED": "1", **env}
    outputs = out / ".stdout", out / ".stderr"
    started = time.time()
    with open(outputs[0], "w") as stdout, open(outputs[1], "w") as stderr:
        # Its own session: stop() finds what it started from the launcher down.
        launch = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=stdout, stderr=stderr, text=True,
                                  start_new_session=True)
        if driver is not None:
            driver(launch, out, outputs[1], limit)
        cpu = _wait(launch, started + limit)
        if cpu is None:
            stop(launch)
            said = f"(stopped after {limit:.0f} s)"
        else:
            said = f"(ran {time.time() - started:.0f} s, {cpu:.1f} s of CPU with the processes it waited for)"
            (out / ".cpu").write_text(f"{cpu}\n")
    printed = [part.read_text(errors="replace") for part in outputs]
    (out / log).write_text(" ".join(command) + f"\n\n{said}\n" + printed[0] + printed[1])
    for part in outputs:
        part.unlink()
    if said.startswith("(stopped"):
        raise subprocess.TimeoutExpired(command, limit)
    return subprocess.CompletedProcess(command, launch.returncode, printed[0], printed[1])


def _wait(launch: subprocess.Popen, deadline: float) -> float | None:
    """Wait for the launch until `deadline` (time.time()); the CPU seconds it and the processes it
    waited for used (os.wait4's), or None if it still runs then."""
    while True:
        pid, status, usage = os.wait4(launch.pid, os.WNOHANG)
        if pid:
            launch.returncode = os.waitstatus_to_exitcode(status)
            return usage.ru_utime + usage.ru_stime
        if time.time() >= deadline:
            return None
        time.sleep(0.1)


def failure_line(stderr: str) -> str:
    """The line that says why a launch failed: a worker's exception or one-line error, rather
    than torchrun's summary after it."""
    lines = [line.split("\r")[-1] for line in stderr.strip().splitlines()] or ["no output"]
    said = [line for line in lines if re.search(r"(Error|Exception): |error: ", line)
            and "ChildFailedError" not in line] or lines
    return said[-1][-300:]


def stand_in(name: str, cpu: bool) -> str:
    """The launch that runs for `name`: itself, or on the CPU the one that stands in for it."""
    return (RUNS[name].cpu_as or name) if cpu else name


def tiny(flags: list[str], changed: dict) -> list[str]:
    """`flags` as the CPU runs them: CPU_SIZE px, CPU_WORKERS loader workers, and `changed` (a flag's
    value replaced, or the flag added; a value None: the flag alone)."""
    changed = {"--image-size": str(CPU_SIZE), "--workers": str(CPU_WORKERS), **changed}
    flags, done = list(flags), set()
    for i, flag in enumerate(flags):
        if flag in changed and changed[flag] is not None and i + 1 < len(flags):
            flags[i + 1] = changed[flag]
            done.add(flag)
        elif flag in changed:
            done.add(flag)
    for flag, value in changed.items():
        if flag not in done and flag not in ("--image-size", "--workers"):
            flags += [flag] if value is None else [flag, value]
    return flags


def command_of(name: str, work: Path, data: Path, gpus: int, cpu: bool = False) -> tuple[list[str], dict]:
    """The command line and the environment of the launch `name`, its outputs in work/name. On the
    CPU (`cpu`): tiny flags, no GPU, the GPU's choices where the CPU has them (AS_ON_GPU=1), one
    thread a process, a counting eager backend for --compile, the hooks of every launch it stands
    in for, and the smaller data set (data-small beside `data`) unless it asks for the larger."""
    run, mode, out = RUNS[name], MODES[RUNS[name].mode], work / name
    flags = [*run.base, *run.flags]
    if cpu:
        flags = tiny(flags, run.cpu_flags)
    flags += ["--batch-size", str(run.per_process(gpus))]
    if mode.script != "train_single.py" and mode.script != "train_dp.py":
        flags += ["--dist-timeout", str(run.dist_timeout(cpu))]
    processes = run.processes(gpus)
    # A world of one needs no launcher (the script makes it, as torchrun --nproc_per_node=1 would).
    launcher_of = _python if cpu and mode.launcher is _torchrun and processes == 1 else mode.launcher
    launcher_flags = run.cpu_launcher_flags if cpu and run.cpu_launcher_flags is not None else run.launcher_flags
    launcher = [*launcher_of(processes), *launcher_flags]
    if run.mode == "accelerate" and "--amp" in flags:  # accelerate takes its precision from its launcher
        at = flags.index("--amp")
        launcher += ["--mixed_precision", flags[at + 1]]
        del flags[at:at + 2]
    hooks = {**MEMORY_ENV, **run.env}
    if cpu:  # the hooks of the launches it stands in for
        for other in RUNS.values():
            if other.cpu_as == name:
                hooks = {**other.env, **hooks}
    env = {**mode.env(), "OVERFLOW_AT": SKIPPED if run.skips else "",
           **{key: value.replace("{out}", str(out)) for key, value in hooks.items()}}
    if cpu:
        env.update({"CUDA_VISIBLE_DEVICES": "", "AS_ON_GPU": "1", "OMP_NUM_THREADS": "1", "COMPILE_BACKEND": "eager"})
    if cpu and not run.cpu_large:
        data = data.parent / f"{data.name}-small"
    command = [*launcher, mode.script, "--data-dir", str(data), "--cache", str(work / "cache"), *flags,
               "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")]
    return command, env


class Launches:
    """Each Run launched once, PARALLEL at a time (start() submits them ahead of the checks);
    calling it gives the run's folder (OUT/name) or raises the error that names the run, its
    last line and its log. On the CPU (`cpu`) a launch stands in for those that name it (cpu_as)."""

    def __init__(self, work: Path, data: Path, gpus: int, parallel: int = PARALLEL, deadline: float = math.inf,
                 cpu: bool = False):
        self.work, self.data, self.gpus, self.deadline, self.cpu = work, data, gpus, deadline, cpu
        self.pool = ThreadPoolExecutor(parallel)
        self.futures: dict[str, Future] = {}

    def start(self, names: list[str]) -> None:
        """Submit these launches (or their stand-ins), each after the one it starts from."""
        for name in map(lambda name: stand_in(name, self.cpu), names):
            source = RUNS[name].start_from
            if source:
                self.start([source.split("/", 1)[0]])
            if name not in self.futures:
                self.futures[name] = self.pool.submit(self._launch, name)

    def __call__(self, name: str) -> Path:
        self.start([name])
        outcome = self.futures[stand_in(name, self.cpu)].result()
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def processes(self, name: str) -> int:
        """The processes of the launch that runs for `name`."""
        return RUNS[stand_in(name, self.cpu)].processes(self.gpus)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _launch(self, name: str) -> Path | Exception:
        run, out = RUNS[name], self.work / name
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        if run.start_from:
            source, file = run.start_from.split("/", 1)
            try:
                origin = self(source) / file
                if origin.is_dir():  # a last.dcp folder
                    shutil.copytree(origin, out / "last.dcp")
                else:
                    shutil.copy(origin, out / "last.pth")
            except (RuntimeError, OSError) as error:
                return RuntimeError(f"{name} did not start: {error}")
        command, env = command_of(name, self.work, self.data, self.gpus, self.cpu)
        log = out / f"log-{name}.txt"
        limit = min(run.limit(self.cpu), self.deadline - time.time())
        if limit < run.planned():
            return RuntimeError(f"{name} not run: {max(limit, 0):.0f} s left before the --deadline")
        try:
            result = _run(command, out, env, limit, log=log.name, driver=run.driver)
        except subprocess.TimeoutExpired:
            return RuntimeError(f"{name} did not end within {limit:.0f} s (log: {log})")
        if result.returncode != run.expect:
            expected = f" (expected {run.expect})" if run.expect else ""
            return RuntimeError(f"{name} failed (exit code {result.returncode}{expected}): "
                                f"{failure_line(result.stderr)} (log: {log})")
        return out


def _model(out: Path) -> dict:
    return _last(out)["model"]


def _last(out: Path) -> dict:
    """A run's last: last.pth, or train_fsdp.py's last.dcp read whole (src.checkpoint.read_last)."""
    from src.checkpoint import read_last
    last = read_last(out)
    if last is None:
        raise RuntimeError(f"no last.pth nor last.dcp in {out}")
    return last


def _saved(path: Path) -> dict:
    """A kept checkpoint (COPY_LAST's copy): a last.pth, or a last.dcp folder read whole."""
    if path.is_dir():
        from src.sharded_checkpoint import read_whole
        return read_whole(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _copies(out: Path, suffix: str = ".pth") -> list[Path]:
    """The checkpoints COPY_LAST kept in out/epochs, in the order they were written."""
    return sorted((out / "epochs").glob(f"last.*{suffix}"), key=lambda path: int(path.name.split(".")[1]))


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


def _share(distance: float, scale: float) -> float:
    return distance / scale if scale > 0 else math.inf


def _compared(gpus: int) -> list[str]:
    """The modes that agreement compares with single: on one GPU, those that split the batch."""
    return [mode for mode in AGREE if gpus > 1 or not MODES[mode].one_device_each]


@dataclass
class Result:
    """What a check found: its report lines, its figures (numbers, for report.json), what failed
    (the modes or parts, by name: it passed if that is empty), and what it skipped and why (a
    comparison that means something only on a GPU, under --device cpu; a leg that needs more GPUs)."""
    lines: list = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    failed: list = field(default_factory=list)
    skipped: list = field(default_factory=list)
    cpu: bool = False  # --device cpu: the comparisons given a GPU-only reason are skipped

    def add(self, line: str, failed: str | None = None) -> None:
        self.lines.append(line if failed is None else f"FAILED {failed}: {line}")
        if failed is not None:
            self.failed.append(failed)

    def skip(self, line: str, why: str) -> None:
        self.lines.append(f"skipped ({why}): {line}")
        self.skipped.append(why)

    def judge(self, line: str, ok: bool, name: str, gpu_only: str | None = None) -> None:
        """The line, failed under `name` unless ok; under --device cpu, skipped when `gpu_only`
        says why it means something on a GPU only."""
        if self.cpu and gpu_only:
            self.skip(line, f"on the CPU: {gpu_only}")
        else:
            self.add(line, None if ok else name)


def _legs(result: Result, launch: "Launches", names: list[str]) -> dict[str, Path]:
    """The folders of these launches, every one waited for: a launch that failed is a failed leg
    of `result`, named, and the others still count."""
    done = {}
    for name in names:
        try:
            done[name] = launch(name)
        except RuntimeError as error:
            result.add(str(error), failed=name)
    return done


def _runs_for(gpus: int, names: list[str]) -> list[str]:
    """The launches among `names` that `gpus` GPUs can run."""
    return [name for name in names if RUNS[name].gpus <= gpus]


def _too_few_gpus(result: Result, gpus: int, names: list[str], what: str) -> None:
    """A skipped line for each launch of `names` that needs more GPUs than there are."""
    for name in names:
        if RUNS[name].gpus > gpus:
            result.skip(f"{name}: {what}", f"{RUNS[name].gpus} GPUs needed, {gpus} here")


# The checks: each returns a Result and names the launches it needs.

STAND_IN = "the float32 run of its mode stands in for it there"


def agreement(launch: "Launches", gpus: int, quick: bool) -> Result:
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["sgd-single", "sgd-far", *(f"sgd-{mode}" for mode in _compared(gpus))])
    if "sgd-single" not in legs or "sgd-far" not in legs:
        return result
    reference = _model(legs["sgd-single"])
    far = _distance(_model(legs["sgd-far"]), reference)
    result.figures["far"] = far
    result.lines.insert(0, f"global batch {2 * micro_batch(gpus)}; far (global batch {micro_batch(gpus)}) = {far:.4g}; "
                        "dropout and the augmentation recipe on (per sample)")
    for mode in _compared(gpus):
        out = legs.get(f"sgd-{mode}")
        if out is None:
            continue
        share = _share(_distance(_model(out), reference), far)
        result.figures[f"{mode} share of far"] = share
        result.add(f"{mode} ({launch.processes(f'sgd-{mode}')} processes): {share:.2e} of far "
                   f"(tolerance {TOLERANCE})", None if share < TOLERANCE else mode)
        if MODES[mode].script == "train_fsdp.py":  # each rank held its share of the state, on the GPU
            held = re.search(r"rank 0 held .*? of the [0-9.]+ MB that each DDP process holds",
                             (out / f"log-sgd-{mode}.txt").read_text())
            expected = 1 / launch.processes(f"sgd-{mode}")
            share_held = float(held.group(0).split(": ")[-1].split(" of the")[0]) if held else None
            result.figures[f"{mode} share held"] = share_held
            result.add(f"{mode}: {held.group(0) if held else 'no memory line'} (expected about {expected:.3f})",
                       None if share_held is not None and abs(share_held - expected) <= 0.02 else f"{mode} memory")
    return result


def logits_dtypes(out: Path) -> set[str]:
    """The dtypes of the logits every rank's loss was computed from (the DTYPE_LOG hook)."""
    log = out / "dtypes.txt"
    return {line.split()[1] for line in log.read_text().splitlines()} if log.exists() else set()


def fp16_learns(launch: "Launches", gpus: int, quick: bool) -> Result:
    """fp16 runs against the float32 run of the same steps, as a share of a scale: SGD's distance
    to another global batch, AdamW's bf16 run (see ADAMW_FP16_TOLERANCE); the logits of every
    fp16 run in float16 (and of its float32 reference in float32: the hook sees)."""
    cases = [("sgd-single", "sgd-far", "of far", FP16_TOLERANCE, [f"sgd-fp16-{mode}" for mode in SYNC_SGD])]
    if not quick:
        cases.append(("adamw-single", "adamw-bf16-single", "of bf16's distance", ADAMW_FP16_TOLERANCE,
                      ["adamw-fp16-single", "adamw-fp16-ddp"]))
    result = Result(cpu=launch.cpu)
    for reference, scale_run, unit, tolerance, names in cases:
        legs = _legs(result, launch, [reference, scale_run, *names])
        if reference not in legs or scale_run not in legs:
            continue
        ref = _model(legs[reference])
        scale = _distance(_model(legs[scale_run]), ref)
        seen = logits_dtypes(legs[reference])
        result.judge(f"{reference}: logits in {sorted(seen)}", seen == {"float32"}, f"{reference} dtype",
                     gpu_only=None if stand_in(reference, launch.cpu) == reference else STAND_IN)
        for name in names:
            if name not in legs:
                continue
            last = _last(legs[name])
            share, loss_scale = _share(_distance(last["model"], ref), scale), (last.get("scaler") or {}).get("scale")
            dtypes = logits_dtypes(legs[name])
            result.figures[f"{name} share of {scale_run}"] = share
            result.figures[f"{name} loss scale"] = loss_scale
            # Steps 1 and 3 (at least) skipped: the scale halved twice.
            ok = share < tolerance and loss_scale is not None and loss_scale <= 2.0 ** 16 / 4 and dtypes == {"float16"}
            result.judge(f"{name}: {share:.3g} {unit} ({scale:.3g}) from {reference} (tolerance {tolerance}); "
                         f"final loss scale {loss_scale} (2^16 halved at each skipped step); logits in "
                         f"{sorted(dtypes)} on every rank", ok, name, gpu_only=f"fp16 is the GPU's kernels; {STAND_IN}")
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


def no_syncs(launch: "Launches", gpus: int, quick: bool) -> Result:
    result = Result(cpu=launch.cpu)
    names = _sync_runs(gpus, quick)
    for name, out in _legs(result, launch, names).items():
        allowed = {SCALER_READ} if name == "sgd-fp16-fsdp-shared" else set()
        records, processes = sync_records(out), launch.processes(name)
        # What the hook records on any device: every rank's record, each epoch's training pass wrapped.
        passes, epochs = [record.get("passes") for record in records], len(json.loads((out / "history.json").read_text()))
        result.add(f"{name}: {len(records)} of {processes} ranks wrote their record, training passes wrapped {passes} "
                   f"({epochs} epochs)", None if len(records) == processes and passes == [epochs] * processes
                   else f"{name} record")
        line, ok = judge_syncs(name, records, processes, allowed)
        result.judge(line, ok, name, gpu_only="set_sync_debug_mode watches CUDA's synchronisations only")
        for record in records:
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


def compiled(launch: "Launches", gpus: int, quick: bool) -> Result:
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["compile", "compile-fsdp-shared"])
    if "compile" in legs:
        graphs = int((legs["compile"] / "compiled.txt").read_text())
        record = json.loads((legs["compile"] / "history.json").read_text())[-1]
        result.figures.update({"single graphs": graphs, "single val acc": record["val_acc"],
                               "single epoch 2 seconds": record["seconds"]})
        result.add(f"single: {graphs} graph(s) compiled", None if graphs >= 1 else "single")
        result.judge(f"single: val acc {record['val_acc']:.3f} (at least 0.8), epoch 2 in {record['seconds']:.1f} s",
                     record["val_acc"] >= 0.8, "single learns",
                     gpu_only="inductor's code is the GPU's; a tiny run learns nothing to speak of")
    for name, out in legs.items():
        line, ok = judge_compiled(name, compiled_ops(out), launch.processes(name))
        result.add(line, None if ok else f"{name} graphs")
    return result


def _resumed_line(result: Result, what: str, straight: dict, resumed: dict, saved: dict, name: str) -> None:
    """A resumed run against the straight one, for the weights and the weight average: their
    distance as a share of how far the straight run moved after the checkpoint it resumed from."""
    for part, get in (("weights", lambda last: last["model"]), ("average", lambda last: last["average"]["model"])):
        moved = _distance(get(straight), get(saved))
        share = _share(_distance(get(resumed), get(straight)), moved)
        result.figures[f"{what} {part} share"] = share
        result.add(f"{what}: resumed vs straight {part}: {share:.2e} of how far the straight run moved after the "
                   f"checkpoint ({moved:.4g}; tolerance {TOLERANCE})", None if share < TOLERANCE else f"{name} {part}")


def resume(launch: "Launches", gpus: int, quick: bool) -> Result:
    """STEPS's run resumed from its step checkpoint RESUMED_AT (in the middle of epoch 1: the
    dropout keys, the fp16 scaler, fused AdamW, the average, across the epoch's end)."""
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["steps-single", "steps-single-resumed"])
    if len(legs) == 2:
        saved = _saved(legs["steps-single"] / "epochs" / RESUMED_AT)
        result.lines.append(f"resumed from {RESUMED_AT}: epoch {saved['epoch'] + 1} step {saved['step']}")
        _resumed_line(result, "single", _last(legs["steps-single"]), _last(legs["steps-single-resumed"]), saved,
                      "resume")
    return result


def _steps_of(states: list[dict], steps_per_epoch: int) -> list[int]:
    """The run's optimizer step each checkpoint was written after."""
    return [state["epoch"] * steps_per_epoch + state["step"] for state in states]


def memory_records(out: Path) -> list[dict]:
    """Each process's record of its CUDA memory and contexts (the MEMORY_LOG hook)."""
    return [json.loads(path.read_text()) for path in sorted(out.glob("memory.json.*"))]


def judge_peak(record: dict) -> tuple[str, bool]:
    """FSDP's peak GPU memory through the first epoch's training, a step checkpoint included, against
    its peak before that checkpoint: equal, within 5% of what the rank held when it was made (its
    weights, gradients, optimizer state and average). Staging the shards on the GPU would add them."""
    before, through, held = (record.get(key) for key in ("peak before the first step checkpoint",
                                                         "peak through the first epoch", "held at the first step checkpoint"))
    if before is None or through is None or held is None:
        return f"rank {record.get('rank')}: no step checkpoint's memory recorded ({sorted(record)})", False
    more = through - before
    return (f"rank {record['rank']}: peak {before / 2**20:.0f} MiB before the first step checkpoint, "
            f"{through / 2**20:.0f} MiB through the epoch that wrote it ({more / 2**20:+.1f} MiB; the rank held "
            f"{held / 2**20:.0f} MiB then, allowed {0.05 * held / 2**20:.0f})"), more <= 0.05 * held


def steps(launch: "Launches", gpus: int, quick: bool) -> Result:
    """--save-every-steps: the background writer's step checkpoints, one after every step in
    order; FSDP's, written by dcp.async_save, resumed to the straight run's end; FSDP's peak
    memory with a step checkpoint, its peak without."""
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["steps-single", "steps-fsdp", "steps-fsdp-resumed"])
    if "steps-single" in legs:
        out = legs["steps-single"]
        history = json.loads((out / "history.json").read_text())
        states = [_saved(path) for path in _copies(out)]
        per_epoch = round(history[0]["train_samples"] / micro_batch(gpus))
        written = _steps_of(states, per_epoch)
        total = per_epoch * len(history)
        result.add(f"single, --save-every-steps 1: {len(states)} checkpoints, after steps {written[:3]} ... "
                   f"{written[-2:]} of {total} ({per_epoch} an epoch; an epoch's last step written by the epoch's save)",
                   None if written == list(range(1, total + 1)) else "single step checkpoints")
    if "steps-fsdp" in legs and "steps-fsdp-resumed" in legs:
        saved = _saved(_copies(legs["steps-fsdp"], ".dcp")[0])
        result.lines.append(f"FSDP ({launch.processes('steps-fsdp')} process(es)): resumed from its last.dcp after "
                            f"epoch {saved['epoch'] + 1} step {saved['step']}, written by dcp.async_save")
        _resumed_line(result, "FSDP", _last(legs["steps-fsdp"]), _last(legs["steps-fsdp-resumed"]), saved, "fsdp")
    if "steps-fsdp" in legs:
        records = memory_records(legs["steps-fsdp"])
        if len(records) != launch.processes("steps-fsdp"):
            result.add(f"FSDP: {len(records)} of {launch.processes('steps-fsdp')} memory records", "fsdp memory record")
        for record in records:
            line, ok = judge_peak(record)
            result.figures[f"FSDP rank {record.get('rank')} memory"] = record
            result.judge(f"FSDP peak GPU memory: {line}", ok, "fsdp peak",
                         gpu_only="torch counts no allocations of the CPU's")
    return result


def decay_at(updates: int, decay: float) -> float:
    """--ema-decay's decay of the update after `updates` others (src/ema.py's formula, written again)."""
    return min(decay, (1 + updates) / (10 + updates))


def lerp_off(before: dict, weights: dict, after: dict, weight: float) -> float:
    """How far `after` is from before + weight x (weights - before), in float64, as a share of the
    rounding that float32 allows there (8 units of roundoff of |before| + |weights|): at most 1."""
    worst = 0.0
    for key, start in before.items():
        a, w, got = start.double(), weights[key].double(), after[key].double()
        want = a + weight * (w - a)
        bound = 8 * 2.0 ** -24 * (a.abs() + w.abs()) + 1e-30
        worst = max(worst, ((got - want).abs() / bound).max().item())
    return worst


def ema(launch: "Launches", gpus: int, quick: bool) -> Result:
    """--ema-decay 0.9 computed again from STEPS's checkpoints (one after every step): each step's
    average is the one before moved toward that step's weights by 1 - decay_at(updates), in
    float32; a step the fp16 scaler skipped (OVERFLOW_AT: steps 1 and 3) leaves the weights, the
    average and its count as they were."""
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["steps-single"])
    if "steps-single" not in legs:
        return result
    states = [_saved(path) for path in _copies(legs["steps-single"])]
    skipped, worst, wrong = [], 0.0, []
    for step, (before, after) in enumerate(zip(states, states[1:]), start=2):
        averages = before["average"]["model"], after["average"]["model"]
        counts = before["average"]["updates"], after["average"]["updates"]
        if counts[1] == counts[0]:
            skipped.append(step)
            if _distance(averages[1], averages[0]) or _distance(after["model"], before["model"]):
                wrong.append(f"step {step} skipped but moved")
            continue
        if counts[1] != counts[0] + 1:
            wrong.append(f"step {step}: updates {counts[0]} -> {counts[1]}")
            continue
        params = {key: value for key, value in after["model"].items() if key in averages[0]}
        off = lerp_off(averages[0], params, averages[1], 1 - decay_at(counts[0], 0.9))
        worst = max(worst, off)
        if off > 1:
            wrong.append(f"step {step}: {off:.3g} of the rounding off")
    first = states[0]["average"]["updates"] if states else None
    result.figures.update({"ema worst share of rounding": worst, "ema skipped steps": skipped})
    ok = not wrong and skipped == [3] and first == 0 and len(states) > 3
    result.add(f"{len(states) - 1} steps: each average the one before moved by 1 - min(0.9, (1 + t) / (10 + t)) "
               f"toward the step's weights, within {worst:.3g} of float32's rounding (at most 1); steps the scaler "
               f"skipped: 1 (no update counted after it: {first}) and {skipped} (expected [3]), left as they were"
               + (f"; WRONG: {'; '.join(wrong[:3])}" if wrong else ""), None if ok else "ema")
    return result


def tracked(store: Path) -> tuple[dict[str, list[tuple[int, float]]], list[str]]:
    """MLflow's SQLite store (--track mlflow's, beside --checkpoint): each metric's (step, value)
    in order, and the runs' statuses."""
    with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True)) as connection:
        metrics: dict[str, list[tuple[int, float]]] = {}
        for key, step, value in connection.execute("SELECT key, step, value FROM metrics ORDER BY step, timestamp"):
            metrics.setdefault(key, []).append((step, value))
        statuses = [status for (status,) in connection.execute("SELECT status FROM runs")]
    return metrics, statuses


def track(launch: "Launches", gpus: int, quick: bool) -> Result:
    """--track mlflow (STEPS's run): every numeric field of every epoch's history record at its
    epoch, step metrics at increasing optimizer steps within the run, one run, FINISHED."""
    result = Result(cpu=launch.cpu)
    legs = _legs(result, launch, ["steps-single"])
    if "steps-single" not in legs:
        return result
    out = legs["steps-single"]
    history = json.loads((out / "history.json").read_text())
    metrics, statuses = tracked(out / "mlflow.db")
    differ = [f"{key} of epoch {record['epoch']}" for record in history for key, value in record.items()
              if key != "epoch" and isinstance(value, (int, float)) and not isinstance(value, bool)
              and (record["epoch"], float(value)) not in metrics.get(f"epoch/{key}", [])]
    step_keys = sorted(key for key in metrics if key.startswith("step/"))
    steps_logged = [step for step, _ in metrics.get("step/loss", [])]
    total = round(sum(record["train_samples"] for record in history) / micro_batch(gpus))
    ok = (not differ and statuses == ["FINISHED"] and "step/loss" in step_keys
          and steps_logged == sorted(set(steps_logged)) and 0 < len(steps_logged) and steps_logged[-1] <= total)
    result.figures["tracked step metrics"] = len(steps_logged)
    result.add(f"MLflow: {len(history)} epochs' records, {sum(len(v) for k, v in metrics.items() if k.startswith('epoch/'))} "
               f"epoch values, every one the history's" + (f" but {differ[:3]}" if differ else "")
               + f"; step metrics {step_keys} at {len(steps_logged)} steps up to {steps_logged[-1] if steps_logged else None} "
               f"of {total}; runs {statuses}", None if ok else "track")
    return result


def syncbn(launch: "Launches", gpus: int, quick: bool) -> Result:
    """--sync-bn over real ranks (two sharing the GPU over gloo; on 2+ GPUs, all of them over NCCL)
    against train_single.py at the same global batch, as a share of how far its second epoch moved."""
    result = Result(cpu=launch.cpu)
    names = _runs_for(gpus, ["syncbn-ddp-shared", "syncbn-ddp"])
    legs = _legs(result, launch, ["syncbn-single", *names])
    _too_few_gpus(result, gpus, ["syncbn-ddp"], "DDP over NCCL with --sync-bn")
    if "syncbn-single" not in legs:
        return result
    reference = _model(legs["syncbn-single"])
    moved = _distance(reference, _saved(_copies(legs["syncbn-single"])[0])["model"])
    result.figures["syncbn epoch 2 moved"] = moved
    for name in names:
        if name in legs:
            share = _share(_distance(_model(legs[name]), reference), moved)
            result.figures[f"{name} share"] = share
            result.add(f"{name} ({launch.processes(name)} processes, --sync-bn, float64): {share:.2e} of how far "
                       f"train_single.py's epoch 2 moved ({moved:.4g}; tolerance {TOLERANCE})",
                       None if share < TOLERANCE else name)
    return result


STOP_LINE = re.compile(r"stopped by SIGTERM at epoch (\d+) step (\d+) of (\d+): (\S+) saved there; to go on")
UNAGREED = re.compile(r"stop: rank 1 stopped answering at epoch \d+ step \d+ \(\w+[^)]*\); last heard \d+ s ago: "
                      r"no step can be agreed without it")


def _said(out: Path, name: str, pattern: re.Pattern) -> list[str]:
    """The lines of the launch's log that `pattern` finds (a progress bar's carriage returns split)."""
    text = (out / f"log-{name}.txt").read_text(errors="replace").replace("\r", "\n")
    return [line.strip() for line in text.splitlines() if pattern.search(line)]


def stop_signal(launch: "Launches", gpus: int, quick: bool) -> Result:
    """A stop on SIGTERM under torchrun (the agreement's DDP flags): one line from rank 0 naming
    the agreed step, STOP_STEP, whose last.pth is the straight run's there (sgd-ddp-shared keeps it);
    a stop that cannot be agreed (rank 1 stopped) ends rank 0 with its line and its flight
    recorder's dump, the collective it waited in last and not completed."""
    result = Result(cpu=launch.cpu)
    pairs = [(f"stop-{mode}", f"sgd-{mode}", f"hung-{mode}") for mode in _stop_modes(gpus)]
    legs = _legs(result, launch, [name for pair in pairs for name in pair])
    _too_few_gpus(result, gpus, ["stop-ddp", "hung-ddp"], "the stop agreement over NCCL (pinned flags, CUDA "
                  "events): on one GPU two ranks share it over gloo, whose agreement is the CPU's")
    far = 0.0  # check 2's scale (the distance to another global batch); its legs failing fail this leg too
    with contextlib.suppress(RuntimeError):
        far = _distance(_model(launch("sgd-far")), _model(launch("sgd-single")))
    for stopped, straight, hung in pairs:
        if stopped in legs and straight in legs:
            lines = _said(legs[stopped], stopped, STOP_LINE)
            match = STOP_LINE.search(lines[0]) if len(lines) == 1 else None
            last = _last(legs[stopped])
            kept = [state for state in map(_saved, _copies(legs[straight]))
                    if (state["epoch"], state["step"]) == (last["epoch"], last["step"])]
            share = _share(_distance(last["model"], kept[0]["model"]), far) if kept else math.inf
            result.figures[f"{stopped} share of far"] = share
            ok = (match is not None and (int(match.group(1)), int(match.group(2))) == (1, STOP_STEP)
                  and (last["epoch"], last["step"]) == (0, STOP_STEP) and share < TOLERANCE)
            result.add(f"{stopped}: {len(lines)} stop line(s) ({lines[0][:120] if lines else 'none'}); last.pth after "
                       f"epoch {last['epoch'] + 1} step {last['step']} (expected 1 and {STOP_STEP}), {share:.2e} of far "
                       f"from {straight}'s last.pth of that step", None if ok else stopped)
        if hung in legs:
            out = legs[hung]
            said = _said(out, hung, UNAGREED)
            dump = out / "trace_0"
            entries = pickle.loads(dump.read_bytes()).get("entries", []) if dump.exists() else []
            waited = entries[-1] if entries else {}
            ok = (len(said) == 1 and waited.get("profiling_name", "").startswith(("gloo:", "nccl:"))
                  and waited.get("state") != "completed")
            result.add(f"{hung}: {len(said)} stop line(s) ({said[0][:140] if said else 'none'}); rank 0's flight "
                       f"recorder: {len(entries)} entries, the last {waited.get('profiling_name')} "
                       f"{waited.get('state')}", None if ok else hung)
    return result


def targets_seen(out: Path) -> dict[str, set[str]]:
    """Per rank, the kinds of targets its loss took (the TARGETS_LOG hook): "soft" (MixUp's and
    CutMix's probabilities), "hard" (class indices)."""
    seen: dict[str, set[str]] = {}
    log = out / "targets.txt"
    for line in (log.read_text().splitlines() if log.exists() else []):
        rank, kind = line.split()
        seen.setdefault(rank, set()).add(kind)
    return seen


MASK_SHAPES = ((5, 1), (5, 2500), (3, 4096))  # (samples, elements): one element; whole blocks of 1024 and a part


def _dropout_masks(device: torch.device) -> tuple[str, bool]:
    """Dropout's masks (src/dropout.py) from Triton's kernel on `device` against torch's ops on the
    CPU, for several shapes, rates and units: the same bits. On a GPU the kernel through _kept's own
    choice (one failure and it would fall back to the ops: asserted not); on the CPU, where the
    kernel cannot run, Triton's interpreter runs it."""
    import src.dropout as dropout
    if dropout.triton is None:
        return "Triton is not installed: the GPU computes the masks with torch's ops", device.type != "cuda"
    generator = torch.Generator().manual_seed(0)
    compared, different = 0, []
    kernel = dropout._kept_kernel
    if device.type != "cuda":
        from triton.runtime.interpreter import InterpretedFunction
        dropout._kept_kernel = InterpretedFunction(kernel.fn)
    try:
        for samples, elements in MASK_SHAPES:
            keys = torch.randint(0, 2**62, (samples,), generator=generator)
            for p in (1e-7, 0.5, 0.97):
                for unit in (0, 3):
                    rows = dropout._first_xorshift(dropout._per_sample(keys, unit, unit))[0]
                    threshold = dropout._signed_threshold(p)
                    assert threshold is not None
                    want = dropout._kept_by_ops(rows, dropout._element_part(elements, rows.device), threshold)
                    if device.type == "cuda":
                        got = dropout._kept(rows.to(device), elements, threshold).cpu()
                    else:
                        got = dropout._kept_by_kernel(rows, elements, threshold)
                    compared += 1
                    if not torch.equal(got, want):
                        different.append((samples, elements, p, unit))
    finally:
        dropout._kept_kernel = kernel
    fell_back = dropout._kernel_failed
    how = "Triton's kernel on the GPU" if device.type == "cuda" else "Triton's kernel in its interpreter"
    return (f"dropout masks by {how} against torch's ops on the CPU: {compared - len(different)} of {compared} the "
            f"same bit for bit (samples x elements {[f'{s}x{e}' for s, e in MASK_SHAPES]}, p 1e-7, 0.5, 0.97, units 0 "
            f"and 3)" + (f"; DIFFERENT: {different[:3]}" if different else "")
            + ("; the kernel FAILED and the ops stood in" if fell_back else "")), not different and not fell_back


def draws(launch: "Launches", gpus: int, quick: bool) -> Result:
    """Per-sample draws on the GPU: Triton's dropout masks are the CPU's; every rank of the
    agreement's runs (dropout and the augmentation recipe on: check 2 compares them) trained on
    MixUp's and CutMix's soft targets."""
    result = Result(cpu=launch.cpu)
    device = torch.device("cuda", torch.cuda.current_device()) if not launch.cpu else torch.device("cpu")
    try:
        line, ok = _dropout_masks(device)
        result.add(line, None if ok else "dropout masks")
    except Exception as error:  # the part reports; the runs are still read
        result.add(f"{type(error).__name__}: {error}", failed="dropout masks")
    names = ["sgd-single", *(f"sgd-{mode}" for mode in _compared(gpus))]
    for name, out in _legs(result, launch, names).items():
        seen = targets_seen(out)
        ranks = launch.processes(name)
        ok = len(seen) == ranks and all("soft" in kinds for kinds in seen.values())
        result.add(f"{name}: the loss of each of its {ranks} ranks took {dict(sorted((r, sorted(k)) for r, k in seen.items()))} "
                   "targets (soft: mixed)", None if ok else f"{name} targets")
    return result


def gpu0(launch: "Launches", gpus: int, quick: bool) -> Result:
    """Each process of a launch over NCCL (one GPU per rank) holds a CUDA context on its own GPU
    alone: none of them but rank 0's on GPU 0 (a thread that makes a CUDA call before it sets its
    GPU opens one there: hundreds of MB each); nvidia-smi's memory of each process on GPU 0 where
    it lists the processes by their pids (a container may show none)."""
    result = Result(cpu=launch.cpu)
    names = _gpu0_runs(gpus, launch.cpu)
    if not names:
        result.skip("every process of the launches runs on GPU 0", "one GPU: no rank has another to keep to")
    for name, out in _legs(result, launch, names).items():
        records = memory_records(out)
        for record in records:
            contexts, rank = record.get("contexts"), int(record.get("rank", -1))
            result.figures[f"{name} rank {rank} MiB on GPU 0"] = record.get("MiB on GPU 0")
            result.judge(f"{name} rank {rank} (GPU {record.get('device')}): CUDA contexts on GPUs {contexts}, "
                         f"{record.get('MiB on GPU 0', 'not listed by nvidia-smi')} MiB on GPU 0",
                         contexts == [rank], f"{name} rank {rank}", gpu_only="no CUDA context to count")
        if len(records) != launch.processes(name):
            result.add(f"{name}: {len(records)} of {launch.processes(name)} processes wrote their record",
                       failed=f"{name} records")
    return result


def _gpu0_runs(gpus: int, cpu: bool = False) -> list[str]:
    """The launches with a GPU per rank and 2+ ranks (NCCL) on `gpus` GPUs; on the CPU, check 7's
    FSDP run, whose record is read and judged nothing."""
    if cpu:
        return ["steps-fsdp"]
    return [name for name in ("sgd-ddp", "sgd-fsdp", "stop-ddp", "syncbn-ddp", "steps-fsdp")
            if RUNS[name].gpus <= gpus and gpus > 1]


@dataclass
class Check:
    key: str
    title: str
    function: Callable
    runs: Callable[[int, bool], list[str]]  # the launches it needs, on `gpus` GPUs, with --quick
    quick: bool = True
    in_process: int = 0  # seconds planned for what it does in this process


def _stop_modes(gpus: int) -> list[str]:
    """The modes of check 11's stops on `gpus` GPUs: two ranks sharing one over gloo; on 2+, DDP over NCCL too."""
    return [mode for mode in ("ddp-shared", "ddp") if RUNS[f"stop-{mode}"].gpus <= gpus]


def _stop_runs(gpus: int) -> list[str]:
    return ["sgd-single", "sgd-far"] + [f"{kind}-{mode}" for mode in _stop_modes(gpus) for kind in ("stop", "sgd", "hung")]


CHECKS = [
    Check("gpu", "on the GPU, in this process (and accelerate's TF32)",
          lambda launch, gpus, quick: on_the_gpu(launch, gpus), lambda g, q: ["accelerate-tf32"],
          in_process=IN_PROCESS),
    Check("agreement", "agreement (--deterministic, every recipe flag, the draws on)", agreement,
          lambda g, q: ["sgd-single", "sgd-far"] + [f"sgd-{m}" for m in _compared(g)]),
    Check("fp16", "fp16 learns", fp16_learns,
          lambda g, q: ["sgd-single", "sgd-far"] + [f"sgd-fp16-{m}" for m in SYNC_SGD]
          + ([] if q else ["adamw-single", "adamw-bf16-single", "adamw-fp16-single", "adamw-fp16-ddp"])),
    Check("sync", "no host synchronisation in a step", no_syncs, lambda g, q: _sync_runs(g, q)),
    Check("compile", "compile compiled", compiled, lambda g, q: ["compile", "compile-fsdp-shared"], quick=False),
    Check("resume", "resume from a step checkpoint with dropout, fp16 AdamW and --ema-decay", resume,
          lambda g, q: ["steps-single", "steps-single-resumed"], quick=False),
    Check("steps", "--save-every-steps: the writer's pinned copies, FSDP's dcp.async_save, FSDP's peak memory", steps,
          lambda g, q: ["steps-single", "steps-fsdp", "steps-fsdp-resumed"], quick=False),
    Check("ema", "--ema-decay computed again from every step", ema, lambda g, q: ["steps-single"], quick=False),
    Check("track", "--track mlflow holds the history", track, lambda g, q: ["steps-single"], quick=False),
    Check("syncbn", "--sync-bn across real ranks", syncbn,
          lambda g, q: ["syncbn-single"] + _runs_for(g, ["syncbn-ddp-shared", "syncbn-ddp"]), quick=False),
    Check("stop", "a stop signal: the agreed step, and the flight recorder's dump where none can be", stop_signal,
          lambda g, q: _stop_runs(g), quick=False),
    Check("draws", "per-sample draws: Triton's dropout masks, the augmentation's soft targets", draws,
          lambda g, q: ["sgd-single"] + [f"sgd-{m}" for m in _compared(g)], in_process=5),
    Check("gpu0", "each process's CUDA context on its own GPU, none on GPU 0", gpu0,
          lambda g, q: _gpu0_runs(g), quick=False),
]


def plan(gpus: int, quick: bool, only: list[str] | None = None) -> list[tuple[Check, list[str], int]]:
    """(check, the launches it adds to those before it, its seconds planned): its launches' seconds
    shared among the PARALLEL that run at once (check 1's in-process part runs beside them)."""
    steps, launched = [], set()
    for check in CHECKS:
        if (check.quick or not quick) and (only is None or check.key in only):
            new = [name for name in dict.fromkeys(check.runs(gpus, quick)) if name not in launched]
            launched.update(new)
            seconds = sum(RUNS[name].planned() for name in new)
            steps.append((check, new, math.ceil(seconds / PARALLEL) + check.in_process))
    return steps


def shared_memory(gpus: int, names: list[str]) -> int:
    """The most /dev/shm the loader workers of the runs that may run at once hold on a node
    (src.devices's rule for each; the PARALLEL largest together)."""
    from src.devices import shared_memory_need
    needs = sorted((shared_memory_need(WORKERS, RUNS[name].per_process(gpus) * 3 * SIZE * SIZE,
                                       RUNS[name].processes(gpus)) for name in names), reverse=True)
    return sum(needs[:PARALLEL])


# Check 1, in this process. Each part adds its lines to the check's Result; on the CPU (--device
# cpu) the same code runs, what only a GPU can show skipped.

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
            model: nn.Module = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1)).to(device)
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


def _resume_on_the_gpu(device, result: Result) -> None:
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
    result.judge(f"CPU AdamW state into fused AdamW on {device}: ours {outcome['ours']}; old order "
                 f"{outcome['loaded, then fused']}", outcome["ours"] == "steps on ['cuda'], a step runs",
                 "resume into fused AdamW", gpu_only="the saved state is where the model is")


class _Probe(nn.Module):
    """Records, in whichever thread runs it, the dtype of what it sees, into `seen`: also from a
    replica, a deep copy (it keeps the list's append, which a deep copy does not copy, where the
    list itself would be copied)."""

    def __init__(self, seen: list):
        super().__init__()
        self.note = seen.append

    def forward(self, x):
        self.note(x.dtype)
        return x


def _in_threads(replicas: list[nn.Module], x: torch.Tensor, device: torch.device) -> None:
    """Each replica's forward in a thread of its own, as DataParallel runs them: torch's
    parallel_apply on a GPU; on the CPU, where it cannot run, what its threads do: autocast entered
    again as the caller has it, without a dtype, whose default in a thread is float16 on CUDA."""
    if device.type == "cuda":
        from torch.nn.parallel import parallel_apply
        parallel_apply(replicas, [(x,) for _ in replicas], devices=[device.index for _ in replicas])
        return
    import threading
    enabled = torch.is_autocast_enabled(device.type)

    def worker(replica: nn.Module) -> None:  # torch/nn/parallel/parallel_apply.py's _worker, on the CPU
        torch.set_autocast_dtype(device.type, torch.float16)
        with torch.amp.autocast(device.type, enabled=enabled):
            replica(x)
    threads = [threading.Thread(target=worker, args=(replica,)) for replica in replicas]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _data_parallel(gpus: int, device, result: Result) -> None:
    from src.data_parallel import AutocastDataParallel, AutocastReplica
    from src.seeds import derive_seed, seed_epoch
    seen: dict[str, list[torch.dtype]] = {"plain": [], "ours": []}
    x = torch.ones(2, 3, 8, 8, device=device)
    with torch.autocast(device.type, torch.bfloat16):
        for name in seen:
            model = nn.Sequential(nn.Conv2d(3, 4, 3), _Probe(seen[name])).to(device)
            replicas: list[nn.Module] = [copy.deepcopy(model) for _ in range(2)]
            if name == "ours":  # made in this thread, as AutocastDataParallel.replicate makes them
                replicas = [AutocastReplica(replica, device.type) for replica in replicas]
            _in_threads(replicas, x, device)
    result.add(f"--amp bf16, two replicas in DataParallel's threads on one {device.type}: ours "
               f"{sorted(set(map(str, seen['ours'])))}, plain replicas {sorted(set(map(str, seen['plain'])))}",
               None if set(seen["ours"]) == {torch.bfloat16} else "DataParallel replicas' dtype")
    seed_epoch(42, 0)
    seeds = [g.initial_seed() for g in torch.cuda.default_generators]
    result.judge(f"seed_epoch: {len(set(seeds))} distinct dropout seeds on {gpus} GPU(s)",
                 len(seeds) == gpus and seeds == [derive_seed(42, 0, 0, gpu) for gpu in range(gpus)], "GPU seeds",
                 gpu_only="no GPU generator to seed")
    if gpus > 1:
        formats = []
        # A 3x3 kernel: a 1x1 convolution's weight has the same layout in both memory formats.
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), _Probe(seen["ours"]), nn.Flatten(), nn.Dropout(0.5))
        net[0].register_forward_pre_hook(lambda module, inputs: formats.append(
            module.weight.is_contiguous(memory_format=torch.channels_last)))
        dp = AutocastDataParallel(net.to(device).to(memory_format=torch.channels_last))
        seen["ours"].clear()
        with torch.autocast("cuda", torch.bfloat16):
            out = dp(torch.ones(2 * gpus, 3, 4, 4, device=device).to(memory_format=torch.channels_last))
        masks = (out != 0).view(gpus, 2, -1)
        distinct = len({tuple(mask.flatten().tolist()) for mask in masks})
        ok = set(seen["ours"]) == {torch.bfloat16} and all(formats) and distinct == gpus
        result.add(f"DataParallel over {gpus} GPUs: replicas ran in {sorted(set(map(str, seen['ours'])))}, "
                   f"channels-last weights in {sum(formats)} of {len(formats)}, {distinct} distinct dropout masks",
                   None if ok else "DataParallel over GPUs")


def _bare_state(args, device) -> Any:
    """A TrainingState of a one-layer model on `device` (what Progress reads of a run's state)."""
    from src.ema import WeightAverage
    from src.state import TrainingState
    model = nn.Linear(3, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingState(args, {}, model, optimizer, None, None, WeightAverage(model, optimizer, None), 1)


def _pinned(device, work: Path, result: Result) -> None:
    """What the project pins on a GPU: the training loaders' batches (loader_options), the progress
    bar's host copies of the running sums (Progress), the feature cache's host copies (_to_host),
    the step checkpoint writer's buffers (CheckpointWriter), whose file holds what the tensors held
    at the save, though the GPU changes them right after (the copies are queued first)."""
    from torch.utils.data import DataLoader, TensorDataset

    from src.checkpoint_writer import CheckpointWriter
    from src.cli import parse_args
    from src.freeze import _to_host
    from src.loaders import loader_options
    from src.progress import Progress
    args = parse_args("", ["--batch-size", "4", "--workers", "0"])
    images = TensorDataset(torch.zeros(8, 3, 8, 8, dtype=torch.uint8), torch.zeros(8, dtype=torch.long))
    loader = DataLoader(images, args.batch_size, **loader_options(args, device))
    batch_pinned = next(iter(loader))[0].is_pinned()
    progress = Progress(args, _bare_state(args, device), batch_images=4, device=device)
    sums_pinned = all(buffer.is_pinned() for buffer in progress.buffers)
    copy_pinned = _to_host(torch.ones(4, device=device))[0].is_pinned()
    writer = CheckpointWriter()
    weights = torch.ones(1 << 22, device=device)  # 16 MB of ones: not what a buffer never written holds
    with tempfile.TemporaryDirectory(dir=work) as folder:
        if device.type == "cuda":  # the GPU busy for about a second first: the copy is queued behind
            torch.cuda._sleep(1 << 30)  # that, and a writer that did not wait for it would find no copy
        writer.save({"model": {"w": weights}}, Path(folder) / "last.pth")
        weights.add_(1.0)  # the next step's update: queued after the copy, it must not reach the file
        writer.wait()
        held = torch.load(Path(folder) / "last.pth", weights_only=True)["model"]["w"]
    buffers_pinned = all(buffer.is_pinned() for buffer in writer.copies.buffers.values())
    saved = bool(held.eq(1).all())
    result.judge(f"training batches pinned: {batch_pinned}; the progress bar's host sums: {sums_pinned}; "
                 f"the feature cache's host copies: {copy_pinned}; the step checkpoint writer's buffers: {buffers_pinned}",
                 batch_pinned and sums_pinned and copy_pinned and buffers_pinned, "pinned",
                 gpu_only="nothing is pinned for a CPU")
    result.add(f"a step checkpoint of 16 MB on the {device.type}, the tensor changed right after the save: the file "
               f"holds {'the value at the save' if saved else 'ANOTHER value'}", None if saved else "step checkpoint's copy")


def judge_tf32(log: str) -> tuple[str, bool]:
    """What the TF32_LOG hook saw in train_accelerate.py --deterministic with a dynamo backend:
    Accelerator() turned TF32 matmuls on (so the check can bite), and the script's own settings,
    made after it, had them off at the first optimizer step."""
    seen: dict[str, bool] = {}
    for line in log.splitlines():
        rank, when, value = line.split()
        seen.setdefault(when, value == "True")
    ok = seen.get("accelerator") is True and seen.get("step") is False
    said = {True: "on", False: "off", None: "not seen"}
    return (f"train_accelerate.py --deterministic, dynamo backend set: TF32 matmuls {said[seen.get('accelerator')]} "
            f"after Accelerator() (accelerate turns them on), {said[seen.get('step')]} at the first optimizer step"), ok


def _accelerate_tf32(launch: "Launches", result: Result) -> None:
    out = launch("accelerate-tf32")
    log = out / "tf32.txt"
    line, ok = judge_tf32(log.read_text() if log.exists() else "")
    result.add(f"accelerate-tf32: the TF32_LOG hook wrote {len((log.read_text() if log.exists() else '').splitlines())} "
               "lines (after Accelerator(), at the first step)", None if log.exists() else "accelerate's TF32 record")
    result.judge(line, ok, "accelerate's TF32", gpu_only="accelerate turns TF32 on for CUDA devices only")


SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10's warning, once per host synchronisation


def _sync_batch_norm(device, result: Result) -> None:
    """--sync-bn's layer (src/batch_norm.py) against torch's SyncBatchNorm function (what
    nn.SyncBatchNorm's training forward calls), in a world of one over NCCL, two training steps in
    float32 and in fp16 channels-last with momentum=None (a cumulative average). Both run torch's
    kernels on the same numbers: the outputs, gradients and running statistics agree to a rounding
    (momentum=None's average is a float32 lerp in ours, the kernel's (1 - f) r + f m in torch's: a
    few roundings of the largest value, 4 u). Our second step runs under
    set_sync_debug_mode("error"): a host synchronisation raises; torch's runs under "warn", its
    synchronisations counted (its mask: a figure); a read-back under "error" must raise (the control).
    On the CPU, where torch's function has no kernels, the reference is nn.BatchNorm2d's own
    training step (a world of one normalises its whole batch), over gloo, without the debug mode."""
    import warnings

    import torch.distributed as dist
    from torch.nn.modules._functions import SyncBatchNorm as TorchSyncBatchNorm

    from src.batch_norm import synced_batch_norm
    cuda = device.type == "cuda"
    control = "not asked"
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
        try:
            torch.ones(1, device=device).sum().item()
            control = "did not raise"
        except RuntimeError:
            control = "raised"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=device if cuda else None)
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
                        if cuda:
                            torch.cuda.set_sync_debug_mode(("warn" if kind == "torch" else "error") if step else "default")
                        try:
                            if kind == "torch" and cuda:
                                factor = momentum if momentum is not None else 1 / (step + 1)
                                y = TorchSyncBatchNorm.apply(mine, bn.weight, bn.bias, bn.running_mean, bn.running_var,
                                                             bn.eps, factor, dist.group.WORLD, 1)
                            elif kind == "torch":
                                y = bn(mine)
                            else:
                                y = synced_batch_norm(bn, mine)
                            y.backward(grads[step])
                        finally:
                            if cuda:
                                torch.cuda.set_sync_debug_mode("default")
                    if kind == "torch" and step:
                        syncs = sum(SYNC_MESSAGE in str(warning.message) for warning in caught)
                ends[kind] = {"y": y, "dx": mine.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
                              "running mean": bn.running_mean, "running var": bn.running_var}
            # 4 u; on the CPU 32 u: torch's CPU kernel sums a channel's values in float32 where our
            # layer's CPU stand-ins sum in float64 (on a GPU both run torch's CUDA kernels)
            units = 4 if cuda else 32
            off = {name: ((ends["ours"][name].float() - ref.float()).abs().max()
                          / (units * torch.finfo(ref.dtype).eps / 2 * ref.float().abs().max())).item()
                   for name, ref in ends["torch"].items()}
            reference = "torch's SyncBatchNorm" if cuda else "nn.BatchNorm2d's training step"
            result.add(f"--sync-bn's layer against {reference} ({case}, a world of one over "
                       f"{'NCCL' if cuda else 'gloo'}): the largest difference {max(off.values()):.3g} of its bound ({units} u) "
                       f"({max(off, key=lambda name: off[name])})", None if max(off.values()) <= 1 else f"--sync-bn's layer ({case})")
            result.judge(f"our training step ran under set_sync_debug_mode('error'), torch's made {syncs} host "
                         f"synchronisation(s) (its mask); a read-back under 'error' {control} (the control)",
                         control == "raised", "--sync-bn's sync control", gpu_only="the sync debug mode is CUDA's")
    finally:
        dist.destroy_process_group()


MEMORY_BATCH, MEMORY_SIZE = 8, 32  # VGG16 at 32 px: its weights, not its activations, fill the memory


def _allocated(device: torch.device, peak: bool = False) -> int:
    """Bytes of CUDA memory allocated now (or at the peak since the last reset); 0 on the CPU."""
    if device.type != "cuda":
        return 0
    return torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)


def _fsdp_amp_memory(device, result: Result) -> None:
    """The memory of one FSDP training step of VGG16, rank 0 of two (torch's fake process group:
    the gathers allocate what a real one does, nothing is sent), without autocast and under
    --amp bf16 and fp16. Autocast casts each gathered float32 weight to half precision; the cast
    is saved for the backward and kept in autocast's cache until the autocast region ends, while
    FSDP frees the gathered float32 weights after each unit's forward: at the end of the forward
    a rank may hold a half-precision copy of every weight (VGG16: 268 MB) besides its shards.
    Sharded as train_fsdp.py shards (fully_shard per unit, then the root). On the CPU SqueezeNet
    1.1 runs the same steps, and torch counts no memory: the figures are skipped."""
    import torch.distributed as dist
    import torchvision
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from src.cli import parse_args
    from src.fsdp import fsdp_units
    from src.recipe import make_optimizer
    cuda = device.type == "cuda"
    build = torchvision.models.vgg16 if cuda else torchvision.models.squeezenet1_1
    figures = {}
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        for amp, dtype in (("no", None), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            start = _allocated(device)
            with torch.device("meta"):  # uninitialised weights: the bytes do not depend on them
                model = build(num_classes=2)
            model.to_empty(device=device)
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for unit in fsdp_units(model):
                fully_shard(unit, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = make_optimizer(model, parse_args("", []), device)
            held = _allocated(device) - start
            with torch.autocast(device.type, dtype, enabled=dtype is not None):
                loss = model(torch.randn(MEMORY_BATCH, 3, MEMORY_SIZE, MEMORY_SIZE, device=device)).float().sum()
            forward = _allocated(device) - start
            loss.backward()
            optimizer.step()
            if cuda:
                torch.cuda.synchronize(device)
            figures[amp] = {"shards MB": held / 1e6, "end of forward MB": forward / 1e6,
                            "peak MB": (_allocated(device, peak=True) - start) / 1e6}
            del model, optimizer, loss
    finally:
        dist.destroy_process_group()
        if cuda:
            torch.cuda.empty_cache()
    with torch.device("meta"):
        whole = sum(p.numel() for p in build(num_classes=2).parameters()) * 4 / 1e6
    line = (f"FSDP --amp memory ({build.__name__}, {MEMORY_SIZE} px, batch {MEMORY_BATCH}, rank 0 of 2, MB): "
            + "; ".join(f"{amp}: {f['shards MB']:.0f} with its shards and their optimizer, "
                        f"{f['end of forward MB']:.0f} "
                        f"at the end of the forward, {f['peak MB']:.0f} at the peak" for amp, f in figures.items())
            + f" (the whole float32 weights: {whole:.0f}; a half-precision copy of them: {whole / 2:.0f})")
    if cuda:
        result.lines.append(line)  # a figure: reported, not judged
        result.figures.update({"fsdp amp memory": figures, "vgg16 float32 weights MB": whole})
    else:
        result.skip(line, "on the CPU: torch counts no allocations of the CPU's (the steps ran, a figure of nothing)")


def on_the_gpu(launch: "Launches", gpus: int) -> Result:
    cpu = launch.cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    result = Result(cpu=cpu)
    parts: dict[str, Callable[[], None]] = {
        "fused optimizers": lambda: result.lines.extend(_fused_optimizers(device)),
        "resume": lambda: _resume_on_the_gpu(device, result),
        "DataParallel": lambda: _data_parallel(0 if cpu else gpus, device, result),
        "pinned": lambda: _pinned(device, launch.work, result),
        "accelerate's TF32": lambda: _accelerate_tf32(launch, result),
        "--sync-bn's layer": lambda: _sync_batch_norm(device, result),
        "FSDP --amp memory": lambda: _fsdp_amp_memory(device, result)}
    for name, part in parts.items():
        try:
            part()
        except Exception as error:  # each part reports; the others still run
            result.add(f"{type(error).__name__}: {str(error)[:500]}", failed=name)
    torch.backends.cuda.matmul.allow_tf32 = False
    return result


# The report: its entries on stdout as each check ends, OUT/report.md to read, OUT/report.json to compare runs.

def entry_markdown(entry: dict) -> str:
    """A check's part of report.md: its verdict and the modes or parts that failed, what it skipped,
    its lines and its figures."""
    failed = f" ({', '.join(entry['failed'])})" if entry["failed"] else ""
    skipped = f", {len(entry['skipped'])} skipped" if entry.get("skipped") else ""
    figures = [f"- figures: {json.dumps(entry['figures'], default=str)}"] if entry.get("figures") else []
    return "\n".join([f"## {entry['number']}. {entry['title']}: {entry['verdict']}{failed}{skipped}, "
                      f"{entry['seconds']:.0f} s (planned {entry['planned']} s, {len(entry['launches'])} launches)", "",
                      *(f"- {line}" for line in entry["lines"]), *figures]) + "\n"


def write_report(work: Path, header: dict, entries: list[dict]) -> str:
    """Write report.md and report.json into `work`; returns the Markdown."""
    if header.get("device") == "cpu":
        machine = (f"--device cpu: every check tiny on the CPU ({header.get('cpu', 'CPU')}); torch {header['torch']}. "
                   "A dry run of the checks: the comparisons that mean something only on a GPU are skipped")
    else:
        machine = (f"{len(header['gpus'])} GPU(s): {', '.join(header['gpus'])}; torch {header['torch']}, "
                   f"CUDA {header['cuda']}")
    lines = [f"# make test-gpu{' --quick' if header['quick'] else ''}, {header['date']}", "", machine, "",
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


def run_check(check: Check, number: int, launch: Any, gpus: int, quick: bool, new: list[str],
              planned: int) -> dict:
    """Run one check; its report entry. An exception of its own is a failed check, named."""
    began = time.time()
    try:
        result = check.function(launch, gpus, quick)
    except Exception as error:  # a failed check is reported; the others still run
        result = Result()
        result.add(f"{type(error).__name__}: {error}", failed=check.key)
    return {"number": number, "key": check.key, "title": check.title,
            "verdict": "FAILED" if result.failed else "passed", "failed": result.failed, "skipped": result.skipped,
            "seconds": time.time() - began, "planned": planned, "launches": new,
            "lines": result.lines, "figures": result.figures}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-selftest"))
    parser.add_argument("--quick", action="store_true", help="the checks that matter most, in under 3 minutes")
    parser.add_argument("--only", help="comma-separated keys of the checks to run: " + ", ".join(c.key for c in CHECKS))
    parser.add_argument("--deadline", type=float, help="seconds from now: a launch that would end later is not "
                        "started (a failed leg, named), one still running is stopped")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: every check tiny on the CPU, the comparisons only a GPU makes meaningful skipped "
                             "(a dry run of this script, for a machine without a GPU)")
    args = parser.parse_args()
    deadline = time.time() + args.deadline if args.deadline else math.inf
    only = args.only.split(",") if args.only else None
    if only and not set(only) <= {check.key for check in CHECKS}:
        parser.error(f"--only: unknown check {sorted(set(only) - {check.key for check in CHECKS})[0]!r}")
    cpu = args.device == "cpu"
    if not cpu and not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")
        return 0
    if cpu:
        os.environ["AS_ON_GPU"] = "1"  # this process's parts take the GPU's choices where the CPU has them
    from src.cache import cached
    from src.devices import cpu_model
    from src.loaders import labelled_images
    from src.tools.synthetic import write_dataset
    gpus = 1 if cpu else torch.cuda.device_count()
    size, workers = (CPU_SIZE, CPU_WORKERS) if cpu else (SIZE, WORKERS)
    work = args.out.resolve()
    data = work / "data"
    # The data, and its pixel cache: on the CPU a smaller set beside it, data-small (command_of).
    sets = {data: CPU_LARGE, work / "data-small": CPU_IMAGES} if cpu else {data: IMAGES}
    for folder, images in sets.items():
        if len(list((folder / "train").glob("*.jpg"))) != images:
            shutil.rmtree(folder, ignore_errors=True)
            write_dataset(folder, n_train=images, n_test=0, size=size, seed=0)
        cached(labelled_images(folder, size, show_progress=False), size, work / "cache", workers, show_progress=False)
    steps = plan(gpus, args.quick, only)
    names = [name for _, new, _ in steps for name in new]
    header = {"date": date.today().isoformat(), "quick": args.quick, "only": only, "device": args.device,
              "cpu": cpu_model(), "gpus": [] if cpu else [torch.cuda.get_device_name(i) for i in range(gpus)],
              "torch": torch.__version__, "cuda": torch.version.cuda,
              "launches": len({stand_in(name, cpu) for name in names}), "parallel": CPU_PARALLEL if cpu else PARALLEL,
              "planned seconds": DATA + sum(planned for _, _, planned in steps),
              "dev shm MB": shared_memory(gpus, names) / 2**20}
    where = "the CPU, tiny" if cpu else f"{header['gpus']}, torch {header['torch']}, CUDA {header['cuda']}"
    print(f"make test-gpu: {where}; {header['launches']} launches, {header['parallel']} at a time, "
          f"{header['planned seconds']} s planned; at most {header['dev shm MB']:.1f} MB of /dev/shm "
          "(Docker's default: 64 MB)", flush=True)
    launch = Launches(work, data, gpus, parallel=header["parallel"], deadline=deadline, cpu=cpu)
    entries, start = [], time.time()
    launch.start(names)  # every launch, in the order of the checks; each check waits for its own
    try:
        for check, new, planned in steps:
            entries.append(run_check(check, CHECKS.index(check) + 1, launch, gpus, args.quick, new, planned))
            write_report(work, header, entries)
            print(entry_markdown(entries[-1]), flush=True)
    finally:
        launch.close()
    failures = sum(entry["verdict"] != "passed" for entry in entries)
    skipped = sum(len(entry["skipped"]) for entry in entries)
    used = [work / name / ".cpu" for name in {stand_in(name, cpu) for name in names}]
    launched = sum(float(path.read_text()) for path in used if path.exists())
    print(f"{len(entries) - failures} of {len(entries)} checks passed ({skipped} comparisons skipped) in "
          f"{time.time() - start:.0f} s, the launches {launched:.0f} s of CPU; report in {work / 'report.md'} "
          f"and {work / 'report.json'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
