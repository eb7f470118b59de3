"""--sync-bn: batch norm over the global micro-batch, so that W processes of B images normalise as
one process of W x B images does.

Without it each process normalises its share of the batch with that share's mean and variance,
and updates its running statistics from them: a ResNet trained by two DDP processes is another
model than one trained by one process at the doubled batch. torch.nn.SyncBatchNorm all-reduces
the statistics in the forward pass (and their gradients in the backward pass) over the process
group, on CUDA only. On a CPU (gloo) it refuses to run, so the same computation is done here with
differentiable all-reduces, for the CPU runs that define and test the behaviour.

With --accumulate N each forward normalises its micro-batch (B per process, W x B in all), as
train_single.py --batch-size W x B --accumulate N does: batch norm never sees the whole step.
The running statistics are the same on every rank (each rank computes them from the same
all-reduced sums), and the state_dict keys are those of the BatchNorm layers they replace.
"""
import torch
import torch.distributed as dist
import torch.nn as nn


class CpuSyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """Batch norm over every process's share of the batch, for CPU processes (gloo): what
    nn.SyncBatchNorm computes on CUDA, which it (and DDP, for any SyncBatchNorm on a CPU) refuses
    to run on a CPU. Outside training, or alone, it is plain batch norm."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and dist.is_initialized() and dist.get_world_size() > 1:
            return _cpu_sync_batch_norm(self, x)
        return super().forward(x)


class _SumOverRanks(torch.autograd.Function):
    """The sum of a tensor over every rank; its gradient is the sum of the ranks' gradients (each
    rank's loss depends on every rank's input through the shared statistics)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _cpu_sync_batch_norm(bn: nn.modules.batchnorm._BatchNorm, x: torch.Tensor) -> torch.Tensor:
    """Training-mode batch norm of x with the mean and biased variance of every rank's x, in two
    passes (the mean, then the squared deviations from it), in float64 as torch's CPU batch norm
    accumulates its statistics; the running variance is the unbiased one, as F.batch_norm keeps it."""
    dims = [0] + list(range(2, x.dim()))
    shape = [1, -1] + [1] * (x.dim() - 2)
    wide = x.double()
    count = wide.new_tensor([x.numel() / x.shape[1]])
    sums = _SumOverRanks.apply(torch.cat([wide.sum(dims), count]))
    n = sums[-1]
    mean = sums[:-1] / n
    centred = wide - mean.view(shape)
    var = _SumOverRanks.apply(centred.square().sum(dims)) / n
    if bn.track_running_stats:
        with torch.no_grad():
            bn.num_batches_tracked.add_(1)
            momentum = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            bn.running_mean.lerp_(mean.detach().to(bn.running_mean.dtype), momentum)
            bn.running_var.lerp_((var.detach() * n / (n - 1)).to(bn.running_var.dtype), momentum)
    y = centred * torch.rsqrt(var.view(shape) + bn.eps)
    if bn.affine:
        y = y * bn.weight.view(shape) + bn.bias.view(shape)
    return y.to(x.dtype)


def sync_batch_norm(model: nn.Module, device: torch.device) -> nn.Module:
    """Every batch norm layer of model normalising over all the processes: torch's SyncBatchNorm
    on GPUs, CpuSyncBatchNorm on the CPU. Call it before wrapping the model in DDP, fully_shard or
    accelerate's prepare; returns the model (the same object on the CPU, where the layers change
    class in place)."""
    if device.type != "cpu":
        return nn.SyncBatchNorm.convert_sync_batchnorm(model)
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.__class__ = CpuSyncBatchNorm
    return model


def batch_norms(model: nn.Module) -> int:
    """How many batch norm layers model has (F.batch_norm layers of every kind)."""
    return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())

