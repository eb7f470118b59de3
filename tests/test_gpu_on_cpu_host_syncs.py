"""No host synchronisation inside a training step, checked on the CPU: no tensor built from Python
values and nothing read back in a step (with the GPU's fused optimizer, AS_ON_GPU=1), channels-last
batches through the loop, and accelerate's loader copying without blocking."""
import pytest
import torch
import torch.nn as nn
from conftest import HostReads, HostWaits, mode_run, script_loader, script_pass

import train_dp
import train_single
from src.cli import parse_args
from src.dropout import per_sample
from src.ema import WeightAverage
from src.loaders import Data
from src.progress import Progress
from src.recipe import make_optimizer, make_schedule
from src.state import TrainingState


class _ReadsInBackward(torch.autograd.Function):
    """The control: a backward that reads a tensor on the host three ways."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        float(grad.sum()), grad.sum().item(), grad[grad > 0]
        return grad


class _Watched:
    """A loader whose batches 2 to n-1 run under the given modes: the steps, not the epoch's end."""

    def __init__(self, loader, *modes):
        self.loader, self.modes = loader, modes

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i == 2:
                for mode in self.modes:
                    mode.__enter__()
            if i == len(self.loader) - 1:
                for mode in reversed(self.modes):
                    mode.__exit__(None, None, None)
            yield batch


class _ReadingLayer(nn.Module):
    """The control's layer: its backward reads a tensor on the host (_ReadsInBackward)."""

    def forward(self, x):
        return _ReadsInBackward.apply(x)


@pytest.mark.parametrize("amp, control", [([], False), (["--amp", "fp16"], False), ([], True)])
def test_no_tensor_is_built_from_python_values_inside_a_step(amp, control, monkeypatch, stop_signals):
    """normalize()'s statistics and batch_sums()'s count were built with torch.tensor(..., device)
    at every batch: on a GPU each is a blocking copy. Steps 3 and on of train_single.py's loop,
    with every recipe flag, build none and read nothing back, in the forward, the backward
    (HostReads, a dispatch mode: autograd runs the backward without function modes, which HostWaits
    is) and the optimizer step. With --amp fp16 and the GPU's fused optimizer (AS_ON_GPU=1), the
    gradient scaler's inf check stays a tensor too (the plain optimizer's path reads it with
    .item() at every step). The stop check after each step (a world of one: a Python flag) reads
    nothing either. The control: a layer whose backward reads a tensor is seen there."""
    monkeypatch.setenv("AS_ON_GPU", "1")
    args = parse_args("", ["--batch-size", "4", "--log-every", "1000", "--augment", "--label-smoothing",
                           "0.1", "--clip-grad-norm", "1", "--lr-schedule", "cosine", "--accumulate", "2",
                           "--weight-decay", "0.01", *amp])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.5),
                          nn.Linear(4, 2), *([_ReadingLayer()] if control else []))
    model = per_sample(model)
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(64)]
    loader = script_loader(train_single, dataset, args)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, 8)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")
    state = TrainingState(args, {}, model, optimizer, scaler, schedule, WeightAverage(model, optimizer, None), 8)
    state.save_step = lambda sums: pytest.fail("no step checkpoint asked for")
    waits, reads = HostWaits(), HostReads()
    with state.stop_signals():
        script_pass(train_single, model, _Watched(loader, waits, reads), args, optimizer, scaler, schedule, state=state)
    assert schedule.last_epoch == 8
    if control:  # each watched micro-batch's backward (the 3rd to the 15th of 16): its three reads
        assert len(reads.calls) == 3 * (len(loader) - 3), reads.calls
        return
    assert waits.calls == [] and reads.calls == []


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
