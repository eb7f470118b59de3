"""Every random draw varies as documented, in the proportions it claims: --augment's crop and flip
across samples, epochs and seeds (docs/recipe.md: 25% to 100% of the area, aspect 3/4 to 4/3, a
horizontal flip), the training order across epochs and ranks, the validation split across seeds.
(Each mode draws the same: test_recipe.py, test_loaders.py; dropout's masks: test_dropout.py.)

Each share is checked against its expected value within 6 standard deviations of the binomial
or uniform draw it is (a false alarm about once in 10^8 runs); the draws are seeded, so a run
that passes passes every time."""
import math

import numpy as np
import pytest
import torch

import train_ddp
from src.augment import crop_params
from src.cli import defaults
from src.loaders import Data, split_indices

SIZE = 224  # at 224 px the rounding of a crop's sides moves its area by < 1 %
N = 4000


def _params(seed: int, epoch: int, n: int = N) -> np.ndarray:
    """(top, left, height, width, flip) of samples 0..n-1."""
    return np.array([crop_params(seed, epoch, index, SIZE) for index in range(n)], dtype=float)


def _within(count: float, n: int, p: float) -> bool:
    """A binomial count of n draws of probability p, within 6 standard deviations."""
    return abs(count - n * p) < 6 * math.sqrt(n * p * (1 - p))


def _accepted(area: np.ndarray) -> np.ndarray:
    """The chance that a try of area share `area` fits the square: its aspect ratio r, drawn
    log-uniform in [3/4, 4/3], must keep both sides within it (area <= r <= 1 / area), as
    torchvision's RandomResizedCrop (and crop_params) retries until one fits."""
    low, high = np.maximum(math.log(3 / 4), np.log(area)), np.minimum(math.log(4 / 3), -np.log(area))
    return np.clip(high - low, 0, None) / math.log(16 / 9)


def _area_share(below: float) -> float:
    """P(area < below) of an accepted crop: the uniform draw on [0.25, 1] weighted by _accepted
    (numerically integrated; a failure of all 10 tries, (1 - 0.62)^10, is neglected)."""
    grid = np.linspace(0.25, 1, 200_001)
    weight = _accepted(grid)
    return float(weight[grid < below].sum() / weight.sum())


def test_augmentation_crops_and_flips_in_the_documented_proportions():
    """Across samples: half of them flipped; a crop's area spans 25 % to 100 % of the image, and
    since a large crop of an extreme aspect does not fit and is drawn again, the small ones are
    more frequent than a uniform draw gives: 40.4 % of them below half of the area, not a third
    (hand-computed by _area_share); the aspect ratio spans 3/4 to 4/3, as many wide as tall and
    log-symmetric; the position uniform over the places the crop fits."""
    top, left, height, width, flip = _params(11, 0).T
    assert _within(flip.sum(), N, 0.5)
    area = height * width / SIZE ** 2
    assert 0.25 * 0.99 <= area.min() < 0.26 and 0.95 < area.max() <= 1.0
    assert _area_share(0.5) == pytest.approx(0.404, abs=0.001)
    for below in (0.4, 0.5, 0.7, 0.9):
        assert _within((area < below).sum(), N, _area_share(below)), below
    ratio = width / height
    assert 0.75 * (1 - 2 / SIZE) <= ratio.min() < 0.77 and 1.3 < ratio.max() <= 4 / 3 * (1 + 2 / SIZE)
    assert _within((ratio > 1).sum(), N, 0.5)
    assert abs(np.log(ratio).mean()) < 6 * math.log(16 / 9) / math.sqrt(12 * N) + 1 / SIZE
    room = (SIZE - height, SIZE - width)
    for place, fits in ((top, room[0]), (left, room[1])):
        moved = fits > 0
        share = place[moved] / fits[moved]  # uniform on [0, 1] where the crop can move
        assert place.min() >= 0 and (place <= fits).all()
        assert (place == 0).any() and (place == fits)[moved].any(), "from edge to edge"
        assert abs(share.mean() - 0.5) < 6 / math.sqrt(12 * moved.sum()) + 1 / SIZE


def test_augmentation_draws_anew_each_epoch_and_for_each_seed():
    """A sample's crop in another epoch, or with another seed, is an independent draw: the same
    flip half the time, the same crop (almost) never."""
    first = _params(11, 0)
    for other in (_params(11, 1), _params(12, 0)):
        assert _within((first[:, 4] == other[:, 4]).sum(), N, 0.5)
        assert (first[:, :4] == other[:, :4]).all(axis=1).sum() < N // 100


def test_training_order_is_a_new_uniform_permutation_each_epoch_on_every_rank():
    """train_ddp.py's sampler over 300 epochs of 10 samples, 2 ranks, batches of 2 per rank (an
    epoch's 2 optimizer steps take 4 samples of each rank's): each sample is a rank's first draw
    as often as any other, each rank's share changes from epoch to epoch (a sample stays on its
    rank half of the time), and the ranks' shares are disjoint."""
    epochs, n = 300, 10
    firsts = np.zeros((2, n))
    same_rank, before = 0, None
    args = defaults(batch_size=2, seed=5, workers=0, augment=False, accumulate=1)
    dataset = [(torch.zeros(1), i) for i in range(n + 2)]
    data = Data(dataset, list(range(n)), [n, n + 1], "")
    samplers = [train_ddp.loaders(dataset, data, args, torch.device("cpu"), rank, 2)[0].sampler for rank in (0, 1)]
    for epoch in range(epochs):
        shares = []
        for rank in (0, 1):
            samplers[rank].set_epoch(epoch)
            shares.append(list(samplers[rank])[:4])
            firsts[rank, shares[-1][0]] += 1
        assert not set(shares[0]) & set(shares[1]) and len(shares[0]) == len(shares[1]) == 4
        if before is not None:
            same_rank += sum(index in before[0] for index in shares[0]) + sum(index in before[1] for index in shares[1])
        before = shares
    for rank in (0, 1):
        assert all(_within(count, epochs, 1 / n) for count in firsts[rank]), firsts[rank]
    # A sample of rank r's 4 in epoch e is among rank r's 4 in epoch e + 1 with probability 4 / 10.
    assert _within(same_rank, (epochs - 1) * 8, 0.4)


def test_the_validation_split_holds_each_image_in_the_stated_share_across_seeds():
    """split_indices: --val-fraction 0.25 of 20 images is exactly 5 for every seed, and over 400
    seeds each image is held out a quarter of the time."""
    held = np.zeros(20)
    for seed in range(400):
        train, val = split_indices(20, 0.25, seed)
        assert len(val) == 5 and sorted(train + val) == list(range(20))
        held[val] += 1
    assert all(_within(count, 400, 0.25) for count in held), held
    assert torch.tensor(held).std() > 0  # not the same images every time


def test_each_epoch_seeds_the_global_generator_from_the_seed_and_the_epoch():
    """seed_epoch: what draws from torch's global generator in an epoch (a layer the project does
    not make per-sample, a user's own) draws the same in a resumed epoch as in the straight one:
    the draws after it are those of a generator seeded with derive_seed(seed, epoch, 0)."""
    from src.seeds import derive_seed, seed_epoch
    with torch.random.fork_rng():
        draws = []
        for epoch in (3, 4, 3):
            torch.rand(5)  # whatever the run drew before
            seed_epoch(7, epoch)
            draws.append(torch.rand(5))
    expected = torch.rand(5, generator=torch.Generator().manual_seed(derive_seed(7, 3, 0)))
    assert torch.equal(draws[0], expected) and torch.equal(draws[2], expected)
    assert not torch.equal(draws[1], expected)
