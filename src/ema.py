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
itself; a step that the fp16 scaler skips updates nothing, in every mode alike. Under FSDP each
rank averages its own shards (DTensors), with no collective; the whole average is gathered only
when it is saved, like the weights.
"""
import contextlib
from typing import Callable, Iterator, TypeVar

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

T = TypeVar("T")


def decay_at(updates: int, decay: float) -> float:
    """The decay of the update after `updates` earlier ones."""
    return min(decay, (1 + updates) / (10 + updates))


class WeightAverage:
    """The EMA of model's parameters. Off (decay None): holds nothing, updates nothing, validates
    nothing (validate and state_dict return None)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, decay: float | None):
        self.model, self.decay, self.updates = model, decay, 0
        self.params = [p for p in model.parameters()] if decay else []
        with torch.no_grad():
            self.average = [p.detach().clone() for p in self.params]
        if decay:
            optimizer.register_step_post_hook(lambda *_: self.update())

    @property
    def on(self) -> bool:
        return bool(self.decay)

    @torch.no_grad()
    def update(self) -> None:
        """average <- average + (1 - decay_t) x (weights - average); no host synchronisation."""
        weight = 1 - decay_at(self.updates, self.decay)
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], weight)
        self.updates += 1

    def validate(self, run: Callable[[], T]) -> T | None:
        """run() with the average in the model (the validation of it), or None when off."""
        if not self.on:
            return None
        with self.swapped_in():
            return run()

    def state_dict(self) -> dict | None:
        """{"model": the average as a whole state_dict on the CPU (with the model's buffers),
        "updates": how many}, or None when off. Under FSDP use src.full_state.gather_state."""
        if not self.on:
            return None
        with self.swapped_in():
            return {"model": {key: value.to("cpu", copy=True) for key, value in self.model.state_dict().items()},
                    "updates": self.updates}

    def load(self, model, saved: dict) -> None:
        """The average of a last.pth (state_dict's) into this one, through model.load_state_dict
        (the plain model, or full_state.WholeModel for FSDP's shards); every rank loads it."""
        if not self.on:
            return
        with self.swapped_in():
            model.load_state_dict(saved["model"])
        self.updates = int(saved["updates"])

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
