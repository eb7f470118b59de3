"""The whole tensors that last.pth and best.pth hold in every mode, for FSDP's sharded model
(train_fsdp.py): gathered from the shards onto rank 0 for src/checkpoint.py's save_epoch, and
loaded into them by its resume() and by --evaluate (src/evaluation.py). A train_single.py or
train_ddp.py last.pth resumes under FSDP, and an FSDP one anywhere else.
"""
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from src.ema import WeightAverage


class Gathered:
    """A whole state_dict standing in for a model or optimizer where src/checkpoint.py saves one."""

    def __init__(self, state: dict):
        self.state = state

    def state_dict(self) -> dict:
        return self.state


def _names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Each optimizer parameter's name, in the order of a plain optimizer.state_dict()'s numbers."""
    name = {param: key for key, param in model.named_parameters()}
    return [name[param] for group in optimizer.param_groups for param in group["params"]]


class Whole(NamedTuple):
    """The whole state_dicts that save_epoch writes: the model's, the optimizer's, the average's."""
    model: Gathered
    optimizer: Gathered
    average: Gathered


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer, average: WeightAverage) -> Whole:
    """The model's, the optimizer's and the weight average's state_dict as one process holds them
    (train_single.py's last.pth: whole tensors, the optimizer's numbered by parameter), on rank 0;
    empty elsewhere. The average (--ema-decay) is gathered from each rank's averaged shards.

    Every rank must call it (each tensor is all-gathered). Rank 0 moves each gathered tensor to
    the CPU before the next is gathered, so no rank holds more than one tensor whole on the device
    and only rank 0 keeps the whole state, once.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    averaged = None
    if average.on:
        with average.swapped_in():
            averaged = {"model": get_model_state_dict(model, options=options), "updates": average.count()}
    by_name = get_optimizer_state_dict(model, optimizer, options=options)  # keyed by parameter name
    if not by_name:
        return Whole(Gathered(model_state), Gathered({}), Gathered(averaged))
    number = {name: i for i, name in enumerate(_names(model, optimizer))}
    return Whole(Gathered(model_state), Gathered({
        "state": {number[name]: state for name, state in by_name["state"].items()},
        "param_groups": [{**group, "params": [number[name] for name in group["params"]]}
                         for group in by_name["param_groups"]]}), Gathered(averaged))


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
        by_name = {"state": {names[i]: dict(saved) for i, saved in state["state"].items()},
                   "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                                    for group in state["param_groups"]]}
        # A parameter that was frozen when last.pth was written has no state in it, and must get
        # none, as a plain load_state_dict leaves it: set_optimizer_state_dict first steps the
        # optimizer once with zero gradients, which gives every parameter that requires a
        # gradient a state (SGD's momentum buffer = weight decay x weights), and keeps that
        # state where the file has none. So during the load exactly the parameters with a state
        # in the file require gradients.
        trains = [param.requires_grad for param in params]
        for i, param in enumerate(params):
            param.requires_grad_(i in state["state"])
        try:
            set_optimizer_state_dict(self.model, self.optimizer, by_name,
                                     options=StateDictOptions(full_state_dict=True))
        finally:
            for param, flag in zip(params, trains):
                param.requires_grad_(flag)
