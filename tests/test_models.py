"""build_model: the 2-class head, local weight files, torchvision's weights= API offline."""
import pytest
import torch
import torch.nn as nn
import torchvision
from conftest import in_process, outputs

from src.dropout import set_samples
from src.errors import UserError
from src.models import build_model, head_of, model_kwargs


@pytest.mark.parametrize("arch", ["vgg16", "squeezenet1_1", "resnet18"])
def test_random_init_model_loads_into_torchvision_two_class_model(arch, tmp_path):
    torch.manual_seed(0)
    model = build_model(arch, "none")
    torch.save(model.state_dict(), tmp_path / "w.pth")
    with torch.device("meta"):  # no initialisation to pay for: the load checks every key and shape
        fresh = torchvision.models.get_model(arch, num_classes=2)
    fresh.load_state_dict(torch.load(tmp_path / "w.pth", weights_only=True), assign=True)
    assert not any(t.is_meta for t in fresh.state_dict().values())
    set_samples(model, torch.arange(1))  # a training forward draws each sample's dropout masks
    assert model(torch.zeros(1, 3, 64, 64)).shape == (1, 2)


@pytest.mark.parametrize("arch", ["squeezenet1_1", "resnet18", "mobilenet_v3_small", "efficientnet_b0",
                                  "regnet_y_400mf", "shufflenet_v2_x0_5", "convnext_tiny", "googlenet"])
def test_imagenet_file_keeps_every_backbone_tensor_and_gets_a_new_head(arch, tmp_path):
    """--weights FILE with ImageNet's 1000 classes: each tensor but the head's is the file's, the
    head has 2 outputs and fresh weights, and the result loads into torchvision's 2-class model."""
    torch.manual_seed(1)
    imagenet = torchvision.models.get_model(arch)  # 1000 classes, like the real file
    torch.save(imagenet.state_dict(), tmp_path / "imagenet.pth")
    model = build_model(arch, str(tmp_path / "imagenet.pth"))
    head, layer = head_of(model)
    assert (layer.out_features if isinstance(layer, nn.Linear) else layer.out_channels) == 2
    file, built = imagenet.state_dict(), model.state_dict()
    backbone = [k for k in built if not k.startswith(head + ".")]
    assert len(backbone) == len(built) - 2, "only the head's weight and bias are new"
    for key in backbone:
        assert torch.equal(built[key], file[key]), key
    torchvision.models.get_model(arch, num_classes=2, **model_kwargs(arch)).load_state_dict(built)
    assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 2)


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


def test_default_weights_offline_is_one_line(exact_data, tmp_path, monkeypatch, capsys):
    """An empty cache and a download that fails, whether or not this machine is online: the
    script's error is the only line, without torch.hub's `Downloading: ...` before it."""
    import urllib.error

    import train_single
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("no network")
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    with pytest.raises(UserError, match="--weights none, or --weights PATH"):
        build_model("squeezenet1_1", "default")
    assert capsys.readouterr() == ("", "")
    code, out, err = in_process(train_single.main, ["--data-dir", str(exact_data), "--arch", "squeezenet1_1",
                                                    *outputs(tmp_path / "out")], monkeypatch, capsys)
    assert (code, out) == (2, "") and err.split("\r")[-1].startswith(
        "error: cannot download the ImageNet weights for squeezenet1_1 from https://"), err
    assert "Downloading" not in err and err.count("\n") == 1, err


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
