"""--freeze and --freeze-epochs: only the new last layer trains, from the backbone's cached outputs
when it can, the same in every mode, and a resume across the unfreezing is exact."""
import pytest
import torch
import torchvision
from conftest import (
    HOOKS,
    TOLERANCE,
    cache_files,
    distance,
    history,
    last_model,
    outputs,
    python,
    run_main,
    weights,
)

import train_single
from src.cache import cached
from src.cli import parse_args
from src.freeze import backbone_outputs, set_frozen
from src.loaders import labelled_images
from src.models import build_model, head_of
from src.transforms import normalize

# ResNet-18 has batch norm: frozen, it runs in eval mode, so its statistics stay the file's and a
# batch split across processes computes what the whole batch does.
FROZEN = ["--arch", "resnet18", "--image-size", "32", "--lr", "0.01", "--epochs", "2", "--workers", "0"]


@pytest.fixture(scope="module")
def backbone(module_tmp):
    """A ResNet-18 state_dict file with 1000 classes, as ImageNet's would be."""
    torch.manual_seed(3)
    path = module_tmp / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    return path


@pytest.fixture(scope="module")
def frozen_runs(runs, small_data, backbone):
    def get(mode, *extra, batch=16, env=None):
        per_process = batch // 2 if mode in ("ddp", "accelerate") else batch
        return runs(mode, *FROZEN, "--weights", str(backbone), "--batch-size", str(per_process),
                    "--freeze", *extra, env=env, data=small_data, kept="file")
    return get


def _backbone_unchanged(out, backbone):
    file = torch.load(backbone, weights_only=True)
    for state in (weights(out), last_model(out)):
        for key, tensor in state.items():
            if not key.startswith("fc."):
                assert torch.equal(tensor, file[key]), key  # weights and batch-norm statistics


def test_frozen_training_changes_only_the_head(frozen_runs, backbone, runs):
    out, result = frozen_runs("single", "--cache", str(runs.root / "frozen-cache"))
    assert "epochs 1 to 2: the last layer trains on resnet18's cached outputs" in result.stdout
    assert cache_files(runs.root / "frozen-cache") == [
        "features_resnet18_32px.f32", "features_resnet18_32px.json", "train_32px.json", "train_32px.u8"]
    _backbone_unchanged(out, backbone)
    torch.manual_seed(42)
    start = build_model("resnet18", str(backbone))
    assert not torch.equal(last_model(out)["fc.weight"], start.fc.weight)
    optimizer = weights(out, "last.pth")["optimizer"]
    assert len(optimizer["state"]) == 2, "momentum for the head's weight and bias only"
    assert history(out)[-1]["val_acc"] > 0.8


def test_the_feature_cache_trains_the_same_head_as_the_images(frozen_runs, runs, backbone):
    cached_out = frozen_runs("single", "--cache", str(runs.root / "frozen-cache"))[0]
    images_out, result = frozen_runs("single")
    assert "--freeze without --cache runs the frozen backbone on every image" in result.stdout
    assert "cached outputs" not in result.stdout
    _backbone_unchanged(images_out, backbone)  # frozen while the whole model runs
    assert torch.allclose(last_model(images_out)["fc.weight"], last_model(cached_out)["fc.weight"], atol=1e-6)
    assert history(images_out)[-1]["val_loss"] == pytest.approx(history(cached_out)[-1]["val_loss"], rel=1e-5)


@pytest.mark.parametrize("mode", ["dp", "ddp", "accelerate"])
def test_every_mode_freezes_the_same(mode, frozen_runs, runs):
    cache = ["--cache", str(runs.root / "frozen-cache")]
    reference = last_model(frozen_runs("single", *cache)[0])
    far = distance(last_model(frozen_runs("single", *cache, batch=8)[0]), reference)
    out, result = frozen_runs(mode, *cache)
    assert result.stdout.count("the last layer trains on resnet18's cached outputs") == 1
    assert distance(last_model(out), reference) / far < TOLERANCE


def test_freeze_with_augment_trains_from_images_and_says_so_once(frozen_runs, runs):
    cache = runs.root / "augment-cache"
    out, result = frozen_runs("ddp", "--cache", str(cache), "--augment", "--epochs", "1")
    assert result.stdout.count("--freeze with --augment trains from the images") == 1
    assert not list(cache.glob("features_*")), "no feature cache: the augmented images change"


def test_freeze_epochs_resume_across_the_unfreezing_equals_the_straight_run(small_data, backbone, tmp_path, runs):
    """Ctrl-C at step 5 of the frozen epoch 1 (12 steps, the head on cached features): last.pth
    there; --resume goes on inside the frozen stage, unfreezes, and ends as the straight run."""
    cache = ["--cache", str(runs.root / "frozen-cache")]
    flags = ["--data-dir", str(small_data), *FROZEN, "--weights", str(backbone), "--batch-size", "16",
             "--freeze-epochs", "1", *cache]
    straight = runs("single", *FROZEN, "--weights", str(backbone), "--batch-size", "16", "--freeze-epochs", "1",
                    *cache, data=small_data, kept="test")[0]
    result = python("train_single.py", *flags, *outputs(tmp_path), env={"PYTHONPATH": HOOKS, "INTERRUPT_AT_STEP": "5"})
    assert result.returncode == 75, result.stderr[-3000:]
    assert (weights(tmp_path, "last.pth")["epoch"], weights(tmp_path, "last.pth")["step"]) == (0, 5)
    result = run_main(train_single.main, [*flags, "--resume", *outputs(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in epoch 1 of 2 after its step 5" in result.stdout and "the last layer trains on" in result.stdout
    assert torch.equal(torch.cat([t.flatten().double() for t in last_model(tmp_path).values()]),
                       torch.cat([t.flatten().double() for t in last_model(straight).values()]))
    file = torch.load(backbone, weights_only=True)
    assert not torch.equal(last_model(straight)["conv1.weight"], file["conv1.weight"]), "epoch 2 unfroze"


@pytest.mark.parametrize("flags, frozen", [(["--freeze-epochs", "2"], 2), (["--freeze"], 4), ([], 0)])
def test_the_stages_run_each_remaining_epoch_once_frozen_or_not(flags, frozen):
    """From any epoch a run starts or resumes at, the stages hold the epochs left, each once, in
    order, the first `frozen` of the run frozen: a run resumed after the frozen epochs does not
    train them again unfrozen."""
    from src.freeze import epoch_stages
    args = parse_args("", ["--arch", "squeezenet1_1", "--weights", "none", "--epochs", "4", *flags])
    model = build_model("squeezenet1_1", "none")
    for start in range(5):
        stages = [(list(stage.epochs), stage.frozen) for stage in
                  epoch_stages(args, model, None, start, torch.device("cpu"), cache_features=False)]
        assert [epoch for epochs, _ in stages for epoch in epochs] == list(range(start, 4)), (start, stages)
        assert all(is_frozen == (epoch < frozen) for epochs, is_frozen in stages for epoch in epochs)


def test_the_feature_cache_is_rebuilt_when_the_backbone_or_size_changes(small_data, tmp_path, capsys):
    args = parse_args("", ["--freeze", "--cache", str(tmp_path), "--arch", "resnet18", "--image-size", "32",
                           "--batch-size", "16"])
    dataset = cached(labelled_images(small_data, 32, show_progress=False), 32, tmp_path, 0, show_progress=False)
    torch.manual_seed(0)
    model = build_model("resnet18", "none")
    set_frozen(model, True)
    first = backbone_outputs(args, model, dataset, torch.device("cpu"), 0, show=True)
    assert "reading resnet18's outputs from the cache" not in capsys.readouterr().out
    assert len(first) == 240 and first[0][0].shape == (512,) and first[0][1] == dataset[0][1]
    backbone_outputs(args, model, dataset, torch.device("cpu"), 0, show=True)
    assert "reading resnet18's outputs from the cache" in capsys.readouterr().out
    with torch.no_grad():
        model.conv1.weight.mul_(1.5)
    again = backbone_outputs(args, model, dataset, torch.device("cpu"), 0, show=True)
    assert "reading" not in capsys.readouterr().out and not torch.equal(again[0][0], first[0][0])
    model.eval()
    with torch.no_grad():
        images = torch.stack([dataset[i][0] for i in range(3)])
        captured = []
        hook = head_of(model)[1].register_forward_hook(lambda m, i, o: captured.append(i[0]))
        model(normalize(images))
        hook.remove()
    assert torch.allclose(torch.stack([again[i][0] for i in range(3)]), captured[0], atol=1e-5)


def test_a_model_whose_last_layer_is_not_its_output_trains_from_images(small_data, tmp_path, capsys):
    args = parse_args("", ["--freeze", "--cache", str(tmp_path), "--arch", "squeezenet1_1", "--image-size", "32"])
    dataset = cached(labelled_images(small_data, 32, show_progress=False), 32, tmp_path, 0, show_progress=False)
    model = build_model("squeezenet1_1", "none")
    assert backbone_outputs(args, model, dataset, torch.device("cpu"), 0, show=True) is None
    assert "the last layer of squeezenet1_1 is not its output layer" in capsys.readouterr().out
