"""src.tools.benchmark's table, chart and checks, the loader measurement it relies on, and --profile
(src/profiling.py) in all four scripts: the benchmark runs each script with --profile, so one
small benchmark serves the profile tests too."""
import csv
import json
import multiprocessing
import re
import shutil
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import cache_files, history, printed_by
from torch.autograd import DeviceType
from torch.utils.data import DataLoader, Dataset, TensorDataset

import src.checkpoint_writer
import src.outputs
from src.cli import defaults
from src.errors import exit_on_error
from src.profiling import Profiler, breakdown, schedule_for
from src.progress import Progress
from src.tools import benchmark
from src.tools.benchmark import loader_alone
from src.tools.commands import run_script

# Not single-jpeg, dp and accelerate: three runs less (their --profile tables are checked on the
# runs of test_modes, in test_watch.py), and --modes is exercised.
RUNS = ["single", "ddp", "freeze"]
ROWS = RUNS + ["bare step", "bare forward", "bare step, torch's dropout", "feature cache build", "loader, JPEG", "loader, cache",
               "loader, cache + augment", "decode full 32 px", "decode draft 32 px",
               "decode full 224 px", "decode draft 224 px"]


@pytest.fixture(scope="module")
def bench(small_data, module_tmp):
    """One small benchmark of every run (each with --profile): its folder and its output."""
    data = module_tmp / "data"
    shutil.copytree(small_data, data)
    out = module_tmp / "bench"
    argv = ["--data-dir", str(data), "--out-dir", str(out), "--processes", "2", "--arch", "resnet18",
            "--image-size", "32", "--batch-size", "8", "--epochs", "1", "--steps", "2", "--modes", ",".join(RUNS)]
    # main() in this process (torch is imported already; the runs and the bare step are its
    # subprocesses), with the random state it seeds given back.
    with torch.random.fork_rng():
        return out, printed_by(benchmark.main, argv)


def test_benchmark_writes_the_table_chart_and_checks(bench):
    out, printed = bench
    with open(out / "benchmark.csv") as f:
        rows = {row["row"]: row for row in csv.DictReader(f)}
    assert list(rows) == ROWS
    assert [rows[m]["processes"] for m in RUNS] == ["1", "2", "1"]
    assert all(float(row["train_images_per_s"]) > 0 for row in rows.values())
    assert float(rows["single"]["speedup"]) == 1.0
    assert rows["bare forward"]["train_images_per_s"] == rows["bare step"]["val_images_per_s"]
    for mode in RUNS:
        record = history(out / "runs" / mode)[-1]
        assert record["train_samples"] == 192 // 16 * 16  # global batch 16 in every mode
        assert float(rows[mode]["epoch_seconds"]) == pytest.approx(record["seconds"], abs=1e-3)
        assert float(rows[mode]["data_wait_share"]) == pytest.approx(
            record["data_wait_seconds"] / record["train_seconds"], abs=1e-3)
        # Only the two-process run communicates.
        communication = float(rows[mode]["communication_share"])
        assert (communication > 0) == (mode == "ddp"), (mode, communication)
    markdown = (out / "benchmark.md").read_text()
    assert "| run | processes (DP: devices) | train images/s | val images/s | epoch s | speed-up | data wait | communication |" in markdown
    assert "| ddp | 2 |" in markdown and "| loader, cache + augment | 1 |" in markdown
    checks = markdown.split("Checks:")[1]
    for text in ("of the bare step (target >= 0.90)", "the cache loader delivers",
                 "the cache loader with --augment delivers", "an epoch of --freeze from the feature cache is",
                 "the feature-cache build runs at", "draft decode at 32 px", "draft decode at 224 px",
                 "per-sample dropout: the bare step takes"):
        assert text in checks, text
    assert "feature cache build (--freeze): 240 images in" in markdown
    assert markdown in printed
    assert (out / "benchmark.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert cache_files(out / "cache") == [
        "features_resnet18_32px.f32", "features_resnet18_32px.json", "train_32px.json", "train_32px.u8"]
    assert not (out / "features").exists()  # the timed build's copy is removed


# The CSV's columns after `processes`, in the Markdown table's order.
FIELDS = ["train_images_per_s", "val_images_per_s", "epoch_seconds", "speedup", "data_wait_share",
          "communication_share"]


def test_the_benchmark_figures_are_those_of_its_runs(bench):
    """Each figure is what it says: a run's images/s its history's samples over seconds, the
    speed-up the ratio of epoch times, the communication share its profile's, every Markdown cell
    the CSV's value, and every check's figure the ratio of the rows it names, ticked when it meets
    its target. (The CSV keeps 3 decimals, the Markdown 1 or 2: compared to within that rounding.)"""
    out, _ = bench
    with open(out / "benchmark.csv") as f:
        rows = {row["row"]: {k: float(v) if k != "row" and v else v for k, v in row.items()}
                for row in csv.DictReader(f)}
    single = history(out / "runs" / "single")[-1]
    for mode in RUNS:
        record = history(out / "runs" / mode)[-1]
        assert rows[mode]["train_images_per_s"] == pytest.approx(
            record["train_samples"] / record["train_seconds"], abs=6e-4)
        assert rows[mode]["val_images_per_s"] == pytest.approx(record["val_samples"] / record["val_seconds"], abs=6e-4)
        assert rows[mode]["speedup"] == pytest.approx(single["seconds"] / record["seconds"], abs=6e-4)
        profile = json.loads((out / "runs" / mode / "profile" / "profile.json").read_text())
        assert rows[mode]["communication_share"] == pytest.approx(
            profile["host"]["seconds"]["communication"] / profile["wall_seconds"], abs=6e-4)
    markdown = (out / "benchmark.md").read_text()
    for name, row in rows.items():
        shown = re.search(rf"^\| {re.escape(name)} \| (.*) \|$", markdown, re.M).group(1).split(" | ")
        assert len(shown) == 7 and shown[0] == str(int(row["processes"]))
        for got, key, scale, digits in zip(shown[1:], FIELDS, (1, 1, 1, 1, 100, 100), (1, 1, 1, 2, 1, 1)):
            if row[key] == "":
                assert got == "", (name, key)
            else:  # a figure at a rounding boundary may round the other way: one unit of the last digit
                assert abs(float(got.rstrip("%")) - scale * row[key]) <= 1.01 * 10 ** -digits, (name, key, got)

    def rate(name):
        return rows[name]["train_images_per_s"]
    # pattern: (numerator, denominator, target) of the figure, each from the CSV
    figures = {
        r"trains at ([\d.]+) of the bare step \(target >= 0.90\)": (rate("single"), rate("bare step"), 0.90),
        r"the bare step is a ceiling: .* trains at ([\d.]+) of it \(target <= 1.05\)":
            (rate("single"), rate("bare step"), -1.05),
        r"the cache loader delivers ([\d.]+)x .*\(target >= 5\)": (rate("loader, cache"), rate("single"), 5),
        r"with --augment delivers ([\d.]+)x .*\(target >= 5\)": (rate("loader, cache + augment"), rate("single"), 5),
        r"--freeze from the feature cache is ([\d.]+)x .*\(target >= 50\)":
            (rows["single"]["epoch_seconds"], rows["freeze"]["epoch_seconds"], 50),
        r"runs at ([\d.]+) of the bare forward ceiling \(target >= 0.90\)":
            (rate("feature cache build"), rate("bare forward"), 0.90),
        r"per-sample dropout: the bare step takes ([\d.]+)x its time with torch's dropout \(target <= 1.05\)":
            (rate("bare step, torch's dropout"), rate("bare step"), -1.05),
        r"draft decode at 32 px: ([\d.]+)x .*\(target >= 1.5\)": (rate("decode draft 32 px"), rate("decode full 32 px"), 1.5),
        r"draft decode at 224 px: ([\d.]+)x .*\(target >= 0.95\)":
            (rate("decode draft 224 px"), rate("decode full 224 px"), 0.95),
    }
    checks = markdown.split("Checks:")[1].strip().splitlines()
    assert len(checks) == len(figures)
    for pattern, (numerator, denominator, target) in figures.items():
        ratio = numerator / denominator
        line = next(line for line in checks if re.search(pattern, line))
        shown = re.search(pattern, line).group(1)
        # The line shows the ratio of the unrounded figures to its decimals (4.4539 as "4.5": up to
        # half a unit of the last one off); the CSV keeps each figure to 3 decimals (up to 5e-4
        # off each), which moves the ratio computed here by up to ratio x (5e-4 / a + 5e-4 / b).
        decimals = len(shown.partition(".")[2])
        bound = 0.5 * 10 ** -decimals + ratio * 5e-4 * (1 / numerator + 1 / denominator) * 1.001 + 1e-12
        assert abs(float(shown) - ratio) <= bound, (line, ratio, bound)
        met = ratio >= target if target > 0 else ratio <= -target  # a negative target: at most
        csv_rounding = ratio * 5e-4 * (1 / numerator + 1 / denominator) * 1.001 + 1e-12
        if abs(ratio - abs(target)) > csv_rounding:  # that close to the target, the CSV's rounding may tip it
            assert line.startswith("- [x] " if met else "- [ ] "), line
    build = re.search(r"feature cache build \(--freeze\): 240 images in ([\d.]+) s \((\d+) images/s", markdown)
    assert float(build.group(2)) == pytest.approx(rate("feature cache build"), abs=0.51)


def test_the_ceilings_process_forks_its_loader_workers_as_a_script_does():
    """A spawned process inherits the spawn start method: the feature build's loader workers would
    each import torch again, and the build measured half its speed."""
    pool = benchmark.fresh_process()
    pool.shutdown()
    assert pool._initializer is benchmark._start_as_a_run
    try:
        multiprocessing.set_start_method("spawn", force=True)  # what the spawned process starts with
        benchmark._start_as_a_run()
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(None, force=True)


# In this process (torch is imported already): a subprocess would spend seconds importing it.
def test_benchmark_bad_out_dir_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--out-dir", str(tmp_path / "file" / "bench")])
    with pytest.raises(SystemExit) as exit:
        exit_on_error(benchmark.main)
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: --out-dir {tmp_path / 'file' / 'bench'}: cannot create it (Not a directory)"


@pytest.mark.parametrize("argv, said", [
    (["--dropout-cost", "--arch", "resnet18"], "argument --arch: --dropout-cost does not read it, or drop it"),
    (["--dropout-cost", "--out-dir", "x"], "argument --out-dir: --dropout-cost does not read it, or drop it"),
    (["--augment-cost", "--processes", "2"], "argument --processes: --augment-cost does not read it, or drop it"),
    (["--save-cost", "--workers", "1"], "argument --workers: --save-cost does not read it, or drop it"),
    (["--worker-start", "--arch", "vgg16"], "argument --arch: --worker-start does not read it, or drop it"),
    (["--reference", "--modes", "single"], "argument --modes: --reference does not read it, or drop it"),
    (["--reference", "--steps", "3"], "argument --steps: --reference does not read it, or drop it"),
    (["--rounds", "3"], "argument --rounds: it is --reference's: add --reference, or drop it"),
    (["--workers", "2", "--modes", "single"], "argument --workers: it is --reference's: add --reference, or drop it"),
    (["--save-cost", "--dropout-cost"], "argument --save-cost: not with --dropout-cost: each is a benchmark of its own"),
])
def test_a_flag_the_chosen_benchmark_does_not_read_is_refused(argv, said, capsys):
    """--dropout-cost --arch resnet18 measured what it always measures and said nothing; two runs
    given together ran the first alone. Each run refuses a flag it does not read, in one line."""
    with pytest.raises(SystemExit) as exit:
        benchmark.parse_args(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and f"error: {said}" in err, err


def test_each_benchmark_takes_every_flag_it_reads(tmp_path):
    """What each run reads is taken beside it (the commands of docs/performance.md and
    docs/measurements.md among them)."""
    for run, flags in benchmark.ONLY_RUNS.items():
        argv = [f"--{run.replace('_', '-')}"]
        for flag in sorted(flags - ({"data_dir"} if "images" in flags else set())):  # --images: without --data-dir
            argv += {"data_dir": ["--data-dir", str(tmp_path)], "out_dir": ["--out-dir", str(tmp_path)],
                     "channels_last": ["--channels-last"], "amp": ["--amp", "bf16"], "weights": ["--weights", "none"],
                     "arch": ["--arch", "resnet18"], "image_size": ["--image-size", "64"],
                     "images": ["--images", "400"]}.get(flag, [f"--{flag.replace('_', '-')}", "2"])
        assert getattr(benchmark.parse_args(argv), run), argv


def test_benchmark_unknown_mode_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit:
        benchmark.parse_args(["--out-dir", str(tmp_path), "--modes", "single,deepspeed"])
    assert exit.value.code == 2
    assert capsys.readouterr().err.strip().endswith(
        ": error: argument --modes: unknown run 'deepspeed' (choose from single-jpeg, single, dp, ddp, ddp-sync-bn, fsdp, "
        "accelerate, freeze) (see --help)")


class SlowImages(Dataset):
    """Tiny images that take `delay` seconds each to make (a sleep: no CPU used)."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int):
        time.sleep(self.delay)
        return torch.zeros(3, 8, 8, dtype=torch.uint8), 0


class WorkerTagged(Dataset):
    """Tiny images, each labelled with the id of the loader worker that made it (-1 outside one)."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, index: int):
        info = torch.utils.data.get_worker_info()
        return torch.zeros(3, 8, 8, dtype=torch.uint8), -1 if info is None else info.id


class WorkersClock:
    """The training loader that train_single.py builds, with its real workers, on a clock of its own:
    each worker makes one batch every `seconds`, all at once, and the loader hands the batches over
    in order, so batch i arrives when its worker has made it and every batch before it has
    arrived. Which worker made a batch is read from its labels (WorkerTagged): the DataLoader's
    own dealing of batches to workers, not an assumed one."""

    def __init__(self, loader, seconds: float):
        self.loader, self.seconds, self.now, self.workers = loader, seconds, 0.0, set()

    def __getattr__(self, name: str):  # prefetch_factor, sampler, ...: the real loader's
        return getattr(self.loader, name)

    def __iter__(self):
        made = {}
        for batch in self.loader:
            worker = batch[1][0].item()
            assert (batch[1] == worker).all() and worker >= 0, batch[1]
            made[worker] = made.get(worker, 0) + 1
            self.now = max(self.now, made[worker] * self.seconds)
            self.workers.add(worker)
            yield batch


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_loader_alone_measures_a_loader_of_known_speed(monkeypatch):
    """4 workers each making a batch of 4 images every 80 ms: 200 images/s, on the loader's clock
    (WorkersClock: the script's own loader and workers, the time read from which worker made each
    batch, so no machine's speed enters). The DataLoader deals batch i to worker i % 4, and the
    batches of a round arrive at once: counting 6 batches after the prefetch queue's 8 (part of a
    round, not whole rounds) would say 24 images in 80 ms, 300 images/s; with --workers ignored
    other workers would make the batches."""
    made = []

    training_loader = benchmark.training_loader

    def loader(*args, **kwargs):
        made.append(WorkersClock(training_loader(*args, **kwargs), seconds=0.08))
        return made[-1]
    monkeypatch.setattr(benchmark, "training_loader", loader)
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: made[-1].now))
    rate = loader_alone(WorkerTagged(), batch=4, workers=4, max_batches=6)
    assert made[-1].workers == {0, 1, 2, 3}
    assert rate == pytest.approx(200, rel=1e-9)


class _InStep:
    """A loader of `workers` workers that stay in step, each making a batch of `batch` images every
    `seconds`: its round k (batches k * workers to k * workers + workers - 1) arrives at (k + 1) x
    seconds, on a clock the test reads instead of time.perf_counter."""

    def __init__(self, workers: int, batch: int, seconds: float):
        self.workers, self.batch, self.seconds, self.now = workers, batch, seconds, 0.0
        self.prefetch_factor, self.sampler = 2, SimpleNamespace(set_epoch=lambda epoch: None)

    def __iter__(self):
        for i in range(1000):
            self.now = (i // self.workers + 1) * self.seconds
            yield torch.zeros(self.batch, 1), torch.zeros(self.batch)


def test_loader_alone_counts_whole_rounds_of_workers(monkeypatch):
    """The same loader without time: 4 workers x 4 images every 80 ms is exactly 200 images/s. A
    clock over part of a round (6 batches from the 9th: two rounds' arrivals, 6 batches) would say 300."""
    loader = _InStep(workers=4, batch=4, seconds=0.08)
    monkeypatch.setattr(benchmark, "training_loader", lambda *args, **kwargs: loader)
    monkeypatch.setattr(benchmark, "time", SimpleNamespace(perf_counter=lambda: loader.now))
    assert loader_alone(list(range(100)), batch=4, workers=4, max_batches=6) == pytest.approx(200, rel=1e-9)


def test_schedule_fits_a_short_epoch():
    assert schedule_for(None) == schedule_for(10) == schedule_for(100) == (2, 2, 6)
    assert schedule_for(5) == (1, 1, 3)
    assert schedule_for(1) == (0, 0, 1)
    assert schedule_for(0) is None
    for cycles in range(1, 12):
        assert sum(schedule_for(cycles)) <= cycles


def _event(name, thread, start, end, parent=None, device=False, **extra):
    fields = dict(name=name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                  device_type=DeviceType.CUDA if device else DeviceType.CPU, is_async=False,
                  activity_type="kernel" if device else "cpu_op", id=0, linked_correlation_id=0,
                  cpu_parent=parent, device_index=0)
    return SimpleNamespace(**{**fields, **extra})


def test_breakdown_partitions_host_and_gpu_time():
    """One made-up CUDA DDP step (microseconds): backward on autograd's thread 2, NCCL on thread 3."""
    conv = _event("aten::conv2d", 1, 120, 300, id=11)
    convolution_backward = _event("autograd::engine::evaluate_function: ConvolutionBackward0", 2, 400, 600, id=12)
    optimizer = _event("Optimizer.step#SGD.step", 1, 800, 900, id=55)
    host = [
        _event("ProfilerStep*", 1, 0, 1000, id=1),
        _event("data wait", 1, 10, 110, id=2),
        conv,
        _event("c10d::broadcast_", 1, 300, 350, id=13),  # DDP's buffer broadcast in its forward
        convolution_backward,
        _event("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 2, 600, 650, id=14),
        _event("c10d::allreduce_", 2, 610, 620, id=15),
        _event("nccl:all_reduce", 3, 620, 750, id=16, is_async=True),  # in flight
        _event("torch.distributed.ddp.reducer::copy_bucket_to_grad", 2, 760, 780, id=17),
        optimizer,
    ]
    launches = [_event("cudaLaunchKernel", 1, 130, 135, conv, id=101, activity_type="cuda_runtime",
                       linked_correlation_id=11),
                _event("cudaLaunchKernel", 2, 410, 415, convolution_backward, id=102,
                       activity_type="cuda_runtime", linked_correlation_id=12)]
    kernels = [_event("sgemm", 0, 150, 450, device=True, id=101, linked_correlation_id=11),
               _event("wgrad", 0, 450, 700, device=True, id=102, linked_correlation_id=12),
               _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 630, 800, device=True, id=104),
               _event("multi_tensor_apply", 0, 820, 880, device=True, id=103, linked_correlation_id=55),
               _event("ProfilerStep#1", 0, 0, 1000, device=True, activity_type="gpu_user_annotation"),
               _event("sgemm", 0, 0, 1000, device=True, device_index=1)]
    result = breakdown(host + launches + kernels, device_index=0)
    assert result["steps"] == 1 and result["wall_seconds"] == pytest.approx(1e-3)
    expected = {"data wait": 100, "forward": 240, "backward": 270, "optimizer": 100,
                "communication": 160, "other": 130}
    assert result["host"]["seconds"] == pytest.approx({k: v / 1e6 for k, v in expected.items()})
    assert result["host"]["communication"] == pytest.approx({"broadcast": 50e-6, "all-reduce": 110e-6})
    assert result["host"]["in_flight_seconds"] == pytest.approx(130e-6)
    device = {"forward": 300, "backward": 250, "optimizer": 60, "communication": 100, "other": 0, "idle": 290}
    assert result["device"]["seconds"] == pytest.approx({k: v / 1e6 for k, v in device.items()})
    assert result["device"]["communication"] == pytest.approx({"all-reduce": 100e-6})
    assert result["device"]["in_flight_seconds"] == pytest.approx(170e-6)


def _state(args, model, optimizer, steps: int):
    """A training state as the scripts make it, for Progress."""
    from src.ema import WeightAverage
    from src.state import TrainingState
    return TrainingState(args, {}, model, optimizer, None, None, WeightAverage(model, optimizer, None), steps)


@pytest.mark.parametrize("batches, steps", [(12, 6), (4, 1)])
def test_profile_fits_the_pass(tmp_path, batches, steps):
    """Through the training loop's Steps: a pass too short for the usual schedule gets a shorter one."""
    args = defaults(profile=True, log_dir=None, checkpoint=str(tmp_path / "best.pth"), log_every=1, epochs=1,
                    accumulate=1)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(2 * batches, 4), torch.zeros(2 * batches, dtype=torch.long))
    progress = Progress(args, _state(args, model, optimizer, batches), 2, torch.device("cpu"))
    for _, (inputs, labels) in progress.training(DataLoader(data, batch_size=2), 0, torch.zeros(4)):
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    figures = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert figures["steps"] == steps and figures["host"]["seconds"]["backward"] > 0
    assert progress.profiler.done


def test_the_profile_finds_the_data_wait_the_loop_clocked(tmp_path):
    """A loader that sleeps 10 ms an image, 2 images a batch: each recorded step waits at least
    20 ms for its batch (a sleep lasts at least as long as asked, on any machine), and the
    profiler's "data wait" ranges, which src/progress.py opens inside the same clocked interval,
    hold that time but for the range's own entry and exit (microseconds a step). A renamed range
    gives 0 (the mode runs of test_watch wait about 15 ms in all: too little to tell)."""
    args = defaults(profile=True, log_dir=None, checkpoint=str(tmp_path / "best.pth"), log_every=1, epochs=1,
                    accumulate=1)
    model = torch.nn.Linear(3 * 8 * 8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    progress = Progress(args, _state(args, model, optimizer, 12), 2, torch.device("cpu"))
    loader = DataLoader(SlowImages(24, delay=0.01), batch_size=2)
    for _, (images, labels) in progress.training(loader, 0, torch.zeros(4)):
        torch.nn.functional.cross_entropy(model(images.flatten(1).float()), labels).backward()
        optimizer.step()
        optimizer.zero_grad()
    figures = json.loads((tmp_path / "profile" / "profile.json").read_text())
    clocked, profiled = figures["data_wait_by_clock_seconds"], figures["host"]["seconds"]["data wait"]
    assert figures["steps"] == 6 and clocked >= 6 * 0.02
    # Measured 0.1 to 0.4 ms apart over 0.13 s; half of it would take a 60 ms stall between the
    # clock's reading and the range's start. Kineto's timestamps are whole microseconds.
    assert 0.5 * clocked < profiled <= clocked + 1e-3


def test_profile_cut_short_by_the_end_of_the_pass(tmp_path):
    """Without the pass's length: the default schedule, and the pass ends while it records."""
    profiler = Profiler(defaults(log_dir=str(tmp_path), checkpoint="unused"), torch.device("cpu"))
    x = torch.ones(3, requires_grad=True)
    for _ in range(6):  # steps 0, 1 skipped, 2, 3 warm-up, 4, 5 recorded but not yet saved
        with torch.profiler.record_function("data wait"):
            pass
        (x * 2).sum().backward()
        profiler.step(0.0)
    profiler.finish()
    figures = json.loads((tmp_path / "profile" / "profile.json").read_text())
    assert figures["steps"] == 1  # step 4; step 5 is the loop's tail, with no training in it
    assert profiler.done


def test_the_torch_dropout_step_draws_from_the_generator_and_the_runs_step_does_not():
    """The row "bare step, torch's dropout" runs torch's own dropout (masks from the process's
    generator); the runs' per-sample dropout draws nothing from it: the ratio of the two rows is
    the price of the per-sample masks, not of nothing."""
    args = benchmark.parse_args(["--arch", "squeezenet1_1", "--image-size", "32", "--steps", "1"])
    for torch_dropout in (False, True):
        step = benchmark._step(args, torch.device("cpu"), 2, True, torch_dropout=torch_dropout)
        before = torch.get_rng_state()
        step()
        assert (not torch.equal(before, torch.get_rng_state())) == torch_dropout


def test_dropout_seconds_times_torchs_dropout_and_the_per_sample_one_alternately_on_one_thread():
    """dropout_seconds on a clock of the test's: rounds alternate torch's nn.Dropout (which draws
    from the generator) and the per-sample one, each timed around one forward and backward on one
    thread, the best round of each returned; the process's threads given back."""
    durations = iter([5.0, 3.0, 2.0, 6.0, 4.0, 1.0])  # torch's, ours, torch's, ours, ...
    now, threads, draws = [0.0], [], []

    def clock() -> float:
        threads.append(torch.get_num_threads())
        draws.append(torch.get_rng_state())
        if len(threads) % 2 == 0:  # a stop: the round's duration has passed
            now[0] += next(durations)
        return now[0]
    before = torch.get_num_threads()
    assert benchmark.dropout_seconds((4, 30), 0.5, rounds=3, clock=clock) == (2.0, 1.0)
    assert set(threads) == {1} and torch.get_num_threads() == before
    # the generator moves during torch's rounds (start, stop) only
    moved = [not torch.equal(draws[i], draws[i + 1]) for i in range(0, len(draws), 2)]
    assert moved == [True, False] * 3


def test_the_dropout_cost_table_shows_its_timings_and_counts(monkeypatch):
    """--dropout-cost's table: each shape's milliseconds and ratio those of its timings (given
    here), its check ticked where the ratio is at most 3; the stochastic-depth rows count the
    model's dropout units as torchvision's model has them, and torchvision's ops: 4 per call of a
    unit with p > 0 (torchvision's stochastic_depth: empty, bernoulli_, div_ and the product;
    nn.Dropout on a CPU the same four, ATen's _dropout_impl), the calls counted here by hooks."""
    timings = iter([(0.004, 0.002), (0.010, 0.0451)])
    monkeypatch.setattr(benchmark, "dropout_seconds", lambda shape, p, rounds: next(timings))
    monkeypatch.setattr(benchmark, "DEPTH_MODELS", ("efficientnet_b0",))
    markdown, results = benchmark.dropout_report(5)
    assert "| 50 x 4096 (VGG16's classifier) | 0.5 | 4.000 | 2.000 | 0.50 | 4 / " in markdown
    assert "| 8 x 197 x 768 (a ViT-B/16 block's activations) | 0.1 | 10.000 | 45.100 | 4.51 | 4 / " in markdown
    assert markdown.split("Checks:")[1].split() == (
        "- [x] per-sample dropout at 50 x 4096: 0.50x torch's time (target <= 3) "
        "- [ ] per-sample dropout at 8 x 197 x 768: 4.51x torch's time (target <= 3)").split()
    assert [met for _, met in results] == [True, False]
    assert "`python -m src.tools.benchmark --dropout-cost --steps 5`" in markdown

    import torchvision
    from torchvision.ops import StochasticDepth
    torch.manual_seed(0)
    plain = torchvision.models.efficientnet_b0(num_classes=2).train()
    found = [m for m in plain.modules() if isinstance(m, (torch.nn.Dropout, StochasticDepth))]
    calls = []
    for module in found:
        module.register_forward_hook(lambda module, *_: calls.append(module.p > 0))
    with torch.no_grad():
        plain(torch.randn(2, 3, 64, 64))
    row = re.search(r"^\| efficientnet_b0 \| (\d+) \| (\d+) \| (\d+) \+ (\d+) \|$", markdown, re.M)
    assert int(row.group(1)) == len(found) and int(row.group(2)) == 4 * sum(calls)


def test_the_training_loader_of_the_loader_rows_takes_the_flags_it_is_given():
    """The loader that --augment-cost (and the loader rows) measures is train_single.py's, with
    the flags given: every modern augmentation on, each image augmented and mixed with a partner
    (a soft target); without flags the images as they are, with their labels."""
    from torchvision.transforms import v2
    dataset = benchmark.InMemory(40, 16)
    split = benchmark.training_loader(dataset, 4, 0, benchmark.MODERN).dataset
    assert split.crop and isinstance(split.policy, v2.TrivialAugmentWide) and split.eraser.p == 0.25
    assert [(type(m).__name__, m.alpha) for m in split.mixer.transforms] == [("MixUp", 0.2), ("CutMix", 1.0)]
    image, target, _ = split[0]
    assert target.shape == (2,) and not torch.equal(image, dataset[split.indices[0]][0])
    plain = benchmark.training_loader(dataset, 4, 0).dataset
    assert (plain.crop, plain.policy, plain.eraser, plain.mixer) == (False, None, None, None)
    assert torch.equal(plain[0][0], dataset[plain.indices[0]][0]) and plain[0][1] == dataset[plain.indices[0]][1]


def test_augment_cpu_ms_times_each_rows_split_on_one_thread_and_keeps_its_best_round():
    """augment_cpu_ms on a clock of the test's: rounds alternate the rows, each timed around the
    same images of its split on one thread, the best round of each kept, as milliseconds per image;
    the process's threads given back."""
    rows = benchmark.AUGMENT_ROWS
    first = [1.0 + i for i in range(len(rows))]
    second = [d * (2 if i % 2 else 0.5) for i, d in enumerate(first)]  # odd rows slower in the second round
    durations, now, threads = iter(first + second), [0.0], []

    def clock() -> float:
        threads.append(torch.get_num_threads())
        if len(threads) % 2 == 0:  # a stop: the row's duration has passed
            now[0] += next(durations)
        return now[0]
    before = torch.get_num_threads()
    cpu = benchmark.augment_cpu_ms(32, 4, rounds=2, clock=clock)
    assert set(threads) == {1} and torch.get_num_threads() == before and len(threads) == 4 * len(rows)
    assert cpu == {flags: 1e3 * min(a, b) / 4 for flags, a, b in zip(rows, first, second)}


def test_the_augment_cost_table_shows_each_rows_best_rate_and_cpu_time(monkeypatch):
    """--augment-cost: each row's flags measured by loader_alone with one worker on a split of
    enough batches (its queue's 2, the counted ones and one), in rounds that alternate the rows, a
    row's best round shown as images/s; beside it augment_cpu_ms's milliseconds over 4 batches'
    images."""
    calls = []
    rates = {flags: 1000.0 / (i + 1) for i, flags in enumerate(benchmark.AUGMENT_ROWS)}

    def measured(dataset, batch, workers, flags, max_batches):
        calls.append(flags)
        assert (batch, workers, max_batches) == (10, 1, 3)
        assert int(0.8 * len(dataset)) // batch >= 2 + max_batches + 1
        assert dataset[0][0].shape == (3, 32, 32) and dataset[0][0].dtype == torch.uint8
        return rates[flags] / (1 if len(calls) <= len(rates) else 2)  # the second round slower
    monkeypatch.setattr(benchmark, "loader_alone", measured)
    cpu = {flags: 0.5 * (i + 1) for i, flags in enumerate(benchmark.AUGMENT_ROWS)}
    monkeypatch.setattr(benchmark, "augment_cpu_ms", lambda size, images: (size, images) == (32, 40) and cpu)
    markdown = benchmark.augment_report(32, 10, 3)
    assert calls == list(benchmark.AUGMENT_ROWS) * benchmark.AUGMENT_ROUNDS
    assert "| none (the loader alone) | 0.50 | 1000 |" in markdown
    assert "| `--augment --auto-augment ta_wide` | 1.50 | 333 |" in markdown
    every = " ".join(benchmark.MODERN)
    assert f"| `{every}` | 4.00 | 125 |" in markdown
    assert "`python -m src.tools.benchmark --augment-cost --image-size 32 --batch-size 10 --steps 3`" in markdown
    assert benchmark.MODERN == ("--augment", "--auto-augment", "ta_wide", "--random-erase", "0.25",
                                "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"), "issue 49's flags"
    calls.clear()
    printed = printed_by(benchmark.main, ["--augment-cost", "--image-size", "32", "--batch-size", "10", "--steps", "3"])
    assert printed == markdown, "the command prints the table, and writes nothing"


def test_save_seconds_times_the_old_save_and_the_new_one_best_of_the_rounds(tmp_path, monkeypatch):
    """save_seconds on a clock of the test's: each round times the old save (in the training
    thread, every byte hashed: src.outputs.atomic_torch_save with hashed=True), then the new one's
    wait in the training thread (CheckpointWriter.save) and its end on disk (the background write,
    not hashed, finished when the clock is read); the best round of each column; the file holds
    the state and its bytes are the file's."""
    times = iter([0.0, 5.0, 5.0, 6.0, 9.0,  # round 1: before 5, blocked 1, written 4
                  10.0, 13.0, 13.0, 15.0, 16.0])  # round 2: before 3, blocked 2, written 3
    flags, done, readings, original = [], [], [], src.outputs.atomic_torch_save

    def recorded(obj, path, hashed=False):
        flags.append(hashed)
        original(obj, path, hashed)
        done.append(hashed)

    def clock() -> float:
        readings.append(done.count(False))  # the background writes finished at this reading
        return next(times)
    monkeypatch.setattr(src.outputs, "atomic_torch_save", recorded)
    monkeypatch.setattr(src.checkpoint_writer, "atomic_torch_save", recorded)
    state = {"model": {"weight": torch.arange(1000.0)}, "step": 7}
    found = benchmark.save_seconds(state, tmp_path / "last.pth", rounds=2, clock=clock)
    assert flags == [True, False] * 2  # each round: the old save hashes, the new one's write does not
    assert readings[4] == 1 and readings[9] == 2  # "written" is read once the round's write is on disk
    path = tmp_path / "last.pth"
    assert found == {"before": 3.0, "blocked": 1.0, "written": 3.0, "bytes": path.stat().st_size}
    loaded = torch.load(path)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["weight"], state["model"]["weight"])


def test_the_save_cost_table_shows_each_checkpoint_and_the_floor_it_sets(tmp_path, monkeypatch):
    """--save-cost's table: a row for last.pth with SGD's momentum and one with the weight average
    too (the state each is saved with: the average's only in the second), each with its MB and
    seconds (given here) and the --save-every-steps at which a write (its seconds) ends within the
    steps between two saves (the step's seconds: batch / the bare step's images/s)."""
    states = []
    written = iter([5.0, 4.0])

    def save_seconds(state, path, rounds):
        states.append((state["average"] is not None, set(state["optimizer"]["state"]) != set(), rounds))
        seconds = next(written)
        return {"before": 2 * seconds, "blocked": 0.25, "written": seconds, "bytes": int(seconds * 1e6)}
    monkeypatch.setattr(benchmark, "save_seconds", save_seconds)
    monkeypatch.setattr(benchmark, "bare_step", lambda args, device, batch, train: 4.0)  # images/s
    args = benchmark.parse_args(["--save-cost", "--arch", "squeezenet1_1", "--weights", "none", "--batch-size", "8",
                                 "--steps", "3", "--out-dir", str(tmp_path)])
    markdown = benchmark.save_cost_report(args, tmp_path)
    assert states == [(False, True, 3), (True, True, 3)]
    assert "batch 8: 2.00 s" in markdown
    assert "| SGD | 5 | 10.00 | 0.250 | 5.00 | 3 |" in markdown
    assert "| SGD and --ema-decay | 4 | 8.00 | 0.250 | 4.00 | 2 |" in markdown
    assert not (tmp_path / "save-cost").exists()


def test_the_worker_start_table_shows_the_first_pass_and_the_median_of_the_later_ones(tmp_path, monkeypatch):
    """--worker-start's table: per data path (JPEG, cache) and way of starting the workers, the
    first pass's seconds to the first batch, and the median of the later passes' seconds and
    images/s (worker_start's figures, given here: 4 passes, the later three in no order, their
    median neither the first nor the smallest); each measured with the sizes it was asked for."""
    import statistics
    calls, figures = [], {}
    for number, (kind, start) in enumerate((kind, start) for kind in ("JPEG", "cache")
                                           for start in benchmark.WORKER_STARTS):
        first = [5.0 + number, 0.9 + number, 0.3 + number, 0.6 + number]
        rates = [10.0 + number, 400.0 + number, 100.0 + number, 250.0 + number]
        figures[kind, start] = {"first": first, "rates": rates}

    def worker_start(start, kind, data_dir, cache_dir, size, batch, workers, passes):
        calls.append((kind, start))
        assert (data_dir, cache_dir, size, batch, workers, passes) == (tmp_path, tmp_path / "cache", 32, 8, 2, 4)
        return figures[kind, start]
    monkeypatch.setattr(benchmark, "worker_start", worker_start)
    monkeypatch.setattr(benchmark, "labelled_images", lambda data_dir, size, show_progress: (data_dir, size))
    monkeypatch.setattr(benchmark, "cached", lambda images, size, cache_dir, workers, show_progress: None)
    markdown = benchmark.worker_start_report(tmp_path, tmp_path / "cache", 32, 8, 2, 4,
                                             run=lambda function, *args: function(*args))
    assert calls == list(figures)
    rows = [line for line in markdown.splitlines() if line.startswith(("| JPEG |", "| cache |"))]
    assert len(rows) == len(figures)
    for row, ((kind, start), found) in zip(rows, figures.items()):
        later, rates = found["first"][1:], found["rates"][1:]
        assert statistics.median(later) not in (found["first"][0], min(later))
        assert row == (f"| {kind} | {start} | {found['first'][0]:.2f} | {statistics.median(later):.2f} "
                       f"| {statistics.median(rates):.0f} |")
    assert "4 passes" in markdown and "2 workers, batch 8, 32 px" in markdown


def _reference_table(printed: str) -> dict[str, list[str]]:
    """--reference's table rows by their first cell: the other cells."""
    rows = [line.strip("|").split("|") for line in printed.splitlines() if line.startswith("| ") and ", round " in line]
    return {cells[0].strip(): [cell.strip() for cell in cells[1:]] for cells in rows}


@pytest.mark.slow  # trains both legs in fresh processes: 17 s, a third of make test-fast
def test_the_reference_runs_train_single_and_the_plain_loop_on_the_same_images(small_data, tmp_path, capsys):
    """--reference: one round of the plain loop of imagenet/main.py and train_single.py --augment, each a
    fresh process over the same copy of the data: both train on the training split's whole batches
    (190 of its 192 images at batch 10), train_single.py with --augment, each run's table row is its
    own figures (history.json's, the plain loop's JSON line), and the CPU columns hold what /proc
    saw of the training process and of its loader worker."""
    data = tmp_path / "data"
    shutil.copytree(small_data, data)  # the benchmark writes train.csv into it
    out = tmp_path / "bench"
    argv = ["--reference", "--data-dir", str(data), "--out-dir", str(out), "--arch", "resnet18", "--image-size", "32",
            "--batch-size", "10", "--epochs", "1", "--workers", "1", "--rounds", "1"]
    with torch.random.fork_rng():
        printed = printed_by(benchmark.main, argv)
    rows = _reference_table(printed)
    assert list(rows) == ["plain loop, round 1", "train_single.py --augment, round 1"], printed
    runs = out / "runs" / "reference"
    plain = json.loads((runs / "plain-loop-1" / "log.txt").read_text().strip().splitlines()[-1])
    ours = history(runs / "train_single-1")[-1]
    assert plain["train_images"] == ours["train_samples"] == 190
    assert json.loads((runs / "train_single-1" / "best.json").read_text())["flags"]["augment"] is True
    for name, (images, seconds) in {"plain loop, round 1": (plain["train_images"], plain["train_seconds"]),
                                    "train_single.py --augment, round 1": (ours["train_samples"],
                                                                           ours["train_seconds"])}.items():
        cells = rows[name]
        assert int(cells[0]) == images and float(cells[1]) == pytest.approx(images / seconds, abs=0.006)
        assert float(cells[4]) > 0 and float(cells[5]) > 0  # the training process's CPU, the worker's
    assert "x the plain loop's images/s (target >= 1)" in printed


def test_the_reference_alternates_the_runs_and_compares_the_best_of_each(monkeypatch, tmp_path, capsys):
    """Two rounds run the plain loop, train_single.py, train_single.py, the plain loop; the check
    compares the best images/s of each (figures given: 10 and 12 for the plain loop, 11 and 9
    for train_single.py: 11 / 12 = 0.92, not met); the CPU columns are per training image."""
    order = []
    given = {"plain loop": [10.0, 12.0], "train_single.py --augment": [11.0, 9.0]}

    def reference_run(leg, args, data_dir, out):
        order.append((leg, out.name))
        return {"leg": leg, "images": 100, "images_per_s": given[leg].pop(0), "data_wait": 0.5, "wall": 30.0,
                "main_cpu": 25.0, "other_cpu": 5.0}
    monkeypatch.setattr(benchmark, "reference_run", reference_run)
    args = benchmark.parse_args(["--reference", "--rounds", "2", "--workers", "2", "--out-dir", str(tmp_path)])
    printed = benchmark.reference_report(args, tmp_path / "data")
    assert order == [("plain loop", "plain-loop-1"), ("train_single.py --augment", "train_single-1"),
                     ("train_single.py --augment", "train_single-2"), ("plain loop", "plain-loop-2")]
    rows = _reference_table(printed)
    assert rows["plain loop, round 2"][1] == "12.00" and rows["train_single.py --augment, round 2"][1] == "9.00"
    assert rows["plain loop, round 1"][4:6] == ["0.2500", "0.0500"]
    assert "- [ ] train_single.py --augment trains at 0.92x the plain loop's images/s (target >= 1)" in printed


SPINNER = """
import os, subprocess, sys, time
def spin(seconds):
    start = time.process_time()
    while time.process_time() - start < seconds:
        pass
if sys.argv[1] == "root":
    child = subprocess.Popen([sys.executable, __file__, "child"])
    spin(0.3)
    child.wait()
    time.sleep(1)  # for the last look
else:
    spin(0.6)
    time.sleep(1)
"""


def test_tree_cpu_adds_up_the_root_and_the_processes_below_it(tmp_path):
    """A process that spins 0.3 s of CPU and starts one that spins 0.6 s, each then sleeping for a
    look: what TreeCPU saw of each, the root's apart, is at least that (by /proc, which counts in
    clock ticks), and the root's is not the child's."""
    script = tmp_path / "spin.py"
    script.write_text(SPINNER)
    cpu = benchmark.TreeCPU()
    run_script("spinner", [sys.executable, str(script), "root"], tmp_path / "out", watch=cpu)
    root, below = cpu.read()
    assert 0.3 <= root < 0.6 <= below
