"""train_fsdp.py, FSDP2 under torchrun, trains the same model as the other modes: the full recipe
with --accumulate against train_single.py at the doubled batch; last.pth resumed across modes in
both directions (and across the unfreezing of --freeze-epochs); one reduce-scatter a step; each
rank's bytes of VGG16 against a DDP rank's; the blocks that get their own fully_shard. And
train_accelerate.py refuses accelerate's FSDP, DeepSpeed and Megatron-LM in one line."""
import json
import shutil
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from accelerate.utils import DistributedType
from conftest import (
    EXACT,
    RECIPE,
    TINY,
    VAL,
    B,
    assert_reproduces,
    assert_same_run,
    copy_run,
    distance,
    evaluate_flags,
    evaluated_record,
    fails_in_process,
    files_and_times,
    in_process,
    last_model,
    mode_run,
    outputs,
    recipe_run,
    run,
    run_main,
    shard_as_train_fsdp,
    stops_straight,
    weights,
)

import train_accelerate
import train_fsdp
import train_single
from src.accelerate_checks import check_accelerator
from src.cli import defaults, parse_args
from src.errors import end_process_group
from src.fsdp import fsdp_units, rank_bytes
from src.loaders import Data
from src.models import build_model, head_of
from src.recipe import make_optimizer, make_schedule


@pytest.fixture(scope="module")
def fsdp_run(runs):
    """Two processes, every recipe flag, --accumulate 2, TensorBoard, --profile; each epoch's
    last.pth kept (OUT/../copies/last.K.pth)."""
    return recipe_run(runs, "fsdp", "--log-dir", "{run}/tensorboard", "--profile", env={"COPY_LAST": "{run}/copies"})


def test_fsdp_with_the_full_recipe_and_accumulate_matches_single(fsdp_run, reference, recipe_far):
    out, result = fsdp_run
    assert "on 2 x cpu" in result.stdout and "x 2 micro-batches" in result.stdout
    assert_same_run(out, reference, recipe_far)


def test_only_rank_0_writes_and_prints_and_best_pth_is_the_plain_model(fsdp_run):
    out, result = fsdp_run
    writes = [line.split(" ", 1) for line in (out.parent / "writes.log").read_text().splitlines()]
    assert {rank for rank, _ in writes} == {"0"}, writes
    assert {Path(path).name for _, path in writes} >= {"best.pth", "best.json", "last.dcp", "history.json",
                                                        "curves.png"}
    for line in ("epoch 1/2  train loss", "done in ", "rank 0 held "):
        assert result.stdout.count(line) == 1, line
    assert result.stderr.count("epoch 1/2 train:   0%") == 1, "one rank draws progress bars"
    state = weights(out)
    assert all(type(tensor) is torch.Tensor for tensor in state.values())  # no DTensor
    torchvision.models.squeezenet1_1(num_classes=2).load_state_dict(state)  # strict: every key, every shape
    assert json.loads((out / "best.json").read_text())["sha256"]


def test_profile_counts_the_all_gathers_and_reduce_scatters(fsdp_run):
    out, result = fsdp_run
    folder = out.parent / "tensorboard" / "profile"
    figures = json.loads((folder / "profile.json").read_text())
    assert figures["world_size"] == 2
    communication = figures["host"]["communication"]
    assert communication["all-gather"] > 0 and communication["reduce-scatter"] > 0, communication
    table = (folder / "profile.md").read_text()
    assert "| - all-gather | " in table and "| - reduce-scatter | " in table
    assert result.stdout.count("| where the time went |") == 1


def test_each_rank_holds_half_of_the_model_at_a_step(fsdp_run):
    """SqueezeNet's parameters all have an even first dimension: each of the two ranks holds
    exactly half of each, and of its gradient and momentum."""
    _, result = fsdp_run
    line = next(line for line in result.stdout.splitlines() if line.startswith("rank 0 held "))
    assert ": 0.500 of the " in line and "MB of gradients" in line, line


def test_an_fsdp_last_dcp_resumes_under_train_single(fsdp_run, runs, reference, recipe_far, tmp_path):
    """Epoch 1's last.dcp of the FSDP run (each rank's shards; read whole, the optimizer's state
    numbered as one process numbers it), resumed by one process with the same global batch in the
    middle of the cosine schedule: it ends where the reference does."""
    out, _ = fsdp_run
    (tmp_path / "out").mkdir()
    shutil.copytree(out.parent / "copies" / "last.1.dcp", tmp_path / "out" / "last.dcp")
    saved = weights(tmp_path / "out", "last.pth")
    assert saved["epoch"] == 1 and sorted(saved["optimizer"]["state"]) == list(range(52))
    result = run_main(train_single.main, ["--data-dir", str(runs.exact_data), *EXACT, *VAL, *RECIPE, "--epochs", "2",
                                          "--batch-size", str(B), "--accumulate", "4", "--resume",
                                          *outputs(tmp_path / "out")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed from" in result.stdout and "after epoch 1" in result.stdout
    assert_same_run(tmp_path / "out", reference, recipe_far)


# In this process, as a world of one (torch is imported already; each launch costs seconds).

def test_freeze_epochs_resume_into_fsdp_across_the_unfreezing(exact_data, tmp_path, world_of_one,
                                                               monkeypatch, capsys):
    """--freeze-epochs 1 with weight decay. Epoch 1 under FSDP trains the last layer alone, from
    the images even with --cache, as one process does. A last.pth of that frozen epoch holds the
    momentum of the last layer only; FSDP resumes it to epoch 2, which trains every layer, and
    ends where train_single.py's two straight epochs do. (Loading an optimizer state into the
    shards must leave the parameters without one in the file without one, as a plain
    load_state_dict does: torch's set_optimizer_state_dict gives each one a state first.)"""
    flags = ["--data-dir", str(exact_data), *EXACT, *VAL, "--batch-size", "20", "--freeze-epochs", "1",
             "--weight-decay", "0.01", "--cache", str(tmp_path / "cache")]

    def train(main, folder, *extra):
        try:
            code, out, err = in_process(main, [*flags, *outputs(tmp_path / folder), *extra], monkeypatch, capsys)
        finally:
            end_process_group()  # as train_fsdp.py's end does
        assert code == 0, err[-3000:]
        return out

    printed = train(train_fsdp.main, "fsdp", "--epochs", "1")
    assert printed.count("--freeze under FSDP runs the frozen backbone on every image") == 1
    frozen = weights(tmp_path / "fsdp", "last.pth")  # last.dcp, read whole
    torch.manual_seed(42)  # what main() draws the model from
    start = build_model("squeezenet1_1", "none").state_dict()
    head = head_of(torchvision.models.squeezenet1_1())[0]
    for key, tensor in frozen["model"].items():
        assert torch.equal(tensor, start[key]) != key.startswith(head + "."), key
    assert len(frozen["optimizer"]["state"]) == 2, "momentum for the last layer's weight and bias only"

    train(train_single.main, "single", "--epochs", "1")
    assert distance(last_model(tmp_path / "single"), frozen["model"]) < 1e-6  # the same epoch, one process
    train(train_fsdp.main, "single", "--epochs", "2", "--resume")
    train(train_single.main, "straight", "--epochs", "2")
    moved = distance(last_model(tmp_path / "straight"), frozen["model"])
    assert distance(last_model(tmp_path / "single"), last_model(tmp_path / "straight")) < 1e-6 * moved
    assert len(weights(tmp_path / "single", "last.pth")["optimizer"]["state"]) == 52
    # FSDP's own last.dcp of the frozen epoch, loaded into the shards: the last layer's momentum alone.
    train(train_fsdp.main, "fsdp", "--epochs", "2", "--resume")
    assert distance(last_model(tmp_path / "fsdp"), last_model(tmp_path / "straight")) < 1e-6 * moved


def test_evaluate_loads_best_pth_into_the_shards(runs, world_of_one, tmp_path, monkeypatch, capsys):
    """--evaluate of train_single.py's best.pth (epoch 1 of the shared run) under FSDP, a world of
    one in this process: the figures of that epoch, and nothing written."""
    out = copy_run("single", runs, tmp_path / "out")
    before = files_and_times(out)
    monkeypatch.chdir(tmp_path)  # where the plot would land
    code, stdout, stderr = in_process(train_fsdp.main, ["--data-dir", str(runs.exact_data), *evaluate_flags("single", out)],
                                      monkeypatch, capsys)
    assert code == 0, stderr
    assert f"validated {out / 'best.pth'} (epoch 1)" in stdout
    assert_reproduces(evaluated_record(stdout), out, 1)
    assert files_and_times(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_amp_autocasts_as_in_the_other_modes(runs, far, tmp_path, world_of_one, monkeypatch, capsys):
    """--amp bf16 under FSDP, a world of one in this process: where train_single.py --amp bf16 ends
    (the same autocast over float32 weights, measured equal to the last bit; with two processes
    it ended bit for bit where train_ddp.py --amp bf16 does, and so did fp16), and 0.025 of far
    from float32 (test_performance), so not float32."""
    code, _, stderr = in_process(train_fsdp.main, ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--epochs", "2",
                                                   "--batch-size", str(2 * B), "--amp", "bf16",
                                                   *outputs(tmp_path / "out")], monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    got = last_model(tmp_path / "out")
    assert distance(got, last_model(runs.exact("single", "--amp", "bf16")[0])) / far < 1e-6
    assert distance(got, last_model(mode_run(runs, "single")[0])) / far > 1e-3


def test_channels_last_is_refused_in_one_line(exact_data, tmp_path, world_of_one, monkeypatch, capsys):
    """FSDP2 cannot shard channels-last weights; fully_shard would stop with a traceback."""
    fails_in_process(train_fsdp.main, ["--data-dir", str(exact_data), *EXACT, *outputs(tmp_path / "out"),
                                       "--channels-last"], monkeypatch, capsys,
                     "error: --channels-last: FSDP shards contiguous weights only")


def test_train_fsdp_gives_each_unit_and_the_root_a_fully_shard_of_its_own(exact_data, tmp_path, world_of_one,
                                                                         monkeypatch, capsys):
    """The model as train_fsdp.py hands it to its optimizer: every unit of fsdp_units (several, for
    SqueezeNet) and the root sharded, each unit gathered on its own in the forward pass (a root
    alone would gather every parameter at once)."""
    from torch.distributed.fsdp import FSDPModule

    from src.errors import UserError
    seen = {}

    def optimizer_of(model, args, device):
        seen["units"] = [isinstance(unit, FSDPModule) for unit in fsdp_units(model)]
        seen["root"] = isinstance(model, FSDPModule)
        raise UserError("seen")
    monkeypatch.setattr(train_fsdp, "make_optimizer", optimizer_of)
    fails_in_process(train_fsdp.main, ["--data-dir", str(exact_data), *EXACT, *outputs(tmp_path / "out")], monkeypatch,
                     capsys, "error: seen")
    assert len(seen["units"]) > 1 and all(seen["units"]) and seen["root"], seen


def _vgg16_step(backend: str, world_size: int, wrap) -> tuple[dict, nn.Module]:
    """rank_bytes of rank 0 after an SGD step with momentum of VGG16 (2 images of 32 px), with
    `wrap` applied to the model in a process group of `backend` and `world_size`."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world_size)
    try:
        with torch.device("meta"):  # uninitialised weights: the bytes do not depend on them, and
            model = torchvision.models.vgg16(num_classes=2)  # drawing them costs seconds
        net = wrap(model.to_empty(device="cpu"))
        optimizer = make_optimizer(model, parse_args("", []), torch.device("cpu"))
        F.cross_entropy(net(torch.randn(2, 3, 32, 32)), torch.tensor([0, 1])).backward()
        optimizer.step()
        return rank_bytes(optimizer), model
    finally:
        dist.destroy_process_group()


def test_each_vgg16_rank_holds_half_of_what_a_ddp_rank_holds():
    """A DDP rank holds the whole model, its gradient and momentum whatever the world size: measured
    in a world of one. FSDP's rank 0 of two, as torch's "fake" process group simulates it (no
    communication, so the values are meaningless; the shards, gradients and optimizer state are
    the real ones). VGG16's parameters all have an even first dimension, so each rank holds
    exactly half of each; the issue's bound is 0.55."""
    ddp, _ = _vgg16_step("gloo", 1, nn.parallel.DistributedDataParallel)
    fsdp, model = _vgg16_step("fake", 2, lambda model: shard_as_train_fsdp(model) or model)
    assert ddp["parameters"] == (138_357_544 - 4096 * 998 - 998) * 4  # torchvision's, less 998 classes
    assert ddp == {"parameters": ddp["parameters"], "gradients": ddp["parameters"], "optimizer": ddp["parameters"]}
    assert {key: 2 * value for key, value in fsdp.items()} == ddp
    assert sum(fsdp.values()) <= 0.55 * sum(ddp.values())
    # The 25088x4096 Linear (77% of the weights): 2048 of its rows on each rank.
    assert dict(model.named_parameters())["classifier.0.weight"].to_local().shape == (2048, 25088)


def test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers(monkeypatch):
    """In a fake world of two (no communication: the collectives are counted, not run). With
    --accumulate 2, train_fsdp.py's loop reduce-scatters the gradients on a step's last
    micro-batch only: as often over 4 micro-batches as --accumulate 1 does over 2. Its validation
    first broadcasts each buffer (batch norm's statistics) from rank 0, as DDP's forward does:
    each rank's own would follow its share of the batches (measured with ResNet-18 on two real
    ranks: validation loss 0.7018 against 0.7004 from the saved model), and a rank with a
    validation batch less runs a forward more, as every forward gathers. With the GPU's kernel
    choices (AS_ON_GPU=1: fused optimizers, but not SGD's, which has no DTensor version)."""
    monkeypatch.setenv("AS_ON_GPU", "1")
    from src.ema import WeightAverage
    from src.progress import Progress
    from src.state import TrainingState

    def counted(name: str) -> list:
        """The `src` of each call of torch.distributed.NAME from now on."""
        seen, call = [], getattr(dist, name)

        def count(*args, **kwargs):
            seen.append(kwargs.get("src"))
            return call(*args, **kwargs)
        monkeypatch.setattr(dist, name, count)
        return seen
    reduce_scatters, broadcasts = counted("reduce_scatter_single"), counted("broadcast")
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        device = torch.device("cpu")
        dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i % 2) for i in range(16)]
        for accumulate in (1, 2):
            args = parse_args("", ["--batch-size", "2", "--accumulate", str(accumulate), "--log-every", "1000"])
            torch.manual_seed(0)
            model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(4, 2))
            shard_as_train_fsdp(model, device)
            optimizer = make_optimizer(model, args, device)
            schedule = make_schedule(optimizer, args, 2)
            data = Data(dataset, list(range(4 * accumulate * 2)), [8, 9, 10, 11, 12], "")
            loader, val_loader = train_fsdp.loaders(dataset, data, args, device, 0, 2)
            loader.sampler.set_epoch(0)
            reduce_scatters.clear()
            state = TrainingState(args, {}, model, optimizer, torch.amp.GradScaler("cpu", enabled=False), schedule,
                                  WeightAverage(model, optimizer, None), 2)
            progress = Progress(args, state, 4, device)
            train_fsdp.train_epoch(model, loader, 0, progress, state, args, device)
            assert schedule.last_epoch == 2 and len(loader) == 2 * accumulate  # 2 optimizer steps
            if accumulate == 1:
                per_two_steps = len(reduce_scatters)
                assert per_two_steps == 2 * 3  # the convolution, batch norm and Linear: a unit each
        assert len(reduce_scatters) == per_two_steps, "one reduce-scatter a step, not one a micro-batch"
        forwards = []
        model.register_forward_hook(lambda module, inputs, output: forwards.append(len(inputs[0])))
        train_fsdp.evaluate(model, val_loader, "val", progress, args, device)
        assert broadcasts == [0, 0, 0]  # running mean, variance and batch count, from rank 0
        # Rank 0's 2 of the 5 validation images are one batch, rank 1's 3 two: one forward more.
        assert forwards == [2, 2]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("images, batch", [(5, 1), (5, 3), (7, 2), (8, 2)])
def test_every_rank_runs_as_many_validation_forwards(images, batch):
    """Each forward of a sharded model gathers from every rank: a rank whose unpadded validation
    shard has a batch less runs one forward more after its own (7 images in batches of 2 over 3
    ranks: 2, 2 and 3 images, so 1, 1 and 2 batches), counted against the loaders of every rank."""
    from src.fsdp import forwards_to_match

    dataset = [(torch.zeros(1), 0) for _ in range(images)]
    for world_size in (2, 3):
        data = Data(dataset, [0] * batch * world_size, list(range(images)), "")
        args = defaults(batch_size=batch, seed=0, workers=0, augment=False)
        loaders = [train_fsdp.loaders(dataset, data, args, torch.device("cpu"), rank, world_size)[1]
                   for rank in range(world_size)]
        forwards = []
        for loader in loaders:
            model = nn.Identity()
            calls = []
            model.register_forward_hook(lambda module, inputs, output: calls.append(1))
            for inputs, _ in loader:
                model(inputs)
            forwards_to_match(model, inputs, loader)
            forwards.append(len(calls))
        assert forwards == [max(map(len, loaders))] * world_size, (world_size, [len(loader) for loader in loaders])


def _names(model: nn.Module, units: list[nn.Module]) -> list[str]:
    return [name for name, module in model.named_modules() if any(module is unit for unit in units)]


def test_the_units_are_the_big_blocks_that_the_model_calls():
    with torch.device("meta"):
        vgg16, resnet18, vit, swin = (torchvision.models.get_model(arch, num_classes=2)
                                      for arch in ("vgg16", "resnet18", "vit_b_16", "swin_t"))
    assert _names(vgg16, fsdp_units(vgg16)) == [
        "features", "features.17", "features.19", "features.21", "features.24", "features.26",
        "features.28", "classifier.0", "classifier.3"]
    assert _names(resnet18, fsdp_units(resnet18)) == ["layer3.0", "layer3.1", "layer4.0", "layer4.1"]
    vit_units = _names(vit, fsdp_units(vit))
    assert "encoder.layers.encoder_layer_0" in vit_units and "encoder.layers.encoder_layer_0.mlp.0" in vit_units
    # Modules whose parent reads their weights instead of calling them are never units.
    assert not any(name.endswith(("out_proj", "qkv", "proj")) for name in
                   vit_units + _names(swin, fsdp_units(swin)))
    for model in (vgg16, resnet18, vit, swin):
        assert all(type(unit).forward is not nn.Module.forward for unit in fsdp_units(model))



# --compile under FSDP: every convolution and Linear layer runs in a compiled graph, as under DDP.

class CompiledCalls:
    """A torch.compile backend that runs each graph as it is (no code generation: seconds, not
    minutes) and counts, per kind, the conv2d and linear calls that run inside compiled graphs."""

    KINDS = ("conv2d", "linear")

    def __init__(self):
        self.calls = dict.fromkeys(self.KINDS, 0)

    def __call__(self, graph, example_inputs):
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        ops = {kind: sum(kind in target for target in targets) for kind in self.KINDS}

        def run(*args):
            for kind in self.KINDS:
                self.calls[kind] += ops[kind]
            return graph.forward(*args)
        return run

    def compile(self, compile):
        """torch.compile with this backend, for monkeypatch.setattr(torch, "compile", ...)."""
        return lambda function, **options: compile(function, backend=self, **options)

    def taken(self) -> dict:
        calls, self.calls = self.calls, dict.fromkeys(self.KINDS, 0)
        return calls


def _layers(model: nn.Module) -> dict:
    """The model's conv2d and linear calls in one forward: each Conv2d and Linear module is called once."""
    return {"conv2d": sum(isinstance(m, nn.Conv2d) for m in model.modules()),
            "linear": sum(isinstance(m, nn.Linear) for m in model.modules())}


@pytest.mark.parametrize("arch", ["vgg11", "resnet18"])
def test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp(arch, monkeypatch):
    """The compiled calls in a training forward and backward and an eval forward, DDP (a world of
    one) and FSDP (rank 0 of torch's "fake" world of two: the gathers are not run, the hooks and
    graph breaks are FSDP's), each model compiled as its script compiles it. VGG11's units are
    bare Conv2d and Linear layers in nn.Sequential containers, ResNet-18's its last four blocks.
    With a limit of 2 compiled versions per function (train and eval mode), regions sharing one
    function's versions would run eagerly."""
    import torch._dynamo
    compile, counted = torch.compile, {}
    for mode, backend, world_size in (("ddp", "gloo", 1), ("fsdp", "fake", 2)):
        torch._dynamo.reset()
        captured = CompiledCalls()
        monkeypatch.setattr(torch, "compile", captured.compile(compile))
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=world_size)
        try:
            with torch.device("meta"):  # uninitialised weights: what is compiled does not depend on them
                model = torchvision.models.get_model(arch, num_classes=2)
            layers = _layers(model)
            model.to_empty(device="cpu")
            if mode == "ddp":
                net = torch.compile(nn.parallel.DistributedDataParallel(model))
            else:
                shard_as_train_fsdp(model, compiled=True)
                net = torch.compile(model)
            with torch._dynamo.config.patch(recompile_limit=2):
                net(torch.randn(2, 3, 32, 32)).sum().backward()
                training = captured.taken()
                net.eval()
                with torch.no_grad():
                    net(torch.randn(2, 3, 32, 32))
            counted[mode] = training, captured.taken()
        finally:
            dist.destroy_process_group()
    assert counted["ddp"] == (layers, layers) and counted["fsdp"] == counted["ddp"], counted


def test_train_fsdp_compile_runs_every_convolution_compiled(exact_data, tmp_path, world_of_one, monkeypatch, capsys):
    """train_fsdp.py --compile, a world of one in this process, one epoch of SqueezeNet (its units
    the Fire blocks of an nn.Sequential that holds its first convolution too): every forward of
    training and validation (5 and 6 batches of 20) runs all 26 convolutions in compiled graphs."""
    captured = CompiledCalls()
    monkeypatch.setattr(torch, "compile", captured.compile(torch.compile))
    code, _, stderr = in_process(train_fsdp.main, ["--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "1",
                                                   "--batch-size", "20", "--compile", *outputs(tmp_path / "out")],
                                 monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    with torch.device("meta"):
        convolutions = _layers(build_model("squeezenet1_1", "none", 0.0))["conv2d"]
    assert captured.taken()["conv2d"] == (100 // 20 + -(-101 // 20)) * convolutions == 11 * 26

# train_accelerate.py and accelerate's sharding plugins.

@pytest.mark.parametrize("variable, plugin", [("ACCELERATE_USE_FSDP", "FSDP"),
                                              ("ACCELERATE_USE_DEEPSPEED", "DeepSpeed"),
                                              ("ACCELERATE_USE_MEGATRON_LM", "Megatron-LM")])
def test_accelerate_refuses_a_sharding_plugin_it_was_asked_for(variable, plugin, exact_data, tmp_path,
                                                              monkeypatch, capsys):
    """What accelerate launch --use_fsdp (--use_deepspeed, --use_megatron_lm) sets, and the
    Accelerator reads: refused before it is made (on a CPU it would train plain DDP; without
    DeepSpeed it would stop with a traceback)."""
    monkeypatch.setenv(variable, "true")
    line = fails_in_process(train_accelerate.main, ["--data-dir", str(exact_data), *outputs(tmp_path / "out")],
                            monkeypatch, capsys, f"accelerate was asked for {plugin} ({variable}=true)")
    assert line.endswith("to shard the model over the processes run torchrun --nproc_per_node=1 train_fsdp.py")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", list(DistributedType))
def test_accelerate_trains_only_with_its_ddp(kind, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    accelerator = SimpleNamespace(distributed_type=kind, num_processes=1, is_main_process=True,
                                  mixed_precision="no", native_amp=True)
    if kind == DistributedType.NO or kind.value.startswith("MULTI_"):
        check_accelerator(accelerator)
    else:
        with pytest.raises(Exception, match=f"accelerate's distributed type is {kind.value}; .*train_fsdp.py"):
            check_accelerator(accelerator)


def test_accelerate_launch_use_fsdp_is_refused_once(exact_data, tmp_path):
    """The launch that trained plain DDP on a CPU, saying nothing: two processes, one line."""
    result = run(["accelerate", "launch", "--use_fsdp", "--fsdp_version", "2", "--num_processes", "2",
                  "--main_process_port", "0", "train_accelerate.py", "--data-dir", str(exact_data), *EXACT,
                  *outputs(tmp_path / "out")], env={"ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf")})
    assert result.returncode != 0
    assert result.stderr.count("error: accelerate was asked for FSDP (ACCELERATE_USE_FSDP=true); ") == 1
    assert "run torchrun --nproc_per_node=2 train_fsdp.py" in result.stderr
    assert "exitcode  : 2" in result.stderr  # as the launcher reports it
    assert not (tmp_path / "out").exists()


def _same_state(a: Path, b: Path) -> None:
    """Two runs' last.pth hold the same weights, average (and its count) and optimizer state, bit for bit."""
    first, second = weights(a, "last.pth"), weights(b, "last.pth")
    for part in ("model",):
        assert all(torch.equal(first[part][k], second[part][k]) for k in first[part]), part
    assert first["average"]["updates"] == second["average"]["updates"]
    assert all(torch.equal(first["average"]["model"][k], second["average"]["model"][k]) for k in first["model"])
    for number, state in first["optimizer"]["state"].items():
        assert all(torch.equal(value, second["optimizer"]["state"][number][key]) for key, value in state.items())


@pytest.mark.parametrize("processes", [1, 2])
def test_an_fsdp_run_resumed_with_ema_ends_bit_for_bit_as_the_straight_one(processes, exact_data, runs, tmp_path,
                                                                          monkeypatch, capsys, request):
    """--ema-decay under FSDP: two epochs straight, and one epoch then --resume to two, end with the
    same weights, average, update count and momentum, bit for bit (loading a sharded optimizer steps
    it once with zero gradients, and the average's hook counted that step: 6 updates became 7 and the
    average moved). The saved average is not the weights: in a world of one torch's gather hands back
    the live parameters, which swapping the weights back in turned into the weights. One process:
    here, in this process. Two: conftest.fsdp_stops, whose restart goes on from epoch 1's last.dcp,
    against its straight run."""
    if processes == 2:
        straight, resumed = stops_straight(runs, "fsdp"), request.getfixturevalue("fsdp_stops")["restarted"].out
        assert "after epoch 1 of 2: going on" in request.getfixturevalue("fsdp_stops")["restarted"].result.stdout
        global_batch = 10
    else:
        flags = ["--data-dir", str(exact_data), *EXACT, *VAL, "--batch-size", str(2 * B), "--ema-decay", "0.9",
                 "--momentum", "0.9"]

        def train(folder, *extra):
            code, _, err = in_process(train_fsdp.main, [*flags, *outputs(tmp_path / folder), *extra], monkeypatch,
                                      capsys)
            assert code == 0, err[-3000:]
        train("straight", "--epochs", "2")
        train("resumed", "--epochs", "1")
        train("resumed", "--epochs", "2", "--resume")
        straight, resumed, global_batch = tmp_path / "straight", tmp_path / "resumed", 2 * B
    _same_state(straight, resumed)
    last = weights(straight, "last.pth")
    assert last["average"]["updates"] == 2 * (100 // global_batch)
    assert distance(last["average"]["model"], last["model"]) > 0, "the average is not the weights"


def test_saves_without_an_optimizer_state_count_no_update_of_the_average(exact_data, tmp_path, world_of_one,
                                                                           monkeypatch, capsys):
    """SGD without momentum keeps no optimizer state; torch's get_optimizer_state_dict then steps the
    optimizer once (lr 0, zero gradients) to make one, and the weight average's step hook counted
    that as an update at every save: with a step checkpoint after every step, 5 steps counted 10."""
    code, _, err = in_process(train_fsdp.main, ["--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "1",
                                                "--batch-size", str(2 * B), "--momentum", "0", "--ema-decay", "0.9",
                                                "--save-every-steps", "1", *outputs(tmp_path)], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    last = weights(tmp_path, "last.pth")
    assert last["average"]["updates"] == 100 // (2 * B) and last["optimizer"]["state"] == {}


def test_the_bytes_of_adamws_state_are_its_two_moments_without_the_step_counts():
    """rank_bytes after an AdamW step of a plain model: the parameters' and gradients' bytes, and
    of the optimizer's state exp_avg and exp_avg_sq only (each a parameter's size), not the 0-dim
    `step` tensor AdamW keeps beside them (the tests above use SGD, which keeps none)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.ReLU(), nn.Linear(3, 2))
    optimizer = make_optimizer(model, parse_args("", ["--optimizer", "adamw"]), torch.device("cpu"))
    F.cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 1, 0])).backward()
    optimizer.step()

    def nbytes(tensor):
        return tensor.numel() * tensor.element_size()
    params = list(model.parameters())
    states = [optimizer.state[p] for p in params]
    assert all(state["step"].dim() == 0 for state in states), "AdamW keeps a 0-dim step count per parameter"
    moments = sum(nbytes(state["exp_avg"]) + nbytes(state["exp_avg_sq"]) for state in states)
    assert moments == 2 * sum(nbytes(p) for p in params) == 2 * 4 * (5 * 3 + 3 + 3 * 2 + 2)
    expected = {"parameters": sum(map(nbytes, params)), "gradients": sum(nbytes(p.grad) for p in params),
                "optimizer": moments}
    assert rank_bytes(optimizer) == expected == rank_bytes(optimizer, whole=True)


def test_the_whole_model_is_a_copy_that_the_next_step_leaves_as_it_was():
    """whole_model in a world of one on the CPU, where torch's gather hands back the live
    parameters: what it returned (best.pth's weights, the epoch's) stays as it was after the
    next optimizer step moves the model."""
    from torch.distributed.fsdp import fully_shard

    from src.fsdp import whole_model
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        fully_shard(model)
        saved = whole_model(model)
        before = {key: value.clone() for key, value in saved.items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        assert not torch.equal(whole_model(model)["0.weight"], before["0.weight"]), "the step moved the weights"
        assert all(torch.equal(saved[key], before[key]) for key in saved)
    finally:
        end_process_group()


def test_a_torch_warning_of_every_step_is_printed_once_per_run(tiny_data, tmp_path, world_of_one, monkeypatch,
                                                               capsys):
    """SqueezeNet's flatten makes FSDP2 warn "returned a view tensor" at every forward; Python says
    a warning once per place, but src/datasets.py changed the warnings' filters around each image
    (to quiet Pillow), which resets that registry: with --workers 0 the warning was printed at
    every step. Counted here as a plain interpreter shows warnings (once per place)."""
    said = []
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = lambda message, *where: said.append(str(message))
        code, _, err = in_process(train_fsdp.main, [*TINY, "--data-dir", str(tiny_data), "--epochs", "2",
                                                    *outputs(tmp_path)], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert sum("returned a view tensor" in text for text in said) == 1, said


def test_fsdp_gathers_the_whole_model_only_for_a_new_best(tiny_data, tmp_path, world_of_one, monkeypatch, capsys):
    """train_fsdp.py gathers the whole weights onto rank 0 (get_model_state_dict with full_state_dict,
    a collective) for best.pth only in an epoch that is the best so far: over three epochs
    validated at accuracy 0.5, 0.25 and 0.75 (the epochs' training and validation stood in for: the
    choice is under test), epochs 1 and 3, and best.json names epoch 3."""
    from conftest import TINY
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    gathered, get_model_state_dict = [], train_fsdp.get_model_state_dict

    def counted(model, *args, options: StateDictOptions | None = None, **kwargs):
        gathered.append(options is not None and options.full_state_dict)
        return get_model_state_dict(model, *args, options=options, **kwargs)
    accuracies = iter([0.5, 0.25, 0.75])
    monkeypatch.setattr(train_fsdp, "get_model_state_dict", counted)
    monkeypatch.setattr(train_fsdp, "train_epoch", lambda *args, **kwargs: torch.tensor([22.4, 16.0, 32.0, 22.4]))
    monkeypatch.setattr(train_fsdp, "evaluate", lambda *args, **kwargs: torch.tensor([5.6, 8 * next(accuracies), 8.0, 5.6]))
    code, out, err = in_process(train_fsdp.main, ["--data-dir", str(tiny_data), *TINY, "--epochs", "3",
                                                  *outputs(tmp_path)], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert [line.endswith("best so far") for line in out.splitlines() if line.startswith("epoch ")] == [True, False, True]
    assert gathered == [True, True], "one gather for each new best, none for epoch 2"
    assert json.loads((tmp_path / "best.json").read_text())["epoch"] == 3
