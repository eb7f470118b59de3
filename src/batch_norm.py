"""--sync-bn: batch norm over the global micro-batch, so that W processes of B images normalise as
one process of W x B images does.

Without it each process normalises its share of the batch with that share's mean and variance,
and updates its running statistics from them: a ResNet trained by two DDP processes is another
model than one trained by one process at the doubled batch. SyncedBatchNorm combines every rank's
statistics in the forward pass (and their gradients' sums in the backward pass) over the default
process group, on a GPU or a CPU.

The arithmetic is torch.nn.SyncBatchNorm's (torch/nn/modules/_functions.py): each rank's mean and
inverse standard deviation and its count, combined with Welford's merge; in the backward pass the
per-channel sums of the output gradient and of its product with the centred input, all-reduced.
On CUDA it calls the same kernels (torch.batch_norm_stats, batch_norm_gather_stats_with_counts,
batch_norm_elemt, batch_norm_backward_reduce, batch_norm_backward_elemt). What it leaves out is
torch's boolean-mask indexing that drops ranks with an empty batch: its result's size depends on
the values, so the host waits for the GPU there, in every training forward of every layer
(pytorch/pytorch#78549), and dynamo cannot trace through it. Here every rank sends its own count,
so ranks of any non-empty size combine without a mask; the scripts never hand a rank an empty
micro-batch, and an empty one is refused (a rank's count of 0 would make the merge divide by 0).
Nothing in a step reads a tensor on the host: with `momentum=None` the cumulative average's
weight 1/num_batches_tracked stays a tensor.

Those five kernels exist on CUDA only; on a CPU (gloo) the same five steps are computed by the
functions below, in float64, for the CPU runs that define and test the behaviour: the CUDA path
and the CPU path share everything but the kernels, and the kernels' dtype contracts are checked
on the CPU as CUDA checks them.

With --accumulate N each forward normalises its micro-batch (B per process, W x B in all), as
train_single.py --batch-size W x B --accumulate N does: batch norm never sees the whole step.
The running statistics are the same on every rank (each rank computes them from the same
all-reduced statistics), and the state_dict keys are those of the BatchNorm layers they replace.
"""
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn


class SyncedBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over every process's share of the batch (any dimensions, channels second).
    Outside training, or alone, it is plain batch norm."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_world_size() > 1:
            self._check_input_dim(x)
            return synced_batch_norm(self, x)
        return super().forward(x)


def synced_batch_norm(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """Training-mode batch norm of x with the statistics of every rank's x (the default process
    group's), updating bn's running statistics as one batch norm of all of them would."""
    if x.numel() == 0:  # a shape: known on the host
        raise ValueError("--sync-bn: a rank's micro-batch is empty; every rank needs at least one sample")
    tracked = bn.track_running_stats and bn.running_mean is not None
    if tracked and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
    return _SyncBatchNorm.apply(x, bn.weight, bn.bias, bn.running_mean if tracked else None,
                                bn.running_var if tracked else None,
                                bn.num_batches_tracked if tracked and bn.momentum is None else None,
                                bn.eps, bn.momentum)


class Kernels(NamedTuple):
    """The five steps of synchronised batch norm, with the signatures of torch's CUDA kernels."""
    stats: Callable
    gather_stats_with_counts: Callable
    elemt: Callable
    backward_reduce: Callable
    backward_elemt: Callable


def _reduced(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _per_channel(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


def _cpu_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's mean and 1 / sqrt(biased variance + eps), per channel (torch.batch_norm_stats)."""
    var, mean = torch.var_mean(x.double(), _reduced(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def _cpu_gather_stats_with_counts(x: torch.Tensor, means: torch.Tensor, invstds: torch.Tensor,
                                  running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                                  momentum: float, eps: float, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ranks' rows (W x C) merged, weighted by their counts (torch.batch_norm_gather_stats_with_counts):
    the mean and inverse standard deviation of all of them; the running statistics moved towards
    the mean and the unbiased variance by `momentum`."""
    # CUDA's kernel reads the counts as the running statistics' type (the input's without them).
    expected = running_mean.dtype if running_mean is not None else x.dtype
    if counts.dtype != expected:
        raise TypeError(f"Expected counts to have type {expected} but got {counts.dtype}")
    n = counts.double().unsqueeze(1)
    total = n.sum()
    mean = (n * means).sum(0) / total
    # Each rank's squared deviations from its own mean, and from the merged one (Chan's merge).
    m2 = ((invstds.reciprocal().square() - eps) * n + n * (means - mean).square()).sum(0)
    if running_mean is not None:
        running_mean.copy_((1 - momentum) * running_mean.double() + momentum * mean)
    if running_var is not None:
        running_var.copy_((1 - momentum) * running_var.double() + momentum * m2 / (total - 1))
    return mean, torch.rsqrt(m2 / total + eps)


def _cpu_elemt(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, mean: torch.Tensor,
               invstd: torch.Tensor, eps: float) -> torch.Tensor:
    """(x - mean) * invstd * weight + bias, in x's dtype (torch.batch_norm_elemt)."""
    shape = _per_channel(x)
    y = (x.double() - mean.view(shape)) * invstd.view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y.to(x.dtype)


def _cpu_backward_reduce(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                         weight: torch.Tensor | None, input_g: bool, weight_g: bool, bias_g: bool) -> tuple:
    """This rank's sums of dy and of dy * (x - mean) per channel (None unless input_g), and its
    share of the weight's and the bias's gradients (torch.batch_norm_backward_reduce)."""
    dims = _reduced(x)
    wide = dy.double()
    sum_dy = wide.sum(dims)
    sum_dy_xmu = (wide * (x.double() - mean.view(_per_channel(x)))).sum(dims)
    dtype = weight.dtype if weight is not None else x.dtype
    return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
            (sum_dy_xmu * invstd).to(dtype) if weight_g else None, sum_dy.to(dtype) if bias_g else None)


def _cpu_backward_elemt(dy: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                        weight: torch.Tensor | None, sum_dy: torch.Tensor, sum_dy_xmu: torch.Tensor,
                        count: torch.Tensor) -> torch.Tensor:
    """The input's gradient from the all-reduced sums and every rank's count
    (torch.batch_norm_backward_elemt): (dy - mean(dy) - (x - mean) * invstd^2 * mean(dy * (x - mean)))
    * invstd * weight, the means over all ranks' samples."""
    if count.dtype != torch.int32:  # CUDA's kernel reads the counts as int
        raise TypeError(f"Expected count to have type torch.int32 but got {count.dtype}")
    shape = _per_channel(x)
    total = count.sum()
    scale = invstd if weight is None else invstd * weight
    dx = (dy.double() - (sum_dy / total).view(shape)
          - (x.double() - mean.view(shape)) * (invstd.square() * sum_dy_xmu / total).view(shape)) * scale.view(shape)
    return dx.to(dy.dtype)


CUDA_KERNELS = Kernels(torch.batch_norm_stats, torch.batch_norm_gather_stats_with_counts, torch.batch_norm_elemt,
                       torch.batch_norm_backward_reduce, torch.batch_norm_backward_elemt)
CPU_KERNELS = Kernels(_cpu_stats, _cpu_gather_stats_with_counts, _cpu_elemt, _cpu_backward_reduce, _cpu_backward_elemt)


def kernels_for(device: torch.device) -> Kernels:
    """torch's kernels on CUDA, the float64 functions above elsewhere."""
    return CUDA_KERNELS if device.type == "cuda" else CPU_KERNELS


def _kernel_layout(x: torch.Tensor) -> torch.Tensor:
    """x as torch's kernels take it: channels-last as it is, anything else contiguous."""
    if x.is_contiguous(memory_format=torch.channels_last) or x.is_contiguous(memory_format=torch.channels_last_3d):
        return x
    return x.contiguous()


class _SyncBatchNorm(torch.autograd.Function):
    """torch's SyncBatchNorm function without the mask (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, batches, eps, momentum):
        kernels = kernels_for(x.device)
        x = _kernel_layout(x)
        weight = weight.contiguous() if weight is not None else None
        channels = x.shape[1]
        mean, invstd = kernels.stats(x, eps)
        # Every rank's (mean, invstd, count) in its own row of zeros: the sum over the ranks is
        # their gather, on any backend (gloo cannot gather into one tensor), and adding zeros is exact.
        mine = torch.cat([mean, invstd, torch.full((1,), x.numel() // channels, dtype=mean.dtype, device=x.device)])
        rows = mean.new_zeros(dist.get_world_size(), 2 * channels + 1)
        rows.select(0, dist.get_rank()).copy_(mine)
        dist.all_reduce(rows)
        means, invstds, counts = rows.split([channels, channels, 1], dim=1)
        counts = counts.reshape(-1)
        if running_mean is not None and momentum is not None:
            into, factor = (running_mean, running_var), momentum
        else:
            # momentum=None (a cumulative average: 1 / num_batches_tracked, a tensor) or no running
            # statistics: the kernel writes the batch's mean and unbiased variance into zeros.
            dtype = running_mean.dtype if running_mean is not None else mean.dtype
            into, factor = (mean.new_zeros(channels, dtype=dtype), mean.new_zeros(channels, dtype=dtype)), 1.0
        mean, invstd = kernels.gather_stats_with_counts(x, means, invstds, *into, factor, eps, counts.to(into[0].dtype))
        if running_mean is not None and momentum is None:
            average = batches.to(running_mean.dtype).reciprocal()
            running_mean.lerp_(into[0], average)
            running_var.lerp_(into[1], average)
        ctx.save_for_backward(x, weight, mean, invstd, counts.to(torch.int32))
        ctx.kernels = kernels
        return kernels.elemt(x, weight, bias, mean, invstd, eps)

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, invstd, counts = ctx.saved_tensors
        kernels, (input_g, weight_g, bias_g) = ctx.kernels, ctx.needs_input_grad[:3]
        grad = _kernel_layout(grad)
        sum_dy, sum_dy_xmu, grad_weight, grad_bias = kernels.backward_reduce(
            grad, x, mean, invstd, weight, input_g, weight_g, bias_g)
        grad_input = None
        if input_g:
            # Every rank's loss depends on every rank's input through the shared statistics. The
            # weight's and bias's gradients stay this rank's share: DDP and FSDP sum them.
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums)
            sum_dy, sum_dy_xmu = sums.split(x.shape[1])
            if weight is not None and weight.dtype != mean.dtype:
                weight = weight.to(mean.dtype)
            grad_input = kernels.backward_elemt(grad, x, mean, invstd, weight, sum_dy, sum_dy_xmu, counts)
        return (grad_input, grad_weight if weight_g else None, grad_bias if bias_g else None,
                None, None, None, None, None)


def sync_batch_norm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every batch norm layer of model normalising over all the processes (SyncedBatchNorm, on any
    device: at each call the layer takes the kernels of its input's device, so `device` changes
    nothing). Call it before wrapping the model in DDP, fully_shard or accelerate's prepare;
    returns the model (the same object: the layers change class in place, keeping their
    parameters, buffers and state_dict keys)."""
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__ = SyncedBatchNorm
    return model


def batch_norms(model: nn.Module) -> int:
    """How many batch norm layers model has (F.batch_norm layers of every kind)."""
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
