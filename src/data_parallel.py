"""nn.DataParallel as train_dp.py needs it: its replicas keep --amp's autocast dtype and
--channels-last's weight format.

On two or more GPUs DataParallel runs each replica in a thread of its own, which re-enters
autocast without a dtype (torch/nn/parallel/parallel_apply.py); the dtype is per thread and
float16 by default on CUDA, so --amp bf16 would silently train in float16 without a gradient
scaler. The replicas here read the dtype in the caller's thread and autocast to it.

Each replica draws the dropout masks of its share of the batch: the module's per-sample dropout
layers hold the keys of the whole batch (src.dropout.set_samples), and each replica gets the keys
of the samples that the scatter gave it, on its GPU.

The replicas on GPUs 1..N get their weights from a broadcast that hands them out as views of one
flat buffer, contiguous (NCHW) whatever the module's format (torch/csrc/cuda/comm.cpp,
broadcast_coalesced): with --channels-last, cuDNN would convert them in every convolution,
forward and backward. The replicas here are made channels-last again, once per forward.
"""
import torch
import torch.nn as nn

from src.config import Config
from src.devices import check_bf16
from src.dropout import sample_keys, set_samples
from src.errors import UserError
from src.models import check_batch_norm


class AutocastReplica(nn.Module):
    """A replica that runs under the autocast dtype of the thread that made it."""

    def __init__(self, replica: nn.Module, device_type: str):
        super().__init__()
        self.replica, self.device_type = replica, device_type
        self.dtype = torch.get_autocast_dtype(device_type)  # read in the caller's thread

    def forward(self, *inputs, **kwargs):
        with torch.autocast(self.device_type, self.dtype, enabled=torch.is_autocast_enabled(self.device_type)):
            return self.replica(*inputs, **kwargs)


class AutocastDataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas autocast to the dtype asked for (--amp bf16), keep the
    module's channels-last weights and draw the dropout masks of their own samples."""

    def scatter(self, inputs, kwargs, device_ids):
        inputs, kwargs = super().scatter(inputs, kwargs, device_ids)
        self.shares = [len(args[0]) for args in inputs]  # the samples each replica gets, in order
        return inputs, kwargs

    def replicate(self, module, device_ids):
        replicas = super().replicate(module, device_ids)
        for replica in replicas[1:]:  # the first holds the module's own tensors
            keep_memory_format(module, replica)
        keys = sample_keys(module)
        if keys is not None and module.training:  # in eval mode nothing draws, and the keys are a training batch's
            for replica, gpu, share in zip(replicas, device_ids, keys.split(self.shares)):
                set_samples(replica, share.to(torch.device(self.src_device_obj.type, gpu), non_blocking=True))
        return [AutocastReplica(replica, self.src_device_obj.type) for replica in replicas]


def keep_memory_format(module: nn.Module, replica: nn.Module) -> None:
    """Make the replica's 4-d weights channels-last where the module's are (a differentiable
    copy: the gradients still reach the module's own weights)."""
    for original, copy in zip(module.modules(), replica.modules()):
        for name, weight in original._parameters.items():
            if (weight is not None and weight.dim() == 4 and not weight.is_contiguous()
                    and weight.is_contiguous(memory_format=torch.channels_last)):
                setattr(copy, name, getattr(copy, name).contiguous(memory_format=torch.channels_last))


def check_data_parallel(args: Config) -> None:
    """Refuse --compile on 2+ GPUs and --amp bf16 where a GPU lacks it, and say how many GPUs
    DataParallel splits each batch over (--evaluate: one)."""
    gpus = torch.cuda.device_count()
    for gpu in range(gpus):  # every GPU runs a replica (training_device checks the first)
        check_bf16(args.amp, gpu)
    if args.sync_bn:  # nn.SyncBatchNorm synchronises processes; DataParallel's replicas are threads
        raise UserError("--sync-bn: DataParallel runs its replicas as threads of one process, which "
                        "SyncBatchNorm cannot synchronise (each replica normalises its share of the batch); "
                        f"use torchrun --nproc_per_node={max(gpus, 1)} train_ddp.py --sync-bn")
    if args.compile and gpus > 1:  # Dynamo compiles per thread, and the replicas run in threads
        raise UserError(f"--compile with DataParallel on {gpus} GPUs would compile nothing (pytorch/pytorch"
                        f"#94636): use torchrun --nproc_per_node={gpus} train_ddp.py --compile")
    if gpus > 1 and not (args.freeze or args.evaluate):
        # DataParallel cuts each batch into chunks of ceil(B / GPUs) images: the last can hold one.
        smallest = min(len(piece) for piece in torch.empty(args.batch_size).chunk(gpus))
        check_batch_norm(args.arch, args.image_size, smallest, f"--batch-size {args.batch_size} split over {gpus} "
                         "GPUs by DataParallel gives a replica 1 image")
    if gpus < 2:
        print(f"train_dp.py: {gpus} GPU(s) visible, DataParallel runs on one device")
    elif args.evaluate:  # validated before the epoch loop, where DataParallel wraps the model
        print(f"train_dp.py --evaluate: validates on the first of the {gpus} GPUs")
    else:
        print(f"train_dp.py: DataParallel splits each batch over {gpus} GPUs")
