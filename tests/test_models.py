"""build_model: the 2-class head, local weight files, torchvision's weights= API offline."""
import pytest
import torch
import torch.nn as nn
import torchvision

from src.errors import UserError
from src.models import build_model


@pytest.mark.parametrize("arch", ["vgg16", "squeezenet1_1", "resnet18"])
def test_random_init_model_loads_into_torchvision_two_class_model(arch, tmp_path):
    torch.manual_seed(0)
    model = build_model(arch, "none")
    torch.save(model.state_dict(), tmp_path / "w.pth")
    fresh = torchvision.models.get_model(arch, num_classes=2)
    fresh.load_state_dict(torch.load(tmp_path / "w.pth", weights_only=True))
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 2)


def test_imagenet_file_keeps_features_and_gets_a_new_head(tmp_path):
    torch.manual_seed(1)
    imagenet = torchvision.models.get_model("squeezenet1_1")  # 1000 classes, like the real file
    torch.save(imagenet.state_dict(), tmp_path / "imagenet.pth")
    model = build_model("squeezenet1_1", str(tmp_path / "imagenet.pth"))
    assert torch.equal(model.features[0].weight, imagenet.features[0].weight)
    assert model.classifier[1].out_channels == 2
    torchvision.models.squeezenet1_1(num_classes=2).load_state_dict(model.state_dict())


def test_default_weights_come_through_torchvision_weights_api(tmp_path, monkeypatch):
    """Offline, torchvision finds the file in its hub cache: the real loading code runs."""
    torch.manual_seed(2)
    imagenet = torchvision.models.get_model("resnet18")
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    cache = tmp_path / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(imagenet.state_dict(), cache / url.rsplit("/", 1)[-1])
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    model = build_model("resnet18", "default")
    assert torch.equal(model.conv1.weight, imagenet.conv1.weight)
    assert model.fc.out_features == 2


def test_default_weights_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache: torchvision must download
    with pytest.raises(UserError, match="--weights none, or --weights PATH"):
        build_model("squeezenet1_1", "default")


def test_weights_of_another_architecture_are_refused(tmp_path):
    torch.save(torchvision.models.get_model("squeezenet1_0").state_dict(), tmp_path / "other.pth")
    (tmp_path / "junk.pth").write_text("not a checkpoint")
    with pytest.raises(UserError, match="not a squeezenet1_1 checkpoint"):
        build_model("squeezenet1_1", str(tmp_path / "other.pth"))
    with pytest.raises(UserError, match="junk.pth is not a PyTorch state_dict"):
        build_model("squeezenet1_1", str(tmp_path / "junk.pth"))
    with pytest.raises(UserError, match="no such file"):
        build_model("squeezenet1_1", str(tmp_path / "missing.pth"))


def test_unknown_arch_and_dropout():
    with pytest.raises(UserError, match="--arch vgg17"):
        build_model("vgg17", "none")
    model = build_model("squeezenet1_1", "none", dropout=0.0)
    assert [m.p for m in model.modules() if isinstance(m, nn.Dropout)] == [0.0]
