"""Building the classifier: a torchvision model with its final layer replaced by a 2-class one."""
import contextlib
import io
import math
import urllib.error
import warnings
from pathlib import Path

import torch
import torch.nn as nn
import torchvision

from src.dropout import per_sample
from src.errors import UserError
from src.outputs import input_problem
from src.ranks import is_first

NUM_CLASSES = 2

# Constructor keywords of our 2-class models beyond num_classes (see model_kwargs).
# googlenet, inception_v3: no auxiliary classifiers. With them a training-mode forward returns a
# named tuple (logits and auxiliary logits), which cross_entropy cannot take. torchvision builds
# them this way itself when it loads their ImageNet weights (aux_logits=False, the aux modules
# None), and its reference train.py never trains them (their weights are ported from the papers;
# its README only evaluates them with --test-only). transform_input=True rescales
# ImageNet-normalised inputs to the [-1, 1] range the ported weights expect, as torchvision sets it
# with those weights; it is not in the state_dict, so every rebuild must pass it again.
# vit_h_14: its default weights (IMAGENET1K_SWAG_E2E_V1) are for 518 px, and torchvision builds it
# at that size to load them; without this, best.pth of --weights default would not load into the
# 224 px model that get_model builds by default.
_MODEL_KWARGS: dict[str, dict[str, object]] = {
    "googlenet": {"aux_logits": False, "transform_input": True},
    "inception_v3": {"aux_logits": False, "transform_input": True},
    "vit_h_14": {"image_size": 518},
}
_AUX_MODULES = ("aux1", "aux2", "AuxLogits")  # googlenet's two, inception_v3's one

# The --image-size values a model takes, for the models that do not take every size from the
# flag's minimum (32) up. Measured with torch 2.14.1 and torchvision 0.29.1 on the CPU: each of the
# 80 models of classification_models(), random init, num_classes=2, googlenet and inception_v3
# without aux classifiers, in training mode, ran a forward pass of a batch of 2 random images at
# 32, 33, 47 and 64 px; where one failed, at every size from 33 up until one worked, then at 4
# sizes above it (+1, +7, +32, x2). The other 72 models worked at all four sizes, and
# tests/test_arch_walk.py trains each one a step at 32 px. (vit_h_14 was measured at its
# default 224 px; with model_kwargs its one size is 518, which the test checks on the meta device.)
# Smaller images shrink to nothing before the last layers (alexnet's last max pool, 3x3
# convolutions in inception_v3):
MIN_IMAGE_SIZE = {"alexnet": 63, "inception_v3": 75}
# Built for one size (the ViTs' position embeddings, maxvit_t's attention windows; the size is
# their weights' meta["min_size"]). maxvit_t also passes 221-223 px (its stride-2 convolutions
# round those up to the same 7x7 grid); it is refused there too, for one plain rule.
ONLY_IMAGE_SIZE = {"maxvit_t": 224, "vit_b_16": 224, "vit_b_32": 224, "vit_l_16": 224,
                   "vit_l_32": 224, "vit_h_14": 518}


def classification_models() -> list[str]:
    return torchvision.models.list_models(module=torchvision.models)


def model_kwargs(arch: str) -> dict:
    """The keywords besides num_classes that build our model of `arch`: pass them to
    torchvision.models.get_model wherever best.pth is loaded into a fresh model."""
    return dict(_MODEL_KWARGS.get(arch, {}))


def check_image_size(arch: str, image_size: int) -> None:
    """Raise UserError, naming the size it needs, if `arch` cannot take `image_size` px images."""
    if arch in ONLY_IMAGE_SIZE and image_size != ONLY_IMAGE_SIZE[arch]:
        raise UserError(f"--arch {arch} takes --image-size {ONLY_IMAGE_SIZE[arch]} only "
                        f"(got {image_size})")
    if image_size < MIN_IMAGE_SIZE.get(arch, 0):
        raise UserError(f"--arch {arch} needs --image-size {MIN_IMAGE_SIZE[arch]} or more "
                        f"(got {image_size})")


def meta_model(arch: str) -> nn.Module:
    """Our model of `arch` (random init) on the meta device: its layers and shapes, no numbers,
    built in a fraction of the time (for the checks made when the flags are parsed)."""
    from accelerate import init_empty_weights  # here: only the checks that need a model load it
    with init_empty_weights(), warnings.catch_warnings():  # each parameter on meta as it is made: no time drawing it
        warnings.simplefilter("ignore")  # googlenet's and inception_v3's notice of their init to come
        model = torchvision.models.get_model(arch, num_classes=NUM_CLASSES, **model_kwargs(arch))
    return model.to("meta")


def check_dropout(arch: str, dropout: float | None) -> None:
    """Refuse --dropout above 0 for a model without a dropout layer (nn.Dropout: the layers it
    sets): 37 of torchvision's 80 have none (the ResNets, RegNets, DenseNets, ConvNeXts,
    ShuffleNets), and the flag was ignored while best.json recorded it."""
    if not dropout or arch not in classification_models():
        return
    if not any(isinstance(module, nn.Dropout) for module in meta_model(arch).modules()):
        raise UserError(f"--dropout {dropout}: --arch {arch} has no dropout layer (nn.Dropout) for it to set, and "
                        "would train without dropout: drop --dropout, or use an --arch with dropout (vgg16, "
                        "squeezenet1_1, efficientnet_b0, vit_b_16, ...)")


def has_batch_norm(arch: str) -> bool:
    """Whether torchvision's `arch` has a batch norm layer (vgg16, squeezenet1_1 and the ViTs have none)."""
    return any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in meta_model(arch).modules())


def check_sync_bn(arch: str, sync_bn: bool) -> None:
    """Refuse --sync-bn for a model without a batch norm layer: there is nothing to synchronise,
    and best.json would record it."""
    if sync_bn and arch in classification_models() and not has_batch_norm(arch):
        raise UserError(f"--sync-bn: --arch {arch} has no batch norm layer for it to synchronise: drop --sync-bn, "
                        "or use an --arch with batch norm (resnet18, efficientnet_b0, ...)")


class _OneValue(Exception):
    """A batch norm layer's input holds one value per channel (see check_batch_norm)."""


def check_batch_norm(arch: str, image_size: int, images: int, what: str) -> None:
    """Refuse, before any work, a forward of `images` images that a batch norm layer of `arch`
    cannot normalise in training: one value per channel (one image whose feature map is 1 x 1
    there, as resnet18's last layers at 32 px), which torch refuses at the first step ("Expected
    more than 1 value per channel when training"). `what` says where the `images` come from
    ("--batch-size 1"). Batch norm sees images x height x width values per channel, so only one
    image can be too few; the model is then built on the meta device (shapes, no numbers) and run
    once to find the layer. The caller leaves out what runs batch norm in eval mode (--freeze,
    --evaluate) or over several processes (--sync-bn)."""
    if images > 1 or arch not in classification_models():  # an unknown --arch: build_model says so
        return
    model = meta_model(arch).train()

    def look(name: str):
        def hook(module, inputs):
            shape = inputs[0].shape
            if shape[0] * math.prod(shape[2:]) == 1:
                raise _OneValue(name, tuple(shape))
        return hook
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.register_forward_pre_hook(look(name))
    try:
        model(torch.empty(images, 3, image_size, image_size, device="meta"))
    except _OneValue as one:
        name, shape = one.args
        raise UserError(f"{what}: batch norm layer {name} of {arch} would get 1 value per channel (its input is "
                        f"{' x '.join(map(str, shape))} at --image-size {image_size}), which torch refuses in "
                        "training: use a --batch-size of 2 or more per process, a larger --image-size, or --freeze "
                        "(batch norm in eval mode)") from None
    except Exception:  # the meta forward fails elsewhere (an op meta tensors cannot run): nothing found
        return


def _drop_aux(model: nn.Module) -> nn.Module:
    """googlenet or inception_v3 without its auxiliary classifiers, as torchvision's builders leave
    it after loading ImageNet weights with aux_logits=False; any other model as it is."""
    if getattr(model, "aux_logits", False):
        setattr(model, "aux_logits", False)  # a bool: Module's __setattr__ is annotated for tensors and modules
        for name in _AUX_MODULES:
            if hasattr(model, name):
                setattr(model, name, None)
    return model


def head_of(model: nn.Module) -> tuple[str, nn.Module]:
    """The name and module of the classification layer: the last Linear (or 1x1 Conv2d, as in SqueezeNet)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))][-1]


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Swap the classification layer (head_of) for a fresh one with num_classes outputs.

    The new layer has the same name as in `torchvision.models.get_model(arch, num_classes=2)`, so
    its state_dict loads into that model.
    """
    name, layer = head_of(model)
    new: nn.Module
    if isinstance(layer, nn.Linear):
        new = nn.Linear(layer.in_features, num_classes)
    elif isinstance(layer, nn.Conv2d):
        shape = (layer.kernel_size, layer.stride, layer.padding)  # Conv2d annotates them tuple[int, ...]
        new = nn.Conv2d(layer.in_channels, num_classes, *shape)  # type: ignore[arg-type]  # and takes them as 2-tuples
    else:  # head_of finds the last Linear or Conv2d
        raise TypeError(f"{name} is a {type(layer).__name__}, not a Linear or Conv2d layer")
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


def read_state_dict(path: Path, flag: str = "--weights") -> dict:
    """The state_dict in a local file (best.pth, torchvision's ImageNet files), or the model's in
    a last.pth; a UserError naming `flag` and the file if there is none."""
    problem = input_problem(path)
    if problem is not None:
        raise UserError(f"{flag} {path}: {problem} (use `default`, `none` or a state_dict file)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # torch raises many types for a file that is not a checkpoint
        raise UserError(f"{flag} {path} is not a PyTorch state_dict ({type(error).__name__})") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a last.pth resume checkpoint
    if not isinstance(state, dict):
        raise UserError(f"{flag} {path} does not hold a state_dict")
    return state


def _load_file(arch: str, path: Path) -> nn.Module:
    """A model from a local state_dict: our 2-class checkpoint, or ImageNet weights with 1000 classes."""
    state = read_state_dict(path)
    kwargs = model_kwargs(arch)
    if kwargs.get("aux_logits") is False:  # torchvision's ImageNet files hold the auxiliary classifiers
        state = {key: value for key, value in state.items() if key.split(".")[0] not in _AUX_MODULES}
    for num_classes in (NUM_CLASSES, 1000):
        model = torchvision.models.get_model(arch, num_classes=num_classes, **kwargs)
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
        model = torchvision.models.get_model(arch, num_classes=NUM_CLASSES, **model_kwargs(arch))
    elif weights == "default":
        imagenet = torchvision.models.get_model_weights(arch).DEFAULT
        # With weights, torchvision refuses aux_logits=False (it loads the auxiliary classifiers'
        # weights too): _drop_aux removes them after loading, as torchvision's googlenet() does.
        kwargs = {key: value for key, value in model_kwargs(arch).items() if key != "aux_logits"}
        try:
            # torch.hub says `Downloading: "URL" to PATH` before it tries: held back until the
            # file is there, so that a download that fails ends with our one line alone.
            with contextlib.redirect_stdout(io.StringIO()) as said:
                model = _drop_aux(torchvision.models.get_model(arch, weights=imagenet, progress=is_first(),
                                                               **kwargs))
        except (urllib.error.URLError, OSError) as error:
            raise UserError(f"cannot download the ImageNet weights for {arch} from {imagenet.url} "
                            f"({error}); use --weights none, or --weights PATH to a local file "
                            "(or put that file in ~/.cache/torch/hub/checkpoints/)") from None
        if is_first():
            print(said.getvalue(), end="")
        model = replace_head(model, NUM_CLASSES)
    else:
        model = _load_file(arch, Path(weights))
    if dropout is not None:
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.p = dropout
    return per_sample(model)  # dropout masks drawn per sample: the same in every mode
