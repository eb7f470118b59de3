"""The fine-tuning recipe keeps the four modes training the same model: augmentation, a warm-up
and cosine schedule, weight decay, label smoothing, clipping and gradient accumulation, all at
once over two epochs; each flag's effect and its bad values."""
import json
import math

import pytest
import torch
import torch.nn as nn
from conftest import (
    EXACT,
    HOOKS,
    RECIPE,
    TOLERANCE,
    VAL,
    B,
    assert_same_run,
    distance,
    fails_in_process,
    history,
    in_process,
    last_model,
    python,
    recipe_run,
    run_main,
    script_loader,
    script_pass,
    weights,
)
from torch.utils.data import TensorDataset

import train_ddp
import train_single
from src.augment import TrainSplit, augment, crop_params
from src.cli import defaults, parse_args
from src.history import best_record
from src.recipe import lr_factor, make_optimizer, make_schedule, steps_per_epoch


# Every recipe flag on, the modern augmentation's among them. 100 training images; a global batch
# of 4 * B = 40 makes 2 optimizer steps an epoch, so the half-epoch warm-up is one step and the
# cosine spans steps 1 to 3. Measured on the single-process run (2026-12-05, AMD EPYC, 2 cores),
# leaving one flag out moves the end weights by this share of `recipe_far`: --weight-decay 0.36,
# --cutmix-alpha 0.25, the schedule 0.25, --augment 0.18, --mixup-alpha 0.17, --auto-augment 0.16,
# --label-smoothing 0.091, --random-erase 0.063, --clip-grad-norm 0.0061; another augmentation
# seed 0.12; the reference's batch-rolling MixUp and CutMix under DDP 0.19. A mode that ignored
# any of them would fail TOLERANCE (1e-3); the modes ended 2.1e-6 (DataParallel) to 8.1e-5
# (accelerate) away.
@pytest.mark.parametrize("mode", ["dp", "ddp", "accelerate"])
def test_every_mode_with_the_full_recipe_matches_single(mode, runs, reference, recipe_far):
    out, result = recipe_run(runs, mode)
    assert "x 2 micro-batches" in result.stdout
    assert_same_run(out, reference, recipe_far)


def test_a_different_augmentation_is_outside_the_tolerance(runs, reference, recipe_far):
    control = recipe_run(runs, "single", env={"AUGMENT_SEED_SHIFT": "1"})[0]
    assert distance(last_model(control), last_model(reference)) / recipe_far > 20 * TOLERANCE


def test_the_references_batch_rolling_mixup_and_cutmix_under_ddp_is_outside_the_tolerance(runs, reference,
                                                                                          recipe_far):
    """The control of the modes' agreement with MixUp and CutMix on: two DDP processes that mix as
    torchvision's reference script does (the BATCH_MIXING hook: each process's micro-batch rolled
    by one, lambda, the box and the choice from the process's generator) instead of by each
    sample's key end far from the one-device run."""
    out, result = recipe_run(runs, "ddp", env={"BATCH_MIXING": "1"})
    assert "x 2 micro-batches" in result.stdout
    assert distance(last_model(out), last_model(reference)) / recipe_far > 20 * TOLERANCE


def test_the_learning_rate_follows_warmup_then_cosine(reference):
    """Recorded after each epoch: the rate of the next step. 4 steps, the first one warming up."""
    expected = [0.001 * 0.5 * (1 + math.cos(math.pi * (2 - 1) / 3)), 0.0]
    assert [r["lr"] for r in history(reference)] == pytest.approx(expected)
    assert weights(reference, "last.pth")["schedule"]["last_epoch"] == 4  # steps taken


def test_best_by_log_loss_picks_best_pth_and_writes_it_only_when_it_improves(reference):
    """Among every epoch's weights and their average (--ema-decay): the lowest log loss."""
    records = history(reference)
    offered = [(r[key], r["epoch"], kind) for r in records
               for key, kind in (("val_log_loss", "weights"), ("val_log_loss_ema", "average"))]
    _, epoch, kind = min(offered)
    info = json.loads((reference / "best.json").read_text())
    assert (info["epoch"], info["weights"]) == (epoch, kind)
    writes = [line.split()[1] for line in (reference.parent / "writes.log").read_text().splitlines()]
    improved = [r for i, r in enumerate(records) if best_record(records[:i + 1], "val_log_loss") is r]
    assert sum(path.endswith("/best.pth") for path in writes) == len(improved)
    assert writes[0].endswith("/best.pth"), "epoch 1 is always the best so far"


# Epoch by epoch, an epoch that is better by one metric and worse by the other: by val_acc the best
# so far is epoch 1, 2, 2, 4 (4 ties 2's accuracy with a lower log loss); by val_log_loss 1, 1, 3, 3.
SCORES = [(0.8, 0.40), (0.9, 0.50), (0.7, 0.30), (0.9, 0.45)]
BEST_SO_FAR = {"val_acc": [1, 2, 2, 4], "val_log_loss": [1, 1, 3, 3]}


@pytest.mark.parametrize("best_by", ["val_acc", "val_log_loss"])
def test_save_epoch_writes_best_pth_only_for_a_better_epoch_by_best_by(best_by, tmp_path):
    """save_epoch over a history written by hand: best.pth and best.json hold the epoch that
    --best-by picks, rewritten only when an epoch beats it; last.pth is every epoch's."""
    from src.ema import WeightAverage
    from src.state import TrainingState
    args = parse_args("", ["--checkpoint", str(tmp_path / "best.pth"), "--plot", str(tmp_path / "curves.png"),
                           "--best-by", best_by])
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = make_schedule(optimizer, args, 1)
    state = TrainingState(args, {"arch": "test"}, model, optimizer, None, schedule,
                          WeightAverage(model, optimizer, None), 1)
    told = []
    for epoch, (acc, log_loss) in enumerate(SCORES, 1):
        record = {"epoch": epoch, "train_loss": 0.5, "train_acc": 0.5, "val_loss": log_loss,
                  "val_acc": acc, "val_log_loss": log_loss}
        with torch.no_grad():
            model.weight.fill_(epoch)  # the weights say which epoch wrote them
        told.append(state.save_epoch(record))
        best = BEST_SO_FAR[best_by][epoch - 1]
        assert torch.equal(torch.load(tmp_path / "best.pth", weights_only=True)["weight"], torch.full((2, 2), best))
        assert json.loads((tmp_path / "best.json").read_text())["epoch"] == best
        assert weights(tmp_path, "last.pth")["epoch"] == epoch
    assert told == [b == e for e, b in enumerate(BEST_SO_FAR[best_by], 1)]


def test_an_epoch_that_is_no_better_keeps_best_pth(exact_data, tmp_path, monkeypatch, capsys):
    """train_single.py with --lr 0: epoch 2 has exactly epoch 1's weights, so exactly its
    validation scores, and is no better by either metric: best.pth is written once, at epoch 1,
    last.pth twice (the renames onto each file are counted), and only epoch 1 says "best so far"."""
    import os

    import train_single
    renamed = []
    replace = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(os.path.basename(dst)), replace(src, dst))[1])
    code, out, err = in_process(train_single.main, [
        "--data-dir", str(exact_data), *EXACT, *VAL, "--image-size", "32", "--epochs", "2", "--batch-size", "20",
        "--lr", "0", "--checkpoint", str(tmp_path / "best.pth"), "--plot", str(tmp_path / "curves.png")],
        monkeypatch, capsys)
    assert code == 0, err[-3000:]
    first, second = history(tmp_path)
    assert (second["val_acc"], second["val_log_loss"]) == (first["val_acc"], first["val_log_loss"])
    assert (renamed.count("best.pth"), renamed.count("best.json"), renamed.count("last.pth")) == (1, 1, 2)
    assert json.loads((tmp_path / "best.json").read_text())["epoch"] == 1
    assert [line.endswith("best so far") for line in out.splitlines() if line.startswith("epoch ")] == [True, False]


def test_best_by_accuracy_gives_equal_accuracies_to_the_lower_log_loss():
    records = [{"epoch": 1, "val_acc": 0.9, "val_log_loss": 0.3}, {"epoch": 2, "val_acc": 1.0, "val_log_loss": 0.2},
               {"epoch": 3, "val_acc": 1.0, "val_log_loss": 0.1}, {"epoch": 4, "val_acc": 1.0, "val_log_loss": 0.1},
               {"epoch": 5, "val_acc": 0.95, "val_log_loss": 0.05}]
    assert best_record(records, "val_acc")["epoch"] == 3  # not 2 (same accuracy), nor the tie 4, nor 5
    assert best_record(records, "val_log_loss")["epoch"] == 5


def test_resume_in_the_middle_of_the_schedule_equals_the_straight_run(exact_data, reference, recipe_far,
                                                                      tmp_path):
    """Every recipe flag on, the modern augmentation's among them: step checkpoints every step
    (--save-every-steps 1), Ctrl-C at the first step of epoch 2 (the run stops after it, last.pth
    saved there: inside an epoch and inside the warmup-and-cosine schedule), then --resume with
    two loader workers instead of none (each sample's partner loaded and both augmented in the
    workers, from the epoch in shared memory), which ends bit for bit as the straight run."""
    flags = ["--data-dir", str(exact_data), *EXACT, *VAL, *RECIPE, "--epochs", "2",
             "--batch-size", str(B), "--accumulate", "4", "--checkpoint", str(tmp_path / "best.pth"),
             "--plot", str(tmp_path / "curves.png")]
    stopped = python("train_single.py", *flags, "--save-every-steps", "1",
                     env={"PYTHONPATH": HOOKS, "INTERRUPT_AT_STEP": "3"})
    assert stopped.returncode == 75, stopped.stderr[-2000:]
    assert [r["epoch"] for r in history(tmp_path)] == [1]
    assert torch.load(tmp_path / "last.pth", weights_only=True)["step"] == 1
    result = run_main(train_single.main, [*flags, "--resume", "--workers", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert assert_same_run(tmp_path, reference, recipe_far) == 0


# In-process: each flag changes what train_single.py's loop does.

def _train_one_epoch(**flags) -> dict:
    argv = ["--lr", "0.1", "--batch-size", "4"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    args = parse_args("", argv)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    data = TensorDataset(torch.randint(0, 256, (32, 3, 8, 8), dtype=torch.uint8), torch.arange(32) % 2)
    dataset = [(image, int(label)) for image, label in data]
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    steps = steps_per_epoch(32, args.batch_size * args.accumulate)
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    script_pass(train_single, model, script_loader(train_single, dataset, args), args, optimizer, scaler, schedule,
                steps=steps)
    return {**model.state_dict(), "steps": torch.tensor(schedule.last_epoch)}


@pytest.mark.parametrize("flag, value", [("augment", True), ("weight_decay", 0.5), ("label_smoothing", 0.3),
                                         ("clip_grad_norm", 0.01), ("accumulate", 2), ("optimizer", "adamw"),
                                         ("lr_schedule", "cosine"), ("warmup_epochs", 0.5),
                                         ("auto_augment", "ta_wide"), ("random_erase", 0.5), ("mixup_alpha", 0.2),
                                         ("cutmix_alpha", 1.0)])
def test_each_recipe_flag_changes_the_training(flag, value):
    plain, changed = _train_one_epoch(epochs=2), _train_one_epoch(**{flag: value, "epochs": 2})
    assert plain["steps"] == 8 and changed["steps"] == (4 if flag == "accumulate" else 8)
    assert any(not torch.equal(plain[k], changed[k]) for k in plain if k != "steps"), flag


def test_weight_decay_spares_biases_and_normalisation_weights():
    """The groups; what a step does with them, and that a frozen parameter (in the optimizer too,
    for --freeze-epochs) is not decayed: test_one_step.py."""
    args = parse_args("", ["--weight-decay", "0.1"])
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    groups = make_optimizer(model, args, torch.device("cpu")).param_groups
    assert [(len(g["params"]), g["weight_decay"]) for g in groups] == [(2, 0.1), (4, 0.0)]
    assert all(p.ndim == 2 for p in groups[0]["params"]) and all(p.ndim == 1 for p in groups[1]["params"])


def test_lr_factor_shapes():
    assert [lr_factor(s, 10, 2, "constant") for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert [round(lr_factor(s, 10, 0, "step"), 6) for s in (0, 4, 5, 7, 8)] == [1, 1, 0.1, 0.1, 0.01]
    # x0.1 at 50% and at 75% of the steps: on 8 steps, from step 4 and from step 6 themselves
    assert [round(lr_factor(s, 8, 0, "step"), 6) for s in range(8)] == [1, 1, 1, 1, 0.1, 0.1, 0.01, 0.01]
    assert lr_factor(0, 10, 0, "cosine") == 1 and lr_factor(10, 10, 0, "cosine") == pytest.approx(0)


@pytest.mark.parametrize("warmup_epochs, steps, warmup_steps", [(0.3, 5, 2), (0.5, 2, 1), (0.1, 5, 0), (1.7, 3, 5)])
def test_a_fractional_warm_up_lasts_its_nearest_whole_count_of_steps(warmup_epochs, steps, warmup_steps):
    """--warmup-epochs E over S steps an epoch: E x S rounded to the nearest step (0.3 x 5 = 1.5: 2
    steps, whose learning rates are 1/2 and 2/2 of --lr), the same in every mode."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = make_schedule(optimizer, defaults(epochs=3, warmup_epochs=warmup_epochs), steps)
    seen = []
    for _ in range(warmup_steps + 2):
        seen.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    assert seen == [(i + 1) / warmup_steps for i in range(warmup_steps)] + [1.0, 1.0]


def test_one_samples_augmentation_is_the_same_whatever_the_workers_or_the_rank():
    """TrainSplit draws from (seed, epoch, sample index) alone: every --workers value and either
    of two ranks see the same pixels for a sample, and another epoch sees other ones."""
    images = torch.randint(0, 256, (24, 3, 32, 32), dtype=torch.uint8)
    dataset = [(images[i], i % 2) for i in range(24)]

    def seen(workers, rank, world, epoch):
        args = defaults(batch_size=4, seed=7, workers=workers, augment=True, accumulate=1)
        loader = script_loader(train_ddp, dataset, args, epoch, rank, world, val_idx=[0, 1])
        split = loader.dataset
        return {split.indices[position]: image for batch_positions, (batch, _, _) in
                zip(_batches(loader.sampler, 4), loader) for position, image in zip(batch_positions, batch)}

    one = seen(0, 0, 1, 3)
    assert len(one) == 24
    for workers in (0, 2):
        for rank in (0, 1):
            for index, image in seen(workers, rank, 2, 3).items():
                assert torch.equal(image, one[index]), (workers, rank, index)
    other_epoch = seen(0, 0, 1, 4)
    assert sum(torch.equal(image, other_epoch[i]) for i, image in one.items()) < 3, "per epoch"
    assert sum(torch.equal(image, images[i]) for i, image in one.items()) < 3, "it augments"
    assert torch.equal(one[5], augment(images[5], crop_params(7, 3, 5, 32)))


def _batches(sampler, size):
    keys = list(sampler)
    return [keys[i:i + size] for i in range(0, len(keys), size)]


def test_train_split_without_augment_is_the_plain_image():
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    split = TrainSplit([(images[i], 0) for i in range(4)], [2, 3], defaults(seed=1, augment=False))
    split.set_epoch(5)
    assert torch.equal(split[1][0], images[3])


@pytest.mark.parametrize("argv, message", [
    (["--accumulate", "0"], "argument --accumulate: must be at least 1"),
    (["--warmup-epochs", "-1"], "argument --warmup-epochs: must be >= 0"),
    (["--warmup-epochs", "2", "--epochs", "2"], "--warmup-epochs: 2.0 is not less than --epochs 2"),
    (["--label-smoothing", "1"], "argument --label-smoothing: must be in [0, 1)"),
    (["--clip-grad-norm", "0"], "argument --clip-grad-norm: must be > 0"),
    (["--weight-decay", "-0.1"], "argument --weight-decay: must be >= 0"),
    (["--optimizer", "lion"], "argument --optimizer: invalid choice: 'lion'"),
    (["--lr-schedule", "linear"], "argument --lr-schedule: invalid choice: 'linear'"),
    (["--best-by", "loss"], "argument --best-by: invalid choice: 'loss'"),
    (["--freeze", "--freeze-epochs", "1"], "pass one of them"),
])
def test_bad_recipe_values_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        parse_args("", argv)
    assert caught.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1, error


def test_a_bad_recipe_value_through_the_script(exact_data, tmp_path, monkeypatch, capsys):
    """In this process: the exit path of train_ddp.py itself is tested under torchrun (test_modes.py)."""
    import train_ddp
    fails_in_process(train_ddp.main, ["--data-dir", str(exact_data), "--accumulate", "0",
                                      "--checkpoint", str(tmp_path / "best.pth")], monkeypatch, capsys,
                     "train_ddp.py: error: argument --accumulate: must be at least 1")
    assert not tmp_path.joinpath("best.pth").exists()


def test_ddp_all_reduces_the_gradients_once_per_optimizer_step():
    """--accumulate 2: train_ddp.py's loop all-reduces on a step's last micro-batch only (no_sync);
    without it, every micro-batch would. Counted with a DDP communication hook, in a world of one."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        args = parse_args("", ["--batch-size", "4", "--accumulate", "2", "--log-every", "1000"])
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)))
        all_reduces = []

        def count(state, bucket):
            all_reduces.append(bucket.index())
            done = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        ddp.register_comm_hook(None, count)
        dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), i % 2) for i in range(16)]
        device = torch.device("cpu")
        optimizer = make_optimizer(ddp, args, device)
        schedule = make_schedule(optimizer, args, 2)
        script_pass(train_ddp, ddp, script_loader(train_ddp, dataset, args), args, optimizer,
                    torch.amp.GradScaler("cpu", enabled=False), schedule, model=ddp.module)
        assert schedule.last_epoch == 2  # 4 micro-batches, 2 optimizer steps
        assert all_reduces == [0, 0], "one bucket, all-reduced once per step"
    finally:
        dist.destroy_process_group()
