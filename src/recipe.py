"""The training recipe the five scripts share: optimizer, learning-rate schedule and the
optimizer step (gradient clipping and the fp16 gradient scaler act once per step, after the
micro-batches of --accumulate).

Every piece counts optimizer steps, never processes or micro-batches, so each mode takes the
same steps with the same learning rates.
"""
import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from src.config import Config
from src.devices import gpu_choices


def make_optimizer(model: nn.Module, args: Config, device: torch.device) -> torch.optim.Optimizer:
    """--optimizer over every parameter; weight decay on weights, not on biases or normalisation.

    Frozen parameters (--freeze) are in it too but get no gradient, and the optimizers skip a
    parameter without one: no state, no update, no weight decay, until it is unfrozen.
    """
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": args.weight_decay},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    # On GPUs the fused kernels are faster, and they take the fp16 scaler's inf check as a tensor
    # where the plain ones read it on the host: one synchronisation per step less. Not SGD's for
    # FSDP's sharded parameters: torch 2.14.1 has no DTensor version of it (AdamW's it has).
    sharded = any(isinstance(p, DTensor) for p in params)
    fused = gpu_choices(device) and not (sharded and args.optimizer == "sgd")
    if args.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=args.lr, fused=fused)
    optimizer = torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, fused=fused)
    optimizer.register_step_pre_hook(zero_momentum)
    return optimizer


def zero_momentum(optimizer: torch.optim.Optimizer, args=None, kwargs=None) -> None:
    """Before each SGD step: a zero momentum buffer for each parameter about to be stepped that has none.

    Fused SGD makes missing buffers with torch.empty_like and leaves their filling to its kernel,
    which writes nothing on a step the fp16 scaler skips: the garbage would be kept and read at
    the next step (torch/optim/sgd.py, _fused_sgd). Zeros give the same first step (momentum x 0
    + gradient, dampening being 0), and let fused SGD take a group whose buffers are partly set
    (--freeze-epochs: the head's are, the backbone's not yet). A step pre-hook rather than a line
    in optimizer_step: accelerate steps the optimizer itself.
    """
    for group in optimizer.param_groups:
        if group["momentum"]:
            for p in group["params"]:
                if p.grad is not None and "momentum_buffer" not in optimizer.state[p]:
                    # preserve_format: the fused kernel wants the strides of the gradient (channels-last)
                    optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def steps_per_epoch(train_images: int, global_batch: int) -> int:
    """Optimizer steps in an epoch: the last incomplete global batch is dropped in every mode."""
    return train_images // global_batch


def lr_factor(step: int, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """The learning rate of optimizer step `step` (from 0) as a fraction of --lr."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if schedule == "step":
        return 0.1 ** ((progress >= 0.5) + (progress >= 0.75))
    return 1.0


def make_schedule(optimizer: torch.optim.Optimizer, args: Config,
                  steps: int) -> LambdaLR:
    """--lr-schedule with --warmup-epochs, stepped once per optimizer step; `steps` per epoch."""
    total, warmup = args.epochs * steps, round(args.warmup_epochs * steps)
    return LambdaLR(optimizer, lambda step: lr_factor(step, total, warmup, args.lr_schedule))


def optimizer_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   schedule: LambdaLR, clip_grad_norm: float | None) -> None:
    """Apply the accumulated gradients: clip their norm, step, update the fp16 scale, schedule.

    The schedule advances at every optimizer step, also one the fp16 scaler skipped, in every
    mode (train_accelerate.py does the same): the learning rate is a function of the step count,
    the same in every mode, precision and device and across --resume. Knowing about a skip would
    cost a host read of the scaler's inf check at every step.
    """
    if clip_grad_norm:
        scaler.unscale_(optimizer)  # clip the true gradients, not the fp16-scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    schedule.step()
