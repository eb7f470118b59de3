"""Every classifier torchvision lists trains a step with a 2-class head, or the command line
refuses the image size it cannot take, in one line naming the size it needs."""
import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from accelerate import init_empty_weights
from conftest import fails_in_process, in_process

from src.dropout import set_samples
from src.errors import UserError
from src.models import (
    MIN_IMAGE_SIZE,
    ONLY_IMAGE_SIZE,
    build_model,
    check_image_size,
    head_of,
    model_kwargs,
)

ARCHS = torchvision.models.list_models(module=torchvision.models)
SMALLEST = 32  # --image-size's minimum

# The five models of over 150M parameters are built on the meta device (shapes, no numbers): the
# random init alone of one takes 2-20 s on a 2-core CPU, a real step of vit_l_16 (224 px) or
# vit_h_14 (518 px) tens of seconds more, and convnext_large's backward pass 5-15 s; together they
# would take the walk past two minutes. On meta the walk still checks that the output is a (2, 2)
# tensor and that the head gets a gradient; smaller models of each family (vit_b_16, vit_b_32,
# regnet_y_32gf, convnext_base) run the same code for real.
ON_META = {"regnet_y_128gf", "vit_h_14", "vit_l_16", "vit_l_32", "convnext_large"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these small steps gain nothing from more, and on a shared, loaded
    machine threads that wait for each other's cores cost up to 100x (measured: densenet121's
    forward at 32 px, 0.09 s with one thread, 13 s with two, at load average 6 on 2 cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# What torchvision's models raise at a size they cannot take: a pooling or convolution window
# larger than what is left of the image (alexnet, inception_v3), maxvit_t's partition into 7x7
# windows, the ViTs' own check of the size they were built for.
TOO_SMALL_OR_NOT_ITS_SIZE = ("Output size is too small|Kernel size can't be greater than actual input size|"
                             r"shape '\[.*\]' is invalid for input of size|Wrong image height! Expected")


def build(arch: str, meta: bool) -> nn.Module:
    """build_model(arch, "none") in training mode, on the meta device if `meta`."""
    if not meta:
        return build_model(arch, "none").train()
    # Each parameter goes to meta as it is made, so no time goes into drawing it; then the buffers.
    # (torch.device("meta") as a context would be simpler, but regnet's builder computes its
    # widths with tensors and .tolist(), which meta tensors cannot give.)
    with init_empty_weights():
        model = build_model(arch, "none")
    return model.to("meta").train()


def walk_size(arch: str) -> int:
    """The smallest size the command line lets through for `arch` (its own, for the one-size models)."""
    return ONLY_IMAGE_SIZE.get(arch, MIN_IMAGE_SIZE.get(arch, SMALLEST))


def refused(arch: str) -> list[int]:
    """Sizes the model cannot take: 32, and just below its minimum or just above its one size
    (not just below: maxvit_t takes 221-223 px, though refused there)."""
    if arch in ONLY_IMAGE_SIZE:
        return [SMALLEST, ONLY_IMAGE_SIZE[arch] + 1]
    return [SMALLEST, MIN_IMAGE_SIZE[arch] - 1]


def test_the_walk_covers_torchvisions_list():
    assert len(ARCHS) >= 80 and {"googlenet", "inception_v3", "maxvit_t", "vit_h_14"} <= set(ARCHS)
    assert (set(MIN_IMAGE_SIZE) | set(ONLY_IMAGE_SIZE) | ON_META) <= set(ARCHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_listed_model_trains_a_step(arch):
    size = walk_size(arch)
    check_image_size(arch, size)  # the size walked is one the command line lets through
    torch.manual_seed(0)
    model = build(arch, arch in ON_META)
    device = "meta" if arch in ON_META else "cpu"
    images, labels = torch.randn(2, 3, size, size, device=device), torch.tensor([0, 1], device=device)
    set_samples(model, torch.tensor([11, 12], device=device))  # the batch's dropout keys
    logits = model(images)
    # A plain tensor, not googlenet's or inception_v3's named tuple with auxiliary logits.
    assert isinstance(logits, torch.Tensor) and tuple(logits.shape) == (2, 2), type(logits)
    F.cross_entropy(logits, labels).backward()
    name, head = head_of(model)
    assert (head.out_features if isinstance(head, nn.Linear) else head.out_channels) == 2, name
    assert all(p.grad is not None for p in head.parameters()), name
    if device == "cpu":  # every random draw of a training forward is per sample: none from the process's generator
        torch.manual_seed(1)
        with torch.no_grad():
            again = model(images)
        assert torch.allclose(again, logits.detach(), rtol=1e-4, atol=1e-5), arch


@pytest.mark.parametrize("arch", sorted(set(MIN_IMAGE_SIZE) | set(ONLY_IMAGE_SIZE)))
def test_sizes_a_model_cannot_take_are_refused_naming_the_size_it_needs(arch):
    needed = walk_size(arch)
    for size in refused(arch):
        with pytest.raises(UserError, match=f"--arch {arch} .*--image-size {needed} ") as error:
            check_image_size(arch, size)
        assert "\n" not in str(error.value)
        # The refusal is real: the model fails at that size, for its size (on meta: shapes are all
        # that matter), and not for another reason.
        with pytest.raises((RuntimeError, AssertionError), match=TOO_SMALL_OR_NOT_ITS_SIZE):
            build(arch, meta=True)(torch.randn(2, 3, size, size, device="meta"))
    # The one size and the minimum are those of torchvision's ImageNet weights.
    assert torchvision.models.get_model_weights(arch).DEFAULT.meta["min_size"] == (needed, needed)


@pytest.mark.parametrize("arch", ["googlenet", "inception_v3"])
def test_imagenet_weights_lose_the_auxiliary_classifiers_and_best_pth_reloads(arch, tmp_path, monkeypatch):
    """--weights default and an ImageNet file give a model without the auxiliary classifiers, whose
    state_dict loads into get_model(arch, num_classes=2, **model_kwargs(arch)), as predict does."""
    from src.inference import load_checkpoint
    torch.manual_seed(0)
    # torchvision's files hold 1000 classes and the auxiliary classifiers, as this one does.
    imagenet = torchvision.models.get_model(arch, aux_logits=True, init_weights=False).state_dict()
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    file = cache / torchvision.models.get_model_weights(arch).DEFAULT.url.rsplit("/", 1)[-1]
    torch.save(imagenet, file)
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # torchvision finds the file offline
    images = torch.randn(2, 3, walk_size(arch), walk_size(arch))
    for weights in ("default", str(file)):
        model = build_model(arch, weights)
        state = model.state_dict()
        assert not [key for key in state if key.lower().startswith("aux")]
        assert all(torch.equal(value, imagenet[key]) for key, value in state.items()
                   if not key.startswith("fc."))
        set_samples(model, torch.arange(2))
        logits = model.train()(images)
        assert isinstance(logits, torch.Tensor) and tuple(logits.shape) == (2, 2), weights
        torch.save(state, tmp_path / "best.pth")
        (tmp_path / "best.json").write_text(json.dumps({"arch": arch, "num_classes": 2, "classes": ["cat", "dog"],
                                                         "image_size": walk_size(arch), "mean": [0.485, 0.456, 0.406],
                                                         "std": [0.229, 0.224, 0.225]}))
        rebuilt = torchvision.models.get_model(arch, num_classes=2, **model_kwargs(arch))
        rebuilt.load_state_dict(torch.load(tmp_path / "best.pth", weights_only=True))
        loaded, _ = load_checkpoint(tmp_path / "best.pth")
        with torch.no_grad():  # the same outputs: transform_input, not in the state_dict, too
            assert torch.equal(loaded(images), model.eval()(images))


def test_train_single_refuses_the_size_in_one_line_before_reading_data(tmp_path, monkeypatch, capsys):
    # The data folder does not exist: had anything read it first, the error would name it.
    import train_single
    code, out, err = in_process(train_single.main, [
        "--arch", "vit_b_16", "--image-size", "64", "--weights", "none", "--data-dir", str(tmp_path / "no-data"),
        "--checkpoint", str(tmp_path / "out" / "best.pth")], monkeypatch, capsys)
    assert code == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--arch vit_b_16" in lines[0] and "--image-size 224 only" in lines[0], err
    assert out == "" and not (tmp_path / "out").exists()


def test_train_ddp_refuses_the_size_too(tmp_path, monkeypatch, capsys):
    import train_ddp
    fails_in_process(train_ddp.main, ["--arch", "inception_v3", "--image-size", "64", "--data-dir",
                                      str(tmp_path / "no-data")], monkeypatch, capsys,
                     "train_ddp.py: error: --arch inception_v3 needs --image-size 75 or more (got 64)")
