"""A run that diverged: a loss that is not finite stops it, and weights that are not finite are
never saved as best.pth or last.pth, nor used by predict, export or --resume.

The check reads the metric sums that every rank already holds on the host, all-reduced, at the
end of an epoch: every rank comes to the same verdict without a collective or a host read of its
own, and none inside a step.
"""
import math

import torch

from src.errors import UserError
from src.metrics import LOSS
from src.ranks import is_first

ADVICE = "try a lower --lr, --clip-grad-norm, --warmup-epochs, or --amp bf16 instead of fp16"


def check_finite_loss(sums: torch.Tensor, where: str, part: str = "training") -> None:
    """Stop the run (a UserError on every rank, said by rank 0) if the summed loss of `sums`
    (batch_sums of the samples of every rank, on the host) is not finite. `where`: "epoch 3",
    or a step within it; `part`: "training" or "validation"."""
    loss = float(sums[LOSS])
    if not math.isfinite(loss):
        raise UserError(f"{where}: the {part} loss is {loss}, the run diverged; stopped before saving "
                        f"anything of {where} (best.pth and last.pth, if any, are from earlier epochs): "
                        f"{ADVICE}", quiet=not is_first())


def non_finite(state: dict) -> list[str]:
    """The names of the floating-point tensors of a state_dict that hold a NaN or an infinity."""
    return [name for name, tensor in state.items()
            if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and not torch.isfinite(tensor).all()]


def check_finite_weights(state: dict, path, advice: str) -> None:
    """Refuse the weights of a run that diverged, naming the file and its first bad tensor (every
    rank that reads them refuses; rank 0 says it)."""
    refuse_non_finite(non_finite(state), path, advice)


def refuse_non_finite(bad: list[str], path, advice: str) -> None:
    """check_finite_weights' refusal, of the names of the tensors found not finite (`bad`)."""
    if bad:
        raise UserError(f"{path} holds weights that are not finite (NaN or infinity) in {len(bad)} tensor(s), "
                        f"first {bad[0]}: it comes from a run that diverged; {advice}", quiet=not is_first())
