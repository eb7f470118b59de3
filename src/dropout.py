"""Dropout drawn per training sample: the same masks in every mode, at every process count.

torch's dropout draws its masks from the generator of the process (and GPU) that runs it, in the
order of the batch it holds: two DDP processes of B images and one process of 2B images draw
different masks for the same sample, and so train different models. Here the mask of a sample is
a function of its key alone, and the key of a training sample is derive_seed(seed, epoch, its
index in the data set, DROPOUT): whichever process, GPU, DataParallel replica or micro-batch holds
it, in a resumed or restarted run too, on a CPU or a GPU.

The mechanism is a counter-based hash computed with tensor ops on the device: for element j of
unit u (the model's u-th dropout layer) of a sample with key k, the bits are
mix(mix(k_low ^ mix(k_high ^ u)) ^ mix(j + GOLDEN)), where mix is a 32-bit integer finaliser
(Wellons' lowbias32: xor-shifts and two multiplications) done in int64 arithmetic that never
overflows. The element is kept when its top 24 bits are at least p x 2^24, and scaled by 1 / (1 - p)
as torch's dropout scales it. Why a hash rather than masks made on the host and carried with the
batch: the masks have the shape of a layer's input, known only inside the model, and for VGG16
they would be 2 x 4096 values per image to move each step; the keys are one int64 per image, and
the hash costs a few elementwise ops per element, on the device, with no host synchronisation.

torchvision's stochastic depth (StochasticDepth, mode "row": EfficientNet, ConvNeXt, Swin, MaxViT)
drops a whole residual branch per sample, drawn the same way (element 0 of its unit). The
modules keep their class names' behaviour in evaluation (the input unchanged), their
probabilities and their (empty) state: best.pth is a plain torchvision state_dict.
"""
import math
import weakref

import torch
import torch.nn as nn
from torchvision.ops import StochasticDepth

from src.seeds import derive_seed

DROPOUT = 1  # the stream of derive_seed that dropout keys come from (augmentation's: src/augment.py)
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # offsets the element counter, so that element 0 does not hash to 0
_BITS = 24  # the resolution of the keep test: p is rounded up to a multiple of 2^-24


def sample_key(seed: int, epoch: int, index: int) -> int:
    """The dropout key of the data set's sample `index` in `epoch`: 63 bits, as an int64 holds them."""
    return derive_seed(seed, epoch, index, DROPOUT)


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h x c) mod 2^32 for int64 h in [0, 2^32): c in two 16-bit halves, so no product reaches 2^63."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def mix(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Chris Wellons' hash prospector): a bijection of [0, 2^32) whose output bits each
    depend on every input bit; h is int64 holding values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def keep_bits(keys: torch.Tensor, unit: int, elements: int) -> torch.Tensor:
    """(samples, elements) int64 values in [0, 2^24): the draw of each element of each sample."""
    per_sample = mix((keys & _M32) ^ mix((keys >> 32) ^ unit))
    per_element = mix((torch.arange(elements, device=keys.device) + _GOLDEN) & _M32)
    return mix(per_sample[:, None] ^ per_element[None, :]) >> (32 - _BITS)


def _threshold(p: float) -> int:
    """Elements whose draw is below this are dropped: p x 2^24, rounded up."""
    return math.ceil(p * (1 << _BITS))


def _keys_for(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    keys = getattr(module, "samples", None)
    if keys is None or len(keys) != len(x):
        raise RuntimeError(f"{type(module).__name__} in training mode needs the keys of the batch's "
                           f"samples (src.dropout.set_samples): got {None if keys is None else len(keys)} "
                           f"keys for {len(x)} samples")
    return keys


class SampleDropout(nn.Dropout):
    """nn.Dropout whose mask is drawn per sample from its key (set_samples)."""

    unit: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        keys = _keys_for(self, x)
        kept = keep_bits(keys.to(x.device), self.unit, x[0].numel()) >= _threshold(self.p)
        # torch's dropout scales in the input's dtype too (x * mask * 1 / (1 - p))
        out = x * kept.view(x.shape).to(x.dtype) * (1 / (1 - self.p))
        if self.inplace:
            return x.copy_(out)
        return out


class SampleStochasticDepth(StochasticDepth):
    """torchvision's StochasticDepth (mode "row") whose per-sample draw comes from the sample's key."""

    unit: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        keys = _keys_for(self, x)
        survival = 1.0 - self.p
        kept = keep_bits(keys.to(x.device), self.unit, 1)[:, 0] >= _threshold(self.p)
        scale = kept.to(x.dtype) / survival if survival > 0 else kept.to(x.dtype)
        return x * scale.view([len(x)] + [1] * (x.dim() - 1))


def per_sample(model: nn.Module) -> nn.Module:
    """Make every dropout layer of model (nn.Dropout, and StochasticDepth in "row" mode) draw per
    sample; returns model. Their probabilities, names and state_dict keys stay torchvision's.

    StochasticDepth in "batch" mode (one draw for the whole batch, which no torchvision
    classifier uses) cannot be the same for a batch cut into processes: it is refused.
    """
    unit = 0
    for name, module in model.named_modules():
        if type(module) is nn.Dropout:
            module.__class__ = SampleDropout
        elif type(module) is StochasticDepth:
            if module.mode != "row":
                raise ValueError(f"{name}: stochastic depth in mode {module.mode!r} draws once per batch; "
                                 "per-sample draws need mode 'row'")
            module.__class__ = SampleStochasticDepth
        else:
            continue
        module.unit = unit
        unit += 1
    return model


_units: "weakref.WeakKeyDictionary[nn.Module, list[nn.Module]]" = weakref.WeakKeyDictionary()


def units(model: nn.Module) -> list[nn.Module]:
    """The per-sample dropout layers of model (or of the wrapper holding it), in unit order."""
    found = _units.get(model)
    if found is None:
        found = sorted((m for m in model.modules() if isinstance(m, (SampleDropout, SampleStochasticDepth))),
                       key=lambda m: m.unit)
        _units[model] = found
    return found


def set_samples(model: nn.Module, keys: torch.Tensor) -> None:
    """Give the dropout layers of model the keys of the samples in the batch it runs next (one
    int64 per sample, in batch order; from the loader, see src.loaders.TrainSplit), on the
    model's device already: a copy from unpinned host memory would make the host wait."""
    for unit in units(model):
        unit.samples = keys


def sample_keys(model: nn.Module) -> torch.Tensor | None:
    """The keys that set_samples gave model's dropout layers, None if it has none."""
    found = units(model)
    return getattr(found[0], "samples", None) if found else None
