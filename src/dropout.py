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
(Wellons' lowbias32: xor-shifts and two multiplications). The element is kept when its top 24
bits are at least p x 2^24, and scaled by 1 / (1 - p) as torch's dropout scales it. Why a hash
rather than masks made on the host and carried with the batch: the masks have the shape of a
layer's input, known only inside the model, and for VGG16 they would be 2 x 4096 values per image
to move each step; the keys are one int64 per image, and the hash costs a few elementwise ops per
element, on the device, with no host synchronisation.

How it is computed, cheaply (the bits are the formula's, whichever path):
- per batch, for every unit at once (set_samples): the per-(sample, unit) part
  mix(k_low ^ mix(k_high ^ u)), in int64 arithmetic that never overflows, for a (units, samples)
  matrix: a few dozen small ops per batch, however many units the model has;
- per shape and device, once (a cache): the per-element part mix(j + GOLDEN);
- per element, in int32 (wrapping multiplications give the low 32 bits that the formula keeps):
  mix's first xor-shift is linear in xor, so it is applied to each part beforehand and the
  element's own work is one xor of the two parts, the rest of mix, and one comparison;
- on a CUDA GPU with Triton, that per-element work is one kernel that writes the mask (the
  per-element part computed in it); under torch.compile the ops are traced, and compiled with
  the model's;
- the mask is applied on a GPU by torch's own dropout kernel (native_dropout_backward: one fused
  kernel forward, one backward), on a CPU through a uint8 view of it; it is kept as bool for the
  backward.

torchvision's stochastic depth (StochasticDepth, mode "row": EfficientNet, ConvNeXt, Swin, MaxViT)
drops a whole residual branch per sample, drawn the same way (element 0 of its unit): set_samples
draws every unit's once per batch, and each unit's forward is a comparison and a scaling. The
modules keep their class names' behaviour in evaluation (the input unchanged), their
probabilities and their (empty) state: best.pth is a plain torchvision state_dict.
"""
import math
import warnings
import weakref
from collections import OrderedDict

import torch
import torch.nn as nn
from torchvision.ops import StochasticDepth

from src.seeds import derive_seed

try:  # CUDA builds of torch ship Triton; without it the GPU takes the ops' path (same masks)
    import triton
    import triton.language as tl
except ImportError:
    triton = None

DROPOUT = 1  # the stream of derive_seed that dropout keys come from (augmentation's: src/augment.py)
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # offsets the element counter, so that element 0 does not hash to 0
_BITS = 24  # the resolution of the keep test: p is rounded up to a multiple of 2^-24
_TOP = 1 << 31  # the top bit of 32: flipped, unsigned order becomes int32's signed order


def _int32(c: int) -> int:
    """The int32 value that has the 32 bits of c (in [0, 2^32))."""
    return c - (1 << 32) if c >= _TOP else c


_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers
_C1_32, _C2_32 = _int32(_C1), _int32(_C2)


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
    h = _mul32(h, _C1)
    h = h ^ (h >> 15)
    h = _mul32(h, _C2)
    return h ^ (h >> 16)


def _to_int32(h: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) as the int32 tensor of the same 32 bits (no conversion overflows)."""
    return ((h ^ _TOP) - _TOP).to(torch.int32)


def _xorshift(h: torch.Tensor, shift: int) -> torch.Tensor:
    """h ^= h >> shift on the 32 bits that int32 h holds, in place: torch's >> on int32 copies the
    sign bit, so the bits it shifts in are masked off (a logical shift)."""
    shifted = h >> shift
    shifted &= (1 << (32 - shift)) - 1
    return h.bitwise_xor_(shifted)


def _rest_of_mix(h: torch.Tensor) -> torch.Tensor:
    """mix after its first xor-shift, in place on int32 h: int32 multiplications wrap around,
    which keeps the low 32 bits of the product, the bits mix keeps."""
    h.mul_(_C1_32)
    _xorshift(h, 15)
    h.mul_(_C2_32)
    return _xorshift(h, 16)


def _first_xorshift(h: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2^32) after mix's first step (h ^ h >> 16), as int32. That step is linear
    in xor: applied to each of the two parts that the element's mix xors, it is applied to their xor."""
    return _to_int32(h ^ (h >> 16))


def _per_sample(keys: torch.Tensor, low: int, high: int) -> torch.Tensor:
    """(high - low + 1, samples) int64 in [0, 2^32): mix(k_low ^ mix(k_high ^ u)) for the units
    u = low..high, each row one unit's."""
    unit = torch.arange(low, high + 1, device=keys.device)[:, None]
    return mix((keys & _M32)[None, :] ^ mix((keys >> 32)[None, :] ^ unit))


def _element_part(elements: int, device: torch.device) -> torch.Tensor:
    """(elements,) int32: the per-element part mix(j + GOLDEN), after mix's first xor-shift."""
    return _first_xorshift(mix((torch.arange(elements, device=device) + _GOLDEN) & _M32))


_ELEMENTS: "OrderedDict[tuple[int, torch.device], torch.Tensor]" = OrderedDict()
_ELEMENTS_KEPT = 16  # shapes per process: a model's dropout layers have a few


def _cached_element_part(elements: int, device: torch.device) -> torch.Tensor:
    """_element_part, made once per (elements, device): it is the same for every batch."""
    key = (elements, device)
    found = _ELEMENTS.get(key)
    if found is None:
        found = _ELEMENTS[key] = _element_part(elements, device)
        if len(_ELEMENTS) > _ELEMENTS_KEPT:
            _ELEMENTS.popitem(last=False)
    else:
        _ELEMENTS.move_to_end(key)
    return found


def _threshold(p: float) -> int:
    """Elements whose draw is below this are dropped: p x 2^24, rounded up."""
    return math.ceil(p * (1 << _BITS))


def _signed_threshold(p: float) -> int | None:
    """The keep test draw >= p x 2^24 (rounded up) on int32 h that holds the 32 bits with the top
    one flipped: h >= this. None when nothing is kept (p so close to 1 that it rounds to 2^24)."""
    threshold = _threshold(p)
    return None if threshold >= 1 << _BITS else (threshold << (32 - _BITS)) - _TOP


def _kept_by_ops(per_sample: torch.Tensor, elements: torch.Tensor, threshold: int) -> torch.Tensor:
    """(samples, elements) bool, kept or not: from the per-sample part (samples,) and the
    per-element part (elements,), both int32 after mix's first xor-shift."""
    h = per_sample[:, None] ^ elements[None, :]
    _rest_of_mix(h)
    h ^= -_TOP  # the top bit flipped: the unsigned order of the draws is h's signed order
    return h >= threshold


if triton is not None:
    @triton.jit
    def _kept_kernel(per_sample, kept, elements, threshold, BLOCK: tl.constexpr):
        """kept[row, j] for j in one block of a row: the per-element part and the rest of mix
        computed here (int32 wraps as _rest_of_mix's does; the constants are _int32's)."""
        row = tl.program_id(1)
        j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        h = j + -1640531527  # + GOLDEN, mod 2^32
        h = h ^ ((h >> 16) & 0xFFFF)
        h = h * 2146121005
        h = h ^ ((h >> 15) & 0x1FFFF)
        h = h * -2073254261
        h = h ^ ((h >> 16) & 0xFFFF)  # the per-element part, mix(j + GOLDEN)
        h = h ^ ((h >> 16) & 0xFFFF)  # its share of the next mix's first xor-shift
        h = h ^ tl.load(per_sample + row)
        h = h * 2146121005
        h = h ^ ((h >> 15) & 0x1FFFF)
        h = h * -2073254261
        h = h ^ ((h >> 16) & 0xFFFF)
        h = h ^ -2147483648
        tl.store(kept + row.to(tl.int64) * elements + j, h >= threshold, mask=j < elements)

_BLOCK = 1024
_kernel_failed = False


def _kept_by_kernel(per_sample: torch.Tensor, elements: int, threshold: int) -> torch.Tensor:
    """_kept_by_ops in one Triton kernel (the per-element part computed in it, no cache read)."""
    kept = torch.empty(len(per_sample), elements, dtype=torch.bool, device=per_sample.device)
    _kept_kernel[(triton.cdiv(elements, _BLOCK), len(per_sample))](
        per_sample, kept, elements, threshold, BLOCK=_BLOCK)
    return kept


def _kept(per_sample: torch.Tensor, elements: int, threshold: int) -> torch.Tensor:
    """(samples, elements) bool: the one Triton kernel on a CUDA GPU, the ops elsewhere."""
    global _kernel_failed
    if torch.compiler.is_compiling():  # traced: the compiler fuses the ops with the model's
        return _kept_by_ops(per_sample, _element_part(elements, per_sample.device), threshold)
    if per_sample.is_cuda and triton is not None and not _kernel_failed and len(per_sample) < 1 << 16:
        try:
            return _kept_by_kernel(per_sample.contiguous(), elements, threshold)
        except Exception as error:  # noqa: BLE001 (a GPU or toolchain Triton cannot build for)
            _kernel_failed = True
            warnings.warn(f"per-sample dropout: Triton's kernel failed ({type(error).__name__}: {error}); "
                          "the masks are computed by torch's ops instead (the same masks, more kernels)",
                          stacklevel=2)
    return _kept_by_ops(per_sample, _cached_element_part(elements, per_sample.device), threshold)


def keep_bits(keys: torch.Tensor, unit: int, elements: int) -> torch.Tensor:
    """(samples, elements) int64 values in [0, 2^24): the draw of each element of each sample."""
    h = _first_xorshift(_per_sample(keys, unit, unit)[0])[:, None] ^ _element_part(elements, keys.device)[None, :]
    return (_rest_of_mix(h).to(torch.int64) & _M32) >> (32 - _BITS)


def _scaled(t: torch.Tensor, kept: torch.Tensor, scale: float, fused: bool | None = None) -> torch.Tensor:
    """The bits of t * kept.to(t.dtype) * scale (torch's dropout scales in the input's dtype).
    fused (by default off a CPU): by torch's native_dropout_backward, one kernel on a GPU."""
    if fused if fused is not None else t.device.type != "cpu":
        return torch.ops.aten.native_dropout_backward(t, kept, scale)
    # bool -> float is not vectorised on a CPU (10x slower than uint8 -> float)
    return (t * kept.view(torch.uint8).to(t.dtype)).mul_(scale)


class _Scale(torch.autograd.Function):
    """x x mask x scale, forward and backward alike, the mask saved as bool (torch's own
    native_dropout_backward's autograd would round the scale to a 16-bit x's dtype first)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kept: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(kept)
        ctx.scale = scale
        return _scaled(x, kept, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        kept, = ctx.saved_tensors
        return _scaled(grad, kept, ctx.scale), None, None


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
    drawn: torch.Tensor  # (samples,) int32: this unit's per-sample part, from set_samples

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        _keys_for(self, x)
        threshold = _signed_threshold(self.p)
        if threshold is None:
            kept = torch.zeros(x.shape, dtype=torch.bool, device=x.device)
        else:
            kept = _kept(self.drawn.to(x.device), x[0].numel(), threshold).view(x.shape)
        # torch's dropout scales in the input's dtype too (x * mask * 1 / (1 - p)); p = 1 gives
        # zeros, as torch's does
        out = _Scale.apply(x, kept, 1 / (1 - self.p) if self.p < 1 else 0.0)
        if self.inplace:
            return x.copy_(out)
        return out


class SampleStochasticDepth(StochasticDepth):
    """torchvision's StochasticDepth (mode "row") whose per-sample draw comes from the sample's key."""

    unit: int
    drawn: torch.Tensor  # (samples,) int32: each sample's draw with its top bit flipped, from set_samples

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        _keys_for(self, x)
        survival = 1.0 - self.p
        threshold = _signed_threshold(self.p)
        drawn = self.drawn.to(x.device)
        kept = drawn >= threshold if threshold is not None else torch.zeros_like(drawn, dtype=torch.bool)
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


_units: "weakref.WeakKeyDictionary[nn.Module, list[SampleDropout | SampleStochasticDepth]]" = weakref.WeakKeyDictionary()


def units(model: nn.Module) -> list[SampleDropout | SampleStochasticDepth]:
    """The per-sample dropout layers of model (or of the wrapper holding it), in unit order."""
    found = _units.get(model)
    if found is None:
        found = sorted([m for m in model.modules() if isinstance(m, (SampleDropout, SampleStochasticDepth))],
                       key=lambda m: m.unit)
        _units[model] = found
    return found


def set_samples(model: nn.Module, keys: torch.Tensor) -> None:
    """Give the dropout layers of model the keys of the samples in the batch it runs next (one
    int64 per sample, in batch order; from the loader, see src.loaders.TrainSplit), on the
    model's device already: a copy from unpinned host memory would make the host wait.

    The per-(sample, unit) part of every unit's draws is computed here, for all units in one go;
    a stochastic-depth unit's whole draw too (its one element).
    """
    found = units(model)
    if not found:
        return
    low, high = found[0].unit, found[-1].unit
    rows = _first_xorshift(_per_sample(keys, low, high))
    parts = wholes = rows.unbind()  # one op for all rows (indexing would be one per unit)
    if any(isinstance(unit, SampleStochasticDepth) for unit in found):
        # element 0's whole draw, top bit flipped, for every unit: a stochastic-depth unit's
        wholes = (_rest_of_mix(rows ^ _cached_element_part(1, keys.device)) ^ -_TOP).unbind()
    for unit in found:
        unit.samples = keys
        unit.drawn = (wholes if isinstance(unit, SampleStochasticDepth) else parts)[unit.unit - low]


def sample_keys(model: nn.Module) -> torch.Tensor | None:
    """The keys that set_samples gave model's dropout layers, None if it has none."""
    found = units(model)
    return getattr(found[0], "samples", None) if found else None
