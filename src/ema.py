"""--ema-decay: an exponential moving average (EMA) of the weights, updated after every optimizer step.

    average = decay_t x average + (1 - decay_t) x weights,   decay_t = min(D, (1 + t) / (10 + t))

where t counts the updates before this one. The warm-up (timm's ModelEmaV2 and torchvision's
references start from the weights too; the (1 + t) / (10 + t) ramp is TensorFlow's
ExponentialMovingAverage with num_updates): early on the average follows the weights closely,
instead of holding the initial weights for ~1 / (1 - D) steps, which on a short fine-tune is most
of the run. Only parameters are averaged. Buffers (batch norm's running statistics) are the
model's own at every moment, that is copied, as timm and torchvision do: the statistics are
already running averages, of the activations of the weights that produced them.

It hangs on the optimizer (a step post-hook): it updates exactly when the optimizer steps, once
per optimizer step, never per micro-batch, also under accelerate, which steps the optimizer
itself; a step that the fp16 scaler skips updates nothing, in every mode alike: the scaler does
not call a plain optimizer's step then, and a fused one's (on a GPU) it calls anyway, with the
skip in `optimizer.found_inf` on the device, which weighs and counts the update there. Under FSDP each
rank averages its own shards (DTensors), with no collective; the whole average is gathered only
when it is saved, like the weights.
"""
import contextlib
from typing import Callable, Iterator, TypeVar, overload

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from src.checkpoint_writer import Later

T = TypeVar("T")


@overload
def decay_at(updates: int, decay: float) -> float: ...
@overload
def decay_at(updates: torch.Tensor, decay: float) -> torch.Tensor: ...
def decay_at(updates: int | torch.Tensor, decay: float) -> float | torch.Tensor:
    """The decay of the update after `updates` earlier ones (a number, or a tensor on the device)."""
    ratio = (1 + updates) / (10 + updates)
    return ratio.clamp(max=decay) if isinstance(ratio, torch.Tensor) else min(decay, ratio)


class WeightAverage:
    """The EMA of model's parameters. Off (decay None): holds nothing, updates nothing, validates
    nothing (validate and state_dict return None)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, decay: float | None):
        self.model, self.decay, self.updates = model, decay, 0
        self.skipped: torch.Tensor | None = None  # on the device: the updates among `updates` whose step the fp16 scaler skipped
        self.params = [p for p in model.parameters()] if decay else []
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]
        if decay:
            optimizer.register_step_post_hook(lambda stepped, *_: self.update(getattr(stepped, "found_inf", None)))

    @property
    def on(self) -> bool:
        return bool(self.decay)

    @torch.no_grad()
    def update(self, found_inf: torch.Tensor | None = None) -> None:
        """average <- average + (1 - decay_t) x (weights - average); no host synchronisation.

        found_inf: what the fp16 scaler hands a fused optimizer whose step it calls also when it
        skips it (nonzero then); the decay and the weight are then computed on the device, in
        float64 as the host computes them, and a skipped step adds nothing and is not counted."""
        if self.decay is None:  # off: no hook calls it
            return
        if found_inf is None and self.skipped is None:
            torch._foreach_lerp_(self.average, [p.detach() for p in self.params], 1 - decay_at(self.updates, self.decay))
        else:
            skip = (found_inf if found_inf is not None else torch.zeros(())).to(
                self.average[0].device, torch.float64).clamp(max=1)
            if self.skipped is None:
                self.skipped = torch.zeros((), dtype=torch.float64, device=skip.device)
            t = self.updates - self.skipped
            weight = (1 - decay_at(t, self.decay)) * (1 - skip)
            cast = {dtype: weight.to(dtype) for dtype in {a.dtype for a in self.average}}
            torch._foreach_lerp_(_local(self.average), _local([p.detach() for p in self.params]),
                                 [cast[a.dtype] for a in self.average])
            self.skipped += skip
        self.updates += 1

    def count(self) -> int:
        """The updates taken, skipped steps left out (reads the device: call it when saving)."""
        return self.updates - (0 if self.skipped is None else round(self.skipped.item()))

    def counted(self) -> "int | Later":
        """count() without reading the device: where the skipped updates are counted on it, a Later
        that the checkpoint's writer makes the count (src.checkpoint_writer)."""
        if self.skipped is None:
            return self.updates
        updates = self.updates
        return Later(self.skipped, lambda skipped: updates - round(skipped.item()))

    def validate(self, run: Callable[[], T]) -> T | None:
        """run() with the average in the model (the validation of it), or None when off."""
        if not self.on:
            return None
        with self.swapped_in():
            return run()

    def state_dict(self) -> dict | None:
        """{"model": the average as a whole state_dict on the CPU (with the model's buffers),
        "updates": how many}, or None when off. Under FSDP use src.fsdp.gather_state."""
        if not self.on:
            return None
        with self.swapped_in():
            return {"model": {key: value.to("cpu", copy=True) for key, value in self.model.state_dict().items()},
                    "updates": self.count()}

    def held(self) -> dict | None:
        """state_dict()'s content as the device holds it, for a writer that copies it without
        making the host wait (src.checkpoint_writer: a step checkpoint): the average's own tensors
        in place of the parameters in the model's state_dict, its buffers the model's; no swap, no
        copy. None when off."""
        if not self.on:
            return None
        average = {id(param): tensor for param, tensor in zip(self.params, self.average)}
        return {"model": {key: average.get(id(value), value).detach()
                          for key, value in self.model.state_dict(keep_vars=True).items()},
                "updates": self.counted()}

    def load(self, model, saved: dict) -> None:
        """The average of a last.pth (state_dict's) into this one, through model.load_state_dict
        (the plain model, or fsdp.WholeModel for FSDP's shards); every rank loads it."""
        if not self.on:
            return
        with self.swapped_in():
            model.load_state_dict(saved["model"])
        self.updates, self.skipped = int(saved["updates"]), None

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model holds the average instead of its weights inside the block (to validate or
        save it; under FSDP each rank swaps its own shards); its weights are back afterwards.
        Whatever the block writes into the parameters becomes the average (resume loads it so)."""
        if not self.on:
            raise RuntimeError("no weight average: --ema-decay is off")
        self._swap()
        try:
            yield
        finally:
            self._swap()

    @torch.no_grad()
    def _swap(self) -> None:
        """Exchange the parameters' values with the average's, one tensor at a time (at most one
        parameter's worth of memory more).

        FSDP gathers a unit's whole weights from the shards before its forward, and frees them
        after, except the root's, which stay gathered after a forward without backward (as in
        validation): the next forward would run them and not the shards swapped here. So every
        FSDP module drops its gathered weights first (reshard(): local, no collective)."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
        for param, average in zip(self.params, self.average):
            held = param.detach().clone()
            param.detach().copy_(average)
            average.copy_(held)


def _local(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """FSDP's DTensors as this rank's shards (the same storage): a device weight tensor, which is
    no DTensor, cannot meet a DTensor in one foreach call."""
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
