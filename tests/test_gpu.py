"""The GPU-only defects, checked on the CPU wherever their mechanism runs there: DataParallel's
replica threads and autocast, tensors built from Python values inside a step, --compile with
DataParallel, --deterministic, the hosts' limits (GPU count, bfloat16, /dev/shm, CPU quota),
and `make test-gpu` on a machine without a GPU. Resume with dropout on: test_reliability.py."""
import copy
import sys
import threading
import traceback

import pytest
import torch
import torch.nn as nn
from conftest import EXACT, HOOKS, LAUNCH, fails_in_process, mode_run, outputs, run
from torch.overrides import TorchFunctionMode

import src.data_parallel as data_parallel
import train_accelerate
import train_ddp
import train_dp
import train_single
from src.cli import parse_args
from src.devices import available_cpus, check_shared_memory
from src.errors import UserError
from src.loaders import make_loaders
from src.progress import Progress
from src.recipe import make_optimizer, make_schedule


def test_data_parallel_replicas_autocast_to_the_dtype_asked_for():
    """DataParallel runs each replica in a thread that re-enters autocast without a dtype
    (parallel_apply); the dtype is per thread. Here the thread's default is set to float16, as on
    CUDA, and --amp bf16 asked for bfloat16 in the main thread."""
    model = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        replica = data_parallel.AutocastReplica(copy.deepcopy(model), "cpu")  # made where DataParallel makes it
    seen = {}

    def replica_thread():  # what torch/nn/parallel/parallel_apply.py's _worker does
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.amp.autocast("cpu", enabled=True):
            seen["plain"] = model(torch.ones(2, 4)).dtype
            seen["ours"] = replica(torch.ones(2, 4)).dtype
    thread = threading.Thread(target=replica_thread)
    thread.start()
    thread.join()
    assert seen == {"plain": torch.float16, "ours": torch.bfloat16}


def test_data_parallel_wraps_every_replica(monkeypatch):
    monkeypatch.setattr(nn.DataParallel, "replicate",
                        lambda self, module, device_ids: [copy.deepcopy(module) for _ in device_ids])
    dp = data_parallel.DataParallel(nn.Linear(2, 2))
    dp.src_device_obj = torch.device("cpu")  # what DataParallel sets when it has GPUs
    replicas = dp.replicate(dp.module, [0, 1])
    assert [type(r) for r in replicas] == [data_parallel.AutocastReplica] * 2


class HostWaits(TorchFunctionMode):
    """Records, outside the data loader's own code, what would make the host wait for a GPU or copy
    Python values to it: tensors built from Python values, and reads of a tensor on the host."""
    WATCHED = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.Tensor.new_tensor,
               torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.__bool__}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WATCHED:
            stack = traceback.extract_stack(limit=12)
            if not any("torch/utils/data" in frame.filename for frame in stack):
                self.calls.append((func.__name__, stack[-2].filename.rsplit("/", 1)[-1], stack[-2].lineno))
        return func(*args, **(kwargs or {}))


class _Watched:
    """A loader whose batches 2 to n-1 run under HostWaits: the steps, not the epoch's end."""

    def __init__(self, loader, mode):
        self.loader, self.mode = loader, mode

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == 2:
                self.mode.__enter__()
            if i == len(self.loader) - 1:
                self.mode.__exit__(None, None, None)
            yield batch


def test_no_tensor_is_built_from_python_values_inside_a_step():
    """normalize()'s statistics and batch_sums()'s count were built with torch.tensor(..., device)
    at every batch: on a GPU each is a blocking copy. Steps 3 and on of train_single.py's loop,
    with every recipe flag, build none and read nothing back."""
    args = parse_args("", ["--batch-size", "4", "--log-every", "1000", "--augment", "--label-smoothing",
                           "0.1", "--clip-grad-norm", "1", "--lr-schedule", "cosine", "--accumulate", "2",
                           "--weight-decay", "0.01"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(64)]
    loader, _ = make_loaders(dataset, list(range(64)), [0], 4, 0, 0, accumulate=2, augment=True)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, 8)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    progress = Progress(args, optimizer, 8, 4, device)
    mode = HostWaits()
    loader.sampler.set_epoch(0)
    loader_pass = progress.pass_over(_Watched(loader, mode), "test", 0)
    train_single.train_epoch(model, loader_pass, device, args, optimizer, scaler, schedule)
    assert schedule.last_epoch == 8
    assert mode.calls == []


@pytest.mark.parametrize("script", [train_single, train_dp])
def test_channels_last_reaches_the_model_through_the_loop(script):
    """The batches the training loop hands the model are channels-last with --channels-last."""
    seen = []
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    model.register_forward_pre_hook(lambda module, inputs: seen.append(
        inputs[0].is_contiguous(memory_format=torch.channels_last)))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i % 2) for i in range(8)]
    for flag in ([], ["--channels-last"]):
        args = parse_args("", ["--batch-size", "4", *flag])
        loader, _ = make_loaders(dataset, list(range(8)), [0], 4, 0, 0)
        device = torch.device("cpu")
        progress = Progress(args, torch.optim.SGD(model.parameters(), lr=0.1), 2, 4, device)
        script.evaluate(model, progress.pass_over(loader, "val"), device, args)
    assert seen == [False, False, True, True]


def test_accelerate_copies_batches_without_blocking(runs):
    """accelerate's prepared loader blocks on each copy unless non_blocking is set."""
    out, _ = mode_run(runs, "accelerate")
    log = (out.parent / "accelerator.log").read_text().split("\n")
    assert sorted(log[:2]) == ["0 split_batches=True non_blocking=True", "1 split_batches=True non_blocking=True"]


@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(n, bf16): torch reports n CUDA GPUs, for the checks made before any is used."""
    def fake(n: int, bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if bf16 else (7, 0))
    return fake


def test_compile_with_data_parallel_on_two_gpus_is_refused(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    fake_gpus(2)
    line = fails_in_process(train_dp.main, ["--data-dir", str(exact_data), "--compile", *outputs(tmp_path)],
                            monkeypatch, capsys, "--compile with DataParallel on 2 GPUs would compile nothing")
    assert "torchrun --nproc_per_node=2 train_ddp.py --compile" in line
    assert not tmp_path.joinpath("best.pth").exists()


def test_more_processes_than_gpus_is_one_line(exact_data, tmp_path):
    result = run([*LAUNCH["ddp"](), "--data-dir", str(exact_data), *outputs(tmp_path)],
                 env={"PYTHONPATH": HOOKS, "FAKE_GPUS": "1"})
    assert result.returncode != 0
    assert result.stderr.count("error: 2 processes on this node but only 1 GPU(s): run torchrun "
                               "--nproc_per_node=1, or set CUDA_VISIBLE_DEVICES= to train on the CPU") == 1
    assert "exitcode  : 2" in result.stderr  # torchrun's summary (with a traceback of its own)


@pytest.mark.parametrize("script, flags", [(train_single, ["--amp", "bf16"]), (train_accelerate, [])])
def test_bf16_on_a_gpu_without_it_is_one_line(script, flags, exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    fake_gpus(1, bf16=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch --mixed_precision sets
    fails_in_process(script.main, ["--data-dir", str(exact_data), *flags, *outputs(tmp_path)], monkeypatch, capsys,
                     "this GPU (Fake GPU) has no bfloat16 arithmetic (Ampere and later have it)")


def test_a_small_dev_shm_is_one_line_before_training(tmpfs, exact_data, tmp_path, monkeypatch, capsys):
    """VGG16's batches of 50 at 224 px are 7.5 MB each: 4 workers prefetching 2 each need more
    than 64 MB (Docker's default /dev/shm); without workers nothing goes through /dev/shm."""
    small_shm = tmpfs("shm", "size=64m")
    with pytest.raises(UserError, match=f"{small_shm} has 64 MB free, but 4 loader workers need about 115 MB"):
        check_shared_memory(4, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(0, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(1, 50 * 3 * 224 * 224, small_shm)
    monkeypatch.setattr("src.devices.SHM", small_shm)
    line = fails_in_process(train_single.main, ["--data-dir", str(exact_data), *EXACT, "--image-size", "224",
                                                "--batch-size", "50", "--workers", "4", *outputs(tmp_path)],
                            monkeypatch, capsys, "--shm-size=8g")
    assert line.startswith(f"error: {small_shm} has 64 MB free, but 4 loader workers need about 115 MB")
    assert not (tmp_path / "history.json").exists()


def test_default_workers_follow_a_containers_cpu_quota(tmp_path):
    import os
    cpus = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # cgroup v2: one CPU
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == cpus
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(tmp_path) == cpus


@pytest.fixture
def restore_numerics(monkeypatch):
    """Put torch's global numerics settings back after a test changes them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    backends = torch.backends
    saved = (torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
             backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(saved[0])
    backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = saved[1:3]
    backends.cudnn.benchmark, backends.cudnn.deterministic = saved[3:]


def _numerics():
    import os
    backends = torch.backends
    return [torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
            backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG")]


def test_deterministic_switches_off_tf32_and_nondeterministic_kernels(restore_numerics):
    from src.devices import configure_numerics
    configure_numerics(False)
    assert _numerics() == [False, True, False, True, False, None]  # torch's defaults, and benchmark
    configure_numerics(True)
    assert _numerics() == [True, False, False, False, True, ":4096:8"]


class _Asked(Exception):
    pass


@pytest.mark.parametrize("script", [train_single, train_dp, train_ddp, train_accelerate])
def test_the_scripts_pass_deterministic_on(script, monkeypatch):
    """Each script hands --deterministic to configure_numerics before it trains (accelerate: just
    after Accelerator(), which turns TF32 on for a dynamo backend)."""
    def configure(deterministic):
        raise _Asked(deterministic)
    monkeypatch.setattr("src.devices.configure_numerics", configure)
    monkeypatch.setattr(train_accelerate, "configure_numerics", configure)
    if script is train_ddp:  # as torchrun sets them (a world of one would set them for good)
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            monkeypatch.setenv(name, "1" if "WORLD" in name else "0")
    for flags, expected in ((["--deterministic"], True), ([], False)):
        monkeypatch.setattr("sys.argv", ["script.py", *flags])
        with pytest.raises(_Asked) as asked:
            script.main()
        assert asked.value.args == (expected,)


def test_make_test_gpu_on_a_machine_without_one_says_so_and_claims_nothing():
    result = run(["make", "--no-print-directory", "-o", ".venv/.installed", "test-gpu", f"PY={sys.executable}"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")
