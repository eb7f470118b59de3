"""The bytes of parameters, gradients and optimizer state that a rank holds: FSDP's line at the end
of a run ("rank 0 held ... of the ... MB that each DDP process holds"), which src/progress.py's
Progress watches for whenever the parameters are sharded. Sizes only: no device is waited for.
"""
import torch
from torch.distributed.tensor import DTensor


def parameters_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter the optimizer holds: every parameter of the model (src/recipe.py's
    make_optimizer takes them all, frozen ones too)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def is_sharded(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer's parameters are FSDP's shards (DTensors)."""
    return optimizer is not None and any(isinstance(p, DTensor) for p in parameters_of(optimizer))


def rank_bytes(optimizer: torch.optim.Optimizer, whole: bool = False) -> dict[str, int]:
    """The bytes of the optimizer's parameters, their gradients and its state that this rank
    holds: the local shards of a sharded model (a DTensor's to_local()), every tensor of a plain
    one; whole: the whole tensors of a sharded model, what each DDP rank holds. Call it after an
    optimizer step and before zero_grad, when all three exist."""
    def size(tensor: torch.Tensor) -> int:
        counted = tensor.to_local() if isinstance(tensor, DTensor) and not whole else tensor
        return counted.numel() * counted.element_size()
    params = parameters_of(optimizer)
    return {"parameters": sum(map(size, params)),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(value) for state in optimizer.state.values() for value in state.values()
                             if torch.is_tensor(value) and value.dim() > 0)}


def watch_rank_bytes(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """A dict that every optimizer step updates, at the step that held the most, with this rank's
    bytes ("rank": rank_bytes) and the whole model's ("whole")."""
    held = {"rank": {}, "whole": {}}

    def after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        now = rank_bytes(optimizer)
        if sum(now.values()) > sum(held["rank"].values()):
            held.update(rank=now, whole=rank_bytes(optimizer, whole=True))
    optimizer.register_step_post_hook(after_step)
    return held


def bytes_line(held: dict[str, dict[str, int]]) -> str:
    """What watch_rank_bytes saw, in one line."""
    if not held["rank"]:
        return "no optimizer step was taken: nothing to say about the memory of the shards"
    mine, whole = sum(held["rank"].values()), sum(held["whole"].values())
    parts = " + ".join(f"{value / 1e6:.1f} MB of {name.replace('optimizer', 'optimizer state')}"
                       for name, value in held["rank"].items())
    return (f"rank 0 held {mine / 1e6:.1f} MB at its fullest optimizer step ({parts}): "
            f"{mine / whole:.3f} of the {whole / 1e6:.1f} MB that each DDP process holds")
