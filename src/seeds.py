"""Every random draw of a run as a function of the seed and of where it happens.

Nothing random is carried from one epoch to the next: each epoch reseeds the CPU and CUDA
generators from (seed, epoch, rank), and each training image's augmentation draws from its own
generator seeded with (seed, epoch, sample index). So a resumed or restarted run draws exactly
what an uninterrupted one does, on a CPU or a GPU, without saving any generator state.
"""
import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers; different tuples give unrelated streams."""
    digest = hashlib.sha256(" ".join(str(int(part)) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_epoch(seed: int, epoch: int, rank: int = 0) -> None:
    """Seed the CPU generator and every GPU's for this epoch on this rank (dropout masks)."""
    torch.manual_seed(derive_seed(seed, epoch, rank))
