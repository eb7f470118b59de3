"""How far two float32 computations of the same classifier may differ in their probabilities:
torch and onnxruntime, or torch with other batches and threads. The bound follows from float32's
unit roundoff and the model's layers, not from a measurement, so it holds on any CPU.

Argument (docs/inference.md has it in full). u = 2^-24, float32's unit roundoff. A float32 dot
product of length n is off by at most about LAMBDA * sqrt(n) * u * (|w| . |x|) when its rounding
errors are independent and of mean zero (Higham and Mary, "A new approach to probabilistic
rounding error analysis", 2019; blocked and pairwise sums, as in oneDNN and MLAS, do better).
Each weight layer k (fan-in n_k) adds such a relative error; to first order they add up through
the network relative to the scale of the logits, M = max(|W| |a| + |b|) of the last weight
layer, computed per image in float64. So each implementation's logits are off by at most
LAMBDA * u * S * M with S = sum_k sqrt(n_k), and two implementations by twice that. Softmax
turns a logit error d into |dp_c| <= 2 p_c (1 - p_c) max |d|. With 4 u for rounding p itself:

    |p_a - p_b| <= 4 * LAMBDA * u * S * M * p (1 - p) + 4 u    per image and class.

This assumes float32 arithmetic throughout (no TF32, no autocast): compare on the CPU.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

U = 2.0 ** -24
LAMBDA = 3.0  # a dot product exceeds LAMBDA sqrt(n) u with probability < 2 exp(-LAMBDA^2 / 2) = 2.2 %


def _fan_in(layer: nn.Module) -> int:
    if isinstance(layer, nn.Conv2d):
        return layer.in_channels // layer.groups * layer.kernel_size[0] * layer.kernel_size[1]
    if isinstance(layer, nn.Linear):
        return layer.in_features
    raise TypeError(f"a {type(layer).__name__} is not a weight layer (Linear or Conv2d)")


def depth_sum(model: nn.Module) -> float:
    """S: the sum of sqrt(fan-in) over the weight layers, and over the attention products of a ViT
    (its in-projection and its query-key products, which are no Linear modules)."""
    total = 0.0
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            total += math.sqrt(_fan_in(module))
        elif isinstance(module, nn.MultiheadAttention):
            total += math.sqrt(module.embed_dim) + math.sqrt(module.head_dim)
    return total


@torch.no_grad()
def rounding_bound(model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p, bound): the model's float32 probabilities for a normalised batch, and for each image and
    class the bound above on how far another float32 computation of them may be."""
    head = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))][-1]
    scale = {}

    def magnitude(module, args, output):  # |W| |a| + |b| of the last weight layer, in float64
        a, w = args[0].double().abs(), module.weight.double().abs()
        b = module.bias.double().abs() if module.bias is not None else None
        if isinstance(module, nn.Conv2d):
            out = F.conv2d(a, w, b, module.stride, module.padding, module.dilation, module.groups)
        else:
            out = F.linear(a, w, b)
        scale["M"] = out.flatten(1).max(dim=1).values

    hook = head.register_forward_hook(magnitude)
    try:
        p = model.eval()(inputs).float().softmax(dim=1)
    finally:
        hook.remove()
    m = scale["M"].view(-1, 1)
    p64 = p.double()
    bound = 4 * LAMBDA * U * depth_sum(model) * m * p64 * (1 - p64) + 4 * U
    return p, bound
