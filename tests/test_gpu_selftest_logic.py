"""make test-gpu's own logic, on the CPU: stopping a hung launch with the workers torchrun put in
sessions of their own, the collective timeout under the launch's limit, the report (Markdown and
JSON, the failed modes named, every agreement leg run after one failed), the verdicts on what the
hooks recorded (host synchronisations with their control, logits' dtypes, compiled calls,
accelerate's TF32), and those hooks' recording parts. No GPU: each test takes well under a second
but the process-tree one (about 2 s) and the sync hook's, which trains two tiny epochs on the CPU."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from types import SimpleNamespace

import conftest
import gpu_selftest as selftest
import pytest
import torch
import torch.nn as nn
from hooks.sitecustomize import SYNC_MESSAGE, SyncRecord, counting_backend, log_dtypes, log_targets, sync_site

# A launcher that starts a worker as torchrun does (start_new_session=True); the worker starts a
# loader-like child in its own process group; all of them wait forever, as in a hung collective.
LAUNCHER = textwrap.dedent("""
    import subprocess, sys, time
    worker = subprocess.Popen([sys.executable, "-c", '''
    import subprocess, sys, time
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(child.pid, flush=True)
    time.sleep(600)
    '''], start_new_session=True, stdout=sys.stdout)
    print(worker.pid, flush=True)
    time.sleep(600)
""")


def _tree(tmp_path):
    """A launcher as selftest._run starts one (its own session), and the pids of its worker and the
    worker's child, once they run."""
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    launch = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    pids = [int(launch.stdout.readline()), int(launch.stdout.readline())]
    return launch, pids


def test_stop_ends_the_workers_that_torchrun_puts_in_sessions_of_their_own(tmp_path):
    launch, pids = _tree(tmp_path)
    try:
        assert set(pids) <= set(selftest.descendants(launch.pid))
        # The worker leads a session of its own, which its child is in too.
        assert len({os.getsid(pid) for pid in pids}) == 1 and os.getsid(pids[0]) in pids
        assert os.getsid(pids[0]) != os.getsid(launch.pid)
        selftest.stop(launch, wait=5)
        assert launch.poll() is not None
        assert not any(map(selftest._running, pids)), "a worker or its child outlived the launch"
    finally:
        for pid in [launch.pid, *pids]:
            try:
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_signal_to_the_launchers_group_alone_misses_the_workers(tmp_path):
    """What the old stop did (os.killpg of the launcher's group): the worker and its child run on."""
    launch, pids = _tree(tmp_path)
    try:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()
        time.sleep(0.2)
        assert all(map(selftest._running, pids))
    finally:
        for pid in pids:
            os.killpg(os.getpgid(pid), signal.SIGKILL)


def test_every_distributed_launch_times_out_its_collectives_well_before_its_limit(tmp_path):
    for gpus in (1, 2, 8):
        for name, run in selftest.RUNS.items():
            command, env = selftest.command_of(name, tmp_path, tmp_path / "data", gpus)
            script = next(part for part in command if part.startswith("train_"))
            if script in ("train_single.py", "train_dp.py"):
                assert "--dist-timeout" not in command
                continue
            minutes = int(command[command.index("--dist-timeout") + 1])
            assert minutes == run.dist_timeout() and 60 * minutes + 60 < run.limit() <= 360, name
            on_cpu = selftest.command_of(name, tmp_path, tmp_path / "data", gpus, cpu=True)[0]
            minutes = int(on_cpu[on_cpu.index("--dist-timeout") + 1])  # a busy CPU is no hang
            assert minutes == selftest.CPU_DIST_TIMEOUT and 60 * minutes + 60 < run.limit(cpu=True), name
            assert all(value.count("{out}") == 0 for value in env.values())


def _result(**entries) -> dict:
    return {"number": 2, "key": "agreement", "title": "agreement", "verdict": "FAILED", "failed": ["fsdp-shared"],
            "seconds": 12.0, "planned": 20, "launches": ["sgd-single"], "lines": ["FAILED fsdp-shared: 2e-3 of far"],
            "figures": {"fsdp-shared share of far": 2e-3}, **entries}


def test_the_report_is_markdown_and_json_naming_what_failed(tmp_path):
    header = {"date": "2026-12-05", "quick": False, "only": None, "gpus": ["NVIDIA H200"], "torch": "2.14.1",
              "cuda": "13.0", "launches": 20, "parallel": 4, "planned seconds": 145}
    markdown = selftest.write_report(tmp_path, header, [_result(), _result(number=3, key="fp16", verdict="passed",
                                                                          failed=[], lines=["ok"])])
    assert markdown == (tmp_path / "report.md").read_text()
    assert "## 2. agreement: FAILED (fsdp-shared), 12 s (planned 20 s, 1 launches)" in markdown
    assert "1 NVIDIA H200" not in markdown and "1 GPU(s): NVIDIA H200; torch 2.14.1, CUDA 13.0" in markdown
    assert markdown.rstrip().endswith("1 of 2 checks passed.")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["torch"] == "2.14.1" and report["cuda"] == "13.0" and report["gpus"] == ["NVIDIA H200"]
    assert report["passed"] == 1
    assert [(c["key"], c["verdict"], c["failed"]) for c in report["checks"]] == [
        ("agreement", "FAILED", ["fsdp-shared"]), ("fp16", "passed", [])]
    assert report["checks"][0]["figures"] == {"fsdp-shared share of far": 2e-3}


def test_a_check_that_raises_fails_under_its_name_and_the_others_still_run():
    def broken(launch, gpus, quick):
        raise KeyError("history.json")
    check = selftest.Check("resume", "resume", broken, lambda g, q: [])
    entry = selftest.run_check(check, 6, None, 1, False, [], 10)
    assert entry["verdict"] == "FAILED" and entry["failed"] == ["resume"] and "KeyError" in entry["lines"][0]
    passed = selftest.run_check(selftest.Check("x", "x", lambda *a: selftest.Result(["fine"]), lambda g, q: []),
                                1, None, 1, False, [], 1)
    assert passed["verdict"] == "passed" and passed["failed"] == []


class FakeLaunches:
    """Launches whose folders exist already; the named ones failed. On `gpus` GPUs, or --device cpu."""

    def __init__(self, root, failed=(), gpus=1, cpu=False):
        self.root, self.failed, self.asked, self.gpus, self.cpu, self.work = root, set(failed), [], gpus, cpu, root

    def __call__(self, name):
        self.asked.append(name)
        if name in self.failed:
            raise RuntimeError(f"{name} failed: boom (log: {self.root / name})")
        return self.root / name

    def processes(self, name):
        return selftest.RUNS[name].processes(self.gpus)


def _save(folder, value: float, scale: float = 2.0 ** 14, log: str = "") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    # A finished run's last.pth as the legs write it (its epoch tells it from train_fsdp.py's last.dcp).
    torch.save({"epoch": 1, "model": {"w": torch.full((4,), value)}, "scaler": {"scale": scale}}, folder / "last.pth")
    (folder / f"log-{folder.name}.txt").write_text(log)


def test_agreement_runs_every_leg_after_one_failed_and_names_the_failed_mode(tmp_path):
    _save(tmp_path / "sgd-single", 0.0)
    _save(tmp_path / "sgd-far", 1.0)  # far = 2 (4 weights 1 apart)
    _save(tmp_path / "sgd-fsdp-shared", 1e-4,
          log="rank 0 held 4.3 MB at its fullest optimizer step (...): 0.500 of the 8.7 MB that each DDP process holds")
    launch = FakeLaunches(tmp_path, failed=["sgd-ddp-shared"])
    result = selftest.agreement(launch, 1, False)
    assert launch.asked == ["sgd-single", "sgd-far", "sgd-ddp-shared", "sgd-fsdp-shared"]
    assert result.failed == ["sgd-ddp-shared"]
    assert result.figures["fsdp-shared share of far"] == pytest.approx(1e-4)  # the leg after the failed one ran
    assert any(line.startswith("FAILED sgd-ddp-shared: sgd-ddp-shared failed: boom") for line in result.lines)
    _save(tmp_path / "sgd-ddp-shared", 0.0)
    _save(tmp_path / "sgd-fsdp-shared", 0.01, log="no memory line")
    result = selftest.agreement(FakeLaunches(tmp_path), 1, False)
    assert "fsdp-shared" in result.failed and "fsdp-shared memory" in result.failed


def test_fp16_needs_float16_logits_on_every_rank(tmp_path):
    """A run whose autocast was off (float32 logits) ends as close to float32 as can be: only
    its logits' dtype tells."""
    _save(tmp_path / "sgd-single", 0.0)
    _save(tmp_path / "sgd-far", 1.0)
    (tmp_path / "sgd-single" / "dtypes.txt").write_text("0 float32\n")
    for mode in selftest.SYNC_SGD:
        _save(tmp_path / f"sgd-fp16-{mode}", 0.01)
        (tmp_path / f"sgd-fp16-{mode}" / "dtypes.txt").write_text("0 float16\n1 float16\n")
    assert selftest.fp16_learns(FakeLaunches(tmp_path), 1, True).failed == []
    (tmp_path / "sgd-fp16-fsdp-shared" / "dtypes.txt").write_text("0 float16\n1 float32\n")
    _save(tmp_path / "sgd-fp16-single", 0.0)
    (tmp_path / "sgd-fp16-single" / "dtypes.txt").write_text("0 float32\n")
    assert selftest.fp16_learns(FakeLaunches(tmp_path), 1, True).failed == ["sgd-fp16-single", "sgd-fp16-fsdp-shared"]


def _record(rank=0, windows=2, control=2, syncs=None):
    return {"rank": rank, "passes": 2, "windows": windows, "control": control, "syncs": syncs or {}}


def test_the_sync_verdict_needs_the_control_and_nothing_but_what_is_allowed():
    read = {"torch/amp/grad_scaler.py:380 <genexpr> < torch/amp/grad_scaler.py:380 _maybe_opt_step": 6}
    judge = selftest.judge_syncs
    assert judge("a", [_record(), _record(1)], 2, set())[1]
    assert not judge("a", [_record()], 2, set())[1], "a rank without a record"
    assert not judge("a", [_record(control=0), _record(1)], 2, set())[1], "blind: the control was not seen"
    assert not judge("a", [_record(windows=1, control=1)], 1, set())[1], "a window did not run"
    assert not judge("a", [_record(syncs=read)], 1, set())[1]
    line, ok = judge("a", [_record(syncs=read)], 1, {selftest.SCALER_READ})
    assert ok and "6 allowed reads (_maybe_opt_step)" in line
    line, ok = judge("a", [_record(syncs={**read, "src/progress.py:90 update": 1})], 1, {selftest.SCALER_READ})
    assert not ok and 'OTHER: {"src/progress.py:90 update": 1}' in line


def test_only_the_fsdp_sgd_run_may_read_the_scalers_flag(tmp_path):
    """FSDP's SGD is foreach (no fused SGD for DTensors): its scaler reads the overflow flag on the
    host once a step. Allowed in that run, a failure in any other (there a fused optimizer takes
    the flag as a tensor)."""
    read = {"torch/amp/grad_scaler.py:380 <genexpr> < torch/amp/grad_scaler.py:380 _maybe_opt_step": 6}
    for name in selftest._sync_runs(1, False):
        (tmp_path / name).mkdir()
        (tmp_path / name / "history.json").write_text(json.dumps([{"epoch": 1}, {"epoch": 2}]))
        for rank in range(selftest.RUNS[name].processes(1)):
            (tmp_path / name / f"syncs.json.{rank}").write_text(json.dumps(_record(rank, syncs=read)))
    result = selftest.no_syncs(FakeLaunches(tmp_path), 1, False)
    assert sorted(result.failed) == sorted(name for name in selftest._sync_runs(1, False)
                                           if name != "sgd-fp16-fsdp-shared")


def test_the_sync_record_sorts_the_control_from_the_others():
    shown = []
    record = SyncRecord("1", lambda *args: shown.append(args[0]))

    def _control_sync():
        record.showwarning(UserWarning(SYNC_MESSAGE), UserWarning, "x.py", 1)

    def _maybe_opt_step():
        with warnings.catch_warnings():  # as torch's warnings arrive: through the warnings module
            warnings.showwarning = record.showwarning
            warnings.filterwarnings("always", message=".*" + SYNC_MESSAGE)
            for _ in range(2):
                warnings.warn(SYNC_MESSAGE + " (function warn_or_error_on_sync)")
    _control_sync()
    _maybe_opt_step()
    record.showwarning(UserWarning("something else"), UserWarning, "x.py", 1)
    assert record.record["control"] == 1 and [str(message) for message in shown] == ["something else"]
    (where, count), = record.record["syncs"].items()
    assert count == 2 and where.split(" < ")[0].endswith(" _maybe_opt_step")
    assert where.split(" < ")[0].startswith("tests/test_gpu_selftest_logic.py:")
    assert "warnings.py" not in where


def test_a_sync_site_names_the_innermost_frames_first():
    frames = [SimpleNamespace(filename=f"/x/site-packages/torch/{name}.py", lineno=i, name=name)
              for i, name in enumerate("abcdefg")]
    assert sync_site(frames) == " < ".join(f"torch/{n}.py:{i} {n}" for i, n in list(enumerate("abcdefg"))[::-1][:6])


def test_the_compiled_verdict_needs_every_convolution_of_every_forward(tmp_path):
    record = {"rank": "0", "graphs": 3, "forwards": 10, "conv2d": 200, "linear": 10, "conv2d modules": 20,
              "linear modules": 1}
    assert selftest.judge_compiled("c", [record], 1)[1]
    assert not selftest.judge_compiled("c", [{**record, "conv2d": 190}], 1)[1]
    assert not selftest.judge_compiled("c", [record], 2)[1]
    assert not selftest.judge_compiled("c", [{**record, "forwards": 0, "conv2d": 0, "linear": 0}], 1)[1]


def test_the_tf32_verdict_needs_accelerate_to_have_turned_it_on_and_the_script_off():
    assert selftest.judge_tf32("0 accelerator True\n0 step False\n")[1]
    assert not selftest.judge_tf32("0 accelerator False\n0 step False\n")[1], "accelerate did nothing: blind"
    assert not selftest.judge_tf32("0 accelerator True\n0 step True\n")[1]
    assert not selftest.judge_tf32("")[1]


def test_the_counting_backend_counts_the_calls_inside_compiled_graphs():
    counts = {"graphs": 0, "conv2d": 0, "linear": 0}
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2))
    compiled = torch.compile(model, backend=counting_backend("eager", counts))
    x = torch.randn(2, 3, 8, 8)
    for _ in range(3):
        assert torch.equal(compiled(x), model(x))
    assert counts == {"graphs": 1, "conv2d": 3, "linear": 3}


def test_the_dtype_hook_logs_each_dtype_of_the_logits_once(tmp_path):
    functional = SimpleNamespace(cross_entropy=lambda input, target: input.float().sum())
    log_dtypes(functional, tmp_path / "dtypes.txt", "1")
    for dtype in (torch.bfloat16, torch.bfloat16, torch.float32):
        functional.cross_entropy(torch.zeros(2, 2, dtype=dtype), torch.zeros(2, dtype=torch.long))
    assert (tmp_path / "dtypes.txt").read_text() == "1 bfloat16\n1 float32\n"


def test_only_runs_the_named_checks_and_their_launches():
    steps = selftest.plan(1, False, ["sync"])
    assert [check.key for check, _, _ in steps] == ["sync"]
    assert steps[0][1] == selftest._sync_runs(1, False)
    assert "sgd-fp16-fsdp-shared" in steps[0][1] and "adamw-fp16-fsdp-shared" in steps[0][1]


def test_the_fused_optimizer_check_fails_when_sgd_is_not_fused(monkeypatch):
    """Check 1 on the CPU with the GPU's choices (AS_ON_GPU=1), make_optimizer's SGD reported
    unfused (as `fused = gpu_choices(device) and args.optimizer == "adamw"` would make it): the
    check fails and prints both optimizers' kernels."""
    import src.recipe
    monkeypatch.setenv("AS_ON_GPU", "1")
    make_optimizer = src.recipe.make_optimizer

    def sgd_unfused(model, args, device):
        optimizer = make_optimizer(model, args, device)
        if args.optimizer == "sgd":
            optimizer.defaults["fused"] = False
        return optimizer
    monkeypatch.setattr(src.recipe, "make_optimizer", sgd_unfused)
    with pytest.raises(AssertionError, match=r"fused \{'sgd': False, 'adamw': True\}"):
        selftest._fused_optimizers(torch.device("cpu"))


def test_the_plan_fits_the_proofs_deadline_at_half_the_speed():
    """checks/gpu_proof.sh gives make test-gpu SELFTEST seconds; the plan counts launches at their
    speed one at a time, and 4 at once share the cores and the GPU: it must fit at half that speed."""
    script = (selftest.ROOT / "checks" / "gpu_proof.sh").read_text()
    deadline = int(script.split("SELFTEST=${SELFTEST:-")[1].split("}")[0])
    planned = selftest.DATA + sum(seconds for _, _, seconds in selftest.plan(1, False))
    assert 2 * planned <= deadline, (planned, deadline)


def test_the_sync_hook_wraps_each_training_pass_of_a_run(tiny_data, tmp_path):
    """The SYNC_CHECK_STEPS hook in a real run (here on the CPU, where it only counts): it wraps
    src.progress's training passes (it once patched a class the reshape removed, and every hooked
    run died at import), and writes its record at exit: two epochs, two passes, no window."""
    command = [sys.executable, "train_single.py", "--data-dir", str(tiny_data), "--arch", "squeezenet1_1",
               "--weights", "none", "--image-size", "32", "--epochs", "2", "--batch-size", "8", "--workers", "0",
               "--checkpoint", str(tmp_path / "best.pth"), "--plot", str(tmp_path / "curves.png")]
    hook = {"PYTHONPATH": conftest.HOOKS, "SYNC_CHECK_STEPS": "1:3", "SYNC_LOG": str(tmp_path / "syncs.json")}
    result = conftest.run(command, env=hook)
    assert result.returncode == 0, result.stderr[-2000:]
    record = json.loads((tmp_path / "syncs.json.0").read_text())
    assert (record["passes"], record["windows"], record["syncs"]) == (2, 0, {})


def test_the_targets_hook_logs_each_kind_of_target_once(tmp_path):
    functional = SimpleNamespace(cross_entropy=lambda input, target, **kwargs: input.float().sum())
    log_targets(functional, tmp_path / "targets.txt", "1")
    for target in (torch.zeros(2, dtype=torch.long), torch.full((2, 2), 0.5), torch.zeros(2, dtype=torch.long)):
        functional.cross_entropy(torch.zeros(2, 2), target, label_smoothing=0.1)
    assert (tmp_path / "targets.txt").read_text() == "1 hard\n1 soft\n"
    assert selftest.targets_seen(tmp_path) == {"1": {"hard", "soft"}}


def test_a_launcher_or_a_fork_server_writes_no_record_under_a_ranks_name(tmp_path):
    """torchrun and accelerate launch start with the workers' environment, the hooks' variables
    included, and end after them; so does each rank's loader fork server (its RANK too), which
    imports the script's modules: a process that trained nothing writes no record at its exit (a
    launcher's once replaced rank 0's, and every two-rank run's rank 0 read as having run no
    window). The control: a process that starts a run (makes its Progress) writes one."""
    env = {"PYTHONPATH": conftest.HOOKS, "SYNC_CHECK_STEPS": "1:2", "SYNC_LOG": str(tmp_path / "syncs.json"),
           "RANK": "1"}
    for code in ("pass", "import src.progress"):
        assert conftest.run([sys.executable, "-c", code], env=env).returncode == 0
        assert not list(tmp_path.glob("syncs.json*")), code
    starts = "import contextlib, src.progress\nwith contextlib.suppress(Exception): src.progress.Progress(None, None, 1, None)"
    assert conftest.run([sys.executable, "-c", starts], env=env).returncode == 0
    assert json.loads((tmp_path / "syncs.json.1").read_text())["passes"] == 0


def test_tiny_sets_the_cpus_size_and_workers_and_the_runs_own_flags():
    flags = ["--arch", "vgg11", "--image-size", "64", "--workers", "2", "--epochs", "1"]
    assert selftest.tiny(flags, {"--arch": "squeezenet1_1", "--compile": None, "--save-every-steps": "4"}) == [
        "--arch", "squeezenet1_1", "--image-size", str(selftest.CPU_SIZE), "--workers", str(selftest.CPU_WORKERS),
        "--epochs", "1", "--compile", "--save-every-steps", "4"]


def test_on_the_cpu_a_launch_stands_in_for_those_that_differ_in_what_only_a_gpu_shows(tmp_path):
    """--device cpu: an fp16 run is its mode's float32 run there (its hooks' variables with it),
    every launch tiny, without a GPU, with the GPU's choices where the CPU has them; a world of one
    runs its script without a launcher; the smaller data set unless the run asks for the larger."""
    assert selftest.stand_in("sgd-fp16-fsdp-shared", True) == "sgd-fsdp-shared"
    assert selftest.stand_in("sgd-fp16-fsdp-shared", False) == "sgd-fp16-fsdp-shared"
    for name, run in selftest.RUNS.items():
        if run.cpu_as:  # a stand-in stands in for others only, and runs the same script (but check 5's FSDP leg)
            assert selftest.RUNS[run.cpu_as].cpu_as is None, name
            assert (name == "compile-fsdp-shared"
                    or selftest.MODES[selftest.RUNS[run.cpu_as].mode].script == selftest.MODES[run.mode].script), name
    command, env = selftest.command_of("sgd-fsdp-shared", tmp_path, tmp_path / "data", 1, cpu=True)
    assert env["SYNC_CHECK_STEPS"] == selftest.SYNC_WINDOW and env["SYNC_LOG"] == f"{tmp_path}/sgd-fsdp-shared/syncs.json"
    assert env["DTYPE_LOG"] == f"{tmp_path}/sgd-fsdp-shared/dtypes.txt"
    assert (env["CUDA_VISIBLE_DEVICES"], env["AS_ON_GPU"], env["OMP_NUM_THREADS"]) == ("", "1", "1")
    assert command[command.index("--data-dir") + 1] == str(tmp_path / "data")
    assert command[command.index("--image-size") + 1] == str(selftest.CPU_SIZE)
    command, env = selftest.command_of("steps-fsdp", tmp_path, tmp_path / "data", 1, cpu=True)
    assert command[:2] == [sys.executable, "train_fsdp.py"] and "torch.distributed.run" not in command
    assert command[command.index("--arch") + 1] == "squeezenet1_1" and command[command.index("--data-dir") + 1] == (
        str(tmp_path / "data-small"))
    command, _ = selftest.command_of("steps-fsdp", tmp_path, tmp_path / "data", 1)
    assert "torch.distributed.run" in command and command[command.index("--arch") + 1] == "vgg11"


def test_a_comparison_only_a_gpu_makes_meaningful_is_skipped_with_its_reason_on_the_cpu():
    on_cpu, on_gpu = selftest.Result(cpu=True), selftest.Result()
    for result in (on_cpu, on_gpu):
        result.judge("logits in float32", False, "fp16", gpu_only="fp16 is the GPU's kernels")
        result.judge("3 of 3 ranks", True, "records")
    assert on_cpu.failed == [] and on_cpu.skipped == ["on the CPU: fp16 is the GPU's kernels"]
    assert on_cpu.lines == ["skipped (on the CPU: fp16 is the GPU's kernels): logits in float32", "3 of 3 ranks"]
    assert on_gpu.failed == ["fp16"] and on_gpu.skipped == []
    entry = {**_result(verdict="passed", failed=[]), "skipped": on_cpu.skipped, "lines": on_cpu.lines}
    said = selftest.entry_markdown(entry)
    assert "## 2. agreement: passed, 1 skipped, 12 s" in said
    assert said.rstrip().endswith('- figures: {"fsdp-shared share of far": 0.002}')


def _steps(folder, decay=0.9, moved_at_skip=False) -> None:
    """A run's step checkpoints as COPY_LAST keeps them, one after each of 6 steps, steps 1 and 3
    skipped by the scaler, the average computed in float32 as the GPU does (with `decay`)."""
    from src.ema import decay_at
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(50, generator=generator)
    average, updates = weights.clone(), 0
    (folder / "epochs").mkdir(parents=True)
    for step in range(1, 7):
        if step not in (1, 3):
            weights = weights + 0.1 * torch.randn(50, generator=generator)
            average = torch.lerp(average, weights, float(1 - decay_at(updates, decay)))
            updates += 1
        elif moved_at_skip and step == 3:
            weights = weights + 1.0
        torch.save({"epoch": 0, "step": step, "model": {"w": weights},
                    "average": {"model": {"w": average}, "updates": updates}}, folder / "epochs" / f"last.{step}.pth")


def test_the_ema_check_computes_each_steps_average_again_and_catches_another_decay(tmp_path):
    _steps(tmp_path / "steps-single")
    result = selftest.ema(FakeLaunches(tmp_path), 1, False)
    assert result.failed == [] and "and [3] (expected [3])" in result.lines[0], result.lines
    for folder, change in (("other-decay", {"decay": 0.05}), ("moved", {"moved_at_skip": True})):
        _steps(tmp_path / folder / "steps-single", **change)
        assert selftest.ema(FakeLaunches(tmp_path / folder), 1, False).failed == ["ema"], folder


def test_the_peak_verdict_allows_a_twentieth_of_what_the_rank_held():
    mib = 2**20
    record = {"rank": "0", "peak before the first step checkpoint": 3000 * mib, "held at the first step checkpoint":
              2600 * mib}
    assert selftest.judge_peak({**record, "peak through the first epoch": 3100 * mib})[1]
    line, ok = selftest.judge_peak({**record, "peak through the first epoch": 5000 * mib})
    assert not ok and "+2000.0 MiB" in line  # the shards staged on the GPU
    assert not selftest.judge_peak({"rank": "0"})[1], "no record: no verdict of a pass"


def test_gpu0_needs_each_rank_on_its_own_gpu_alone(tmp_path):
    """On 2 GPUs: every NCCL launch's rank r holds a context on GPU r only; a rank 1 that also holds
    one on GPU 0 fails, named; on one GPU there is nothing to judge: skipped."""
    names = selftest._gpu0_runs(2)
    assert "stop-ddp" in names and "steps-fsdp" in names
    for name in names:
        (tmp_path / name).mkdir()
        for rank in range(2):
            (tmp_path / name / f"memory.json.{rank}").write_text(json.dumps({"rank": str(rank), "device": rank,
                                                                               "contexts": [rank]}))
    assert selftest.gpu0(FakeLaunches(tmp_path, gpus=2), 2, False).failed == []
    (tmp_path / "stop-ddp" / "memory.json.1").write_text(json.dumps({"rank": "1", "device": 1, "contexts": [0, 1]}))
    assert selftest.gpu0(FakeLaunches(tmp_path, gpus=2), 2, False).failed == ["stop-ddp rank 1"]
    one = selftest.gpu0(FakeLaunches(tmp_path), 1, False)
    assert one.failed == [] and one.skipped == ["one GPU: no rank has another to keep to"]
