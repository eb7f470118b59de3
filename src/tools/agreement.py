"""How close two runs end: the distance between their weights, and the share of it that the modes
are held to (docs/modes.md)."""
import torch

# How far apart two runs of the same job may end, as a share of "far": the distance between a run
# and the same job with another global batch, which takes other steps. Measured for 2 epochs of
# SqueezeNet: DDP and accelerate with 2 processes end 7e-5 of far from train_single.py (the
# processes run one thread each, the single one two: float sums in another order); DataParallel
# on the CPU, 0.
TOLERANCE = 1e-3


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The Euclidean distance between two state_dicts with the same keys, all tensors as one vector."""
    if a.keys() != b.keys():
        raise ValueError(f"the state_dicts hold other tensors: {sorted(a.keys() ^ b.keys())[:3]}")
    total = torch.zeros((), dtype=torch.float64)  # added in the keys' order, as sum() did from 0
    for k in a:
        total += ((a[k].double() - b[k].double()) ** 2).sum()
    return total.sqrt().item()
