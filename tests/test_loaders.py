"""The split and the samplers: the same global batches in every mode, each validation sample once."""
import pytest
import torch

from src.errors import UserError
from src.loaders import EpochSampler, make_loaders, split_indices


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


def _batches(n, batch_size, world_size, epoch, seed=7, accumulate=1):
    """Per optimizer step, the set of dataset indices that all ranks together train on."""
    data = [(torch.zeros(1), i) for i in range(n)]  # the label is the sample's index
    per_rank = []
    for rank in range(world_size):
        loader, _ = make_loaders(data, list(range(n)), list(range(world_size)), batch_size, seed,
                                 workers=0, rank=rank, world_size=world_size, accumulate=accumulate)
        loader.sampler.set_epoch(epoch)
        micro = [labels.tolist() for _, labels, _ in loader]
        per_rank.append([sum(micro[i:i + accumulate], []) for i in range(0, len(micro), accumulate)])
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


@pytest.mark.parametrize("world_size, accumulate", [(1, 4), (2, 2), (4, 1)])
def test_accumulation_takes_the_steps_of_more_processes(world_size, accumulate):
    """--accumulate N with W processes of B images: the steps of N * W processes."""
    n, batch = 103, 5
    for epoch in range(2):
        steps = _batches(n, batch, world_size, epoch, accumulate=accumulate)
        assert steps == _batches(n, batch * 4, 1, epoch)
        assert len(steps) == n // (batch * 4) and all(len(step) == batch * 4 for step in steps)


def test_the_sampler_matches_distributed_samplers_order():
    """Our sampler yields DistributedSampler's seeded permutation (and the epoch with each index)."""
    from torch.utils.data import DistributedSampler
    for rank in (0, 1):
        ours = EpochSampler(103, 10, seed=7, rank=rank, world_size=2)
        theirs = DistributedSampler(range(103), num_replicas=2, rank=rank, seed=7, drop_last=True)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert [(epoch, i) for i in list(theirs)[:len(ours)]] == list(ours)


@pytest.mark.parametrize("n, world_size", [(101, 2), (101, 3), (7, 4), (5, 5)])
def test_validation_shards_cover_every_sample_once(n, world_size):
    """The validation loaders make_loaders gives each rank: together every validation sample,
    each once (no padding, which would count a sample twice), whatever the number of ranks."""
    data = [(torch.zeros(1), i) for i in range(2 * n)]  # the label is the sample's index
    val_idx = list(range(n, 2 * n))
    seen = []
    for rank in range(world_size):
        _, val_loader = make_loaders(data, list(range(n)), val_idx, 1, 0, 0, rank=rank, world_size=world_size)
        seen += [label for _, labels in val_loader for label in labels.tolist()]
    assert sorted(seen) == val_idx


def test_too_large_a_batch_or_too_many_processes():
    data = [(torch.zeros(1), i) for i in range(10)]
    with pytest.raises(UserError, match="--batch-size 6 x 2 process"):
        make_loaders(data, list(range(10)), [0, 1], 6, 0, 0, rank=0, world_size=2)
    # Every rank checks before any collective (so none waits for the others); rank 0 alone says it.
    for rank in range(3):
        with pytest.raises(UserError, match="3 processes but only 2 validation images") as error:
            make_loaders(data, list(range(8)), [8, 9], 1, 0, 0, rank=rank, world_size=3)
        assert error.value.quiet == (rank != 0)


@pytest.mark.parametrize("world_size, accumulate", [(1, 1), (2, 2), (3, 1)])
def test_a_resumed_epoch_skips_its_finished_steps_without_reading_their_images(world_size, accumulate):
    """start_at(k) after set_epoch: each rank's loader hands out what an uninterrupted epoch hands
    out after its k-th optimizer step, and the data set reads none of the samples before; accelerate
    sets the same epoch again as its loader begins (kept), the next epoch starts from its first step."""
    n, batch, k = 103, 5, 2
    reads = []

    class Counted(torch.utils.data.Dataset):
        def __len__(self):
            return n

        def __getitem__(self, index):
            reads.append(index)
            return torch.zeros(1), index

    for rank in range(world_size):
        loader, _ = make_loaders(Counted(), list(range(n)), list(range(world_size)), batch, 7, workers=0, rank=rank,
                                 world_size=world_size, accumulate=accumulate)
        loader.sampler.set_epoch(3)
        whole = [labels.tolist() for _, labels, _ in loader]
        reads.clear()
        loader.sampler.set_epoch(3)
        loader.sampler.start_at(k)
        loader.sampler.set_epoch(3)
        assert len(loader) == len(whole) - k * accumulate
        assert [labels.tolist() for _, labels, _ in loader] == whole[k * accumulate:]
        assert sorted(reads) == sorted(sum(whole[k * accumulate:], []))
        loader.sampler.set_epoch(4)
        assert len(loader) == len(whole)
