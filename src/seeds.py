"""Every random draw of a run as a function of the seed and of where it happens.

Nothing random is carried from one epoch to the next: each epoch reseeds the CPU and CUDA
generators from (seed, epoch, rank) (each GPU's from its index too), and each training image's
augmentation draws from its own generator seeded with (seed, epoch, sample index). So a resumed
or restarted run draws exactly what an uninterrupted one does, on a CPU or a GPU, without saving
any generator state.
"""
import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers; different tuples give unrelated streams."""
    digest = hashlib.sha256(" ".join(str(int(part)) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_epoch(seed: int, epoch: int, rank: int = 0) -> None:
    """Seed the CPU generator and every GPU's for this epoch on this rank (dropout masks).

    Each GPU gets a seed of its own: DataParallel's replicas draw their dropout masks in step,
    each from its own GPU's generator, and torch.manual_seed gives them all the same seed (the
    same masks on every GPU). Seeding a generator is host state: no GPU is touched.
    """
    torch.manual_seed(derive_seed(seed, epoch, rank))
    if torch.cuda.is_available():
        torch.cuda.init()  # fills default_generators (a no-op once the run has used its GPU)
        for gpu, generator in enumerate(torch.cuda.default_generators):
            generator.manual_seed(derive_seed(seed, epoch, rank, gpu))
