"""`make test-gpu`: on a machine with NVIDIA GPUs, what the CPU test suite cannot check, in one report.

    python tests/gpu_selftest.py [--out gpu-selftest] [--skip-benchmark]

Runs the real scripts and launchers on a small synthetic set, on every visible GPU:
1. single vs DDP (one process per GPU) vs accelerate, and DataParallel where there are two GPUs
   or more, with --deterministic: their weights agree to TOLERANCE of the distance to a run with
   another global batch (the tolerance of the CPU tests, where 7e-5 is measured);
2. --amp bf16 --channels-last --compile trains (one device, and DDP);
3. no host synchronisation inside a training step: each script runs a few steps with
   torch.cuda.set_sync_debug_mode("error") (SYNC_CHECK_STEPS; tests/hooks/sitecustomize.py), which raises at any;
4. resume with dropout on ends exactly where the straight run does (one device and DDP);
5. the benchmark at a small size.
Writes OUT/report.md (also printed) and exits 1 if any check failed. On a machine without a GPU
it says so in one line and exits 0, claiming nothing.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
TOLERANCE = 1e-3
AGREE = ["--arch", "alexnet", "--weights", "none", "--image-size", "224", "--dropout", "0", "--lr", "0.01",
         "--epochs", "2", "--deterministic"]  # AlexNet: no batch norm; at 224 px its pooling is exact
TRAIN = ["--arch", "resnet18", "--weights", "none", "--image-size", "64", "--lr", "0.01", "--epochs", "2"]


def _run(command: list[str], out: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                   "HF_HOME": str(out / "hf"), **(env or {})}
    result = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(" ".join(command) + "\n\n" + result.stdout + result.stderr)
    return result


def _train(name: str, launcher: list[str], script: str, flags: list[str], work: Path, data: Path,
           env: dict | None = None) -> Path:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    result = _run([*launcher, script, "--data-dir", str(data), "--cache", str(work / "cache"), *flags,
                   "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")], out, env)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{name} failed: {tail} (log: {out / 'log.txt'})")
    return out


def _model(out: Path) -> dict:
    return torch.load(out / "last.pth", map_location="cpu", weights_only=True)["model"]


def _distance(a: dict, b: dict) -> float:
    return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()


def _launchers(gpus: int) -> dict:
    return {"single": [sys.executable], "dp": [sys.executable],
            "ddp": ["torchrun", "--standalone", f"--nproc_per_node={gpus}"],
            "accelerate": ["accelerate", "launch", "--num_processes", str(gpus)]
            + (["--multi_gpu"] if gpus > 1 else [])}


SCRIPTS = {"single": "train_single.py", "dp": "train_dp.py", "ddp": "train_ddp.py",
           "accelerate": "train_accelerate.py"}


def agreement(work: Path, data: Path, gpus: int) -> list[str]:
    batch = 16
    launch = _launchers(gpus)
    runs = {"single": _train("agree-single", launch["single"], "train_single.py",
                             AGREE + ["--batch-size", str(batch * gpus)], work, data)}
    far_run = _train("agree-far", launch["single"], "train_single.py",
                     AGREE + ["--batch-size", str(batch * gpus // 2)], work, data)
    modes = ["ddp", "accelerate"] + (["dp"] if gpus > 1 else [])
    for mode in modes:
        per_process = batch * gpus if mode == "dp" else batch
        runs[mode] = _train(f"agree-{mode}", launch[mode], SCRIPTS[mode], AGREE + ["--batch-size", str(per_process)],
                            work, data)
    reference = _model(runs["single"])
    far = _distance(_model(far_run), reference)
    lines = [f"global batch {batch * gpus}; far (the distance to global batch {batch * gpus // 2}) = {far:.4g}"]
    failed = False
    for mode in modes:
        share = _distance(_model(runs[mode]), reference) / far
        failed |= not share < TOLERANCE
        lines.append(f"{mode}: {share:.2e} of far (tolerance {TOLERANCE})")
    if failed:
        raise AssertionError("; ".join(lines))
    return lines


def _per_process(mode: str, global_batch: int, gpus: int) -> list[str]:
    """--batch-size for a global batch: the same number of steps whatever the GPUs."""
    return ["--batch-size", str(global_batch if mode in ("single", "dp") else max(1, global_batch // gpus))]


def fast_path(work: Path, data: Path, gpus: int) -> list[str]:
    flags = TRAIN + ["--amp", "bf16", "--channels-last", "--compile"]
    lines = []
    for mode in ("single", "ddp"):
        out = _train(f"fast-{mode}", _launchers(gpus)[mode], SCRIPTS[mode], flags + _per_process(mode, 64, gpus),
                     work, data)
        record = json.loads((out / "history.json").read_text())[-1]
        lines.append(f"{mode}: val acc {record['val_acc']:.3f}, epoch 2 in {record['seconds']:.1f} s")
        if record["val_acc"] < 0.8:
            raise AssertionError(f"{mode} with bf16, channels-last and compile did not learn: {record}")
    return lines


def no_syncs(work: Path, data: Path, gpus: int) -> list[str]:
    """Steps 2 to 8 of the first epoch under set_sync_debug_mode("error"): 512 training images in
    global batches of 32 make 16 micro-batches on every rank, whatever the GPUs."""
    launch, lines = _launchers(gpus), []
    cases = [("single", ["--amp", "bf16"], {}), ("single-fp16", ["--amp", "fp16"], {}),
             ("dp", ["--amp", "bf16"], {}), ("ddp", ["--amp", "bf16"], {}),
             ("accelerate", [], {"ACCELERATE_MIXED_PRECISION": "bf16"})]
    for name, extra, env in cases:
        mode = name.split("-")[0]
        if name == "accelerate":
            launcher = launch[mode][:2] + ["--mixed_precision", "bf16"] + launch[mode][2:]
        else:
            launcher = launch[mode]
        _train(f"sync-{name}", launcher, SCRIPTS[mode], TRAIN + _per_process(mode, 32, gpus) + ["--epochs", "1", *extra],
               work, data, {"SYNC_CHECK_STEPS": "2:8", "PYTHONPATH": str(ROOT / "tests" / "hooks"), **env})
        lines.append(f"{name}: steps 2 to 8 ran under set_sync_debug_mode('error')")
    return lines


def resume(work: Path, data: Path, gpus: int) -> list[str]:
    flags = ["--arch", "alexnet", "--weights", "none", "--image-size", "224", "--lr", "0.01",
             "--deterministic", "--batch-size", "16"]  # AlexNet's dropout 0.5, on
    lines = []
    for mode in ("single", "ddp"):
        launcher = _launchers(gpus)[mode]
        straight = _train(f"resume-{mode}-straight", launcher, SCRIPTS[mode], flags + ["--epochs", "2"], work, data)
        stopped = _train(f"resume-{mode}", launcher, SCRIPTS[mode], flags + ["--epochs", "1"], work, data)
        out = work / f"resume-{mode}"
        result = _run([*launcher, SCRIPTS[mode], "--data-dir", str(data), "--cache", str(work / "cache"), *flags,
                       "--epochs", "2", "--resume", "--checkpoint", str(stopped / "best.pth"),
                       "--plot", str(stopped / "curves.png")], out / "resumed")
        if result.returncode != 0:
            raise RuntimeError(f"resume {mode} failed: {result.stderr.strip().splitlines()[-1:]}")
        distance = _distance(_model(stopped), _model(straight))
        norm = _distance(_model(straight), {k: v * 0 for k, v in _model(straight).items()})
        lines.append(f"{mode}: distance between resumed and straight weights {distance:.3g} (weights' norm {norm:.3g})")
        # One device: bit for bit. DDP with 3 or more ranks may differ in the rounding: its first
        # step after a start all-reduces one bucket of every gradient, later steps rebuilt buckets.
        if distance > (0 if mode == "single" or gpus < 3 else 1e-6 * norm):
            raise AssertionError("; ".join(lines))
    return lines


def benchmark(work: Path, data: Path, gpus: int) -> list[str]:
    out = work / "benchmark"
    result = _run([sys.executable, "-m", "src.tools.benchmark", "--images", "2000", "--arch", "resnet18",
                   "--image-size", "64", "--batch-size", "64", "--epochs", "2", "--processes", str(gpus),
                   "--out-dir", str(out)], out)
    if result.returncode != 0:
        raise RuntimeError(f"benchmark failed: {result.stderr.strip().splitlines()[-1:]}")
    return (out / "benchmark.md").read_text().splitlines()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-selftest"))
    parser.add_argument("--skip-benchmark", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("make test-gpu: no CUDA GPU is visible here, so nothing was checked (see docs/gpus.md)")
        return 0
    from src.tools.synthetic import write_dataset
    gpus = torch.cuda.device_count()
    work = args.out.resolve()
    data = work / "data"
    if not (data / "train").is_dir():
        write_dataset(data, n_train=640, n_test=0, size=256, seed=0)
    checks = [("agreement with --deterministic", agreement), ("bf16, channels-last, compile", fast_path),
              ("no host synchronisation in a step", no_syncs), ("resume with dropout", resume)]
    if not args.skip_benchmark:
        checks.append(("benchmark", benchmark))
    names = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus))
    report = [f"# make test-gpu, {date.today().isoformat()}", "",
              f"{gpus} GPU(s): {names}; torch {torch.__version__}, CUDA {torch.version.cuda}", ""]
    failures = 0
    for title, check in checks:
        start = time.time()
        try:
            lines, verdict = check(work, data, gpus), "passed"
        except Exception as error:  # a failed check is reported; the others still run
            lines, verdict = [str(error)], "FAILED"
            failures += 1
        report += [f"## {title}: {verdict} ({time.time() - start:.0f} s)", ""] + [f"- {line}" for line in lines] + [""]
        (work / "report.md").write_text("\n".join(report) + "\n")
    print("\n".join(report))
    print(f"{len(checks) - failures} of {len(checks)} checks passed; report in {work / 'report.md'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
