"""Per-sample dropout (src/dropout.py): a sample's mask is a function of its key alone, checked
against an independent computation of the hash in plain Python, and drawn in the proportions and
with the scaling that torch's dropout has."""
import hashlib
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from conftest import TOLERANCE, B, distance, last_model, mode_run
from torchvision.ops import StochasticDepth

from src import dropout
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
    element drawn below it dropped."""
    keys = torch.tensor([dropout.sample_key(42, 0, 5)])
    draws = dropout.keep_bits(keys, 0, 64)[0]
    at = int(draws.sort().values[32])  # the median draw: some elements below it, some above
    layer = dropout.per_sample(nn.Dropout(at / 2 ** 24))
    dropout.set_samples(layer, keys)
    kept = layer(torch.ones(1, 64))[0] != 0
    assert kept.tolist() == [int(draw) >= at for draw in draws]
    assert kept[draws == at].all() and 0 < kept.sum() < 64


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
    from types import SimpleNamespace

    import train_ddp
    from src.loaders import Data
    dataset = [(torch.zeros(3, 4, 4, dtype=torch.uint8), i % 2) for i in range(12)]
    train = [1, 3, 4, 6, 8, 9, 10, 11]
    args = SimpleNamespace(batch_size=2, seed=7, workers=0, augment=False, accumulate=1)
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
