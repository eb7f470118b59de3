"""Watching a run: TensorBoard event files from rank 0 alone (accelerate through its own tracker),
the time spent waiting for data, the progress bars, and --profile in all four scripts."""
import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from conftest import history, mode_run, outputs, recipe_run, script_loader, script_pass
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train_single
from src.cli import parse_args
from src.profiling import CATEGORIES
from src.recipe import make_optimizer, make_schedule

# The EXACT runs: 100 training images in batches of 20, 5 optimizer steps an epoch, 2 epochs,
# --log-every 2: step scalars after steps 2, 4 and 5 of each epoch (the last step always reports).
STEPS = [2, 4, 5, 7, 9, 10]


def _events(folder: Path) -> tuple[list[Path], EventAccumulator]:
    files = sorted(folder.rglob("events.out.tfevents.*"))
    assert files, f"no event file under {folder}"
    accumulator = EventAccumulator(str(files[0].parent))
    accumulator.Reload()
    return files, accumulator


@pytest.mark.parametrize("mode", ["single", "dp", "ddp", "accelerate"])
def test_tensorboard_holds_the_step_and_epoch_scalars_from_rank_0_only(mode, runs):
    out, _ = mode_run(runs, mode)
    files, events = _events(out.parent / "tensorboard")
    assert len(files) == 1, f"one writer: {files}"
    if mode == "accelerate":  # accelerate's TensorBoard tracker: a run folder named by init_trackers
        assert files[0].parent.name == "train_accelerate"
    records = history(out)
    tags = set(events.Tags()["scalars"])
    for field in records[0]:
        if field != "epoch":
            scalars = events.Scalars(f"epoch/{field}")
            assert [s.step for s in scalars] == [1, 2], field
            assert [s.value for s in scalars] == pytest.approx([r[field] for r in records], rel=1e-6), field
    assert [s.step for s in events.Scalars("step/loss")] == STEPS
    assert [s.step for s in events.Scalars("step/lr")] == STEPS
    assert [s.value for s in events.Scalars("step/lr")] == pytest.approx([0.001] * 6)
    # images/s between two reports of a pass: two an epoch
    assert [s.step for s in events.Scalars("step/images_per_s")] == [4, 5, 9, 10]
    assert all(s.value > 0 for s in events.Scalars("step/images_per_s"))
    assert all(0.3 < s.value < 1.5 for s in events.Scalars("step/loss"))
    assert tags == {f"epoch/{f}" for f in records[0] if f != "epoch"} | {"step/loss", "step/lr", "step/images_per_s"}


def test_tensorboard_counts_optimizer_steps_under_accumulate(runs):
    """FSDP's full-recipe run of test_fsdp.py: 2 micro-batches of 10 per rank a step, a global
    batch of 40, so 2 optimizer steps an epoch (80 of the 100 training images; 4 micro-batches per
    rank), --log-every 10: one step report an epoch, after its last step, at optimizer steps 2 and 4
    (micro-batches would give 4 and 6), each with the learning rate that step left, which
    history.json records at the epoch's end."""
    out, _ = recipe_run(runs, "fsdp", "--log-dir", "{run}/tensorboard", "--profile", env={"COPY_LAST": "{run}/copies"})
    _, events = _events(out.parent / "tensorboard")
    records = history(out)
    assert [r["train_samples"] for r in records] == [80, 80]
    assert [s.step for s in events.Scalars("step/loss")] == [2, 4]
    lrs = events.Scalars("step/lr")
    assert [s.step for s in lrs] == [2, 4]
    assert [s.value for s in lrs] == pytest.approx([r["lr"] for r in records], rel=1e-6)
    assert [s.step for s in events.Scalars("epoch/lr")] == [1, 2]


def test_log_every_counts_optimizer_steps_not_micro_batches(tmp_path):
    """--accumulate 2 --log-every 1 over 3 optimizer steps (6 micro-batches) of train_single.py's
    epoch: one step report after each optimizer step, at steps 1, 2 and 3 (a report after each
    micro-batch would give 0, 1, 1, 2, 2, 3), as the tracker of --track receives them. The recipe
    run above logs every 10 steps of an epoch of 2: its only reports are the epochs' last either way."""
    from src.ema import WeightAverage
    from src.state import TrainingState
    args = parse_args("", ["--batch-size", "2", "--accumulate", "2", "--log-every", "1", *outputs(tmp_path)])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(12)]
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    schedule = make_schedule(optimizer, args, 3)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainingState(args, {}, model, optimizer, scaler, schedule, WeightAverage(model, optimizer, None), 3)

    class Recorded:  # the tracker's side of the step metrics
        def __init__(self):
            self.steps = []

        def log_step(self, values: dict, step: int) -> None:
            self.steps.append(step)
    state.tracker = tracker = Recorded()
    script_pass(train_single, model, script_loader(train_single, dataset, args), args, optimizer, scaler, schedule,
                state=state)
    assert tracker.steps == [1, 2, 3]


def _shown(stderr: str, epoch: int) -> dict[int, tuple[float, float | None]]:
    """{batch: (loss, img/s)} as the training bar of `epoch` last drew them at that batch: a report
    sets the bar's figures right after its batch (set_postfix redraws at once), and they stay until
    the next report."""
    shown = {}
    for drawn in stderr.splitlines():  # a bar redraws after a carriage return: a line of its own here
        found = re.search(rf"^epoch {epoch}/2 train: .* (\d+)/5 \[.*, loss=([^,\]]+)(?:, img/s=([^\]]+))?\]$",
                          drawn.strip())
        if found:
            batch, loss, rate = found.groups()
            shown[int(batch)] = (float(loss), None if rate is None else float(rate))
    return shown


@pytest.mark.parametrize("mode", ["single", "dp"])
def test_the_progress_bar_shows_the_recent_loss_and_images_per_second(mode, runs):
    """The bar shows what TensorBoard records at each report (to the 3 significant digits of the
    loss and the whole images/s it prints), and each report's loss is the mean over the
    micro-batches since the one before: weighted by their images they make the epoch's train_loss
    (one process: its sums are all the samples; under a launcher they are rank 0's)."""
    out, result = mode_run(runs, mode)
    _, events = _events(out.parent / "tensorboard")
    losses = {s.step: s.value for s in events.Scalars("step/loss")}
    rates = {s.step: s.value for s in events.Scalars("step/images_per_s")}
    for epoch, record in enumerate(history(out), 1):
        steps = [step for step in STEPS if 5 * (epoch - 1) < step <= 5 * epoch]
        shown = _shown(result.stderr, epoch)
        assert min(shown) == steps[0] - 5 * (epoch - 1), "no figures before the first report"
        for step in steps:
            loss, rate = shown[step - 5 * (epoch - 1)]
            # Half a unit of the last digit shown, and TensorBoard's float32 rounding.
            assert abs(loss - losses[step]) <= 0.5e-2 * 10 ** math.floor(math.log10(losses[step])) * 1.001
            assert (rate is None) == (step not in rates)
            assert rate is None or abs(rate - rates[step]) <= 0.501
        images = [20 * (step - before) for before, step in zip([5 * (epoch - 1)] + steps, steps)]
        assert sum(images) == record["train_samples"] == 100
        assert sum(n * losses[step] for n, step in zip(images, steps)) / 100 == pytest.approx(
            record["train_loss"], rel=1e-5)


def test_data_wait_grows_with_a_slow_loader_while_the_model_time_does_not(runs):
    """50 ms more for each image (SLOW_ITEM, a sleep, in the loop's own process: --workers 0):
    the 100 training images' sleeps, at least 5 s on any machine, are all inside the data wait,
    and the model's share of the epoch (train_seconds - data_wait_seconds) does not take them. The
    two runs may be made under other loads (the test runner's other worker): the model's time
    (0.22 s in a plain run here, 0.27 s in the slow one) would have to grow tenfold to fail this."""
    normal = history(mode_run(runs, "single")[0])[0]
    slow = history(runs.exact("single", epochs=1, env={"SLOW_ITEM": "0.05"})[0])[0]
    injected = 100 * 0.05
    assert slow["data_wait_seconds"] >= injected
    model_time = [r["train_seconds"] - r["data_wait_seconds"] for r in (normal, slow)]
    assert model_time[1] < model_time[0] + injected / 2, model_time
    assert normal["data_wait_seconds"] < 0.5 * normal["train_seconds"]


@pytest.mark.parametrize("mode", ["single", "dp", "ddp", "accelerate"])
def test_profile_writes_a_trace_and_the_table(runs, mode):
    """--profile on the mode runs: with 5 steps an epoch the profile is shortened to fit
    (src/profiling.py schedule_for): two steps recorded."""
    out, result = mode_run(runs, mode)
    folder = out.parent / "tensorboard" / "profile"
    trace = json.loads((folder / "rank0.pt.trace.json").read_text())
    assert any(event.get("name", "").startswith("ProfilerStep#") for event in trace["traceEvents"])
    table = (folder / "profile.md").read_text()
    for category in CATEGORIES:
        assert f"| {category} | " in table
    assert table.split("\n\n")[1] in result.stdout  # printed by rank 0, once
    assert result.stdout.count("| where the time went |") == 1
    assert "gpuGetDeviceCount" not in result.stderr + result.stdout  # kineto kept quiet without a GPU
    figures = json.loads((folder / "profile.json").read_text())
    assert figures["steps"] == 2 and figures["world_size"] == (2 if mode in ("ddp", "accelerate") else 1)
    seconds = figures["host"]["seconds"]
    assert sum(seconds.values()) == pytest.approx(figures["wall_seconds"], rel=1e-6)
    assert seconds["forward"] > 0 and seconds["backward"] > 0 and seconds["optimizer"] > 0
    # The profiler's "data wait" ranges lie inside the loop's own clocked intervals (whole
    # microseconds in the trace), and are not empty: each step decodes its images (--workers 0).
    # How close the two are: test_benchmark.py, with a loader slow enough to tell.
    assert 0 < seconds["data wait"] <= figures["data_wait_by_clock_seconds"] + 1e-3
    if mode in ("ddp", "accelerate"):
        assert figures["host"]["communication"]["all-reduce"] > 0
        assert "| - all-reduce | " in table and "gloo collectives were in flight" in table
    else:
        assert seconds["communication"] == 0


def test_images_per_second_are_the_images_since_the_last_report_over_its_seconds(tmp_path):
    """A report after micro-batch 6 of --accumulate 2, the one before after micro-batch 4 at 2.5 s
    earlier: the images counted in the sums since then (16: two micro-batches of 8 images) over
    2.5 s, and the loss over those images, at optimizer step 3."""
    from tqdm import tqdm

    from src.metrics import COUNT, LOSS
    from src.progress import Progress
    from src.state import TrainingState
    args = parse_args("", ["--batch-size", "8", "--accumulate", "2", *outputs(tmp_path)])
    model = nn.Linear(1, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.25)
    state = TrainingState(args, {}, model, optimizer, None, None, None, 5)
    logged = []
    progress = Progress(args, state, 8, torch.device("cpu"), log=lambda values, step: logged.append((step, values)))
    before = torch.tensor([5.0, 20.0, 32.0, 4.0])
    now = torch.tensor([9.0, 30.0, 48.0, 6.0])
    progress._report(tqdm(disable=True), now, 6, 12.5, (before, 4, 10.0), 0)
    images = (now - before)[COUNT].item()
    assert logged == [(3, {"step/loss": (now - before)[LOSS].item() / images, "step/images_per_s": images / 2.5,
                           "step/lr": 0.25})]
