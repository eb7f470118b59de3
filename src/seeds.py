"""Every random draw of a run as a function of the seed and of where it happens.

Nothing random is carried from one epoch to the next: each training image's augmentation draws
from generators seeded with (seed, epoch, sample index) and a stream per draw (src/augment.py:
torchvision's transforms borrow the process's CPU generator so seeded, and give it back as it
was), and its dropout masks are a hash of a key made the same way (src/dropout.py); the
process's CPU and CUDA generators, which none of the project's draws leave changed, are reseeded
every epoch from (seed, epoch) (each GPU's from its index too) for whatever torch code draws from
them. So a resumed or restarted run draws exactly what an
uninterrupted one does, in every mode, on a CPU or a GPU, without saving any generator state.
"""
import hashlib

import torch


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers; different tuples give unrelated streams."""
    digest = hashlib.sha256(" ".join(str(int(part)) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_epoch(seed: int, epoch: int, rank: int = 0) -> None:
    """Seed the CPU generator and every GPU's for this epoch (and `rank`: the scripts leave it at 0).

    The project's own draws (dropout, augmentation) leave these generators as they were; what else draws
    from them does so the same after a resume. Each GPU gets a seed of its own: torch.manual_seed
    gives them all the same one, and DataParallel's replicas, each on its own GPU, would draw
    alike. Seeding a generator is host state: no GPU is touched.
    """
    torch.manual_seed(derive_seed(seed, epoch, rank))
    if torch.cuda.is_available():
        torch.cuda.init()  # fills default_generators (a no-op once the run has used its GPU)
        for gpu, generator in enumerate(torch.cuda.default_generators):
            generator.manual_seed(derive_seed(seed, epoch, rank, gpu))
