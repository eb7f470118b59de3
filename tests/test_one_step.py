"""One optimizer step of each script's own train_epoch, against the same step computed here by hand:
the loss (label smoothing), gradient accumulation, clipping, weight decay (SGD and AdamW) and a
frozen backbone. The modes are compared with each other elsewhere (test_modes, test_recipe); a
mistake in src/ that all four share passes those and fails these.

Every case is one global batch of N images, so one optimizer step: SGD's momentum buffer starts as
that step's gradient (update = lr x gradient), and AdamW's bias-corrected first step moves each
weight by lr x g / (|g| + eps). The script and the hand computation do the same float32
operations, in a different order at most: they agree to a few float32 roundings of the values
(within 1e-5 relative, 1e-6 absolute), while each feature changes the update by a tenth of it or more.
"""
import copy
import importlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from conftest import fails_in_process, script_loader, script_pass, shard_as_train_fsdp
from torch.distributed.tensor import DTensor

from src.cli import parse_args
from src.data_parallel import AutocastDataParallel
from src.freeze import set_frozen
from src.recipe import make_optimizer, make_schedule

N, LR = 8, 0.1
SCRIPTS = ["single", "dp", "ddp", "fsdp", "accelerate"]
# ImageNet's statistics, as torchvision documents them (src/transforms.py holds the same numbers).
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)


def _model(backbone_modes: bool = False) -> nn.Module:
    """Weights (ndim 2 and 4) and biases; its last Linear is the head. backbone_modes: with batch
    norm and dropout, whose training mode the frozen case must switch off (elsewhere their batch
    statistics and random masks would be the script's own, not the hand computation's)."""
    torch.manual_seed(0)
    if backbone_modes:
        return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Dropout(0.5), nn.Linear(4, 2))
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randint(0, 256, (N, 3, 8, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    return images, torch.tensor([0, 1] * (N // 2))


def script_step(script: str, model: nn.Module, *argv: str, frozen: bool = False,
                mixed_precision: str = "no") -> nn.Module:
    """train_epoch of train_{script}.py over one epoch of N images (one optimizer step) on model,
    wrapped as the script wraps it; returns model, trained. mixed_precision: accelerate's setting
    (what `accelerate launch --mixed_precision` passes it; the other scripts take --amp)."""
    args = parse_args("", ["--lr", str(LR), "--workers", "0", "--log-every", "1000", *argv])
    args.batch_size = N // args.accumulate
    images, labels = _batch()
    dataset = [(images[i], int(labels[i])) for i in range(N)]
    module = importlib.import_module(f"train_{script}")
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    schedule = make_schedule(optimizer, args, 1)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp == "fp16")  # as the scripts make it
    if script == "single":
        script_pass(module, model, script_loader(module, dataset, args), args, optimizer, scaler, schedule, frozen=frozen)
    elif script == "dp":
        script_pass(module, AutocastDataParallel(model), script_loader(module, dataset, args), args, optimizer, scaler,
                    schedule, model=model, frozen=frozen)
    elif script == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            script_pass(module, DDP(model), script_loader(module, dataset, args), args, optimizer, scaler, schedule,
                        model=model, frozen=frozen)
        finally:
            dist.destroy_process_group()
    elif script == "fsdp":  # a world of one: the script's own steps on the sharded model
        plain = copy.deepcopy(model)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            shard_as_train_fsdp(model, device)  # before the optimizer, as the script does
            optimizer = make_optimizer(model, args, device)
            schedule = make_schedule(optimizer, args, 1)
            script_pass(module, model, script_loader(module, dataset, args), args, optimizer, scaler, schedule,
                        frozen=frozen)
            plain.load_state_dict({key: value.full_tensor() if isinstance(value, DTensor) else value
                                   for key, value in model.state_dict().items()})
        finally:
            dist.destroy_process_group()
        model = plain
    else:
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DataLoaderConfiguration
        accelerator = Accelerator(gradient_accumulation_steps=args.accumulate, step_scheduler_with_optimizer=False,
                                  mixed_precision=mixed_precision,
                                  dataloader_config=DataLoaderConfiguration(split_batches=True))
        try:
            loader = script_loader(module, dataset, args)
            net, loader = accelerator.prepare(model, loader)
            prepared = accelerator.prepare(optimizer)
            script_pass(module, net, loader, args, prepared, accelerator.scaler, schedule, model=model,
                        frozen=frozen, accelerator=accelerator)
        finally:
            AcceleratorState._reset_state(True)  # the next Accelerator() starts from nothing
            GradientState._reset_state()
    assert schedule.last_epoch == 1, "one optimizer step"
    return model


def hand_step(model: nn.Module, smoothing: float = 0.0, clip: float | None = None, weight_decay: float = 0.0,
              optimizer: str = "sgd", frozen: bool = False) -> dict:
    """The state_dict after one step, from the textbook formulas."""
    model = copy.deepcopy(model)
    images, labels = _batch()
    x = (images.float() / 255 - MEAN) / STD
    backbone, head = model[:-1], model[-1]
    model.train(not frozen)
    logp = F.log_softmax(head(backbone(x)), dim=1)
    # Label smoothing: the target puts 1 - s on the label and s spread evenly over the 2 classes.
    loss = ((1 - smoothing) * -logp[torch.arange(N), labels] + smoothing * -logp.mean(dim=1)).mean()
    params = [p for p in (head if frozen else model).parameters()]
    grads = torch.autograd.grad(loss, params)
    if clip is not None:
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        assert norm > clip, "the case must clip"
        grads = [g * clip / norm for g in grads]
    with torch.no_grad():
        for p, g in zip(params, grads):
            decay = weight_decay if p.ndim > 1 else 0.0  # never on biases and normalisation weights
            if optimizer == "sgd":  # L2: the decay joins the gradient
                p -= LR * (g + decay * p)
            else:  # AdamW: decoupled decay; the first step is lr * g / (|g| + eps)
                p.mul_(1 - LR * decay).sub_(LR * g / (g.abs() + 1e-8))
    return model.state_dict()


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in got:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda text: f"{key}: {text}")


CASES = {
    "plain": ([], {}),
    "label-smoothing": (["--label-smoothing", "0.3"], {"smoothing": 0.3}),
    "clip": (["--clip-grad-norm", "0.01"], {"clip": 0.01}),
    "weight-decay": (["--weight-decay", "0.5"], {"weight_decay": 0.5}),
    "adamw": (["--optimizer", "adamw", "--weight-decay", "0.5"], {"optimizer": "adamw", "weight_decay": 0.5}),
    "accumulate": (["--accumulate", "2"], {}),  # two micro-batches of 4: the gradient of all 8
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("script", SCRIPTS)
def test_one_step_is_the_hand_computed_step(script, case):
    argv, formula = CASES[case]
    start = _model()
    want = hand_step(start, **formula)
    got = script_step(script, copy.deepcopy(start), *argv).state_dict()
    _same(got, want)
    assert not torch.equal(got["0.weight"], start.state_dict()["0.weight"]), "it trained"


@pytest.mark.parametrize("script", ["single", "accelerate"])  # single, dp and ddp share optimizer_step
def test_clipping_moves_the_weights_by_lr_times_the_norm(script):
    """SGD's first step moves the weights by lr x the clipped gradient: its norm is lr x --clip-grad-norm."""
    start = _model()
    got = script_step(script, copy.deepcopy(start), "--clip-grad-norm", "0.01").state_dict()
    moved = torch.sqrt(sum(((got[k] - v) ** 2).sum() for k, v in start.state_dict().items()
                           if k.endswith(("weight", "bias"))))
    assert moved.item() == pytest.approx(LR * 0.01, rel=1e-4)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_frozen_stage_trains_the_head_alone_with_the_backbone_in_eval_mode(script, optimizer):
    """set_frozen, then the frozen stage's train_epoch: the backbone's weights and batch-norm
    statistics stay as they were (weight decay on, so an optimizer that decayed a parameter without
    a gradient would move it), and the head takes the step computed with the backbone in eval mode
    (dropout off, the running statistics used)."""
    start = _model(backbone_modes=True)
    with torch.no_grad():  # running statistics other than the initial ones, so eval mode shows
        start[1].running_mean.uniform_(-1, 1)
        start[1].running_var.uniform_(0.5, 2)
    want = hand_step(start, weight_decay=0.5, optimizer=optimizer, frozen=True)
    model = copy.deepcopy(start)
    set_frozen(model, True)
    assert [name for name, p in model.named_parameters() if p.requires_grad] == ["6.weight", "6.bias"]
    got = script_step(script, model, "--weight-decay", "0.5", "--optimizer", optimizer, frozen=True).state_dict()
    for key, tensor in start.state_dict().items():
        if not key.startswith("6."):
            assert torch.equal(got[key], tensor), key
    _same(got, want)


@pytest.mark.parametrize("script, amp, dtype", [
    *[(script, "bf16", torch.bfloat16) for script in SCRIPTS],
    # accelerate does not autocast to float16 on a CPU: train_accelerate.py refuses it (below).
    *[(script, "fp16", torch.float16) for script in ("single", "dp", "ddp", "fsdp")]])
def test_amp_runs_the_forward_in_its_dtype_and_keeps_float32_weights(script, amp, dtype):
    """Whatever the CPU does inside a kernel, autocast hands the convolution and the head their
    inputs and takes their outputs in --amp's dtype (accelerate: its --mixed_precision); the
    weights stay float32. Without it, float32."""
    for setting, expected in (("no", torch.float32), (amp, dtype)):
        model = _model()
        seen = []
        for layer in (model[0], model[-1]):
            layer.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
        if script == "accelerate":
            script_step(script, model, mixed_precision=setting)
        else:
            script_step(script, model, "--amp", setting)
        assert seen and set(seen) == {expected}, setting
        assert all(p.dtype == torch.float32 for p in model.parameters())


def test_accelerate_with_fp16_on_a_cpu_is_refused(exact_data, tmp_path, monkeypatch, capsys):
    """accelerate on a CPU runs --mixed_precision fp16 in float32 (no autocast, no scaler) while
    saying fp16: train_accelerate.py stops before any work instead."""
    from accelerate.state import AcceleratorState, GradientState

    import train_accelerate
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")  # what `accelerate launch --mixed_precision fp16` sets
    try:
        # A small model and no download: had it not refused, the run would end 0 in seconds.
        fails_in_process(train_accelerate.main, ["--data-dir", str(exact_data), "--arch", "squeezenet1_1", "--weights",
                                                 "none", "--image-size", "32", "--workers", "0",
                                                 "--checkpoint", str(tmp_path / "best.pth"), "--plot", str(tmp_path / "c.png")],
                         monkeypatch, capsys, "--mixed_precision fp16: accelerate does not autocast to float16 on a cpu")
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert not (tmp_path / "best.pth").exists()
