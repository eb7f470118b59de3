"""The GPU-only defects, checked on the CPU wherever their mechanism runs there: DataParallel's
replica threads, autocast, weight format and dropout seeds, tensors built from Python values
inside a step, the GPU's fused optimizers under fp16 with skipped steps in the real training loops
(AS_ON_GPU=1), the schedule at a skipped step, resuming a CPU checkpoint under fused AdamW,
--dist-timeout and caches shared by nodes, --compile with DataParallel, --deterministic (also
against accelerate's TF32 for dynamo), the benchmark's ceilings, the hosts' limits (GPU count,
shared GPUs, bfloat16, /dev/shm per node, CPU quota), and `make test-gpu`: its plan, its
fused-optimizer check, and a machine without a GPU. Resume with dropout on: test_reliability.py."""
import contextlib
import copy
import importlib
import math
import multiprocessing
import os
import shutil
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
from accelerate.utils import InitProcessGroupKwargs
from conftest import (
    EXACT,
    HOOKS,
    LAUNCH,
    TOLERANCE,
    distance,
    fails_in_process,
    history,
    last_model,
    mode_run,
    outputs,
    printed_by,
    run,
    shared_dataset,
    weights,
)
from torch.overrides import TorchFunctionMode

import src.data_parallel as data_parallel
import train_accelerate
import train_ddp
import train_dp
import train_single
from src.atomic import atomic_torch_save
from src.checkpoint import resume, run_info
from src.cli import parse_args
from src.devices import available_cpus, check_gpus, check_shared_memory, training_device
from src.errors import UserError
from src.loaders import labelled_images, make_loaders
from src.progress import Progress
from src.recipe import lr_factor, make_optimizer, make_schedule, optimizer_step
from src.seeds import seed_epoch
from src.tools.synthetic import write_dataset


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


@pytest.mark.parametrize("amp", [[], ["--amp", "fp16"]])
def test_no_tensor_is_built_from_python_values_inside_a_step(amp, monkeypatch):
    """normalize()'s statistics and batch_sums()'s count were built with torch.tensor(..., device)
    at every batch: on a GPU each is a blocking copy. Steps 3 and on of train_single.py's loop,
    with every recipe flag, build none and read nothing back. With --amp fp16 and the GPU's fused
    optimizer (AS_ON_GPU=1), the gradient scaler's inf check stays a tensor too (the plain
    optimizer's path reads it with .item() at every step)."""
    monkeypatch.setenv("AS_ON_GPU", "1")
    args = parse_args("", ["--batch-size", "4", "--log-every", "1000", "--augment", "--label-smoothing",
                           "0.1", "--clip-grad-norm", "1", "--lr-schedule", "cosine", "--accumulate", "2",
                           "--weight-decay", "0.01", *amp])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(64)]
    loader, _ = make_loaders(dataset, list(range(64)), [0], 4, 0, 0, accumulate=2, augment=True)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, 8)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
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


def test_accelerate_with_more_processes_than_gpus_is_one_line(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    """accelerate itself would fail later with NCCL's "Duplicate GPU detected"."""
    fake_gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fails_in_process(train_accelerate.main, ["--data-dir", str(exact_data), *outputs(tmp_path)], monkeypatch,
                     capsys, "2 processes on this node but only 1 GPU(s): run accelerate launch --num_processes 1")


def test_data_parallel_checks_bf16_on_every_gpu(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    """Each GPU runs a replica: one without bfloat16 among them is refused, not only the first."""
    fake_gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if device in (0, None) else (7, 0))
    fails_in_process(train_dp.main, ["--data-dir", str(exact_data), "--amp", "bf16", *outputs(tmp_path)],
                     monkeypatch, capsys, "this GPU (Fake GPU) has no bfloat16 arithmetic")


def test_a_resume_with_another_memory_format_gives_the_optimizer_state_the_weights_layout(tmp_path):
    """--channels-last may change across a resume; CUDA's fused kernels refuse momentum and weights
    in different layouts, so each state tensor takes its parameter's."""
    torch.manual_seed(0)
    saved_model = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    args = parse_args("", ["--resume", *outputs(tmp_path)])
    saving = make_optimizer(saved_model, args, torch.device("cpu"))
    saved_model(torch.randn(2, 3, 5, 5)).sum().backward()
    saving.step()
    model = nn.Conv2d(3, 4, 3)  # contiguous this time
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    from src.checkpoint import load_optimizer
    load_optimizer(optimizer, saving.state_dict())
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    assert buffer.stride() == model.weight.stride() and not saving.state[saved_model.weight][
        "momentum_buffer"].is_contiguous()
    assert torch.equal(buffer, saving.state[saved_model.weight]["momentum_buffer"])


def test_a_small_dev_shm_is_one_line_before_training(tmpfs, exact_data, tmp_path, monkeypatch, capsys):
    """VGG16's batches of 50 at 224 px are 7.5 MB each: 4 workers prefetching 2 each need more
    than 64 MB (Docker's default /dev/shm); without workers nothing goes through /dev/shm."""
    small_shm = tmpfs("shm", "size=64m")
    with pytest.raises(UserError, match=f"{small_shm} has 64 MB free, but 4 loader workers need about 115 MB"):
        check_shared_memory(4, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(0, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(1, 50 * 3 * 224 * 224, small_shm)
    monkeypatch.setattr("src.devices.SHM", small_shm)
    monkeypatch.setattr("src.devices.available_cpus", lambda: 4)  # --workers 4 is not capped to this machine's CPUs
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


def test_make_test_gpu_is_planned_within_its_time_and_dev_shm():
    """By counting: under 6 minutes on one GPU (--quick: 3) at the start-up measured for a launch;
    every run's loader workers fit Docker's 64 MB /dev/shm; every mode divides its global batch."""
    import gpu_selftest as selftest
    for quick, limit in ((False, 360), (True, 180)):
        steps = selftest.plan(1, quick)
        assert selftest.DATA + sum(seconds for _, _, seconds in steps) < limit
        assert [check.title for check, _, _ in steps][:3] == [check.title for check in selftest.CHECKS[:3]]
    for gpus in (1, 2, 3, 8):
        names = [name for _, new, _ in selftest.plan(gpus, False) for name in new]
        assert len(names) == len(set(names)) and selftest.shared_memory(gpus, names) < selftest.SHM
        for name in names:
            run = selftest.RUNS[name]
            whole = run.per_process(gpus) * run.processes(gpus) * (2 if run.half_batch else 1)
            assert whole == selftest.micro_batch(gpus), (gpus, name)
    agreed = [name for _, new, _ in selftest.plan(1, True) for name in new if name.startswith("sgd-") and "fp16" not in name]
    assert agreed == ["sgd-single", "sgd-far", "sgd-ddp-shared", "sgd-fsdp-shared"]  # on one GPU: two ranks share it


def test_make_test_gpus_windows_can_see_what_they_check():
    """The sync window starts after DDP's bucket rebuild (the first forward after the first synced
    backward: micro-batch --accumulate), which copies to the host once by design; the resume runs
    train (not frozen) in epoch 1, so that dropout draws there and reseeding shows."""
    import gpu_selftest as selftest
    accumulate = int(selftest.RECIPE[selftest.RECIPE.index("--accumulate") + 1])
    assert int(selftest.SYNC_WINDOW.split(":")[0]) > accumulate
    flags = [*selftest.RUNS["resume-straight"].base, *selftest.RUNS["resume-straight"].flags]
    freeze = [flags[i + 1] for i, flag in enumerate(flags) if flag == "--freeze-epochs"]
    assert freeze[-1] == "0"  # argparse keeps the last


def test_make_test_gpus_fused_optimizer_check_bites(monkeypatch):
    """The self-test's in-process check of fused SGD and AdamW, run on the CPU (AS_ON_GPU=1): it
    passes, and it sees the NaN that fused SGD without its zero momentum ends with."""
    import gpu_selftest as selftest
    monkeypatch.setenv("AS_ON_GPU", "1")
    lines = selftest._fused_optimizers(torch.device("cpu"))
    assert "without its zero momentum: NaN" in lines[0] and "step count [2.0]" in lines[1]


def test_make_test_gpu_on_a_machine_without_one_says_so_and_claims_nothing():
    result = run(["make", "--no-print-directory", "-o", ".venv/.installed", "test-gpu", f"PY={sys.executable}"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == (
        "make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")


# The GPU's choices on the CPU. AS_ON_GPU=1 makes src.devices.gpu_choices take the CUDA branch
# (fused SGD and AdamW, which torch also has for the CPU), and fp16_as_on_cuda makes accelerate
# autocast and scale fp16 on the CPU as it does on CUDA. The hooks' OVERFLOW_AT skips steps 1
# and 3 of 5, the way an fp16 overflow does, and torch.empty_like hands out NaN: uninitialised
# memory cannot pass for zeros. The runs train in this process (no torch import to pay for).

FP16_RUN = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "32", "--dropout", "0",
            "--workers", "0", "--val-fraction", "0.1667", "--epochs", "1", "--lr", "0.01",
            "--batch-size", "2", "--lr-schedule", "cosine", "--weight-decay", "0.01"]  # 12 images: 10 train, 2 validation
SKIPPED = {1, 3}
STEPS = 5


def _nan_empty_like(empty_like):
    def poisoned(*args, **kwargs):
        tensor = empty_like(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
    return poisoned


@pytest.fixture(scope="module")
def fp16_runs(request, tmp_path_factory):
    """fp16_runs(script, as_on_gpu, *flags): the output folder of an fp16 run of FP16_RUN (train_single.py
    --amp fp16, train_accelerate.py under --mixed_precision fp16) with steps 1 and 3 skipped; made once."""
    from accelerate.state import AcceleratorState
    from hooks.sitecustomize import fp16_as_on_cuda, overflowing
    data = shared_dataset(request, "tiny", n_train=12, n_test=0, size=32, seed=3)
    made = {}

    def train(script, as_on_gpu: str, *flags: str):
        key = (script.__name__, as_on_gpu, flags)
        if key not in made:
            out = tmp_path_factory.mktemp(f"fp16-{script.__name__}")
            amp = ["--amp", "fp16"] if script is train_single else []
            argv = ["--data-dir", str(data), *FP16_RUN, *amp, *flags, *outputs(out)]
            with pytest.MonkeyPatch.context() as patch, torch.random.fork_rng(), _kept_numerics():
                patch.setenv("AS_ON_GPU", as_on_gpu)
                patch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what accelerate launch --mixed_precision sets
                patch.setattr(torch, "empty_like", _nan_empty_like(torch.empty_like))
                for name, function in zip(("_unscale_grads_", "step"), overflowing(torch.amp.GradScaler, SKIPPED)):
                    patch.setattr(torch.amp.GradScaler, name, function)
                patch.setattr(train_accelerate, "Accelerator", fp16_as_on_cuda(train_accelerate.Accelerator))
                AcceleratorState._reset_state(reset_partial_state=True)
                try:
                    printed_by(script.main, argv)
                finally:
                    AcceleratorState._reset_state(reset_partial_state=True)
            made[key] = out
        return made[key]
    return train


@contextlib.contextmanager
def _kept_numerics():
    """Gives torch's global numerics settings back (a script's main() sets them)."""
    backends = torch.backends
    saved = (torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
             backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = saved[1:3]
        backends.cudnn.benchmark, backends.cudnn.deterministic = saved[3:]


def _kernels(out) -> set:
    return {group["fused"] for group in weights(out, "last.pth")["optimizer"]["param_groups"]}


def _far(fp16_runs, *flags) -> float:
    """The plain optimizer's run against the same with another global batch (1 instead of 2)."""
    return distance(last_model(fp16_runs(train_single, "0", *flags)),
                    last_model(fp16_runs(train_single, "0", *flags, "--batch-size", "1")))


@pytest.mark.parametrize("script", [train_single, train_accelerate])
def test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does(fp16_runs, script):
    """Fused SGD made its missing momentum buffers with empty_like and wrote nothing into them at
    a skipped step: the next step read garbage (here NaN). Given zeros first, it takes the steps
    of plain SGD, in train_single.py's loop and in accelerate's: the two kernels differ in the
    order of their float operations only, as the modes do (TOLERANCE of another global batch)."""
    plain, fused = fp16_runs(script, "0"), fp16_runs(script, "1")
    assert _kernels(plain) == {False} and _kernels(fused) == {True}
    for out in (plain, fused):
        assert weights(out, "last.pth")["scaler"]["scale"] == 2.0 ** 16 / 4  # steps 1 and 3 skipped
    assert distance(last_model(fused), last_model(plain)) / _far(fp16_runs) < TOLERANCE


def test_fp16_with_the_gpus_fused_adamw_ends_where_plain_adamw_does(fp16_runs):
    """Fused AdamW takes a skipped step off its step count, and ends where plain AdamW does."""
    adamw = ["--optimizer", "adamw", "--lr", "0.001"]
    plain, fused = (fp16_runs(train_single, gpu, *adamw) for gpu in "01")
    far = _far(fp16_runs, *adamw)
    assert _kernels(fused) == {True}
    last = weights(fused, "last.pth")
    skipped = math.log2(2.0 ** 16 / last["scaler"]["scale"])  # the scale halves at each
    assert skipped >= len(SKIPPED)
    assert {float(state["step"]) for state in last["optimizer"]["state"].values()} == {STEPS - skipped}
    assert distance(last_model(fused), last_model(plain)) / far < TOLERANCE


@pytest.mark.parametrize("script", [train_single, train_accelerate])
def test_the_schedule_advances_at_every_optimizer_step_also_a_skipped_one(fp16_runs, script):
    """The one rule of every mode: the learning rate is that of the step count, skipped steps
    included. accelerate knows of the skips here (plain SGD: the scaler does not call its step) and
    would hold its prepared schedule back at each; train_accelerate.py steps its own."""
    out = fp16_runs(script, "0")
    last = weights(out, "last.pth")
    assert last["scaler"]["scale"] == 2.0 ** 16 / 4
    assert last["schedule"]["last_epoch"] == STEPS
    # After the epoch: the rate of step 5 of 5, the end of the cosine (3 steps in: 0.35 of --lr).
    assert [record["lr"] for record in history(out)] == pytest.approx([0.01 * lr_factor(STEPS, STEPS, 0, "cosine")])


def test_optimizer_step_advances_the_schedule_when_the_scaler_skips():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
    before = model.weight.detach().clone()
    optimizer_step(model, optimizer, scaler, schedule, None)
    assert torch.equal(model.weight, before) and scaler.get_scale() == 2.0 ** 15  # skipped
    assert schedule.last_epoch == 1


@pytest.mark.parametrize("device, switch", [("cuda", None), ("cpu", "1")])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_optimizers_survive_a_skipped_first_step(optimizer, device, switch, monkeypatch):
    """make_optimizer for a GPU (or the CPU with AS_ON_GPU=1) gives fused kernels; an inf at the
    first step, then two finite steps, end where the plain optimizer ends. empty_like hands out
    NaN: fused SGD's buffers made at the skipped step would be NaN without their zeros."""
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like(torch.empty_like))
    args = parse_args("", ["--optimizer", optimizer, "--lr", "0.1", "--weight-decay", "0.01"])
    ends = []
    for kind, choose in (("plain", "0"), (device, switch)):
        if choose is None:
            monkeypatch.delenv("AS_ON_GPU", raising=False)
        else:
            monkeypatch.setenv("AS_ON_GPU", choose)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        opt = make_optimizer(model, args, torch.device("cpu" if kind == "plain" else device))
        assert opt.defaults["fused"] == (kind != "plain")
        scaler = torch.amp.GradScaler("cpu")
        for scale in (float("inf"), 1.0, 1.0):
            scaler.scale(model(torch.ones(2, 3)).sum() * scale).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # The kernels differ in the order of their float operations (a few float32 roundings).
    assert ends[1].isfinite().all() and torch.allclose(ends[0], ends[1], rtol=1e-5, atol=1e-7)


def test_fused_sgd_takes_a_backbone_unfrozen_after_its_head_trained(monkeypatch):
    """--freeze-epochs: the head has momentum buffers when the backbone gets its first gradient,
    and fused SGD takes a group's buffers as all set or all missing (it raised a TypeError)."""
    ends = []
    for choose in ("0", "1"):
        monkeypatch.setenv("AS_ON_GPU", choose)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        args = parse_args("", ["--lr", "0.1", "--freeze-epochs", "1", "--epochs", "2"])
        optimizer = make_optimizer(model, args, torch.device("cpu"))
        for step in range(4):
            model[0].requires_grad_(step >= 2)  # frozen for two steps
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(*ends, rtol=1e-5, atol=1e-7)


def test_the_shared_memory_check_counts_every_process_of_the_node(monkeypatch):
    """8 processes with a loader worker each share Docker's 64 MB /dev/shm: 480 MB for batches of 15 MB."""
    monkeypatch.setattr("src.devices.shutil.disk_usage", lambda path: SimpleNamespace(free=64 * 2**20))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UserError, match="has 64 MB free, but 8 processes x 1 loader workers need about 480 MB") as error:
        check_shared_memory(1, 15 * 2**20, Path("/"))
    assert not error.value.quiet
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(UserError) as error:
        check_shared_memory(1, 15 * 2**20, Path("/"))
    assert error.value.quiet  # rank 0 says it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_shared_memory(1, 15 * 2**20, Path("/"))  # one process: 60 MB


def test_each_gpu_draws_its_own_dropout_masks(monkeypatch):
    """DataParallel's replicas draw dropout from their own GPU's generator; torch.manual_seed gives
    every GPU the same seed, so every replica drew the same mask. Two CPU generators stand in."""
    generators = (torch.Generator(), torch.Generator())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    with torch.random.fork_rng(devices=[]):
        masks = []
        for epoch in (0, 0, 1):
            seed_epoch(42, epoch, rank=1)
            masks.append([torch.bernoulli(torch.full((64,), 0.5), generator=g) for g in generators])
    assert not torch.equal(*masks[0])  # the two GPUs
    assert torch.equal(masks[0][1], masks[1][1])  # a function of (seed, epoch, rank, GPU)
    assert not torch.equal(masks[0][1], masks[2][1])


def test_data_parallel_replicas_keep_channels_last_weights(monkeypatch):
    """Broadcast hands GPUs 1..N their weights as views of one flat buffer, NCHW. torch's own
    replicate() runs here, with the broadcast done by the same flatten and unflatten on the CPU."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def broadcast(tensors, devices, detach=False):  # comm.broadcast_coalesced's layout
        if not tensors:
            return []
        flat = _flatten_dense_tensors([t.detach() if detach else t for t in tensors])
        return [list(tensors)] + [list(_unflatten_dense_tensors(flat, tensors)) for _ in devices[1:]]
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.replicate"), "_broadcast_coalesced_reshape", broadcast)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).to(memory_format=torch.channels_last)
    dp = data_parallel.DataParallel(model)
    dp.src_device_obj = torch.device("cpu")  # what DataParallel sets when it has GPUs
    replicas = dp.replicate(model, [0, 1, 2])
    assert [r.replica[i].weight.is_contiguous(memory_format=torch.channels_last)
            for r in replicas for i in (0, 2)] == [True] * 6
    replicas[2](torch.ones(1, 3, 8, 8)).sum().backward()  # the gradients reach the module's weights
    assert model[0].weight.grad is not None and model[2].weight.grad.abs().sum() > 0


def test_resume_places_a_cpu_checkpoints_adamw_state_for_fused_adamw(tmp_path, monkeypatch):
    """load_state_dict places AdamW's step tensors by the saved groups' flags: a CPU run's stayed
    on the CPU under fused AdamW on a GPU, which refuses them at the first step. The meta device
    stands in for the GPU."""
    args = parse_args("", ["--optimizer", "adamw", "--resume", "--epochs", "2", *outputs(tmp_path)])
    info = run_info(args, 50, "digest")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    schedule = make_schedule(optimizer, args, 1)
    atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {},
                       "schedule": schedule.state_dict(), "epoch": 1, "history": [{"epoch": 1}], "info": info},
                      tmp_path / "last.pth")
    monkeypatch.setenv("AS_ON_GPU", "1")
    gpu_model = nn.Linear(4, 2).to("meta")
    fused = make_optimizer(gpu_model, args, torch.device("meta"))
    assert resume(args, info, gpu_model, fused, None, make_schedule(fused, args, 1)) == [{"epoch": 1}]
    assert [group["fused"] for group in fused.param_groups] == [True, True]
    assert {state["step"].device.type for state in fused.state.values()} == {"meta"}


def _dist_timeout_of(script, argv, monkeypatch) -> dict:
    """What train_ddp.py's setup and train_accelerate.py's Accelerator() get as timeouts."""
    seen = {}
    if script is train_ddp:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)

        def store(timeout):
            seen["store"] = timeout
            return None, 0, 1
        monkeypatch.setattr(train_ddp, "torchrun_store", store)
        monkeypatch.setattr(train_ddp.dist, "init_process_group",
                            lambda backend, **kwargs: seen.update(backend=backend, group=kwargs["timeout"]))
        train_ddp.setup_distributed(parse_args("", argv, distributed=True))
    else:
        def accelerator(**kwargs):
            seen["group"] = [h.timeout for h in kwargs["kwargs_handlers"] if isinstance(h, InitProcessGroupKwargs)][0]
            raise _Asked()
        monkeypatch.setattr(train_accelerate, "Accelerator", accelerator)
        monkeypatch.setattr("sys.argv", ["train_accelerate.py", *argv])
        with pytest.raises(_Asked):
            train_accelerate.main()
    seen["cache wait"] = os.environ["DIST_TIMEOUT_MINUTES"]
    return seen


@pytest.mark.parametrize("script", [train_ddp, train_accelerate])
def test_dist_timeout_sets_the_process_group_and_the_cache_wait(script, monkeypatch, restore_numerics):
    """A node still building its --cache keeps the others waiting in their next collective: the
    timeout is --dist-timeout (60 minutes by default), and so is the node's own wait for its cache."""
    monkeypatch.setenv("DIST_TIMEOUT_MINUTES", "unset")  # given back after the test
    for argv, minutes in (([], 60), (["--dist-timeout", "90"], 90)):
        seen = _dist_timeout_of(script, argv, monkeypatch)
        assert seen.pop("cache wait") == str(minutes)
        assert set(seen.values()) - {"gloo"} == {timedelta(minutes=minutes)}


def test_a_cache_wait_gives_up_after_dist_timeout(tmp_path, monkeypatch):
    import src.cache as cache
    monkeypatch.setattr(cache, "WAIT_SECONDS", 30)
    monkeypatch.setenv("DIST_TIMEOUT_MINUTES", "0.01")
    monkeypatch.setenv("LOCAL_RANK", "1")
    start = time.monotonic()
    with pytest.raises(UserError, match="waited 0 min for .*a.u8, which the first process of this node builds"):
        cache.ensure_array(tmp_path / "a.u8", tmp_path / "a.json", "key", (4,), np.uint8, None, "--cache", "x")
    assert time.monotonic() - start < 10


def test_nodes_with_other_copies_of_the_images_share_a_cache_folder(tmp_path, monkeypatch):
    """Two nodes' copies of the images (cp without -p: other modification times) have other keys.
    With one file name for both, node B's build replaced node A's, and A's other processes waited
    for a key that never came; each key has files of its own now."""
    import src.cache as cache
    write_dataset(tmp_path / "a", n_train=6, n_test=0, size=32, seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copy)  # new mtimes
    nodes = [labelled_images(tmp_path / node, 32, show_progress=False) for node in "ab"]
    monkeypatch.setattr(cache, "WAIT_SECONDS", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")  # each node's builder
    built = [cache.cached(dataset, 32, tmp_path / "cache", 0, show_progress=False) for dataset in nodes]
    assert built[0].key != built[1].key and built[0].path != built[1].path
    monkeypatch.setenv("LOCAL_RANK", "1")  # node A's second process finds its cache at once
    again = cache.cached(nodes[0], 32, tmp_path / "cache", 0, show_progress=False)
    assert again.path == built[0].path and torch.equal(again[5][0], nodes[0][5][0])


def test_deterministic_survives_accelerates_tf32_for_dynamo(monkeypatch, restore_numerics):
    """accelerate turns TF32 matmuls on in Accelerator() when a dynamo backend is set (CUDA only):
    a fake does it here, and --deterministic must still end with it off."""
    from accelerate.state import AcceleratorState

    class DynamoAccelerator(train_accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            torch.backends.cuda.matmul.allow_tf32 = True  # accelerate/state.py with a dynamo backend on CUDA

    def stop(args):
        raise _Asked(torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(train_accelerate, "Accelerator", DynamoAccelerator)
    monkeypatch.setattr(train_accelerate, "check_writable", stop)
    monkeypatch.setattr("sys.argv", ["train_accelerate.py", "--deterministic"])
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(_Asked) as asked:
            train_accelerate.main()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert asked.value.args == (False,)


def test_the_benchmarks_ceilings_run_as_the_runs_do(monkeypatch, restore_numerics):
    """The bare step bounds train_single.py: the same (fused, on a GPU) optimizer, and the spawned
    process sets cudnn.benchmark as a script does. AS_ON_GPU=1 takes the GPU's branch."""
    from src.tools import benchmark
    made = []
    monkeypatch.setattr(benchmark, "make_optimizer", lambda *a: made.append(make_optimizer(*a)) or made[-1])
    monkeypatch.setenv("AS_ON_GPU", "1")
    args = benchmark.parse_args(["--arch", "squeezenet1_1", "--image-size", "32", "--steps", "1"])
    assert benchmark.bare_step(args, torch.device("cpu"), 2, True) > 0
    assert [opt.defaults["fused"] for opt in made] == [True] and made[0].defaults["momentum"] == 0.9
    torch.backends.cudnn.benchmark = False
    benchmark._start_as_a_run()
    multiprocessing.set_start_method(None, force=True)
    assert torch.backends.cudnn.benchmark


def test_several_processes_may_share_a_gpu_when_asked(fake_gpus, monkeypatch, restore_numerics):
    """SHARE_GPUS=1 (make test-gpu on one GPU): two ranks on GPU 0 over gloo; NCCL refuses that."""
    fake_gpus(1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(UserError, match="2 processes on this node but only 1 GPU"):
        check_gpus(2)
    monkeypatch.setenv("SHARE_GPUS", "1")
    check_gpus(2)
    assert training_device(False, None, local_rank=1) == torch.device("cuda", 0)
    monkeypatch.setattr(train_ddp, "training_device", lambda *a: torch.device("cuda", 0))
    assert _dist_timeout_of(train_ddp, [], monkeypatch)["backend"] == "gloo"
    monkeypatch.delenv("SHARE_GPUS")
    monkeypatch.setenv("DIST_TIMEOUT_MINUTES", "unset")
    assert _dist_timeout_of(train_ddp, [], monkeypatch)["backend"] == "nccl"
