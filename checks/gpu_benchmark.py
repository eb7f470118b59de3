"""The blog post's job on one GPU: VGG16 at 224 px, batch 50, 20,000 training and 5,000 validation
JPEGs, train_single.py --amp bf16 --channels-last, from the JPEGs and from --cache, with and without
--compile: seconds per epoch against the post's 4 min 35 s, images/s and MFU.

    python checks/gpu_benchmark.py [--out gpu-benchmark] [--deadline SECONDS] [--legs jpeg,cache,...]
    python checks/gpu_benchmark.py --dry-run --out /tmp/benchmark-dry-run   # on a CPU, tiny: the script end to end

The images are synthetic (src.tools.synthetic's stripes, about 500x400 like Kaggle's photographs),
DISTINCT of them drawn on every core and each written under several names: JPEG decoding costs
what the size and quality make it cost, whatever the picture. Each leg trains --epochs 2 and
reports the second (the first also pays for cuDNN's autotuning, the cache build and compilation);
a leg that cannot finish before --deadline is not started, one still running then is stopped and
reports the epochs it finished. The MFU counts the FLOPs of a training image as torch's
FlopCounterMode does (train_flops: VGG16 at 224 px, 30.9 GFLOP forward and 92.6 forward and
backward, twice its 46.3 G multiply-adds). Writes OUT/benchmark.md and OUT/benchmark.json (per leg:
its command, epochs, seconds, images/s, MFU; the GPU, torch, CUDA, the CPUs), and the runs' logs
in OUT/runs/LEG/log.txt.

--dry-run runs all of it but the GPU's work, on the CPU, tiny (DRY_RUN: SqueezeNet 1.1 at 32 px on
40 images, no loader worker processes, each leg's --compile with TORCH_COMPILE_DISABLE=1, which
leaves torch.compile's wrapper running the model eagerly, since inductor's compilation for a CPU
costs minutes): the images drawn and written, the FLOP count, the legs launched and read back, the
report; its figures are a CPU's and mean nothing for the GPU.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "checks"))

BLOG_EPOCH_SECONDS = 4 * 60 + 35  # the post's epoch, on one GPU
# Dense bfloat16 peaks (FLOP/s) from NVIDIA's data sheets, by a name the GPU's name holds.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}
LEGS = {  # name: extra flags; the order is the order they run in
    "jpeg": [],
    "cache": ["--cache", "{cache}"],
    "cache-compile": ["--cache", "{cache}", "--compile"],
    "jpeg-compile": ["--compile"],
}
# Seconds a leg needs at least (start-up, 2 epochs, the cache build or compilation): one that
# cannot have them before the deadline is not started.
LEG_SECONDS = {"jpeg": 60, "cache": 60, "cache-compile": 100, "jpeg-compile": 100}


@dataclass(frozen=True)
class Shape:
    """The job: the model, its input size and batch; the images written (`distinct` of them drawn,
    about `size` px wide)."""
    arch: str
    image_size: int
    batch_size: int
    images: int
    distinct: int
    size: int


FULL = Shape("vgg16", image_size=224, batch_size=50, images=25000, distinct=2500, size=500)
DRY_RUN = Shape("squeezenet1_1", image_size=32, batch_size=4, images=40, distinct=8, size=64)


def _draw(task: tuple[int, int, int, int]) -> list[bytes]:
    """JPEG bytes of `count` synthetic images of one class, drawn from `seed`."""
    from io import BytesIO

    from src.tools.synthetic import synthetic_image
    seed, label, count, size = task
    rng, encoded = np.random.default_rng(seed), []
    for _ in range(count):
        buffer = BytesIO()
        synthetic_image(rng, label, size).save(buffer, "JPEG", quality=int(rng.integers(80, 96)))
        encoded.append(buffer.getvalue())
    return encoded


def write_images(data: Path, images: int, distinct: int, size: int) -> dict:
    """data/train/{cat,dog}.N.jpg: `images` files, half of each class, made of `distinct` drawn
    images (on every core) written in turn; and data/train.csv (filename,label, in the order a
    scan gives), so that no run opens every image to list them."""
    from src.outputs import atomic_write_text
    start = time.perf_counter()
    shutil.rmtree(data, ignore_errors=True)
    (data / "train").mkdir(parents=True)
    cores = len(os.sched_getaffinity(0))
    per_task = max(1, distinct // 2 // cores)
    tasks = [(seed, label, per_task, size) for seed in range(max(1, distinct // 2 // per_task)) for label in (0, 1)]
    with ProcessPoolExecutor(cores) as pool:
        drawn: dict[int, list[bytes]] = {0: [], 1: []}
        for (_, label, _, _), encoded in zip(tasks, pool.map(_draw, tasks)):
            drawn[label] += encoded
    rows = ["filename,label"]
    for label, name in enumerate(("cat", "dog")):
        for n in range(images // 2):
            (data / "train" / f"{name}.{n}.jpg").write_bytes(drawn[label][n % len(drawn[label])])
            rows.append(f"{name}.{n}.jpg,{label}")
    atomic_write_text(data / "train.csv", "\n".join(rows) + "\n")
    sizes = [len(blob) for blobs in drawn.values() for blob in blobs]
    return {"images": images, "distinct": len(sizes), "mean kB": sum(sizes) / len(sizes) / 1e3,
            "seconds": time.perf_counter() - start, "cores": cores}


def loader_workers(batch_size: int, image_size: int, cores: int) -> tuple[int, str]:
    """The --workers that /dev/shm holds (src.devices's rule), at most the cores; and why."""
    from src.devices import SHM, shared_memory_need
    need = shared_memory_need(1, batch_size * 3 * image_size * image_size)
    free = shutil.disk_usage(SHM).free if SHM.is_dir() else None
    if free is None:
        return cores, "no /dev/shm"
    workers = min(cores, free // need)
    return workers, f"/dev/shm has {free / 2**20:.0f} MB free, {need / 2**20:.2f} MB a worker"


def train_flops(arch: str, image_size: int) -> tuple[int, int]:
    """(forward, forward and backward) FLOPs of one training image of `arch` at `image_size` px, as
    torch's FlopCounterMode counts them (a multiply-add is 2 FLOPs; the first layer computes no
    gradient of its input): on the meta device, so no memory and no arithmetic. In evaluation
    mode: a training forward's dropout and batch statistics add no counted FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    from src.models import build_model
    with torch.device("meta"):
        model = build_model(arch, "none")
    model.eval()
    image = torch.empty(1, 3, image_size, image_size, device="meta")
    with FlopCounterMode(display=False) as forward:
        model(image)
    with FlopCounterMode(display=False) as both:
        model(image).sum().backward()
    return forward.get_total_flops(), both.get_total_flops()


def leg_command(name: str, shape: Shape, data: Path, out: Path, workers: int, epochs: int = 2) -> list[str]:
    """train_single.py for the leg `name`."""
    flags = [flag.replace("{cache}", str(out / "cache")) for flag in LEGS[name]]
    return [sys.executable, "train_single.py", "--data-dir", str(data), "--arch", shape.arch, "--weights", "none",
            "--image-size", str(shape.image_size), "--batch-size", str(shape.batch_size),
            "--epochs", str(epochs), "--amp", "bf16", "--channels-last", "--workers", str(workers), *flags,
            "--checkpoint", str(out / "runs" / name / "best.pth"), "--plot", str(out / "runs" / name / "curves.png")]


def leg_figures(history: list[dict], peak: float | None, flops: float) -> dict:
    """A leg's figures from its history.json: each epoch's seconds, and the last epoch's (the
    second, unless the leg was stopped) training images/s, MFU (`flops` per training image at the
    `peak` FLOP/s), data wait and seconds."""
    if not history:
        return {"epochs": 0}
    last = history[-1]
    rate = last["train_samples"] / last["train_seconds"]
    return {"epochs": len(history), "epoch seconds": [record["seconds"] for record in history],
            "reported epoch": len(history), "seconds": last["seconds"], "train seconds": last["train_seconds"],
            "val seconds": last["val_seconds"], "train images/s": rate,
            "data wait share": last["data_wait_seconds"] / last["train_seconds"],
            "MFU": rate * flops / peak if peak else None,
            "blog epoch / this epoch": BLOG_EPOCH_SECONDS / last["seconds"], "val acc": last["val_acc"]}


def run_leg(name: str, command: list[str], out: Path, seconds: float, env: dict | None = None) -> tuple[str, float]:
    """Run a leg for at most `seconds` (`env`: variables added to this process's); ("finished" |
    "stopped at the deadline" | "failed: LINE", wall)."""
    from gpu_selftest import failure_line, stop
    folder = out / "runs" / name
    folder.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(folder / "log.txt", "w") as log:
        log.write(" ".join(command) + "\n\n")
        log.flush()
        launch = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            code = launch.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            stop(launch)
            return "stopped at the deadline", time.perf_counter() - start
    if code != 0:
        return f"failed: {failure_line((folder / 'log.txt').read_text())}", time.perf_counter() - start
    return "finished", time.perf_counter() - start


def peak_flops() -> tuple[float | None, str]:
    if not torch.cuda.is_available():
        return None, "no GPU: no MFU"
    name = torch.cuda.get_device_name(0)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak, f"{name}: {peak / 1e12:.0f} TFLOP/s dense bf16 (data sheet)"
    return None, f"{name}: peak unknown here, no MFU"


def write_report(out: Path, report: dict) -> str:
    """OUT/benchmark.json and OUT/benchmark.md; returns the Markdown."""
    (out / "benchmark.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"# The blog post's job on one GPU, {report['date']}", "",
             f"{report['machine']}; {report['peak']}", "",
             f"{report['shape']['images']} JPEGs ({report['data']['distinct']} distinct, "
             f"{report['data']['mean kB']:.0f} kB "
             f"on average, written in {report['data']['seconds']:.0f} s on {report['data']['cores']} cores), "
             f"80% train; {report['shape']['arch']} at {report['shape']['image_size']} px, batch "
             f"{report['shape']['batch_size']}, --amp bf16 --channels-last, {report['workers']} loader workers "
             f"({report['workers why']}); the post: {BLOG_EPOCH_SECONDS} s an epoch", "",
             f"MFU: {report['train GFLOP per image']:.1f} GFLOP per training image ({report['forward GFLOP per image']:.1f} "
             "forward), as torch's FlopCounterMode counts one image's forward and backward", "",
             "| leg | outcome | epoch 1 s | reported epoch s | post's epoch / it | train images/s | MFU | data wait |",
             "|---|---|---|---|---|---|---|---|"]
    for name, leg in report["legs"].items():
        f = leg.get("figures", {})
        if not f.get("epochs"):
            lines.append(f"| {name} | {leg['outcome']} | | | | | | |")
            continue
        mfu = f"{f['MFU']:.1%}" if f["MFU"] is not None else "n/a"
        lines.append(f"| {name} | {leg['outcome']} | {f['epoch seconds'][0]:.1f} | {f['seconds']:.1f} (epoch "
                     f"{f['reported epoch']}) | {f['blog epoch / this epoch']:.1f}x | "
                     f"{f['train images/s']:.1f} | {mfu} | "
                     f"{f['data wait share']:.0%} |")
    lines += ["", "Commands (from the repository):", ""] + [f"    {' '.join(leg['command'])}"
                                                            for leg in report["legs"].values()]
    markdown = "\n".join(lines) + "\n"
    (out / "benchmark.md").write_text(markdown)
    return markdown


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-benchmark"))
    parser.add_argument("--deadline", type=float, default=None, help="seconds from now within which to end")
    parser.add_argument("--legs", default=",".join(LEGS), help="comma-separated, of " + ", ".join(LEGS))
    parser.add_argument("--dry-run", action="store_true",
                        help=f"tiny ({DRY_RUN.images} images of {DRY_RUN.size} px, {DRY_RUN.arch} at "
                             f"{DRY_RUN.image_size} px): the script end to end on a CPU")
    args = parser.parse_args()
    start = time.perf_counter()
    deadline = start + args.deadline if args.deadline else float("inf")
    legs = args.legs.split(",")
    if not set(legs) <= set(LEGS):
        parser.error(f"--legs: unknown leg {sorted(set(legs) - set(LEGS))[0]!r}")
    if not torch.cuda.is_available() and not args.dry_run:
        print("gpu_benchmark: no CUDA GPU is visible here (--dry-run runs it tiny on the CPU)")
        return 0
    from src.devices import hardware
    shape = DRY_RUN if args.dry_run else FULL
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"
    print(f"writing {shape.images} JPEGs into {data}", flush=True)
    written = write_images(data, shape.images, shape.distinct, shape.size)
    workers, why = loader_workers(shape.batch_size, shape.image_size, written["cores"])
    if args.dry_run:
        workers, why = 0, "--dry-run: the loading in the training process"
    peak, peak_line = peak_flops()
    forward, flops = train_flops(shape.arch, shape.image_size)
    report = {"date": date.today().isoformat(), "machine": hardware(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
              "peak": peak_line, "dry run": args.dry_run, "shape": asdict(shape), "data": written, "workers": workers,
              "workers why": why, "blog epoch seconds": BLOG_EPOCH_SECONDS,
              "train GFLOP per image": flops / 1e9, "forward GFLOP per image": forward / 1e9,
              "legs": {}}
    for name in legs:
        command = leg_command(name, shape, data, out, workers)
        left = deadline - time.perf_counter()
        if left < (10 if args.dry_run else LEG_SECONDS[name]):
            report["legs"][name] = {"command": command, "outcome": f"not run: {left:.0f} s left before the deadline"}
        else:
            print(f"leg {name}: {' '.join(command)}", flush=True)
            # --dry-run: torch.compile's wrapper without its compilation (inductor's, for a CPU, takes minutes)
            outcome, wall = run_leg(name, command, out, left, {"TORCH_COMPILE_DISABLE": "1"} if args.dry_run else None)
            history_file = out / "runs" / name / "history.json"
            history = json.loads(history_file.read_text()) if history_file.exists() else []
            report["legs"][name] = {"command": command, "outcome": outcome, "wall seconds": wall,
                                    "figures": leg_figures(history, peak, flops)}
        write_report(out, report)
        print(f"leg {name}: {report['legs'][name]['outcome']}", flush=True)
    print(write_report(out, report))
    return 0 if all(leg["outcome"] == "finished" for leg in report["legs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
