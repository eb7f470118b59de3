"""Per-sample dropout (src/dropout.py): a sample's mask is a function of its key alone, checked
against an independent computation of the hash in plain Python, and drawn in the proportions and
with the scaling that torch's dropout has."""
import hashlib
import math
import os
import subprocess
import sys
import textwrap
from collections import OrderedDict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from conftest import TOLERANCE, B, distance, last_model, mode_run
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.ops import StochasticDepth

from src import dropout
from src.cli import defaults
from src.models import build_model

M32 = 0xFFFFFFFF


def lowbias32(h: int) -> int:
    """Chris Wellons' lowbias32, written from its definition with Python's unbounded integers."""
    h ^= h >> 16
    h = (h * 0x7FEB352D) & M32
    h ^= h >> 15
    h = (h * 0x846CA68B) & M32
    return h ^ (h >> 16)


def kept_by_hand(key: int, unit: int, element: int, p: float) -> bool:
    per_sample = lowbias32((key & M32) ^ lowbias32((key >> 32) ^ unit))
    per_element = lowbias32((element + 0x9E3779B9) & M32)
    return lowbias32(per_sample ^ per_element) >> 8 >= math.ceil(p * 2 ** 24)


# The masks of the cheaper computation (src/dropout.py: the per-sample part per batch, the
# per-element part cached, int32 ops, one Triton kernel on a GPU) against the formula as it was
# computed before, written here again from its definition: int64 tensors, no overflow.
def old_mix(h: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 h in [0, 2^32): each multiplication in two 16-bit halves of the constant."""
    def times(h, c):
        return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & M32
    h = h ^ (h >> 16)
    h = times(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = times(h, 0x846CA68B)
    return h ^ (h >> 16)


def old_kept(keys: torch.Tensor, unit: int, elements: int, p: float) -> torch.Tensor:
    """(samples, elements) bool: draw = the top 24 bits of mix(per_sample ^ per_element), kept
    when at least p x 2^24 rounded up."""
    per_sample = old_mix((keys & M32) ^ old_mix((keys >> 32) ^ unit))
    per_element = old_mix((torch.arange(elements) + 0x9E3779B9) & M32)
    return old_mix(per_sample[:, None] ^ per_element[None, :]) >> 8 >= math.ceil(p * 2 ** 24)


def _keys(n: int, seed: int) -> torch.Tensor:
    """n int64 keys across the whole int64 range (sample_key's are 63 bits; the formula takes any),
    with 0 and the extremes among them."""
    keys = torch.randint(-2 ** 63, 2 ** 63 - 1, (n,), generator=torch.Generator().manual_seed(seed))
    keys[: min(n, 3)] = torch.tensor([0, 2 ** 63 - 1, -2 ** 63])[: min(n, 3)]
    return keys


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_the_hash_is_lowbias32_computed_without_overflow():
    values = torch.tensor([0, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 1, 0x12345678, 0xDEADBEEF])
    assert dropout.mix(values).tolist() == [lowbias32(v) for v in values.tolist()]


def test_a_mask_is_the_hand_computed_function_of_key_unit_and_element():
    layer = dropout.per_sample(nn.Sequential(nn.Dropout(0.3), nn.Dropout(0.6)))
    keys = torch.tensor([dropout.sample_key(42, epoch, index) for epoch, index in [(0, 5), (0, 6), (3, 5)]])
    dropout.set_samples(layer, keys)
    x = torch.ones(3, 40)
    first = layer[0](x)
    second = layer[1](x)
    for row, key in enumerate(keys.tolist()):
        for element in range(40):
            assert (first[row, element] != 0) == kept_by_hand(key, 0, element, 0.3)
            assert (second[row, element] != 0) == kept_by_hand(key, 1, element, 0.6)
    assert torch.all((first == 0) | torch.isclose(first, torch.tensor(1 / 0.7)))


def test_an_element_drawn_exactly_at_p_is_kept():
    """The keep test is draw >= p x 2^24 (the module's docstring; torch keeps an element with
    probability 1 - p): with p set to one element's draw / 2^24, that element is kept, every
    element drawn below it dropped. The element is one whose whole 32-bit hash is its draw x 2^8
    (its low 8 bits 0): the layer compares the 32 bits, and there too it is at equality."""
    keys = torch.tensor([dropout.sample_key(42, 0, 5)])
    per_sample = old_mix((keys & M32) ^ old_mix((keys >> 32) ^ 0))
    hashes = old_mix(per_sample ^ old_mix((torch.arange(4096) + 0x9E3779B9) & M32))
    draws = dropout.keep_bits(keys, 0, 4096)[0]
    assert torch.equal(draws, hashes >> 8)
    element = next(j for j, h in enumerate(hashes.tolist()) if h & 0xFF == 0 and 0.2 < h / 2 ** 32 < 0.8)
    at = int(draws[element])
    layer = dropout.per_sample(nn.Dropout(at / 2 ** 24))
    dropout.set_samples(layer, keys)
    kept = layer(torch.ones(1, 4096))[0] != 0
    assert kept.tolist() == [int(draw) >= at for draw in draws]
    assert kept[element] and 0 < kept.sum() < 4096


def test_a_sample_gets_its_mask_whatever_batch_or_position_holds_it():
    layer = dropout.per_sample(nn.Dropout(0.5))
    keys = torch.tensor([dropout.sample_key(7, 1, i) for i in range(6)])
    x = torch.randn(6, 8, 5)
    dropout.set_samples(layer, keys)
    whole = layer(x)
    order = torch.tensor([4, 0, 5, 2, 1, 3])
    pieces = []
    for part in order.split([1, 3, 2]):  # other batches, in another order, as processes hold them
        dropout.set_samples(layer, keys[part])
        pieces.append(layer(x[part]))
    assert torch.equal(torch.cat(pieces), whole[order])


def test_masks_vary_across_samples_units_and_epochs_in_the_proportion_p():
    """Each mask keeps a share 1 - p of the elements, within 6 standard deviations of a binomial
    draw; masks of other samples, epochs or units agree no more than independent draws do."""
    p, n = 0.5, 4096
    model = dropout.per_sample(nn.Sequential(nn.Dropout(p), nn.Dropout(p)))
    x = torch.ones(8, n)

    def masks(epoch: int) -> list[torch.Tensor]:
        dropout.set_samples(model, torch.tensor([dropout.sample_key(1, epoch, i) for i in range(8)]))
        return [unit(x) != 0 for unit in model]
    (a0, b0), (a1, _) = masks(0), masks(1)
    sigma = math.sqrt(n * p * (1 - p))
    for mask in (a0, b0, a1):
        assert (mask.sum(1).float() - n * (1 - p)).abs().max() < 6 * sigma
    # two independent masks agree on a share p^2 + (1-p)^2 of the elements
    agree = (1 - p) ** 2 + p ** 2
    for x_mask, y_mask in ((a0[0], a0[1]), (a0[0], b0[0]), (a0[0], a1[0])):
        assert abs((x_mask == y_mask).sum().item() - n * agree) < 6 * math.sqrt(n * agree * (1 - agree))


def test_the_expectation_is_kept_and_evaluation_is_untouched():
    layer = dropout.per_sample(nn.Dropout(0.25))
    x = torch.full((64, 1000), 2.0)
    dropout.set_samples(layer, torch.arange(64) * 977)
    out = layer(x)
    assert torch.all((out == 0) | torch.isclose(out, torch.tensor(2 / 0.75)))
    n, p = x.numel(), 0.25
    assert abs(out.mean().item() - 2.0) < 6 * 2 / 0.75 * math.sqrt(p * (1 - p) / n)
    layer.eval()
    assert layer(x) is x


def test_stochastic_depth_drops_whole_samples_per_key():
    layer = dropout.per_sample(nn.Sequential(nn.Dropout(0.1), StochasticDepth(0.5, "row")))[1]
    assert layer.unit == 1
    keys = torch.tensor([dropout.sample_key(3, 0, i) for i in range(400)])
    dropout.set_samples(layer, keys)
    out = layer(torch.ones(400, 2, 3, 3))
    kept = [kept_by_hand(k, 1, 0, 0.5) for k in keys.tolist()]
    assert [bool(out[i].ne(0).all()) for i in range(400)] == kept
    assert [bool(out[i].eq(0).all()) for i in range(400)] == [not k for k in kept]
    assert torch.all(out[torch.tensor(kept)] == 2.0)
    with pytest.raises(ValueError, match="mode 'batch'"):
        dropout.per_sample(StochasticDepth(0.5, "batch"))


def test_stochastic_depth_keeps_a_sample_drawn_exactly_at_p():
    """The keep test of a stochastic-depth unit is draw >= p x 2^24 too: with p set to one
    sample's draw / 2^24 (exact in a float), that sample is kept, and dropped at the next draw
    up. The sample is one whose whole 32-bit hash (element 0 of its unit, computed by hand) is its
    draw x 2^8 (its low 8 bits 0): the layer compares the 32 bits, and there too it is at equality."""
    keys = [dropout.sample_key(11, 0, i) for i in range(4096)]
    hashes = [lowbias32(lowbias32((k & M32) ^ lowbias32((k >> 32) ^ 0)) ^ lowbias32(0x9E3779B9)) for k in keys]
    at_key = next(i for i, h in enumerate(hashes) if h & 0xFF == 0 and 0.2 < h / 2 ** 32 < 0.8)
    at = hashes[at_key] >> 8
    below = next(i for i, h in enumerate(hashes) if h >> 8 < at)
    above = next(i for i, h in enumerate(hashes) if h >> 8 > at)
    batch = torch.tensor([keys[at_key], keys[below], keys[above]])
    for p, expected in [(at / 2 ** 24, [True, False, True]), ((at + 1) / 2 ** 24, [False, False, True])]:
        layer = dropout.per_sample(StochasticDepth(p, "row"))
        assert layer.unit == 0 and math.ceil(p * 2 ** 24) == round(p * 2 ** 24)
        dropout.set_samples(layer, batch)
        out = layer(torch.ones(3, 2, 2))
        assert [bool(out[i].ne(0).all()) for i in range(3)] == expected, p
        assert [kept_by_hand(k, 0, 0, p) for k in batch.tolist()] == expected


def test_a_training_forward_without_keys_fails_instead_of_drawing_per_process():
    layer = dropout.per_sample(nn.Dropout(0.5))
    with pytest.raises(RuntimeError, match="set_samples"):
        layer(torch.ones(2, 3))
    dropout.set_samples(layer, torch.arange(3))
    with pytest.raises(RuntimeError, match="3 keys for 2 samples"):
        layer(torch.ones(2, 3))


@pytest.mark.parametrize("arch", ["vgg11", "squeezenet1_1", "efficientnet_b0"])
def test_built_models_draw_per_sample_and_keep_torchvision_state_dicts(arch):
    torch.manual_seed(0)
    model = build_model(arch, "none")
    plain = torchvision.models.get_model(arch, num_classes=2)
    assert model.state_dict().keys() == plain.state_dict().keys()
    kinds = {type(m) for m in model.modules()}
    assert nn.Dropout not in kinds and StochasticDepth not in kinds
    probabilities = [m.p for m in plain.modules() if isinstance(m, (nn.Dropout, StochasticDepth))]
    assert [m.p for m in dropout.units(model)] == probabilities and probabilities


def test_vgg_gradients_of_a_batch_split_between_two_processes_are_the_whole_batchs():
    """VGG11 (dropout 0.5 after each of its two hidden Linear layers, torchvision's default) in
    training mode: the mean of the gradients of two shares of B images (every other sample, as the
    DDP sampler deals them, each share with its samples' keys) equals the gradient of the 2 x B
    images in one piece, to float rounding: within the tolerance the modes' runs meet, as a share
    of how far apart the two are with torch's own dropout, which draws per process (the control).
    The runs themselves, in every mode with SqueezeNet's dropout: test_modes.py."""
    torch.manual_seed(0)
    ours = build_model("vgg11", "none")
    torchs = torchvision.models.get_model("vgg11", num_classes=2)
    torchs.load_state_dict(ours.state_dict())
    images, labels = torch.randn(2 * B, 3, 32, 32), torch.randint(0, 2, (2 * B,))
    keys = torch.tensor([dropout.sample_key(42, 0, i) for i in range(2 * B)])
    whole, shares = [torch.arange(2 * B)], [torch.arange(0, 2 * B, 2), torch.arange(1, 2 * B, 2)]

    def gradient(model: nn.Module, parts: list[torch.Tensor]) -> torch.Tensor:
        """The mean over the parts of each part's gradient, as DDP averages the processes' gradients."""
        model.train()
        total = 0
        for part in parts:
            model.zero_grad()
            dropout.set_samples(model, keys[part])
            F.cross_entropy(model(images[part]), labels[part]).backward()
            total = total + torch.cat([p.grad.flatten() for p in model.parameters()])
        return total / len(parts)
    apart = (gradient(ours, shares) - gradient(ours, whole)).norm()
    torch.manual_seed(1)
    control = (gradient(torchs, shares) - gradient(torchs, whole)).norm()
    assert apart < TOLERANCE * control, (apart, control)


def test_per_process_masks_would_end_outside_the_tolerance(runs, far):
    """The control: SqueezeNet's two DDP processes with torch's own dropout (PER_PROCESS_DROPOUT,
    a test hook: each process draws its masks from its generator) end far outside the tolerance
    that the per-sample masks meet (test_modes.py)."""
    reference = mode_run(runs, "single")[0]
    out = runs.exact("ddp", env={"PER_PROCESS_DROPOUT": "1"})[0]
    assert distance(last_model(out), last_model(reference)) / far > 20 * TOLERANCE


def test_the_loader_hands_each_sample_its_key_for_its_epoch():
    """TrainSplit gives each training sample sample_key(seed, epoch, index in the data set): other
    epochs draw other masks, every rank and --workers value the same ones."""

    import train_ddp
    from src.loaders import Data
    dataset = [(torch.zeros(3, 4, 4, dtype=torch.uint8), i % 2) for i in range(12)]
    train = [1, 3, 4, 6, 8, 9, 10, 11]
    args = defaults(batch_size=2, seed=7, workers=0, augment=False, accumulate=1)
    seen = {}
    for epoch in (0, 1):
        for rank in (0, 1):
            loader = train_ddp.loaders(dataset, Data(dataset, train, [0, 2], ""), args, torch.device("cpu"), rank, 2)[0]
            loader.sampler.set_epoch(epoch)
            loader.dataset.set_epoch(epoch)
            for position, key in zip(loader.sampler, (k for _, _, keys in loader for k in keys.tolist())):
                seen[(epoch, train[position])] = key
    assert seen == {(epoch, index): dropout.sample_key(7, epoch, index) for epoch in (0, 1) for index in train}
    assert len(set(seen.values())) == len(seen)
    # derive_seed(7, epoch, index, DROPOUT = 1) computed by hand: a stream of its own, not the
    # seed that --augment's crop and flip of the same sample draw from (derive_seed(7, epoch, index))
    assert seen == {(epoch, index): _derived(7, epoch, index, 1) for epoch in (0, 1) for index in train}
    assert not set(seen.values()) & {_derived(7, epoch, index) for epoch in (0, 1) for index in train}


def _derived(*parts: int) -> int:
    """src.seeds.derive_seed from its definition: the first 8 bytes of the parts' sha256, 63 bits."""
    return int.from_bytes(hashlib.sha256(" ".join(map(str, parts)).encode()).digest()[:8], "little") >> 1


@pytest.mark.parametrize("shape, ps", [((1, 1), (1e-7, 0.5)), ((3, 7), (0.1, 0.9)), ((2, 33), (0.5, 1 - 1e-7)),
                                       ((5, 3, 17, 19), (0.3,)), ((50, 4096), (0.5,)), ((8, 197, 768), (0.1,))])
def test_the_masks_outputs_and_gradients_are_the_old_formulas_bit_for_bit(shape, ps):
    """Every element of every unit (dropout and stochastic depth, units 0 to 5 of one model, keys
    anywhere in int64, odd sizes that leave the vectorised loops a tail): kept where the old
    formula keeps it, the output x * mask.to(x.dtype) * (1 / (1 - p)) (stochastic depth:
    x * (mask.to(x.dtype) / (1 - p)), as torchvision's) and its gradient to the bit, in float32,
    bfloat16 and float64 (a scale that 16 bits cannot hold, 1 / 0.9, included)."""
    for p in ps:
        model = dropout.per_sample(nn.Sequential(nn.Dropout(p), StochasticDepth(p, "row"), nn.Dropout(p),
                                                 StochasticDepth(p, "row"), nn.Dropout(p), nn.Dropout(p)))
        keys = _keys(shape[0], seed=len(shape) + shape[-1])
        dropout.set_samples(model, keys)
        for unit, layer in enumerate(model):
            kept = old_kept(keys, unit, math.prod(shape[1:]) if isinstance(layer, nn.Dropout) else 1, p)
            kept = kept.view(shape) if isinstance(layer, nn.Dropout) else kept.view([shape[0]] + [1] * (len(shape) - 1))
            for dtype in (torch.float32, torch.bfloat16, torch.float64) if shape[0] < 50 else (torch.float32,):
                x = torch.randn(shape, generator=torch.Generator().manual_seed(unit)).to(dtype).requires_grad_()
                grad = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(dtype)
                out = layer(x)
                out.backward(grad)
                y = x.detach().clone().requires_grad_()
                if isinstance(layer, nn.Dropout):
                    expected = y * kept.to(dtype) * (1 / (1 - p))
                else:  # torchvision's stochastic depth divides the mask, in x's dtype, by 1 - p
                    expected = y * (kept.to(dtype) / (1 - p))
                expected.backward(grad)
                assert torch.equal(_bits(out), _bits(expected)), (p, unit, dtype)
                assert torch.equal(_bits(x.grad), _bits(y.grad)), (p, unit, dtype)


def test_the_old_formula_here_is_the_hand_computed_one():
    """The transcription above against kept_by_hand (Python's integers), on a few elements."""
    keys = _keys(4, seed=1)
    kept = old_kept(keys, 3, 50, 0.4)
    assert kept.tolist() == [[kept_by_hand(key, 3, j, 0.4) for j in range(50)] for key in keys.tolist()]


def test_keep_bits_are_the_old_draws():
    keys = _keys(6, seed=2)
    for unit in (0, 1, 2 ** 31 - 1, 2 ** 40):
        per_sample = old_mix((keys & M32) ^ old_mix((keys >> 32) ^ unit))
        per_element = old_mix((torch.arange(300) + 0x9E3779B9) & M32)
        assert torch.equal(dropout.keep_bits(keys, unit, 300), old_mix(per_sample[:, None] ^ per_element[None, :]) >> 8)


def test_p_of_one_drops_everything_as_torchs_dropout_does():
    layer = dropout.per_sample(nn.Dropout(1.0))
    dropout.set_samples(layer, _keys(3, seed=3))
    x = torch.randn(3, 10)
    assert torch.equal(layer(x), nn.Dropout(1.0)(x))
    depth = dropout.per_sample(StochasticDepth(1.0, "row"))
    dropout.set_samples(depth, _keys(3, seed=3))
    assert torch.equal(depth(x), torch.zeros(3, 10))


def test_the_gpus_fused_scaling_computes_the_cpus_bits():
    """On a GPU the mask is applied by torch's native_dropout_backward, forward and backward (one
    fused kernel each, (float)mask * x * scale); on the CPU by a uint8 mask. Both ways (torch's op
    run on the CPU) give the bits of x * mask.to(x.dtype) * scale, in every float dtype and at
    zeros, infinities and NaNs."""
    x = torch.randn(4000) * 10
    x[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0])
    kept = torch.rand(4000, generator=torch.Generator().manual_seed(0)) > 0.4
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        for scale in (2.0, 1 / 0.9, 1 / 0.7):
            expected = x.to(dtype) * kept.to(dtype) * scale
            for fused in (True, False):
                assert torch.equal(_bits(dropout._scaled(x.to(dtype), kept, scale, fused)), _bits(expected)), \
                    (dtype, scale, fused)


def test_the_triton_kernel_draws_the_old_masks():
    """The CUDA path's one kernel, run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, in a
    process of its own: Triton reads it when the kernel is defined): the old formula's masks, in
    rows of several blocks and a partial one."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import math, sys, torch
        from src import dropout
        sys.path.insert(0, "tests")
        from test_dropout import _keys, old_kept
        keys = _keys(5, seed=4)
        for elements in (1, 2500):  # one element; two whole blocks of 1024 and a partial one
            for p in (1e-7, 0.5, 0.97):
                for unit in (0, 3):
                    rows = dropout._first_xorshift(dropout._per_sample(keys, unit, unit))[0]
                    kept = dropout._kept_by_kernel(rows, elements, dropout._signed_threshold(p))
                    assert torch.equal(kept, old_kept(keys, unit, elements, p)), (elements, p, unit)
        print("same masks")
    """)
    done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "same masks", done.stderr[-3000:]


def test_the_triton_kernel_compiles_for_an_h100():
    """The interpreter runs the kernel as Python; Triton's compiler, which a GPU runs, types it: it
    compiles for an H100 (sm_90, no GPU needed to compile) to a cubin whose arithmetic on the hash
    is int32 (the wrapping multiplications the masks need)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    signature = {"per_sample": "*i32", "kept": "*i1", "elements": "i32", "threshold": "i32", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(fn=dropout._kept_kernel, signature=signature, constexprs={"BLOCK": 1024}),
                            target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"]
    # the hash's four multiplications, on blocks of 1024 int32
    multiplications = [line for line in kernel.asm["ttir"].splitlines() if "arith.muli" in line and "tensor<" in line]
    assert len(multiplications) == 4 and all("tensor<1024xi32>" in line for line in multiplications), multiplications


def test_a_compiled_model_draws_the_old_masks():
    """Under torch.compile the per-element work is traced (the compiler fuses it with the model's):
    the old formula's masks, and the eager model's outputs and gradients, for two batch sizes
    (backend aot_eager: Dynamo's tracing and autograd's graphs, in seconds; inductor's code runs
    in test_performance's --compile run)."""
    torch.manual_seed(0)
    model = dropout.per_sample(nn.Sequential(nn.Linear(16, 64), nn.Dropout(0.3), nn.Linear(64, 64),
                                             StochasticDepth(0.4, "row"), nn.Dropout(1 / 3)))
    compiled = torch.compile(model, backend="aot_eager", dynamic=True)
    layer = torch.compile(model[1], backend="aot_eager", dynamic=True)
    for batch in (6, 9):
        keys, x = _keys(batch, seed=batch), torch.randn(batch, 16)
        dropout.set_samples(model, keys)
        assert torch.equal(layer(torch.ones(batch, 40)) != 0, old_kept(keys, 0, 40, 0.3)), batch
        results = []
        for run in (model, compiled):
            model.zero_grad()
            out = run(x)
            out.square().sum().backward()
            results.append([out] + [p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*results)), batch


class _Ops(TorchDispatchMode):
    """Records the aten ops dispatched inside it, each with its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, tensors))
        return func(*args, **(kwargs or {}))


def _mixed(units: int) -> nn.Module:
    """A model of `units` dropout units, every third one stochastic depth."""
    return dropout.per_sample(nn.Sequential(*[StochasticDepth(0.2, "row") if i % 3 == 2 else nn.Dropout(0.2)
                                              for i in range(units)]))


def test_set_samples_draws_every_units_per_sample_part_in_the_same_ops_for_3_units_or_60():
    """The per-(sample, unit) part for all units at once: as many ops for a model of 60 units
    (EfficientNet-B0 has 17, ConvNeXt-T 18, Swin-T 12 of stochastic depth) as for one of 3 (each
    op on a bigger tensor), where drawing per unit took dozens of ops per unit."""
    counts = []
    for units in (3, 60):
        model = _mixed(units)
        dropout.set_samples(model, _keys(8, seed=5))  # the first also makes element 0's part (cached)
        with _Ops() as seen:
            dropout.set_samples(model, _keys(8, seed=5))
        counts.append(len(seen.ops))
    assert counts[0] == counts[1], counts


def test_a_units_forward_reads_no_key_and_a_shape_seen_before_makes_no_element_part(monkeypatch):
    """After set_samples, a unit's training forward starts from what set_samples drew: no op reads
    the keys. The per-element part is made once per shape (and device): the second batch of a
    shape makes none (no arange), a new shape makes its own."""
    monkeypatch.setattr(dropout, "_ELEMENTS", OrderedDict())  # none made by the tests before
    model = _mixed(3)
    keys = _keys(4, seed=6)

    def forward(x: torch.Tensor) -> list[str]:
        dropout.set_samples(model, keys)
        with _Ops() as seen:
            model(x)
        assert not any(t is keys for _, tensors in seen.ops for t in tensors)
        return [name for name, _ in seen.ops]
    x = torch.randn(4, 5, 13)
    first, second = forward(x), forward(x)
    assert first.count("arange") == 1 and second.count("arange") == 0 and len(second) < len(first)
    assert forward(torch.randn(4, 3, 11)).count("arange") == 1
