"""The machine a run trains on: its device, the numerics there, what it is (hardware()), and the
host limits that would otherwise fail late (too few GPUs, a small /dev/shm, no bfloat16, a container's CPU quota)."""
import math
import os
import platform
import shutil
from pathlib import Path

import torch

from src.errors import UserError

SHM = Path("/dev/shm")


def available_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """The CPUs this process may use: its affinity mask, capped by a cgroup CPU quota.

    A container limited to 8 CPUs on a 128-core host sees 128 in its affinity mask; the quota
    (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`) is what it really gets.
    """
    cpus = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota(Path(cgroup_root))
    return max(1, min(cpus, math.ceil(quota))) if quota else cpus


def default_workers(local_processes: int | None = None) -> int:
    """The CPUs this process may use, shared among the processes on this node (LOCAL_WORLD_SIZE,
    which torchrun and accelerate set, unless given)."""
    if local_processes is None:
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(1, available_cpus() // local_processes)


def _cgroup_cpu_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup of this process, or None when it sets no limit."""
    own = ""
    try:  # cgroup v2: "0::/path" in /proc/self/cgroup; containers usually see "/"
        own = next((line.split("::", 1)[1].strip() for line in
                    Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")), "")
    except OSError:
        pass
    for folder in dict.fromkeys([root / own.lstrip("/"), root]):
        try:
            limit, period = (folder / "cpu.max").read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        except (OSError, ValueError):
            continue
    for v1 in ("cpu", "cpu,cpuacct"):
        try:
            quota = int((root / v1 / "cpu.cfs_quota_us").read_text())
            microseconds = int((root / v1 / "cpu.cfs_period_us").read_text())
            return quota / microseconds if quota > 0 else None
        except (OSError, ValueError):
            continue
    return None


def gpu_choices(device: torch.device) -> bool:
    """Whether to make the choices made for a CUDA GPU that torch can also run on a CPU: the fused
    SGD and AdamW kernels, which take the fp16 scaler's inf check as a tensor.

    Always on CUDA. On the CPU when AS_ON_GPU=1: the tests' switch, so that the CPU suite runs the
    GPU's branch of each such decision in the real training loop. AS_ON_GPU=0 makes a GPU take
    the CPU's branch, to compare the two there. Choices a CPU cannot run (pinned memory, CUDA
    events, NCCL) test device.type == "cuda"; docs/gpus.md lists them, checked by make test-gpu.
    """
    switch = os.environ.get("AS_ON_GPU")
    return switch == "1" if switch in ("0", "1") else device.type == "cuda"


def configure_numerics(deterministic: bool) -> None:
    """--deterministic: IEEE float32 and deterministic kernels, for comparing runs on GPUs.

    Otherwise cuDNN benchmarks its convolution kernels once (the input size never changes) and
    keeps torch's defaults, under which Ampere and later GPUs run float32 convolutions in TF32.
    Call before the first CUDA operation: cuBLAS reads its workspace setting when it starts.
    """
    if not deterministic:
        torch.backends.cudnn.benchmark = True
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    # No TF32 in convolutions nor in matrix products. The allow_tf32 setters, not the newer
    # fp32_precision ones: after those, torch refuses to read allow_tf32 (a "mix of the legacy and
    # new APIs"), which cudnn.flags() and inductor's convolution templates still do.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False  # benchmarking may pick another kernel in each run
    torch.backends.cudnn.deterministic = True
    # warn_only: torch has no deterministic CUDA kernel for a few ops (adaptive average pooling's
    # backward, nll_loss); they warn and run. Their atomic adds reorder sums only where several
    # inputs feed one output, which VGG16 at 224 px and ResNets do not do.
    torch.use_deterministic_algorithms(True, warn_only=True)


def gpus_shared() -> bool:
    """SHARE_GPUS=1: a node may run more processes than it has GPUs, which then share them (rank
    r on GPU r mod GPUs) over gloo, since NCCL refuses two ranks on one GPU. For checking the
    distributed code on a machine with fewer GPUs than ranks (make test-gpu on one GPU); slower
    than one process per GPU."""
    return os.environ.get("SHARE_GPUS") == "1"


def process_group_backend(device: torch.device) -> str:
    """NCCL for one rank per GPU; gloo on the CPU, and for ranks sharing a GPU (NCCL refuses two
    ranks on one GPU: gpus_shared)."""
    return "nccl" if device.type == "cuda" and not gpus_shared() else "gloo"


def check_gpus(local_processes: int, launch: str = "torchrun --nproc_per_node={gpus}") -> None:
    """One process per GPU: refuse more processes on this node than it has GPUs (unless
    SHARE_GPUS=1). `launch`: the launcher's command for one process per GPU, for the message."""
    gpus = torch.cuda.device_count()
    if torch.cuda.is_available() and local_processes > gpus and not gpus_shared():
        raise UserError(
            f"{local_processes} processes on this node but only {gpus} GPU(s): run "
            f"{launch.format(gpus=gpus)}, or set CUDA_VISIBLE_DEVICES= to train on the CPU",
            quiet=int(os.environ.get("LOCAL_RANK", 0)) != 0)


def check_bf16(precision: str | None, local_rank: int = 0) -> None:
    """bfloat16 runs natively on Ampere and later NVIDIA GPUs; older ones emulate it, slowly.

    Asks about this process's GPU (its local rank), not the current one, which is GPU 0 until
    the process selects its own.
    """
    if precision != "bf16" or not torch.cuda.is_available() or torch.version.hip:
        return
    if torch.cuda.get_device_capability(local_rank) < (8, 0):
        name = torch.cuda.get_device_name(local_rank)
        raise UserError(f"this GPU ({name}) has no bfloat16 arithmetic (Ampere and later have it): "
                        "use --amp fp16 (accelerate: --mixed_precision fp16) or full precision")


def training_device(deterministic: bool, precision: str | None, local_rank: int = 0) -> torch.device:
    """The GPU of this process (its local rank; with SHARE_GPUS=1 modulo the GPUs) or the CPU,
    set up for training."""
    configure_numerics(deterministic)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    gpu = local_rank % torch.cuda.device_count() if gpus_shared() else local_rank
    check_bf16(precision, gpu)
    return torch.device("cuda", gpu)


def check_shared_memory(workers: int, batch_bytes: int, shm: Path | None = None) -> None:
    """DataLoader workers hand their batches over in /dev/shm; Docker gives it 64 MB by default,
    and a worker that runs out dies with a bus error in the middle of an epoch. All the loader
    workers of a node share it: LOCAL_WORLD_SIZE processes (torchrun, accelerate launch) of
    `workers` each."""
    shm = Path(shm or SHM)
    if workers == 0 or not shm.is_dir():
        return
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    need = shared_memory_need(workers, batch_bytes, processes)
    free = shutil.disk_usage(shm).free
    if free < need:
        who = f"{processes} processes x {workers}" if processes > 1 else f"{workers}"
        raise UserError(f"{shm} has {free / 2**20:.0f} MB free, but {who} loader workers need "
                        f"about {need / 2**20:.0f} MB there for their batches: give the container "
                        "more (docker run --shm-size=8g, or --ipc=host), or pass --workers 0",
                        quiet=int(os.environ.get("LOCAL_RANK", 0)) != 0)


def shared_memory_need(workers: int, batch_bytes: int, processes: int = 1) -> int:
    """Bytes of /dev/shm that `processes` processes with `workers` loader workers each may hold."""
    return processes * 2 * workers * 2 * batch_bytes  # prefetch_factor 2 per worker, and room for the batch in use


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which decides float rounding and speed on a CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """One line naming the machine and the versions a measurement was made with."""
    cpus = len(os.sched_getaffinity(0))
    gpus = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            if torch.cuda.is_available() else "no GPU")
    return (f"{cpu_model()}, {cpus} CPU cores, {gpus}; torch {torch.__version__}, "
            f"Python {platform.python_version()}")
