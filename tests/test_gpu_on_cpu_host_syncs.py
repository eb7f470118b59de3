"""No host synchronisation inside a training step, checked on the CPU: no tensor built from Python
values and nothing read back in a step (with the GPU's fused optimizer, AS_ON_GPU=1), channels-last
batches through the loop, and accelerate's loader copying without blocking."""
import traceback

import pytest
import torch
import torch.nn as nn
from conftest import mode_run, script_loader, script_pass
from torch.overrides import TorchFunctionMode

import train_dp
import train_single
from src.cli import parse_args
from src.ema import WeightAverage
from src.loaders import Data
from src.progress import Progress
from src.recipe import make_optimizer, make_schedule
from src.state import TrainingState


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
def test_no_tensor_is_built_from_python_values_inside_a_step(amp, monkeypatch, stop_signals):
    """normalize()'s statistics and batch_sums()'s count were built with torch.tensor(..., device)
    at every batch: on a GPU each is a blocking copy. Steps 3 and on of train_single.py's loop,
    with every recipe flag, build none and read nothing back. With --amp fp16 and the GPU's fused
    optimizer (AS_ON_GPU=1), the gradient scaler's inf check stays a tensor too (the plain
    optimizer's path reads it with .item() at every step). The stop check after each step (a
    world of one: a Python flag) reads nothing either."""
    monkeypatch.setenv("AS_ON_GPU", "1")
    args = parse_args("", ["--batch-size", "4", "--log-every", "1000", "--augment", "--label-smoothing",
                           "0.1", "--clip-grad-norm", "1", "--lr-schedule", "cosine", "--accumulate", "2",
                           "--weight-decay", "0.01", *amp])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(64)]
    loader = script_loader(train_single, dataset, args)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, 8)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
    state = TrainingState(args, {}, model, optimizer, scaler, schedule, WeightAverage(model, optimizer, None), 8)
    state.save_step = lambda sums: pytest.fail("no step checkpoint asked for")
    mode = HostWaits()
    with state.stop_signals():
        script_pass(train_single, model, _Watched(loader, mode), args, optimizer, scaler, schedule, state=state)
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
        data = Data(dataset, list(range(8)), list(range(8)), "")
        device = torch.device("cpu")
        loader = script.loaders(dataset, data, args, device)[1]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainingState(args, {}, model, optimizer, None, None, WeightAverage(model, optimizer, None), 2)
        script.evaluate(model, loader, "val", Progress(args, state, 4, device), args, device)
    assert seen == [False, False, True, True]


def test_accelerate_copies_batches_without_blocking(runs):
    """accelerate's prepared loader blocks on each copy unless non_blocking is set."""
    out, _ = mode_run(runs, "accelerate")
    log = (out.parent / "accelerator.log").read_text().split("\n")
    assert sorted(log[:2]) == ["0 split_batches=True non_blocking=True", "1 split_batches=True non_blocking=True"]
