"""--freeze and --freeze-epochs: train the new last layer on a fixed pretrained backbone
("feature extraction"), the feature cache that makes those epochs cost seconds, and the run's
epochs in stages that every script's loop runs through.

A frozen backbone's parameters get no gradient (so DDP leaves them out of its all-reduce and the
optimizer gives them no state and no weight decay), and it runs in eval mode: dropout off, batch
norm statistics fixed. Its output for an image, the input of the last layer, is then the same
in every epoch; with --cache it is computed once for every image, by the first process of each
node, and kept memory-mapped in DIR/features_{arch}_{size}px.{key}.f32 (the key covers the pixel
cache's and the backbone's weights, so nodes with other images or weights never share a file).
The frozen epochs then train the last layer alone on those vectors. Not with any flag that
changes or mixes the training images every epoch (--augment, --auto-augment, --random-erase,
--mixup-alpha, --cutmix-alpha: src.augment.augments): those epochs train from the images. best.pth
is the whole model either way.

Stages: consecutive epochs that train the same thing from the same data. Without --freeze and
--freeze-epochs one stage holds every epoch; with them the frozen epochs come first, training the
last layer alone, from the backbone's cached outputs where they can be cached.
"""
import hashlib
from pathlib import Path
from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from src.augment import augments
from src.cache import MappedArray, ensure_array
from src.config import Config
from src.datasets import worker_options
from src.models import head_of
from src.ranks import is_first
from src.transforms import model_inputs

FORMAT = 1  # bump when the layout or the computation changes


def set_frozen(model: nn.Module, frozen: bool) -> None:
    """Only the last layer trains when frozen; every layer otherwise."""
    model.requires_grad_(not frozen)
    head_of(model)[1].requires_grad_(True)


def frozen_until(args: Config) -> int:
    """The number of epochs, from the first, that train the last layer only."""
    return args.epochs if args.freeze else min(args.freeze_epochs, args.epochs)


def _head_input(model: nn.Module, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the last layer's input, the model's output) for a batch, in eval mode without gradients."""
    seen = []
    hook = head_of(model)[1].register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    try:
        output = model(images)
    finally:
        hook.remove()
    return seen[-1], output


def _weights_digest(model: nn.Module) -> str:
    digest = hashlib.sha256()
    head = head_of(model)[0]
    for name, tensor in model.state_dict().items():
        if not name.startswith(head + "."):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _to_host(vectors: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """A host copy of vectors on its way, and the event that says it has arrived (None: it has).
    From CUDA, to("cpu", non_blocking=True) copies into pinned memory without making the host wait."""
    host = vectors.to("cpu", non_blocking=True)
    if not vectors.is_cuda:
        return host, None
    arrived = torch.cuda.Event()
    arrived.record()
    return host, arrived


def _store(array: np.ndarray, copy: tuple, start: int) -> None:
    host, arrived = copy
    if arrived is not None:
        arrived.synchronize()
    array[start:start + len(host)] = host.numpy()


@torch.no_grad()
def backbone_outputs(args: Config, model: nn.Module, dataset: Dataset,
                     device: torch.device, workers: int, show: bool = True) -> MappedArray | None:
    """The feature cache of a frozen stage, built if needed; None to train from the images."""
    if not args.cache:
        if show:
            print("--freeze without --cache runs the frozen backbone on every image in every epoch; "
                  "--cache DIR computes its outputs once")
        return None
    changing = augments(args)
    if changing:
        if show:
            print(f"--freeze with {' '.join(changing)} trains from the images: the backbone's outputs change "
                  "with every augmented or mixed image, so they are not cached")
        return None
    if not isinstance(dataset, MappedArray):  # with --cache the run's images are the pixel cache (labelled_data)
        raise TypeError(f"the feature cache is built from the pixel cache (a MappedArray), not a {type(dataset).__name__}")
    was_training = model.training
    model.eval()
    try:
        probe = model_inputs(torch.stack([dataset[i][0] for i in range(min(4, len(dataset)))]), device)
        inputs, output = _head_input(model, probe)
        head = head_of(model)[1]
        # Only where the last layer's output is the model's output can it train alone on its input
        # (not so for SqueezeNet, whose 1x1 convolution is followed by pooling).
        if not (isinstance(head, nn.Linear) and inputs.dim() == 2
                and torch.allclose(head(inputs), output, rtol=1e-4, atol=1e-5)):
            if show:
                print(f"the last layer of {args.arch} is not its output layer: the frozen epochs "
                      "train from the images")
            return None
        dim = head.in_features
        key = hashlib.sha256(f"{FORMAT} {args.arch} {args.image_size} {getattr(dataset, 'key', '')} "
                             f"{_weights_digest(model)}".encode()).hexdigest()
        path = Path(args.cache) / f"features_{args.arch}_{args.image_size}px.{key[:16]}.f32"
        labels = dataset.labels  # the pixel cache's MappedArray: --cache holds the pixels too

        def fill(array: np.ndarray) -> None:
            # Pinned batches, and each batch's outputs copied to the host while the device computes
            # the next one: the GPU never waits for the host writing the file.
            loader = DataLoader(dataset, batch_size=args.batch_size, num_workers=workers,
                                pin_memory=device.type == "cuda", generator=torch.Generator(),
                                **(worker_options() if workers else {}))
            start, previous = 0, None  # the previous batch's outputs, on their way to the host
            for images, _ in tqdm(loader, desc=f"computing {args.arch}'s outputs for {len(dataset)} images",
                                  disable=not show, leave=False):
                vectors = _head_input(model, model_inputs(images, device, args.channels_last))[0].float()
                if previous is not None:
                    _store(array, *previous)
                previous, start = (_to_host(vectors), start), start + len(vectors)
            if previous is not None:
                _store(array, *previous)

        ensure_array(path, path.with_suffix(".json"), key, (len(dataset), dim), np.float32, fill,
                     "--cache", f"{args.arch}'s outputs", show)
        return MappedArray(path, labels, (dim,), np.float32)
    finally:
        model.train(was_training)


class Stage(NamedTuple):
    """Consecutive epochs that train the same thing from the same data."""
    epochs: range
    frozen: bool
    net: nn.Module  # what the loop runs: the model, or its last layer on cached backbone outputs
    data: Dataset  # images (uint8), or the backbone outputs (float32 vectors)


def epoch_stages(args: Config, model: nn.Module, dataset: Dataset, start: int,
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
