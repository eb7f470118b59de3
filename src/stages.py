"""The run's epochs in stages, what every script's loop runs through (with or without --freeze):
consecutive epochs that train the same thing from the same data. Without --freeze and
--freeze-epochs one stage holds every epoch; with them the frozen epochs come first, training the
last layer alone, from the backbone's cached outputs where src/freeze.py can cache them.
"""
import argparse
from typing import Iterator, NamedTuple

import torch
import torch.nn as nn
from torch.utils.data import Dataset

from src.freeze import backbone_outputs, frozen_until, set_frozen
from src.models import head_of
from src.ranks import is_first


class Stage(NamedTuple):
    """Consecutive epochs that train the same thing from the same data."""
    epochs: range
    frozen: bool
    net: nn.Module  # what the loop runs: the model, or its last layer on cached backbone outputs
    data: Dataset  # images (uint8), or the backbone outputs (float32 vectors)


def epoch_stages(args: argparse.Namespace, model: nn.Module, dataset: Dataset, start: int,
                 device: torch.device, cache_features: bool = True) -> Iterator[Stage]:
    """The epochs from `start` on, in one stage or two: frozen ones first (all with --freeze, the
    first K with --freeze-epochs K), then the rest (all of them without either flag). Each stage
    freezes or unfreezes the model as it begins. cache_features=False (FSDP, whose last layer is
    sharded): the frozen epochs train from the images."""
    end, show = frozen_until(args), is_first()
    if start < end:
        set_frozen(model, True)
        features = backbone_outputs(args, model, dataset, device, args.workers, show) if cache_features else None
        if not cache_features and args.cache and show:
            print("--freeze under FSDP runs the frozen backbone on every image in every epoch: the "
                  "sharded model's last layer cannot train alone on cached outputs")
        if features is None:
            yield Stage(range(start, end), True, model, dataset)
        else:
            if show:
                print(f"epochs {start + 1} to {end}: the last layer trains on {args.arch}'s cached outputs")
            yield Stage(range(start, end), True, head_of(model)[1], features)
    if max(start, end) < args.epochs:
        set_frozen(model, False)
        yield Stage(range(max(start, end), args.epochs), False, model, dataset)
