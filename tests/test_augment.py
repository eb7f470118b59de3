"""The augmentation recipe (src/augment.py): each draw is what it claims, over many keys, and a
function of the sample's key (seed, epoch, index) alone, whatever process computes it.

Each share is checked against its expected value within 6 standard deviations of the binomial
draw it is (a false alarm about once in 10^8 runs), a distribution against its CDF with the
Dvoretzky-Kiefer-Wolfowitz bound at the same false-alarm rate; the draws are seeded, so a run that
passes passes every time. Where a draw is torchvision's, a spy on the v2 transform records what it
drew (and, for the policies' operations, skips applying them: the draw is under test, not the
image kernels)."""
import collections
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import EXACT, RECIPE, VAL, B, U, evaluated_record, history, in_process
from torch.utils.data import DataLoader, Dataset
from torchvision.transforms import v2

import train_single
from src import augment as aug
from src import checkpoint
from src.augment import ERASE_FILL, TrainSplit, augment, crop_params, partner
from src.cache import MappedArray
from src.cli import defaults, parse_args
from src.config import Config
from src.dropout import sample_key
from src.errors import UserError
from src.freeze import backbone_outputs
from src.metrics import EPS, batch_sums
from src.models import build_model
from src.transforms import IMAGENET_STD, normalize

ROOT = Path(__file__).resolve().parent.parent
FALSE_ALARM = 1e-8


def _within(count: float, n: int, p: float) -> bool:
    """A binomial count of n draws of probability p, within 6 standard deviations."""
    return abs(count - n * p) < 6 * math.sqrt(n * p * (1 - p))


def _flags(**changes) -> Config:
    """The recipe's flags as the command line gives them (every augmentation off), changed."""
    return defaults(**{"seed": 7, **changes})


def _images(n: int, size: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """n random uint8 images and labels, the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)
    labels = torch.randint(0, 2, (n,), generator=generator).tolist()
    return [(images[i], labels[i]) for i in range(n)]


class Recorded(Dataset):
    """`dataset`, recording the indices that are read."""

    def __init__(self, dataset):
        self.dataset, self.read = dataset, []

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int):
        self.read.append(index)
        return self.dataset[index]


def _spy_policy(monkeypatch, cls) -> list[tuple[str, float]]:
    """(operation, magnitude) of each operation `cls` (a v2 auto-augment policy) applies, which
    the spy leaves unapplied."""
    seen = []

    def record(self, image, transform_id, magnitude, **options):
        seen.append((transform_id, magnitude))
        return image
    monkeypatch.setattr(cls, "_apply_image_or_video_transform", record)
    return seen


def _spy_mixers(monkeypatch) -> list[tuple[str, dict]]:
    """(v2.MixUp or v2.CutMix, its params and "raw": the lambda it drew from Beta(alpha, alpha),
    before CutMix's correction) of each mixing draw."""
    seen, draws = [], []
    beta_sample = torch.distributions.Beta.sample

    def sample(self, *args, **kwargs):
        value = beta_sample(self, *args, **kwargs)
        draws.append(float(value))
        return value
    monkeypatch.setattr(torch.distributions.Beta, "sample", sample)
    for cls in (v2.MixUp, v2.CutMix):
        def make_params(self, flat_inputs, original=cls.make_params):
            params = original(self, flat_inputs)
            seen.append((type(self).__name__, {**params, "raw": draws[-1]}))
            return params
        monkeypatch.setattr(cls, "make_params", make_params)
    return seen


def _items(split: TrainSplit, epochs, positions=None) -> dict:
    out = {}
    for epoch in epochs:
        split.set_epoch(epoch)
        for position in positions if positions is not None else range(len(split)):
            out[(epoch, position)] = split[position]
    return out


# --augment: today's crop and flip, bit for bit

def test_crop_and_flip_are_the_draws_of_crop_params_bit_for_bit():
    """--augment alone gives augment(image, crop_params(seed, epoch, index, size)), the draws
    --augment made before the recipe grew, with the int label and the dropout key."""
    dataset = _images(12, 32)
    indices = [1, 4, 5, 7, 10, 11]
    split = TrainSplit(dataset, indices, _flags(augment=True))
    for (epoch, position), (image, target, key) in _items(split, (0, 3)).items():
        index = indices[position]
        assert torch.equal(image, augment(dataset[index][0], crop_params(7, epoch, index, 32)))
        assert target == dataset[index][1] and isinstance(target, int)
        assert key == sample_key(7, epoch, index)
    plain = TrainSplit(dataset, indices, _flags())
    assert torch.equal(plain[2][0], dataset[5][0]), "without a flag, the image as it is"


# The same sample whatever computes it

ALL = dict(augment=True, auto_augment="ta_wide", random_erase=0.5, mixup_alpha=0.2, cutmix_alpha=1.0)


def _all_on(dataset=None) -> TrainSplit:
    return TrainSplit(dataset or _images(24, 32), list(range(2, 24)), _flags(**ALL))


def _same(one: dict, other: dict) -> None:
    assert one.keys() == other.keys()
    for where, (image, target, key) in one.items():
        image_2, target_2, key_2 = other[where]
        assert torch.equal(image, image_2) and torch.equal(target, target_2) and key == key_2, where


def subprocess_items(path: str) -> None:
    """Run in another process by the test below: every item of _all_on in epochs 0 and 1."""
    torch.manual_seed(12345)
    torch.save(_items(_all_on(), (0, 1)), path)


def test_a_sample_is_the_same_whatever_process_worker_or_global_seed_computes_it(tmp_path):
    """With every flag on: the items of two epochs computed here, here again after another
    global seed and draws from it, by two persistent loader workers that learn the epoch from
    set_epoch, and in another process, are the same bit for bit; the process's generator is left
    as it was. The items augment (differ from the plain images) and differ from epoch to epoch."""
    torch.manual_seed(0)
    here = _items(_all_on(), (0, 1))
    state = torch.get_rng_state()
    torch.manual_seed(99)
    torch.rand(17)
    state_99 = torch.get_rng_state()
    _same(here, _items(_all_on(), (0, 1)))
    assert torch.equal(torch.get_rng_state(), state_99), "the process's generator is given back"
    assert not torch.equal(state, state_99)

    split = _all_on()
    loader = DataLoader(split, batch_size=5, num_workers=2, persistent_workers=True, generator=torch.Generator())
    workers = {}
    for epoch in (0, 1):
        split.set_epoch(epoch)
        for batch, (images, targets, keys) in enumerate(loader):
            for row in range(len(keys)):
                workers[(epoch, batch * 5 + row)] = (images[row], targets[row], int(keys[row]))
    _same(here, workers)

    path = tmp_path / "items.pt"
    subprocess.run([sys.executable, "-c", "import sys; sys.path[:0] = sys.argv[1:3]; import test_augment; "
                    "test_augment.subprocess_items(sys.argv[3])", str(ROOT), str(ROOT / "tests"), str(path)],
                   check=True, cwd=ROOT, timeout=300)
    _same(here, torch.load(path, weights_only=True))

    plain = _images(24, 32)
    assert sum(torch.equal(image, plain[position + 2][0]) for (_, position), (image, _, _) in here.items()) == 0
    assert sum(torch.equal(here[(0, p)][0], here[(1, p)][0]) for p in range(22)) == 0, "anew each epoch"
    assert all(target.shape == (2,) and target.dtype == torch.float32 for _, target, _ in here.values())


def test_each_draw_of_a_key_has_a_stream_of_its_own(monkeypatch):
    """The seeds that one sample's draws come from (crop, policy, erasing, partner, mixing) and its
    dropout key are six different ones: no two draws share a stream, so none is a function of
    another's, and switching one flag on changes none of the other draws."""
    seeds = []
    real = aug.derive_seed

    def recorded(*parts):
        seed = real(*parts)
        seeds.append((parts, seed))
        return seed
    monkeypatch.setattr(aug, "derive_seed", recorded)
    split = TrainSplit(_images(6, 32), [0, 1, 2, 3, 4, 5], _flags(**ALL))
    split.set_epoch(4)
    split[3]
    own = {seed for parts, seed in seeds if parts[:3] == (7, 4, 3)}
    own.add(sample_key(7, 4, 3))
    assert len(own) == 6, seeds
    assert real(7, 4, 3) in own, "the crop's seed: --augment's draws as they were"


# --auto-augment

def test_trivial_augment_draws_each_operation_and_magnitude_equally_often(monkeypatch):
    """TrivialAugmentWide's 14 operations each 1/14 of the time; each operation's magnitude one of
    its 31 bins, uniformly, and signed ones negated half the time; a sample draws anew in another
    epoch (the same operation 1/14 of the time)."""
    seen = _spy_policy(monkeypatch, v2.TrivialAugmentWide)
    n = 7000
    split = TrainSplit(_images(1, 8) * n, list(range(n)), _flags(auto_augment="ta_wide"))
    _items(split, (0,))
    first = list(seen)
    space = v2.TrivialAugmentWide._AUGMENTATION_SPACE
    counts = collections.Counter(op for op, _ in first)
    assert len(first) == n and set(counts) == set(space)
    for op in space:
        assert _within(counts[op], n, 1 / len(space)), (op, counts)
    bins, negative, signed = collections.Counter(), 0, 0
    for op, magnitude in first:
        magnitudes = space[op][0](31, 8, 8)
        if magnitudes is None:
            assert magnitude == 0
            continue
        found = (magnitudes.double() - abs(magnitude)).abs()
        assert found.min() < 1e-6, (op, magnitude)
        if op != "Posterize":  # its 31 bins round to 7 values: the bin is not told by the value
            bins[int(found.argmin())] += 1
        if space[op][1] and magnitude != 0:  # a signed one (the sign of bin 0's 0 is not seen)
            signed += 1
            negative += magnitude < 0
    assert all(_within(bins[b], sum(bins.values()), 1 / 31) for b in range(31)), bins
    assert _within(negative, signed, 0.5)
    seen.clear()
    _items(split, (1,))
    assert _within(sum(a[0] == b[0] for a, b in zip(first, seen)), n, 1 / len(space))


@pytest.mark.parametrize("magnitude", [5, 20])
def test_randaugment_applies_two_operations_at_ra_magnitude(magnitude, monkeypatch):
    seen = _spy_policy(monkeypatch, v2.RandAugment)
    n = 300
    split = TrainSplit(_images(1, 8) * n, list(range(n)), _flags(auto_augment="ra", ra_magnitude=magnitude))
    _items(split, (0,))
    assert len(seen) == 2 * n
    space = v2.RandAugment._AUGMENTATION_SPACE
    measured = 0
    for op, value in seen:
        magnitudes = space[op][0](31, 8, 8)
        if magnitudes is not None:
            assert abs(abs(value) - float(magnitudes[magnitude])) < 1e-6, (op, value)
            measured += 1
    assert measured > n / 2


@pytest.mark.parametrize("severity", [1, 4])
def test_augmix_draws_its_magnitudes_below_augmix_severity(severity, monkeypatch):
    """AugMix's chains draw each operation's magnitude from its first `severity` bins of 10, each of
    them (uniformly, as torchvision draws it)."""
    seen = _spy_policy(monkeypatch, v2.AugMix)
    n = 300
    split = TrainSplit(_images(1, 8) * n, list(range(n)), _flags(auto_augment="augmix", augmix_severity=severity))
    _items(split, (0,))
    space, bins = v2.AugMix._AUGMENTATION_SPACE, collections.Counter()
    for op, value in seen:
        magnitudes = space[op][0](10, 8, 8)
        if magnitudes is not None and op != "Posterize":
            found = (magnitudes.double() - abs(value)).abs()
            assert found.min() < 1e-6
            bins[int(found.argmin())] += 1
    assert set(bins) == set(range(severity)), bins


def test_each_policy_runs_on_the_uint8_images():
    for name in ("ta_wide", "ra", "augmix"):
        split = TrainSplit(_images(4, 32), [0, 1, 2, 3], _flags(auto_augment=name))
        images = [split[p][0] for p in range(4)]
        assert all(image.dtype == torch.uint8 and image.shape == (3, 32, 32) for image in images)


# --random-erase

SIZE = 64
GRID = 2000


def _erased_shares() -> tuple[float, np.ndarray]:
    """(the chance that one try fits, the erased area shares of the tries that fit, each of equal
    weight), over a GRID x GRID grid of the two uniform draws of v2.RandomErasing's try: the area
    share in [0.02, 0.33], the log aspect ratio in [log 0.3, log 3.3]; sides rounded as it rounds
    them, a try fitting when both sides are below SIZE (the grid's error is below 1e-3)."""
    u = (np.arange(GRID) + 0.5) / GRID
    area = SIZE * SIZE * (0.02 + 0.31 * u)[:, None]
    ratio = np.exp(math.log(0.3) + (math.log(3.3) - math.log(0.3)) * u)[None, :]
    h, w = np.round(np.sqrt(area * ratio)), np.round(np.sqrt(area / ratio))
    fits = (h < SIZE) & (w < SIZE)
    return float(fits.mean()), (h * w)[fits] / SIZE ** 2


def test_random_erasing_erases_with_probability_p_a_box_of_the_documented_area():
    """--random-erase P: an image erased with probability P (x the chance that one of ten tries
    fits), the box's area share distributed as v2.RandomErasing's scale (0.02, 0.33) and ratio
    (0.3, 3.3) give it, its place uniform, and its pixels the ImageNet mean: 0 once normalised."""
    p, n = 0.5, 4000
    zeros = torch.zeros(3, SIZE, SIZE, dtype=torch.uint8)
    split = TrainSplit([(zeros, 0)] * n, list(range(n)), _flags(random_erase=p))
    fit, shares = _erased_shares()
    erased, areas, above, below = 0, [], 0, 0
    for image, _, _ in _items(split, (0,)).values():
        rows, cols = image.any(0).any(1).nonzero()[:, 0], image.any(0).any(0).nonzero()[:, 0]
        if len(rows) == 0:
            continue
        erased += 1
        top, h, left, w = int(rows[0]), len(rows), int(cols[0]), len(cols)
        box = image[:, top:top + h, left:left + w]
        assert (box == torch.tensor(ERASE_FILL, dtype=torch.uint8)[:, None, None]).all(), "one box, the fill"
        assert int(image.any(0).sum()) == h * w
        areas.append(h * w / SIZE ** 2)
        if 2 * top != SIZE - h:  # the middle place has no side
            above += 2 * top < SIZE - h
            below += 2 * top > SIZE - h
    assert _within(erased, n, p * (1 - (1 - fit) ** 10))
    areas = np.array(areas)
    for share in (0.08, 0.16, 0.24):
        assert _within((areas <= share).sum(), erased, float((shares <= share).mean())), share
    assert _within(above, above + below, 0.5)
    fill = normalize(torch.tensor(ERASE_FILL, dtype=torch.uint8).view(1, 3, 1, 1))
    assert fill.abs().max() <= 0.5 / 255 / min(IMAGENET_STD)


# Partners and mixing

def test_the_partner_is_drawn_uniformly_from_the_others_of_the_split_and_loaded_by_the_dataset():
    """Each sample's partner: any other position of the training split, equally often, never
    itself; read through `dataset` at its index; anew each epoch."""
    n, epochs = 30, 150
    indices = list(range(5, 5 + n))
    recorded = Recorded(_images(40, 8))
    split = TrainSplit(recorded, indices, _flags(mixup_alpha=1.0))
    counts, same = collections.Counter(), 0
    previous = {}
    for epoch in range(epochs):
        split.set_epoch(epoch)
        for position in range(n):
            recorded.read.clear()
            split[position]
            index, other = recorded.read
            assert index == indices[position] and other != index and other in indices
            assert other == indices[partner(7, epoch, index, position, n)]
            counts[other] += 1
            same += previous.get(position) == other
            previous[position] = other
    # each of the other n - 1 positions draws a sample once an epoch, with chance 1 / (n - 1)
    assert all(_within(counts[index], epochs * (n - 1), 1 / (n - 1)) for index in indices), counts
    assert _within(same, (epochs - 1) * n, 1 / (n - 1))


def _beta_cdf(x: float, alpha: float) -> float:
    """Beta(alpha, alpha)'s CDF at x, integrated: with t = s^(1 / alpha) the density's
    t^(alpha - 1) dt is ds / alpha, leaving the smooth (1 - s^(1 / alpha))^(alpha - 1) on
    [0, x^alpha] for x <= 1/2 (trapezoids of 1/4000: error below 1e-6); the rest by symmetry."""
    if x > 0.5:
        return 1 - _beta_cdf(1 - x, alpha)
    s = np.linspace(0, x ** alpha, 4001)
    f = (1 - s ** (1 / alpha)) ** (alpha - 1)
    norm = math.exp(2 * math.lgamma(alpha) - math.lgamma(2 * alpha))
    return float(np.trapezoid(f, s) / alpha / norm)


def _ks_distance(values: list[float], cdf) -> float:
    values = np.sort(np.array(values))
    n = len(values)
    at = np.array([cdf(value) for value in values])
    return float(max((np.arange(1, n + 1) / n - at).max(), (at - np.arange(n) / n).max()))


def test_the_beta_cdf_integration_against_closed_forms():
    """Beta(1, 1) is uniform; Beta(1/2, 1/2)'s CDF is (2 / pi) asin(sqrt(x))."""
    for x in (0.01, 0.2, 0.5, 0.77):
        assert abs(_beta_cdf(x, 1.0) - x) < 1e-6
        assert abs(_beta_cdf(x, 0.5) - 2 / math.pi * math.asin(math.sqrt(x))) < 1e-4


@pytest.mark.parametrize("flag, alpha", [("mixup_alpha", 0.2), ("cutmix_alpha", 1.0)])
def test_lambda_follows_beta_alpha_alpha(flag, alpha, monkeypatch):
    """lambda ~ Beta(alpha, alpha) over many keys: the empirical CDF within the DKW bound of it."""
    seen = _spy_mixers(monkeypatch)
    n = 4000
    split = TrainSplit(_images(50, 8), list(range(50)), _flags(**{flag: alpha}))
    epochs = range(n // 50)
    _items(split, epochs)
    assert len(seen) == n
    bound = math.sqrt(math.log(2 / FALSE_ALARM) / (2 * n))
    assert _ks_distance([params["raw"] for _, params in seen], lambda x: _beta_cdf(x, alpha)) < bound


def test_mixup_and_cutmix_each_mix_half_of_the_samples_with_both_alphas(monkeypatch):
    """With both alphas, RandomChoice takes MixUp for half of the samples and CutMix for the
    other half, each drawing lambda ~ Beta(its own alpha, its own alpha)."""
    seen = _spy_mixers(monkeypatch)
    n = 4000
    split = TrainSplit(_images(50, 8), list(range(50)), _flags(mixup_alpha=0.2, cutmix_alpha=1.0))
    _items(split, range(n // 50))
    kinds = collections.Counter(kind for kind, _ in seen)
    assert set(kinds) == {"MixUp", "CutMix"} and _within(kinds["MixUp"], n, 0.5), kinds
    for kind, alpha in (("MixUp", 0.2), ("CutMix", 1.0)):  # each draws lambda with its own alpha
        raw = [params["raw"] for name, params in seen if name == kind]
        bound = math.sqrt(math.log(2 / FALSE_ALARM) / (2 * len(raw)))
        assert _ks_distance(raw, lambda x: _beta_cdf(x, alpha)) < bound, kind


def test_mixup_blends_the_two_augmented_images_and_their_labels_by_lambda(monkeypatch):
    """The image is lambda x a + (1 - lambda) x b rounded to uint8, a and b each augmented from
    its own key; the target lambda x one_hot(a) + (1 - lambda) x one_hot(b)."""
    seen = _spy_mixers(monkeypatch)
    dataset = _images(20, 16)
    recorded = Recorded(dataset)
    split = TrainSplit(recorded, list(range(20)), _flags(augment=True, random_erase=0.5, mixup_alpha=1.0))
    split.set_epoch(3)
    for position in range(20):
        recorded.read.clear()
        image, target, _ = split[position]
        a, b = recorded.read
        lam = seen[-1][1]["lam"]
        first = split.augmented(dataset[a][0], 3, a).float()
        second = split.augmented(dataset[b][0], 3, b).float()
        assert (image.float() - (lam * first + (1 - lam) * second)).abs().max() <= 0.5 + 1e-3
        expected = lam * F.one_hot(torch.tensor(dataset[a][1]), 2) + (1 - lam) * F.one_hot(torch.tensor(dataset[b][1]), 2)
        assert torch.allclose(target, expected.float(), atol=1e-6)


def test_cutmix_pastes_a_box_of_the_partner_and_lambda_is_the_share_left(monkeypatch):
    """Each pixel is the sample's or its partner's (each augmented from its own key), the partner's
    in one box, and lambda is corrected to the share of the image left to the sample (v2.CutMix's
    correction: the drawn lambda differs where the box was clipped at the border)."""
    seen = _spy_mixers(monkeypatch)
    dataset = _images(30, 16)
    recorded = Recorded(dataset)
    split = TrainSplit(recorded, list(range(30)), _flags(augment=True, cutmix_alpha=1.0))
    corrected = 0
    for epoch in range(4):
        split.set_epoch(epoch)
        for position in range(30):
            recorded.read.clear()
            image, target, _ = split[position]
            a, b = recorded.read
            first, second = split.augmented(dataset[a][0], epoch, a), split.augmented(dataset[b][0], epoch, b)
            pasted = (image == second).all(0) & (image != first).any(0)
            assert ((image == first).all(0) | pasted).all()
            x1, y1, x2, y2 = seen[-1][1]["box"]
            box = torch.zeros(16, 16, dtype=torch.bool)
            box[y1:y2, x1:x2] = True
            assert not (pasted & ~box).any() and (image[:, box] == second[:, box]).all()
            lam = 1 - box.sum().item() / 16 ** 2
            label = lam * F.one_hot(torch.tensor(dataset[a][1]), 2) + (1 - lam) * F.one_hot(torch.tensor(dataset[b][1]), 2)
            assert torch.allclose(target, label.float(), rtol=0, atol=2 ** -23)
            corrected += abs(seen[-1][1]["raw"] - lam) > 0.05
    assert corrected > 10


def test_a_mixed_targets_loss_is_the_mix_of_the_two_losses_with_label_smoothing_once(monkeypatch):
    """The scripts' loss, F.cross_entropy(logits, target, label_smoothing=S), of a mixed target is
    lambda x CE_S(a) + (1 - lambda) x CE_S(b): the target is not smoothed already."""
    seen = _spy_mixers(monkeypatch)
    dataset = Recorded(_images(40, 8))
    split = TrainSplit(dataset, list(range(40)), _flags(mixup_alpha=0.4, cutmix_alpha=1.0))
    targets, lams, pairs = [], [], []
    for position in range(40):
        dataset.read.clear()
        targets.append(split[position][1])
        lams.append(seen[-1][1].get("lam", seen[-1][1].get("lam_adjusted")))
        pairs.append([dataset.dataset[index][1] for index in dataset.read])
    targets, lam, (a, b) = torch.stack(targets), torch.tensor(lams), torch.tensor(pairs).T
    assert torch.allclose(targets.sum(1), torch.ones(40)) and (targets >= 0).all()
    logits = torch.randn(40, 2, generator=torch.Generator().manual_seed(1))
    for smoothing in (0.0, 0.1):
        loss = F.cross_entropy(logits, targets, label_smoothing=smoothing, reduction="none")
        each = [F.cross_entropy(logits, labels, label_smoothing=smoothing, reduction="none") for labels in (a, b)]
        assert torch.allclose(loss, lam * each[0] + (1 - lam) * each[1], atol=1e-5)


# Metrics of soft targets

def test_batch_sums_of_soft_targets_count_the_dominant_label():
    """The loss sum is F.cross_entropy's with the soft targets, the log loss weighted the same way,
    a correct prediction is the target's argmax; hard labels sum as one-hot targets do."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(64, 2, generator=generator) * 3
    lam = torch.rand(64, generator=generator)
    a, b = torch.randint(0, 2, (64,), generator=generator), torch.randint(0, 2, (64,), generator=generator)
    targets = lam[:, None] * F.one_hot(a, 2) + (1 - lam[:, None]) * F.one_hot(b, 2)
    loss, correct, count, log_loss = batch_sums(logits, targets).tolist()
    log_p = logits.double().log_softmax(1)
    assert math.isclose(loss, -(targets.double() * log_p).sum().item(), rel_tol=1e-5)
    dominant = torch.where(targets[:, 1] > targets[:, 0], 1, 0)
    assert correct == (logits.argmax(1) == dominant).sum().item() and count == 64
    assert 0 < correct < 64 and (dominant != a).any(), "a test that tells the dominant label from a"
    p_dog = log_p.exp()[:, 1].clamp(EPS, 1 - EPS)
    expected = -(targets[:, 1].double() * p_dog.log() + targets[:, 0].double() * (1 - p_dog).log()).sum()
    assert math.isclose(log_loss, expected.item(), rel_tol=1e-5)
    assert torch.allclose(batch_sums(logits, a), batch_sums(logits, F.one_hot(a, 2).float()), rtol=1e-6)
    # hard labels: the sums as they were before soft targets, bit for bit
    p_dog = logits.softmax(1)[:, 1].clamp(EPS, 1 - EPS)
    before = torch.stack([F.cross_entropy(logits, a, reduction="sum"), (logits.argmax(1) == a).sum().float(),
                          torch.tensor(64.0), -torch.where(a == 1, p_dog.log(), (1 - p_dog).log()).sum()])
    assert torch.equal(batch_sums(logits, a), before)
    # the sums keep no graph: an epoch's running sum would hold every micro-batch's until its end
    assert batch_sums(logits.clone().requires_grad_(), a).grad_fn is None


# The flags, resume, the feature cache

@pytest.mark.parametrize("argv, message", [
    (["--mixup-alpha", "-1"], "argument --mixup-alpha: must be >= 0, got -1.0"),
    (["--cutmix-alpha", "inf"], "argument --cutmix-alpha: must be a finite number, got inf"),
    (["--random-erase", "1.5"], "argument --random-erase: must be in [0, 1], got 1.5"),
    (["--auto-augment", "bogus"], "argument --auto-augment: invalid choice: 'bogus'"),
    (["--ra-magnitude", "99"], "argument --ra-magnitude: must be at most 30, got 99"),
    (["--augmix-severity", "0"], "argument --augmix-severity: must be at least 1, got 0"),
])
def test_bad_augmentation_values_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args("", argv)
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


def test_the_flags_reach_the_transforms():
    args = parse_args("", ["--auto-augment", "ra", "--ra-magnitude", "13", "--random-erase", "0.25",
                           "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"])
    assert aug.policy(args).magnitude == 13 and aug.eraser(args).p == 0.25
    mixers = aug.mixer(args).transforms
    assert [(type(m).__name__, m.alpha) for m in mixers] == [("MixUp", 0.2), ("CutMix", 1.0)]
    assert aug.policy(parse_args("", ["--auto-augment", "augmix", "--augmix-severity", "6"])).severity == 6
    defaults = parse_args("", [])
    assert (defaults.ra_magnitude, defaults.augmix_severity) == (9, 3), "the reference's defaults"
    assert aug.policy(defaults) is None and aug.eraser(defaults) is None and aug.mixer(defaults) is None


CHANGES = [("--auto-augment", "ta_wide", "off, not ta_wide"), ("--ra-magnitude", "5", "9, not 5"),
           ("--augmix-severity", "4", "3, not 4"), ("--random-erase", "0.25", "0.0, not 0.25"),
           ("--mixup-alpha", "0.2", "0.0, not 0.2"), ("--cutmix-alpha", "1.0", "0.0, not 1.0")]
TUNED = {"--ra-magnitude": ["--auto-augment", "ra"], "--augmix-severity": ["--auto-augment", "augmix"]}


def _resume(tmp_path, *argv: str, drop: tuple = (), base: tuple = ()) -> list:
    """checkpoint.load_last of a last.pth written with the default flags and `base` (less the info
    keys `drop`, as a last.pth older than them), asked with base and argv."""
    flags = ["--checkpoint", str(tmp_path / "best.pth"), "--workers", "0", *base]
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    info = checkpoint.run_info(parse_args("", flags), 50, "data")
    info = {key: value for key, value in info.items() if key not in drop}
    torch.save(checkpoint.last_state([], model.state_dict(), optimizer.state_dict(), None, None, schedule, info),
               tmp_path / "last.pth")
    args = parse_args("", [*flags, "--resume", *argv])
    return checkpoint.load_last(args, checkpoint.run_info(args, 50, "data"), model, optimizer, None, schedule).history


@pytest.mark.parametrize("flag, value, shown", CHANGES)
def test_resume_refuses_another_augmentation(flag, value, shown, tmp_path):
    with pytest.raises(UserError) as caught:
        _resume(tmp_path, flag, value, base=tuple(TUNED.get(flag, ())))
    assert f"was trained with {flag} {shown}" in str(caught.value) and "\n" not in str(caught.value)


def test_a_last_pth_older_than_the_flags_resumes_with_their_defaults(tmp_path):
    added = ("auto_augment", "ra_magnitude", "augmix_severity", "random_erase", "mixup_alpha", "cutmix_alpha")
    assert _resume(tmp_path, drop=added) == []
    with pytest.raises(UserError, match=r"was trained with --mixup-alpha 0.0, not 0.2"):
        _resume(tmp_path, "--mixup-alpha", "0.2", drop=added)


class _Pixels(MappedArray):
    """A few uint8 images with the pixel cache's `labels`, in memory."""

    def __init__(self):
        self.items = _images(6, 32)
        self.labels = [label for _, label in self.items]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index]


@pytest.mark.parametrize("argv", [["--augment"], ["--auto-augment", "ta_wide"], ["--random-erase", "0.1"],
                                  ["--mixup-alpha", "0.2"], ["--cutmix-alpha", "1.0"]])
def test_the_feature_cache_is_not_used_with_any_augmentation_or_mixing(argv, tmp_path, capsys):
    """The frozen backbone's outputs of images that change every epoch (or are mixed) cannot be
    computed once: the frozen epochs train from the images, and say why. Without the flags the
    same call builds the cache."""
    torch.manual_seed(0)
    model = build_model("resnet18", "none")
    base = ["--freeze", "--cache", str(tmp_path), "--arch", "resnet18", "--image-size", "32", "--workers", "0"]
    assert backbone_outputs(parse_args("", base + argv), model, _Pixels(), torch.device("cpu"), 0) is None
    assert f"--freeze with {argv[0]} trains from the images" in capsys.readouterr().out
    assert not list(tmp_path.glob("features_*"))
    assert len(backbone_outputs(parse_args("", base), model, _Pixels(), torch.device("cpu"), 0)) == 6
    assert list(tmp_path.glob("features_*.f32"))



# Validation sees none of it

def test_validation_with_every_augmentation_flag_is_that_without_them_and_trainings_own(reference, exact_data,
                                                                                        monkeypatch, capsys):
    """train_single.py --evaluate of the full recipe run's best.pth (src/inference.py, through the
    script's own validation loader and pass), with every recipe flag on (the modern augmentation's
    among them) and with none: the same sums, so the same record, bit for bit; and the figures the
    run's training recorded for that epoch and those weights (best.json's `weights`: the weights or
    their average), to the order of float32 sums (101 x u)."""
    base = ["--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "2", "--batch-size", str(B),
            "--checkpoint", str(reference / "best.pth"), "--evaluate"]
    records = []
    for flags in (RECIPE, []):
        code, out, err = in_process(train_single.main, [*base, *flags], monkeypatch, capsys)
        assert code == 0, err[-3000:]
        records.append({k: v for k, v in evaluated_record(out).items() if k != "val_seconds"})
    assert records[0] == records[1]
    info = json.loads((reference / "best.json").read_text())
    suffix = "_ema" if info["weights"] == "average" else ""
    trained = history(reference)[info["epoch"] - 1]
    assert records[0]["val_samples"] == trained["val_samples"] == 101
    assert records[0]["val_acc"] == trained["val_acc" + suffix]
    for key in ("val_loss", "val_log_loss"):
        assert records[0][key] == pytest.approx(trained[key + suffix], rel=101 * U, abs=0), (key, records, trained)
