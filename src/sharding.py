"""FSDP2 for train_fsdp.py: which blocks get their own fully_shard, and what validation needs of a
sharded model (the checkpoints' whole tensors: src/full_state.py; the bytes each rank holds:
src/memory.py).

fully_shard replaces every parameter by a DTensor cut on dim 0 into one piece per rank (torch.chunk:
ceil(rows / W) rows a rank), so each rank keeps 1/W of the parameters, and the gradients and
optimizer state that follow their shape. A unit (a module given its own fully_shard) is
all-gathered whole just before its forward, freed after it, gathered again for its backward, and
its gradients are reduce-scattered back to the shards; the root's fully_shard takes every parameter
that no unit holds. See docs/fsdp.md.
"""
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from src.errors import UserError

# Below this many parameters (4 MB in float32) a unit's three collectives a step cost more in
# latency than gathering its weights with the next unit up saves.
UNIT_PARAMETERS = 1_000_000


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules that get their own fully_shard, innermost first (the order fully_shard wants).

    Going up from the leaves, a module becomes a unit once the parameters it holds that no unit
    below it holds reach min(UNIT_PARAMETERS, 5% of the model) (small models get units too),
    provided the model calls it as a module: a child of an nn.Sequential or nn.ModuleList, or of
    the model itself, with a forward of its own. FSDP gathers a unit's weights in hooks around its
    forward, so a parent that reads a child's weights directly (nn.MultiheadAttention passes
    out_proj.weight to a function, torchvision's Swin attention its qkv and proj weights) would
    get the shards; and fully_shard refuses a ModuleList, which has no forward. Everything left
    over stays with the root, which is gathered for the whole forward and backward.

    VGG16: classifier.0 and classifier.3 (the 25088x4096 and 4096x4096 Linear layers, 89% of the
    weights), each convolution from features.17 on, and `features` itself for the first seven
    convolutions; the root keeps the last Linear (8K parameters). ResNets: their blocks from the
    size on (resnet18: layer3.0 to layer4.1); ViTs: each encoder layer and its MLP's Linears.
    """
    total = sum(p.numel() for p in model.parameters())
    threshold = min(UNIT_PARAMETERS, total // 20)
    called = {id(child) for module in model.modules() if isinstance(module, (nn.Sequential, nn.ModuleList))
              for child in module.children()} | {id(child) for child in model.children()}
    units = []

    def visit(module: nn.Module) -> int:  # the parameters below and in module that no unit holds yet
        held = sum(p.numel() for p in module.parameters(recurse=False)) + sum(map(visit, module.children()))
        if (module is not model and held >= threshold and id(module) in called
                and type(module).forward is not nn.Module.forward):
            units.append(module)
            return 0
        return held
    visit(model)
    return units


def shard_model(model: nn.Module, device: torch.device) -> None:
    """fully_shard each unit (fsdp_units), then the root, over all the ranks; the model must be on
    `device` already. Call it before making the optimizer: fully_shard replaces the parameters.

    The weights stay float32 and --amp autocasts as in the other modes, rather than FSDP's
    MixedPrecisionPolicy(param_dtype=...), which would halve the bytes gathered but casts every
    parameter: measured on the CPU (torch 2.14.1), any model with batch norm then fails (its
    weights in bfloat16, its running statistics in float32: "expected scalar type BFloat16 but
    found Float"), and autocast keeps the numerics of train_ddp.py --amp, bit for bit.
    """
    if not all(param.is_contiguous() for param in model.parameters()):  # before fully_shard's traceback
        raise UserError("--channels-last: FSDP shards contiguous weights only (torch 2.14.1: \"FSDP does not "
                        "support non-contiguous parameters yet\"); drop --channels-last",
                        quiet=dist.get_rank() != 0)
    # The mesh of the training device, explicitly: fully_shard's default follows the machine's
    # accelerator, which would be CUDA for a gloo run on the CPU of a machine with a GPU.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)


def broadcast_buffers(model: nn.Module) -> None:
    """Rank 0's buffers (batch norm's running statistics) on every rank, as DDP broadcasts them
    before each forward. FSDP shards parameters only: each rank's buffers follow its own share of
    the batches, and the ranks would validate with different statistics than best.pth holds
    (rank 0's). Every rank must call it."""
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def forwards_to_match(model: nn.Module, inputs: torch.Tensor, loader: DataLoader) -> None:
    """After this rank's validation batches, the forwards (of its last `inputs`, for nothing) that
    it falls short of the rank with the most batches.

    Every forward of a sharded model gathers its weights from all the ranks, so every rank must run
    as many; the unpadded validation shards (src.loaders.ShardSampler) differ by up to a sample,
    so a rank may have a batch less. The largest shard is known on every rank: no collective.
    """
    most = math.ceil(loader.sampler.largest / loader.batch_size)
    for _ in range(most - len(loader)):
        model(inputs)
