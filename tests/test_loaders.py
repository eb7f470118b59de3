"""The split and the samplers: the same global batches in every mode, each validation sample once."""
import pytest
import torch
from torch.utils.data import TensorDataset

from src.errors import UserError
from src.loaders import ShardSampler, make_loaders, split_indices


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_indices(101, 0.2, seed=42)
    assert (train, val) == split_indices(101, 0.2, seed=42)
    assert len(val) == 20 and len(train) == 81
    assert sorted(train + val) == list(range(101))
    assert split_indices(101, 0.2, seed=43) != (train, val)


@pytest.mark.parametrize("fraction, n", [(0.001, 100), (0.999, 100)])
def test_split_that_would_be_empty_is_refused(fraction, n):
    with pytest.raises(UserError, match="--val-fraction"):
        split_indices(n, fraction, seed=0)


def _batches(n, batch_size, world_size, epoch, seed=7):
    """Per step, the set of dataset indices that all ranks together train on."""
    data = TensorDataset(torch.arange(n))
    per_rank = []
    for rank in range(world_size):
        loader, _ = make_loaders(data, list(range(n)), list(range(world_size)), batch_size, seed,
                                 workers=0, rank=rank, world_size=world_size)
        loader.sampler.set_epoch(epoch)
        per_rank.append([batch[0].tolist() for batch in loader])
    assert len({len(batches) for batches in per_rank}) == 1
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ddp_global_batches_equal_single_process_batches(world_size):
    n, batch = 103, 5
    for epoch in range(3):
        single = _batches(n, batch * world_size, 1, epoch)
        assert _batches(n, batch, world_size, epoch) == single
        assert len(single) == n // (batch * world_size)
    assert _batches(n, batch, 1, 0) != _batches(n, batch, 1, 1), "reshuffled each epoch"


@pytest.mark.parametrize("n, world_size", [(101, 2), (101, 3), (7, 4), (5, 5)])
def test_validation_shards_cover_every_sample_once(n, world_size):
    shards = [list(ShardSampler(n, world_size, rank)) for rank in range(world_size)]
    assert sorted(sum(shards, [])) == list(range(n))
    assert sum(len(ShardSampler(n, world_size, r)) for r in range(world_size)) == n


def test_too_large_a_batch_or_too_many_processes():
    data = TensorDataset(torch.arange(10))
    with pytest.raises(UserError, match="--batch-size 6 x 2 process"):
        make_loaders(data, list(range(10)), [0, 1], 6, 0, 0, rank=0, world_size=2)
    with pytest.raises(UserError, match="3 processes but only 2 validation images"):
        make_loaders(data, list(range(8)), [8, 9], 1, 0, 0, rank=0, world_size=3)
