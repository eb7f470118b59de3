"""Building the classifier: a torchvision model with its final layer replaced by a 2-class one."""
import urllib.error
from pathlib import Path

import torch
import torch.nn as nn
import torchvision

from src.errors import UserError

NUM_CLASSES = 2


def classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Swap the last Linear (or 1x1 Conv2d, as in SqueezeNet) for a fresh one with num_classes outputs.

    The new layer has the same name as in `torchvision.models.get_model(arch, num_classes=2)`, so
    its state_dict loads into that model.
    """
    name, layer = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]
    if isinstance(layer, nn.Linear):
        new = nn.Linear(layer.in_features, num_classes)
    else:
        new = nn.Conv2d(layer.in_channels, num_classes, layer.kernel_size, layer.stride, layer.padding)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def _load_file(arch: str, path: Path) -> nn.Module:
    """A model from a local state_dict: our 2-class checkpoint, or ImageNet weights with 1000 classes."""
    if not path.is_file():
        raise UserError(f"--weights {path}: no such file (use `default`, `none` or a state_dict file)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a file that is not a checkpoint
        raise UserError(f"--weights {path} is not a PyTorch state_dict ({type(error).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a last.pth resume checkpoint
    if not isinstance(state, dict):
        raise UserError(f"--weights {path} does not hold a state_dict")
    for num_classes in (NUM_CLASSES, 1000):
        model = torchvision.models.get_model(arch, num_classes=num_classes)
        try:
            model.load_state_dict(state)
        except RuntimeError:
            continue
        return model if num_classes == NUM_CLASSES else replace_head(model, NUM_CLASSES)
    raise UserError(f"--weights {path} is not a {arch} checkpoint with 2 or 1000 classes; "
                    "pass the --arch it was trained with")


def build_model(arch: str = "vgg16", weights: str = "default", dropout: float | None = None) -> nn.Module:
    """`arch` with 2 outputs; weights are `default` (torchvision's ImageNet weights), `none` or a path.

    Seed the global RNG first: the new final layer, and with `none` every layer, is drawn from it.
    """
    if arch not in classification_models():
        raise UserError(f"--arch {arch}: not a torchvision classification model "
                        "(e.g. vgg16, vgg16_bn, resnet50, squeezenet1_1)")
    if weights == "none":
        model = torchvision.models.get_model(arch, num_classes=NUM_CLASSES)
    elif weights == "default":
        imagenet = torchvision.models.get_model_weights(arch).DEFAULT
        try:
            model = torchvision.models.get_model(arch, weights=imagenet)
        except (urllib.error.URLError, OSError) as error:
            raise UserError(f"cannot download the ImageNet weights for {arch} from {imagenet.url} "
                            f"({error}); use --weights none, or --weights PATH to a local file "
                            "(or put that file in ~/.cache/torch/hub/checkpoints/)") from None
        model = replace_head(model, NUM_CLASSES)
    else:
        model = _load_file(arch, Path(weights))
    if dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
    return model
