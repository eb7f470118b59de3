"""`make test-gpu` (checks/gpu_selftest.py) on a machine without a GPU: its plan fits its time and
/dev/shm, its windows see what they check, its fused-optimizer check bites, and without a GPU it
says so and claims nothing."""
import sys

import torch
from conftest import (
    run,
)


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
