"""`make test-gpu` (checks/gpu_selftest.py) on a machine without a GPU: its plan fits its time and
/dev/shm, its windows see what they check, its fused-optimizer check bites, and without a GPU it
says so and claims nothing; check 1's parts run on the CPU; and the GPU proof's dry run
(checks/gpu_proof.sh --dry-run: every check with --device cpu, the benchmark with --dry-run) runs
every check and leg tiny, each passed, what only a GPU can show skipped with its reason."""
import json
import shutil
import sys

import pytest
import torch
from conftest import (
    run,
)


def test_make_test_gpu_is_planned_within_its_time_and_dev_shm():
    """By counting: under 7 minutes on one GPU (--quick: 3) at the start-up measured for a launch;
    every run's loader workers fit Docker's 64 MB /dev/shm; every mode divides its global batch."""
    import gpu_selftest as selftest
    for quick, limit in ((False, 420), (True, 180)):
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
    train (not frozen) with dropout on in epoch 1, so that dropout draws there and reseeding shows,
    and resume after the steps OVERFLOW_AT skips (the resumed process, which would count anew,
    skips none); the stop's step falls inside an epoch, on a GPU's data and on the CPU's."""
    import gpu_selftest as selftest
    accumulate = int(selftest.RECIPE[selftest.RECIPE.index("--accumulate") + 1])
    assert int(selftest.SYNC_WINDOW.split(":")[0]) > accumulate
    for name in ("steps-single", "steps-single-resumed"):
        flags = [*selftest.RUNS[name].base, *selftest.RUNS[name].flags]
        assert "--freeze-epochs" not in flags and "--dropout" not in flags and "--accumulate" not in flags
    resumed_at = int(selftest.RESUMED_AT.split(".")[1])  # a step checkpoint, one a step
    assert resumed_at >= max(map(int, selftest.SKIPPED.split(","))) and not selftest.RUNS["steps-single-resumed"].skips
    for images in (selftest.IMAGES, selftest.CPU_IMAGES):  # the steps of an epoch at a global batch of 16
        assert resumed_at < 0.8 * images // selftest.micro_batch(1)
    for images in (selftest.IMAGES, selftest.CPU_LARGE):  # the recipe's 2 micro-batches a step
        assert selftest.STOP_STEP < 0.8 * images // (2 * selftest.micro_batch(1))


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


# Check 1's parts in this process, on the CPU: the code a GPU runs (its imports, its calls of the
# project's functions), what only a GPU can show skipped.

def test_check_1s_pinned_part_builds_what_a_gpu_pins_and_the_writers_file_holds_the_saved_value(tmp_path):
    """The loaders' options, Progress, the feature cache's copy and the step checkpoint writer, as
    check 1 makes them on a GPU: an import of a name src no longer has, or a call that no longer
    fits its function, fails here before it fails on a GPU. The writer's file holds the tensor's
    value at the save, though it changed right after; nothing is pinned for a CPU: skipped."""
    import gpu_selftest as selftest
    result = selftest.Result(cpu=True)
    selftest._pinned(torch.device("cpu"), tmp_path, result)
    assert result.failed == [] and result.skipped == ["on the CPU: nothing is pinned for a CPU"]
    assert result.lines[-1].endswith("the file holds the value at the save")


def test_check_1s_fsdp_memory_part_shards_as_train_fsdp_does_and_steps_under_each_amp():
    """The FSDP --amp memory figure's steps (a fake process group of two, fully_shard per unit and
    on the root, a step without autocast, in bf16 and in fp16) run on the CPU; its figures, which
    torch does not count there, are skipped, not reported as measured."""
    import gpu_selftest as selftest
    result = selftest.Result(cpu=True)
    selftest._fsdp_amp_memory(torch.device("cpu"), result)
    assert result.failed == [] and len(result.skipped) == 1 and result.skipped[0].startswith("on the CPU: torch counts")
    assert all(f"{amp}: 0 with its shards" in result.lines[0] for amp in ("no", "bf16", "fp16"))


def test_check_1s_replica_batch_norm_and_resume_parts_judge_on_the_cpu():
    """DataParallel's replicas in threads (parallel_apply's autocast, with float16 as a thread's
    default as on CUDA): ours bfloat16, plain ones float16; --sync-bn's layer against batch norm of
    the whole batch in a world of one, float32 and fp16 channels-last; the fused AdamW resume runs.
    The GPU's seeds, the sync debug mode and the state's device are skipped, with their reasons."""
    import gpu_selftest as selftest
    result = selftest.Result(cpu=True)
    device = torch.device("cpu")
    selftest._data_parallel(0, device, result)
    selftest._sync_batch_norm(device, result)
    selftest._resume_on_the_gpu(device, result)
    assert result.failed == [], result.lines
    assert "ours ['torch.bfloat16'], plain replicas ['torch.float16']" in result.lines[0]
    assert sum("--sync-bn's layer against nn.BatchNorm2d's training step" in line for line in result.lines) == 2
    assert sorted(set(result.skipped)) == ["on the CPU: no GPU generator to seed", "on the CPU: the saved state is "
                                           "where the model is", "on the CPU: the sync debug mode is CUDA's"]


def test_the_draws_check_compares_tritons_masks_with_the_cpus_in_the_interpreter():
    """Check 12's masks: Triton's kernel (run by its interpreter on the CPU) against torch's ops,
    every shape, rate and unit the same bit for bit."""
    import gpu_selftest as selftest
    line, ok = selftest._dropout_masks(torch.device("cpu"))
    assert ok and "in its interpreter" in line and "18 of 18 the same bit for bit" in line, line


# The dry run of the GPU proof (checks/gpu_proof.sh --dry-run): make test-gpu's every check with
# --device cpu and the blog post's benchmark with --dry-run, each tiny, on the CPU: minutes.

@pytest.fixture(scope="module")
def proof(tmp_path_factory):
    """(OUT, the self-test's report.json, the proof's result) of one dry run, read by the tests below."""
    out, work = tmp_path_factory.mktemp("proof"), tmp_path_factory.mktemp("proof-work")
    result = run(["bash", "checks/gpu_proof.sh", "--dry-run", str(out), "600", sys.executable],
                 env={"WORK": str(work)}, timeout=1800)
    if result.returncode == 0:  # the runs' checkpoints, 1.2 GB, that the tests do not read (they read OUT)
        shutil.rmtree(work)
    report = json.loads((out / "selftest" / "report.json").read_text())
    return out, report, result


def test_every_check_of_make_test_gpu_runs_on_the_cpu_and_passes(proof):
    """`--device cpu`: all 13 checks, each passed, each skipped comparison with its reason (on the
    CPU, or more GPUs than one), each check's figures on stdout; the proof's summary says both
    parts ended with 0."""
    import gpu_selftest as selftest
    out, report, result = proof
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("make test-gpu: exit 0 after ")
    assert result.stdout.splitlines()[1].startswith("benchmark: exit 0 after ")
    assert [check["key"] for check in report["checks"]] == [check.key for check in selftest.CHECKS]
    failed = {check["key"]: check["lines"] for check in report["checks"] if check["verdict"] != "passed"}
    assert not failed, failed
    reasons = {reason for check in report["checks"] for reason in check["skipped"]}
    assert reasons and all(reason.startswith("on the CPU: ") or "GPUs needed, 1 here" in reason
                           or reason.startswith("one GPU") for reason in reasons), reasons
    log = (out / "selftest.log").read_text()
    assert log.count("\n- figures: ") >= 10 and "13 of 13 checks passed" in log


def test_each_new_check_makes_its_comparisons_that_are_real_on_the_cpu(proof):
    """The checks of this round's features judge on the CPU what the CPU can show: a step
    checkpoint's resume, the average computed again, the tracked history, --sync-bn across two
    ranks, the agreed stop and the unagreed one's dump, Triton's masks and the soft targets."""
    _, report, _ = proof
    judged = {check["key"]: [line for line in check["lines"] if not line.startswith("skipped")]
              for check in report["checks"]}
    expected = {"resume": "single: resumed vs straight average: ", "steps": "FSDP: resumed vs straight weights: ",
                "ema": "toward the step's weights, within ", "track": "every one the history's",
                "syncbn": "syncbn-ddp-shared (2 processes, --sync-bn, float64): ",
                "stop": "stop-ddp-shared: 1 stop line(s) (stopped by SIGTERM at epoch 1 step 8 of 10",
                "draws": "18 of 18 the same bit for bit"}
    for key, said in expected.items():
        assert any(said in line for line in judged[key]), (key, judged[key])
    assert any(line.startswith("hung-ddp-shared: 1 stop line(s)") for line in judged["stop"]), judged["stop"]
    assert any("skipped" in line and "2 GPUs needed" in line for line in report["checks"][10]["lines"])


def test_the_benchmarks_dry_run_runs_every_leg_and_the_proof_keeps_the_small_files(proof):
    out, _, _ = proof
    benchmark = json.loads((out / "benchmark" / "benchmark.json").read_text())
    assert benchmark["dry run"] and {name: leg["outcome"] for name, leg in benchmark["legs"].items()} == {
        name: "finished" for name in ("jpeg", "cache", "cache-compile", "jpeg-compile")}
    assert (out / "machine.txt").read_text().startswith("nvidia-smi: not run (--dry-run)")
    assert (out / "selftest" / "report.md").exists() and list((out / "selftest").glob("*/log-*.txt"))
