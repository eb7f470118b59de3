"""--ema-decay (src/ema.py): the average against a hand computation, updated once per optimizer
step (not per micro-batch, not on a step the fp16 scaler skips), swapped in and out exactly,
saved and picked for best.pth by --best-by; in every mode, the full recipe's runs (conftest's
RECIPE, with --accumulate) keep the same average (tests/test_recipe.py compares them)."""
import json

import pytest
import torch
import torch.nn as nn
from conftest import MICRO, PROCESSES, recipe_run, weights

from src.cli import defaults
from src.ema import WeightAverage, decay_at
from src.history import best_choice
from src.state import TrainingState


def test_the_decay_warms_up_then_holds():
    assert [decay_at(t, 0.999) for t in (0, 1, 8, 10)] == pytest.approx([1 / 10, 2 / 11, 9 / 18, 11 / 20])
    assert decay_at(10_000, 0.999) == 0.999 and decay_at(10_000, 0.9) == 0.9


def test_the_average_is_the_hand_computed_recursion_of_the_steps():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, optimizer, 0.5)
    expected = [p.detach().clone() for p in model.parameters()]
    for t in range(4):
        model(torch.randn(5, 3)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        d = min(0.5, (1 + t) / (10 + t))
        expected = [d * e + (1 - d) * p.detach() for e, p in zip(expected, model.parameters())]
    assert average.updates == 4
    for got, want in zip(average.average, expected):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7)


def test_a_step_the_fp16_scaler_skips_updates_nothing():
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, optimizer, 0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
    scaler.scale(model(torch.full((1, 3), float("inf"))).sum()).backward()  # inf gradients: the step is skipped
    scaler.step(optimizer)
    assert scaler._found_inf_per_device(optimizer)
    assert average.updates == 0


def test_swapped_in_holds_the_average_and_gives_the_weights_back_exactly():
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, optimizer, 0.9)
    weights_before = [p.detach().clone() for p in model.parameters()]
    average.average = [torch.randn_like(p) for p in average.average]
    held = [a.clone() for a in average.average]
    with average.swapped_in():
        assert all(torch.equal(p, a) for p, a in zip(model.parameters(), held))
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights_before))
    assert all(torch.equal(a, h) for a, h in zip(average.average, held))
    saved = average.state_dict()
    assert torch.equal(saved["model"]["weight"], held[0]) and saved["updates"] == 0


def test_off_it_holds_updates_and_validates_nothing():
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, optimizer, None)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    assert (average.updates, average.average, average.state_dict(), average.validate(lambda: 1)) == (0, [], None, None)


def _record(epoch, acc, loss, acc_ema, loss_ema):
    return {"epoch": epoch, "val_acc": acc, "val_log_loss": loss, "val_loss": loss,
            "val_acc_ema": acc_ema, "val_log_loss_ema": loss_ema, "val_loss_ema": loss_ema}


def test_best_pth_holds_the_average_when_it_validates_better(tmp_path):
    """Epoch 1: the weights win; epoch 2: the average beats everything so far; epoch 3: neither
    beats epoch 2's average. best.pth and best.json follow, and last.pth keeps the average."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    average = WeightAverage(model, optimizer, 0.9)
    average.average = [torch.full_like(p, 7.0) for p in average.average]
    args = defaults(checkpoint=str(tmp_path / "best.pth"), plot=str(tmp_path / "c.png"), best_by="val_acc")
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    state = TrainingState(args, {"arch": "x"}, model, optimizer, None, schedule, average, 1)
    picked = []
    for record in (_record(1, 0.8, 0.5, 0.7, 0.6), _record(2, 0.8, 0.5, 0.9, 0.3), _record(3, 0.85, 0.4, 0.8, 0.4)):
        is_best = state.save_epoch({**record, "train_loss": 0, "train_acc": 0})
        info = json.loads((tmp_path / "best.json").read_text())
        picked.append((is_best, info["epoch"], info["weights"]))
    assert picked == [(True, 1, "weights"), (True, 2, "average"), (False, 2, "average")]
    assert torch.equal(weights(tmp_path)["weight"], torch.full((2, 2), 7.0))
    assert best_choice(state.history, "val_acc")[1] == "average"
    last = weights(tmp_path, "last.pth")
    assert torch.equal(last["average"]["model"]["weight"], torch.full((2, 2), 7.0))
    assert torch.equal(last["model"]["weight"], model.weight.detach())


@pytest.mark.parametrize("mode", ["single", "ddp", "accelerate"])
def test_the_average_is_updated_once_per_optimizer_step_with_accumulate(mode, runs):
    """The full recipe's runs take 2 optimizer steps an epoch (2 epochs) in micro-batches of
    MICRO[mode] (--accumulate 2 or 4): the average counts 4 updates, not one per micro-batch,
    and differs from the weights."""
    out = recipe_run(runs, mode)[0]
    last = weights(out, "last.pth")
    batch, accumulate = MICRO[mode]
    assert batch * PROCESSES[mode] * accumulate == 40 and accumulate > 1
    assert last["average"]["updates"] == last["schedule"]["last_epoch"] == 4
    moved = sum((last["average"]["model"][k] - last["model"][k]).abs().sum() for k in last["model"])
    assert moved > 0


def test_a_step_the_fp16_scaler_skips_inside_a_fused_kernel_changes_nothing():
    """found_inf, what the scaler hands a fused optimizer whose step it calls also when it skips it:
    1 leaves the average and its count as they were; 0 updates it as the host's arithmetic does
    (an average updated only at the steps taken, to float rounding)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # never stepped: update() is called here
    on_device, on_host = WeightAverage(model, optimizer, 0.9), WeightAverage(model, optimizer, 0.9)
    for found in (0.0, 1.0, 0.0, 1.0, 1.0, 0.0):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        before = [a.clone() for a in on_device.average]
        on_device.update(torch.tensor(found))
        if found:
            assert all(torch.equal(a, b) for a, b in zip(on_device.average, before))
        else:
            on_host.update()
        # The two lerps differ at most in float32 rounding of the weight's product: a few units of
        # float32's epsilon of the largest operand per update, over at most 3 updates taken.
        bound = 3 * 4 * torch.finfo(torch.float32).eps * max(t.abs().max().item() for t in [*model.parameters(), *on_host.average])
        assert all(torch.allclose(a, b, rtol=0, atol=bound) for a, b in zip(on_device.average, on_host.average))
    assert on_device.count() == on_host.count() == 3
    assert not all(torch.equal(a, b) for a, b in zip(on_device.average, [p.detach() for p in model.parameters()]))
