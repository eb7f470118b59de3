"""The GPU's fused optimizers, run on the CPU (AS_ON_GPU=1 takes the GPU's branch of
src.devices.gpu_choices): fp16 with skipped steps in the real training loops, the schedule at a
skipped step, a backbone unfrozen after its head, and resuming a CPU checkpoint (or one of
another memory format) under fused kernels."""
import contextlib
import math

import pytest
import torch
import torch.nn as nn
from conftest import (
    TOLERANCE,
    distance,
    history,
    last_model,
    outputs,
    printed_by,
    shared_dataset,
    weights,
)

import train_accelerate
import train_single
from src.checkpoint import load_last, run_info
from src.cli import parse_args
from src.history import RECORD_KEYS
from src.outputs import atomic_torch_save
from src.recipe import lr_factor, make_optimizer, make_schedule, optimizer_step

# The GPU's choices on the CPU. AS_ON_GPU=1 makes src.devices.gpu_choices take the CUDA branch
# (fused SGD and AdamW, which torch also has for the CPU), and fp16_as_on_cuda makes accelerate
# autocast and scale fp16 on the CPU as it does on CUDA. The hooks' OVERFLOW_AT skips steps 1
# and 3 of 5, the way an fp16 overflow does, and torch.empty_like hands out NaN: uninitialised
# memory cannot pass for zeros. The runs train in this process (no torch import to pay for).


FP16_RUN = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "32", "--dropout", "0",
            "--workers", "0", "--val-fraction", "0.1667", "--epochs", "1", "--lr", "0.01",
            "--batch-size", "2", "--lr-schedule", "cosine", "--weight-decay", "0.01"]  # 12 images: 10 train, 2 validation
SKIPPED = {1, 3}
STEPS = 5


def _nan_empty_like(empty_like):
    def poisoned(*args, **kwargs):
        tensor = empty_like(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor
    return poisoned


# A history record with every field, as --resume wants it (src.history.RECORD_KEYS).
RECORD = {key: 1 for key in RECORD_KEYS}


@pytest.fixture(scope="module")
def fp16_runs(request, tmp_path_factory):
    """fp16_runs(script, as_on_gpu, *flags): the output folder of an fp16 run of FP16_RUN (train_single.py
    --amp fp16, train_accelerate.py under --mixed_precision fp16) with steps 1 and 3 skipped; made once."""
    from accelerate.state import AcceleratorState
    from hooks.sitecustomize import fp16_as_on_cuda, overflowing
    data = shared_dataset(request, "tiny", n_train=12, n_test=0, size=32, seed=3)
    made = {}

    def train(script, as_on_gpu: str, *flags: str):
        key = (script.__name__, as_on_gpu, flags)
        if key not in made:
            out = tmp_path_factory.mktemp(f"fp16-{script.__name__}")
            amp = ["--amp", "fp16"] if script is train_single else []
            argv = ["--data-dir", str(data), *FP16_RUN, *amp, *flags, *outputs(out)]
            with pytest.MonkeyPatch.context() as patch, torch.random.fork_rng(), _kept_numerics():
                patch.setenv("AS_ON_GPU", as_on_gpu)
                patch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what accelerate launch --mixed_precision sets
                patch.setattr(torch, "empty_like", _nan_empty_like(torch.empty_like))
                for name, function in zip(("_unscale_grads_", "step"), overflowing(torch.amp.GradScaler, SKIPPED)):
                    patch.setattr(torch.amp.GradScaler, name, function)
                patch.setattr(train_accelerate, "Accelerator", fp16_as_on_cuda(train_accelerate.Accelerator))
                AcceleratorState._reset_state(reset_partial_state=True)
                try:
                    printed_by(script.main, argv)
                finally:
                    AcceleratorState._reset_state(reset_partial_state=True)
            made[key] = out
        return made[key]
    return train


@contextlib.contextmanager
def _kept_numerics():
    """Gives torch's global numerics settings back (a script's main() sets them)."""
    backends = torch.backends
    saved = (torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
             backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = saved[1:3]
        backends.cudnn.benchmark, backends.cudnn.deterministic = saved[3:]


def _kernels(out) -> set:
    return {group["fused"] for group in weights(out, "last.pth")["optimizer"]["param_groups"]}


def _far(fp16_runs, *flags) -> float:
    """The plain optimizer's run against the same with another global batch (1 instead of 2)."""
    return distance(last_model(fp16_runs(train_single, "0", *flags)),
                    last_model(fp16_runs(train_single, "0", *flags, "--batch-size", "1")))


@pytest.mark.parametrize("script", [train_single, train_accelerate])
def test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does(fp16_runs, script):
    """Fused SGD made its missing momentum buffers with empty_like and wrote nothing into them at
    a skipped step: the next step read garbage (here NaN). Given zeros first, it takes the steps
    of plain SGD, in train_single.py's loop and in accelerate's: the two kernels differ in the
    order of their float operations only, as the modes do (TOLERANCE of another global batch)."""
    plain, fused = fp16_runs(script, "0"), fp16_runs(script, "1")
    assert _kernels(plain) == {False} and _kernels(fused) == {True}
    for out in (plain, fused):
        assert weights(out, "last.pth")["scaler"]["scale"] == 2.0 ** 16 / 4  # steps 1 and 3 skipped
    assert distance(last_model(fused), last_model(plain)) / _far(fp16_runs) < TOLERANCE


def test_fp16_with_the_gpus_fused_adamw_ends_where_plain_adamw_does(fp16_runs):
    """Fused AdamW takes a skipped step off its step count, and ends where plain AdamW does."""
    adamw = ["--optimizer", "adamw", "--lr", "0.001"]
    plain, fused = (fp16_runs(train_single, gpu, *adamw) for gpu in "01")
    far = _far(fp16_runs, *adamw)
    assert _kernels(fused) == {True}
    last = weights(fused, "last.pth")
    skipped = math.log2(2.0 ** 16 / last["scaler"]["scale"])  # the scale halves at each
    assert skipped >= len(SKIPPED)
    assert {float(state["step"]) for state in last["optimizer"]["state"].values()} == {STEPS - skipped}
    assert distance(last_model(fused), last_model(plain)) / far < TOLERANCE


def test_the_weight_average_leaves_out_the_steps_the_scaler_skips_under_fused_sgd(fp16_runs):
    """--ema-decay hangs on the optimizer's step. The scaler does not call plain SGD's step at a
    skipped step, but calls a fused optimizer's anyway (its kernel skips on the device): the
    average must then add nothing and not count the step, as with plain SGD, and end where it does."""
    plain, fused = (weights(fp16_runs(train_single, gpu, "--ema-decay", "0.9"), "last.pth") for gpu in "01")
    assert {group["fused"] for group in fused["optimizer"]["param_groups"]} == {True}
    assert fused["scaler"]["scale"] == plain["scaler"]["scale"] == 2.0 ** 16 / 4  # steps 1 and 3 skipped
    assert plain["average"]["updates"] == fused["average"]["updates"] == STEPS - len(SKIPPED)
    assert distance(fused["average"]["model"], plain["average"]["model"]) / _far(fp16_runs) < TOLERANCE


@pytest.mark.parametrize("script", [train_single, train_accelerate])
def test_the_schedule_advances_at_every_optimizer_step_also_a_skipped_one(fp16_runs, script):
    """The one rule of every mode: the learning rate is that of the step count, skipped steps
    included. accelerate knows of the skips here (plain SGD: the scaler does not call its step) and
    would hold its prepared schedule back at each; train_accelerate.py steps its own."""
    out = fp16_runs(script, "0")
    last = weights(out, "last.pth")
    assert last["scaler"]["scale"] == 2.0 ** 16 / 4
    assert last["schedule"]["last_epoch"] == STEPS
    # After the epoch: the rate of step 5 of 5, the end of the cosine (3 steps in: 0.35 of --lr).
    assert [record["lr"] for record in history(out)] == pytest.approx([0.01 * lr_factor(STEPS, STEPS, 0, "cosine")])


def test_optimizer_step_advances_the_schedule_when_the_scaler_skips():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.full((1, 2), float("inf"))).sum()).backward()
    before = model.weight.detach().clone()
    optimizer_step(model, optimizer, scaler, schedule, None)
    assert torch.equal(model.weight, before) and scaler.get_scale() == 2.0 ** 15  # skipped
    assert schedule.last_epoch == 1


@pytest.mark.parametrize("device, switch", [("cuda", None), ("cpu", "1")])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_fused_optimizers_survive_a_skipped_first_step(optimizer, device, switch, monkeypatch):
    """make_optimizer for a GPU (or the CPU with AS_ON_GPU=1) gives fused kernels; an inf at the
    first step, then two finite steps, end where the plain optimizer ends. empty_like hands out
    NaN: fused SGD's buffers made at the skipped step would be NaN without their zeros."""
    monkeypatch.setattr(torch, "empty_like", _nan_empty_like(torch.empty_like))
    args = parse_args("", ["--optimizer", optimizer, "--lr", "0.1", "--weight-decay", "0.01"])
    ends = []
    for kind, choose in (("plain", "0"), (device, switch)):
        if choose is None:
            monkeypatch.delenv("AS_ON_GPU", raising=False)
        else:
            monkeypatch.setenv("AS_ON_GPU", choose)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
        opt = make_optimizer(model, args, torch.device("cpu" if kind == "plain" else device))
        assert opt.defaults["fused"] == (kind != "plain")
        scaler = torch.amp.GradScaler("cpu")
        for scale in (float("inf"), 1.0, 1.0):
            scaler.scale(model(torch.ones(2, 3)).sum() * scale).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    # The kernels differ in the order of their float operations (a few float32 roundings).
    assert ends[1].isfinite().all() and torch.allclose(ends[0], ends[1], rtol=1e-5, atol=1e-7)


def test_fused_sgd_takes_a_backbone_unfrozen_after_its_head_trained(monkeypatch):
    """--freeze-epochs: the head has momentum buffers when the backbone gets its first gradient,
    and fused SGD takes a group's buffers as all set or all missing (it raised a TypeError)."""
    ends = []
    for choose in ("0", "1"):
        monkeypatch.setenv("AS_ON_GPU", choose)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        args = parse_args("", ["--lr", "0.1", "--freeze-epochs", "1", "--epochs", "2"])
        optimizer = make_optimizer(model, args, torch.device("cpu"))
        for step in range(4):
            model[0].requires_grad_(step >= 2)  # frozen for two steps
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        ends.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.allclose(*ends, rtol=1e-5, atol=1e-7)


def test_resume_places_a_cpu_checkpoints_adamw_state_for_fused_adamw(tmp_path, monkeypatch):
    """load_state_dict places AdamW's step tensors by the saved groups' flags: a CPU run's stayed
    on the CPU under fused AdamW on a GPU, which refuses them at the first step. The meta device
    stands in for the GPU."""
    args = parse_args("", ["--optimizer", "adamw", "--resume", "--epochs", "2", *outputs(tmp_path)])
    info = run_info(args, 50, "digest")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    schedule = make_schedule(optimizer, args, 1)
    atomic_torch_save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": {},
                       "schedule": schedule.state_dict(), "epoch": 1, "history": [RECORD], "info": info},
                      tmp_path / "last.pth")
    monkeypatch.setenv("AS_ON_GPU", "1")
    gpu_model = nn.Linear(4, 2).to("meta")
    fused = make_optimizer(gpu_model, args, torch.device("meta"))
    assert load_last(args, info, gpu_model, fused, None, make_schedule(fused, args, 1)).history == [RECORD]
    assert [group["fused"] for group in fused.param_groups] == [True, True]
    assert {state["step"].device.type for state in fused.state.values()} == {"meta"}


def test_a_resume_with_another_memory_format_gives_the_optimizer_state_the_weights_layout(tmp_path):
    """--channels-last may change across a resume; CUDA's fused kernels refuse momentum and weights
    in different layouts, so each state tensor takes its parameter's."""
    torch.manual_seed(0)
    saved_model = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    args = parse_args("", ["--resume", *outputs(tmp_path)])
    saving = make_optimizer(saved_model, args, torch.device("cpu"))
    saved_model(torch.randn(2, 3, 5, 5)).sum().backward()
    saving.step()
    model = nn.Conv2d(3, 4, 3)  # contiguous this time
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    from src.checkpoint import load_optimizer
    load_optimizer(optimizer, saving.state_dict())
    buffer = optimizer.state[model.weight]["momentum_buffer"]
    assert buffer.stride() == model.weight.stride() and not saving.state[saved_model.weight][
        "momentum_buffer"].is_contiguous()
    assert torch.equal(buffer, saving.state[saved_model.weight]["momentum_buffer"])
