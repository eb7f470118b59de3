"""FSDP2 for train_fsdp.py: which blocks get their own fully_shard, what validation needs of a
sharded model, the whole tensors that checkpoints hold, and the bytes each rank holds.

fully_shard replaces every parameter by a DTensor cut on dim 0 into one piece per rank (torch.chunk:
ceil(rows / W) rows a rank), so each rank keeps 1/W of the parameters, and the gradients and
optimizer state that follow their shape. A unit (a module given its own fully_shard) is
all-gathered whole just before its forward, freed after it, gathered again for its backward, and
its gradients are reduce-scattered back to the shards; the root's fully_shard takes every parameter
that no unit holds. See docs/fsdp.md.

best.pth holds whole tensors in every mode: gathered from the shards onto rank 0 when saved, and
loaded into them by --evaluate; so does another mode's last.pth, which resume() loads into the
shards (WholeModel, WholeOptimizer). FSDP's own last is each rank's shards (src/sharded_checkpoint.py).
whole_model, whole_optimizer and whole_average gather the whole state as train_fsdp.py saved it
before (best.pth's weight average; the cost tool's "gather"). The bytes of parameters, gradients and
optimizer state a rank holds make FSDP's line at the end of a run ("rank 0 held ... of the ... MB
that each DDP process holds"); sizes only, no device is waited for.
"""
import contextlib
import math
import re
import types
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from src.ema import WeightAverage
from src.errors import UserError
from src.loaders import ShardSampler

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


def check_shardable(model: nn.Module) -> None:
    """Refuse in one line what fully_shard would refuse with a traceback: non-contiguous weights
    (--channels-last).

    (The weights stay float32 and --amp autocasts as in the other modes, rather than FSDP's
    MixedPrecisionPolicy(param_dtype=...), which would halve the bytes gathered but casts every
    parameter: measured on the CPU (torch 2.14.1), any model with batch norm then fails (its
    weights in bfloat16, its running statistics in float32: "expected scalar type BFloat16 but
    found Float"), and autocast keeps the numerics of train_ddp.py --amp, bit for bit.)
    """
    if not all(param.is_contiguous() for param in model.parameters()):
        raise UserError("--channels-last: FSDP shards contiguous weights only (torch 2.14.1: \"FSDP does not "
                        "support non-contiguous parameters yet\"); drop --channels-last",
                        quiet=dist.get_rank() != 0)


def compile_units(model: nn.Module, units: list[nn.Module]) -> None:
    """torch.compile each unit's computation and the torch.nn containers' pieces between units,
    which a compiled root cannot reach: the rest, the model's own forward code around the units,
    is compiled by torch.compile(model), as in the other modes.

    FSDP runs its hooks around each unit's forward eagerly (torch 2.14.1 wraps them in
    torch._dynamo.disable), so a compiled root breaks its graph at every unit it calls, and the
    unit's call then runs in a new Python frame. Dynamo starts no frame in torch.nn's own code,
    and gives up on a loop whose body breaks the graph: a unit that is an nn.Conv2d, nn.Linear or
    nn.Sequential, and an nn.Sequential holding units, ran eagerly (VGG16: all 13 convolutions
    and its Linear layers; the root compiled its pooling and flatten). Here each unit that holds
    no other unit gets a compiled forward of its own, and each nn.Sequential holding units runs
    its children in turn (an eager loop), those between two units compiled together. Each piece
    is its own torch.compile call over a function with a code object of its own: dynamo keeps at
    most 8 compiled versions per code object, and pieces sharing one function's 8 ran eagerly
    once eval mode had recompiled the first ones (torch 2.14's isolate_recompiles=True does the
    same, but torch releases before it do not have it).
    """
    unit_ids = {id(unit) for unit in units}
    # The modules with a unit below them (not counting themselves).
    holding = {id(module) for module in model.modules()
               if any(id(inner) in unit_ids for child in module.children() for inner in child.modules())}
    for name, module in model.named_modules():
        if id(module) in holding and type(module).forward is nn.Sequential.forward:
            module.forward = _sequence(name, list(module.children()), unit_ids | holding)
        elif id(module) in unit_ids and id(module) not in holding:
            module.forward = torch.compile(_own_code(_calling(module.forward), name))


def _own_code(function, name: str):
    """`function` with a code object of its own, named after the module (dynamo's logs say it)."""
    code = function.__code__.replace(co_name="compiled_" + re.sub(r"\W", "_", name or "model"))
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__,
                              function.__closure__)


def _calling(forward):
    """A function of ours calling `forward`: dynamo traces into torch.nn's forwards from there."""
    def call(*args, **kwargs):
        return forward(*args, **kwargs)
    return call


def _sequence(name: str, children: list[nn.Module], sharded: set[int]):
    """nn.Sequential's forward over `children`: the units and the modules holding units (their
    ids in `sharded`) called as they are, each run of the others between them compiled as one."""
    runs: list[nn.Module | list[nn.Module]] = []
    for child in children:
        if id(child) in sharded:
            runs.append(child)
        elif runs and isinstance(runs[-1], list):
            runs[-1].append(child)
        else:
            runs.append([child])
    steps: list[Callable[..., Any]] = [torch.compile(_own_code(_chain(step), f"{name}.{index}"))
                                       if isinstance(step, list) else step for index, step in enumerate(runs)]

    @torch.compiler.disable(recursive=False)  # a loop that breaks the graph: dynamo would skip it anyway
    def forward(x):
        for step in steps:
            x = step(x)
        return x
    return forward


def _chain(children: list[nn.Module]):
    def forward(x):
        for child in children:
            x = child(x)
        return x
    return forward


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
    if not isinstance(loader.sampler, ShardSampler) or loader.batch_size is None:
        raise TypeError("forwards_to_match: a validation loader of batches over a ShardSampler")
    most = math.ceil(loader.sampler.largest / loader.batch_size)
    for _ in range(most - len(loader)):
        model(inputs)


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimizer parameter's name, in the order of a plain optimizer.state_dict()'s numbers."""
    name = {param: key for key, param in model.named_parameters()}
    return [name[param] for group in optimizer.param_groups for param in group["params"]]


OPTIONS = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on rank 0's CPU


def whole_model(model: nn.Module) -> dict:
    """The model's whole state_dict on rank 0 (empty elsewhere), as one process holds it; every
    rank must call it (each tensor is all-gathered; rank 0 moves each to the CPU before the next,
    so no rank holds more than one whole tensor on the device). Never the live tensors: in a world
    of one on the CPU, torch's gather hands back the parameters themselves (a one-shard DTensor's
    full_tensor() is a view, and the CPU offload copies nothing), which the next step changes."""
    state: dict[str, Any] = get_model_state_dict(model, options=OPTIONS)
    live = {tensor.untyped_storage().data_ptr() for tensor in _local_tensors(model)}
    return {key: value.clone() if value.untyped_storage().data_ptr() in live else value
            for key, value in state.items()}


def _local_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers()]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def whole_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's state_dict as one process holds it (train_single.py's last.pth: whole
    tensors, numbered by parameter) on rank 0, empty elsewhere; every rank must call it."""
    if not optimizer.state:  # nothing to gather (SGD without momentum keeps none)
        # and torch's call would first step the optimizer once with zero gradients to make a state
        # (torch/distributed/checkpoint/state_dict.py _init_optim_state), which the weight
        # average's step hook would count as an update at every save
        return {"state": {}, "param_groups": optimizer.state_dict()["param_groups"]}
    by_name: dict[str, Any] = get_optimizer_state_dict(model, optimizer, options=OPTIONS)  # keyed by parameter name
    if not by_name:
        return {}
    number = {name: i for i, name in enumerate(_names(model, optimizer))}
    return {"state": {number[name]: state for name, state in by_name["state"].items()},
            "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                             for group in by_name["param_groups"]]}


def whole_average(model: nn.Module, average: WeightAverage) -> dict | None:
    """The weight average's state_dict (--ema-decay; None without), gathered from each rank's
    averaged shards as whole_model gathers the weights; every rank must call it."""
    if not average.on:
        return None
    with average.swapped_in():
        return {"model": whole_model(model), "updates": average.count()}


class WholeModel:
    """A sharded model where src/checkpoint.py's resume() (or --evaluate) loads a plain one: its
    load_state_dict() takes the whole tensors of any mode's file, and each rank keeps its pieces.
    Every rank must load the same dict (resume() sends last.pth to all)."""

    def __init__(self, model: nn.Module):
        self.model = model

    def load_state_dict(self, state: dict) -> None:
        # A copy: set_model_state_dict puts the shards into the dict it is given.
        set_model_state_dict(self.model, dict(state), options=StateDictOptions(full_state_dict=True))


class WholeOptimizer:
    """The optimizer of a sharded model where resume() loads a plain one: load_state_dict() takes
    any mode's last.pth state (whole tensors, numbered by parameter), and each rank keeps its pieces."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def load_state_dict(self, state: dict) -> None:
        names = _names(self.model, self.optimizer)
        params = [param for group in self.optimizer.param_groups for param in group["params"]]
        by_name: dict[str, Any] = {"state": {names[i]: dict(saved) for i, saved in state["state"].items()},
                   "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                    for group in state["param_groups"]]}
        with requiring_grad(params, [i in state["state"] for i in range(len(params))]):
            set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                     options=StateDictOptions(full_state_dict=True))


@contextlib.contextmanager
def requiring_grad(params: list[torch.Tensor], flags: list[bool]) -> Iterator[None]:
    """Inside the block each parameter requires a gradient where its flag says so (those with an
    optimizer state in the file being loaded); as before after it.

    A parameter that was frozen when a checkpoint was written has no state in it, and must get
    none, as a plain load_state_dict leaves it: torch's get_optimizer_state_dict and
    set_optimizer_state_dict first step an optimizer without a state once with zero gradients,
    which gives every parameter that requires a gradient a state (SGD's momentum buffer = weight
    decay x weights), and keeps that state where the file has none."""
    trains = [param.requires_grad for param in params]
    for param, flag in zip(params, flags):
        param.requires_grad_(flag)
    try:
        yield
    finally:
        for param, flag in zip(params, trains):
            param.requires_grad_(flag)


def parameters_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every parameter the optimizer holds: every parameter of the model (src/recipe.py's
    make_optimizer takes them all, frozen ones too)."""
    return [param for group in optimizer.param_groups for param in group["params"]]


def is_sharded(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether the optimizer's parameters are FSDP's shards (DTensors)."""
    return optimizer is not None and any(isinstance(p, DTensor) for p in parameters_of(optimizer))


def rank_bytes(optimizer: torch.optim.Optimizer, whole: bool = False) -> dict[str, int]:
    """The bytes of the optimizer's parameters, their gradients and its state that this rank
    holds: the local shards of a sharded model (a DTensor's to_local()), every tensor of a plain
    one; whole: the whole tensors of a sharded model, what each DDP rank holds. The state is the
    per-element kind (SGD's momentum, AdamW's exp_avg and exp_avg_sq), the memory that sharding
    divides; not AdamW's 0-dim step counts, a few bytes that every rank holds whole. Call it after an
    optimizer step and before zero_grad, when all three exist."""
    def size(tensor: torch.Tensor) -> int:
        counted = tensor.to_local() if isinstance(tensor, DTensor) and not whole else tensor
        return counted.numel() * counted.element_size()
    params = parameters_of(optimizer)
    return {"parameters": sum(map(size, params)),
            "gradients": sum(size(p.grad) for p in params if p.grad is not None),
            "optimizer": sum(size(value) for state in optimizer.state.values() for value in state.values()
                             if torch.is_tensor(value) and value.dim() > 0)}


def watch_rank_bytes(optimizer: torch.optim.Optimizer) -> dict[str, dict[str, int]]:
    """A dict that every optimizer step updates, at the step that held the most, with this rank's
    bytes ("rank": rank_bytes) and the whole model's ("whole")."""
    held: dict[str, dict[str, int]] = {"rank": {}, "whole": {}}

    def after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        now = rank_bytes(optimizer)
        if sum(now.values()) > sum(held["rank"].values()):
            held.update(rank=now, whole=rank_bytes(optimizer, whole=True))
    optimizer.register_step_post_hook(after_step)
    return held


def bytes_line(held: dict[str, dict[str, int]]) -> str:
    """What watch_rank_bytes saw, in one line."""
    if not held["rank"]:
        return "no optimizer step was taken: nothing to say about the memory of the shards"
    mine, whole = sum(held["rank"].values()), sum(held["whole"].values())
    parts = " + ".join(f"{value / 1e6:.1f} MB of {name.replace('optimizer', 'optimizer state')}"
                       for name, value in held["rank"].items())
    return (f"rank 0 held {mine / 1e6:.1f} MB at its fullest optimizer step ({parts}): "
            f"{mine / whole:.3f} of the {whole / 1e6:.1f} MB that each DDP process holds")
