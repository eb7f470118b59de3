"""python -m src.tools.compare_recipes: the three recipes, the same steps, figures from the runs' history.json."""
import csv
import json

import pytest
from conftest import fails_in_process, printed_by

from src.tools import compare_recipes


@pytest.fixture(scope="module")
def compared(module_tmp):
    """A tiny comparison: 40 hard images at 32 px, one epoch of 4 steps per recipe. Its main() runs
    in this process (torch is imported already); the three trainings are subprocesses of it."""
    out = module_tmp / "compare"
    argv = ["--out-dir", str(out), "--images", "40", "--image-size", "32", "--epochs", "1", "--batch-size", "8",
            "--workers", "0", "--arch", "resnet18", "--weights", "none"]
    return out, printed_by(compare_recipes.main, argv)


def test_table_and_csv_report_both_recipes_from_their_histories(compared):
    out, printed = compared
    rows = {row["recipe"]: row for row in csv.DictReader(open(out / "compare.csv"))}
    assert list(rows) == ["baseline", "full", "modern"]
    markdown = (out / "compare.md").read_text()
    assert markdown in printed
    for name, row in rows.items():
        history = json.loads((out / "runs" / name / "history.json").read_text())
        assert len(history) == 1 and int(row["epochs"]) == 1
        last = history[-1]
        assert float(row["last_val_log_loss"]) == pytest.approx(last["val_log_loss"], abs=1e-6)
        assert float(row["best_val_log_loss"]) == pytest.approx(last["val_log_loss"], abs=1e-6)
        assert float(row["last_val_acc"]) == pytest.approx(last["val_acc"], abs=1e-6)
        assert int(row["val_images"]) == last["val_samples"] == 8
        assert int(row["steps"]) == last["train_samples"] // 8 == 4
        assert (f"| {name} | {last['val_log_loss']:.4f} (1) | {last['val_log_loss']:.4f} | "
                f"{last['val_acc']:.4f} (1) | {last['val_acc']:.4f} | 4 |") in markdown
    assert "validation log loss: " in markdown and "standard error" in markdown


def test_runs_differ_only_in_the_recipe(compared):
    out, _ = compared
    baseline, full, modern = (json.loads((out / "runs" / name / "best.json").read_text())
                              for name in ("baseline", "full", "modern"))
    # The same data, split, model and steps...
    for key in ("arch", "image_size", "batch_size", "seed", "val_fraction", "data", "epochs", "lr"):
        assert baseline[key] == full[key] == modern[key], key
    # ...the baseline recipe with the scripts' defaults, the full one with every piece on.
    assert (baseline["augment"], baseline["lr_schedule"], baseline["warmup_epochs"], baseline["weight_decay"],
            baseline["label_smoothing"], baseline["clip_grad_norm"]) == (False, "constant", 0.0, 0.0, 0.0, None)
    assert full["augment"] and full["lr_schedule"] == "cosine" and 0 < full["warmup_epochs"] < 1
    assert full["weight_decay"] > 0 and full["label_smoothing"] > 0 and full["clip_grad_norm"] > 0
    # ...the modern one with the full one's and the modern augmentation, which the other two leave off.
    modern_augmentation = ("auto_augment", "random_erase", "mixup_alpha", "cutmix_alpha")
    assert [modern[key] for key in modern_augmentation] == ["ta_wide", 0.1, 0.2, 1.0]
    for run in (baseline, full):
        assert [run[key] for key in modern_augmentation] == [None, 0.0, 0.0, 0.0]
    recipe = ("augment", "lr_schedule", "warmup_epochs", "weight_decay", "label_smoothing", "clip_grad_norm")
    assert [modern[key] for key in recipe] == [full[key] for key in recipe]
    assert json.loads((out / "data" / "synthetic.json").read_text())["hard"] is True


@pytest.mark.parametrize("flags, message", [
    (["--epochs", "0"], "compare_recipes.py: error: argument --epochs: must be at least 1, got 0 (see --help)"),
    (["--lr", "-1"], "compare_recipes.py: error: argument --lr: must be > 0, got -1.0 (see --help)"),
    (["--optimiser", "sgd"], "compare_recipes.py: error: unrecognized arguments: --optimiser sgd (see --help)"),
])
def test_bad_flag_is_one_line_and_exit_2(tmp_path, flags, message, monkeypatch, capsys):
    assert fails_in_process(compare_recipes.main, ["--out-dir", str(tmp_path), *flags], monkeypatch, capsys,
                            message) == message


def test_missing_data_dir_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    line = fails_in_process(compare_recipes.main, ["--out-dir", str(tmp_path / "out"), "--data-dir",
                                                   str(tmp_path / "nowhere")], monkeypatch, capsys, "--data-dir")
    assert line == f"error: --data-dir {tmp_path / 'nowhere'}: no train/ folder in it"


@pytest.mark.parametrize("baseline, full, says", [
    (0.26101, 0.26104, "last-epoch validation log loss: the baseline and full recipes tie to four decimals (0.2610)"),
    (0.2610, 0.2620, "the baseline recipe is lower, 0.2610 against 0.2620 (under 1% less than the full recipe's)"),
    (0.2610, 0.1540, "the full recipe is lower, 0.1540 against 0.2610 (41% less than the baseline recipe's)"),
])
def test_verdict_says_how_much_lower_in_words_that_hold(baseline, full, says):
    """Nearly equal log losses are not "(0% less ...)"."""
    row = {"best_val_log_loss": 0.3, "last_val_acc": 0.9, "best_val_acc": 0.9, "val_images": 500}
    lines = compare_recipes.verdict({"baseline": {**row, "last_val_log_loss": baseline},
                                     "full": {**row, "last_val_log_loss": full}})
    assert says in lines[0] and "0%" not in lines[0], lines[0]


def test_verdict_compares_each_recipe_with_the_one_before_it():
    """Full against baseline, modern against full (what the modern augmentation adds), each by its
    last and best epoch; the accuracies of all three against the noise of a difference."""
    def row(last, best, acc):
        return {"last_val_log_loss": last, "best_val_log_loss": best, "last_val_acc": acc, "best_val_acc": acc,
                "val_images": 400}
    lines = compare_recipes.verdict({"baseline": row(0.30, 0.28, 0.80), "full": row(0.20, 0.20, 0.90),
                                     "modern": row(0.25, 0.15, 0.85)})
    assert lines[:4] == [
        "last-epoch validation log loss: the full recipe is lower, 0.2000 against 0.3000 (33% less than the baseline recipe's)",
        "best-epoch validation log loss: the full recipe is lower, 0.2000 against 0.2800 (29% less than the baseline recipe's)",
        "last-epoch validation log loss: the full recipe is lower, 0.2000 against 0.2500 (20% less than the modern recipe's)",
        "best-epoch validation log loss: the modern recipe is lower, 0.1500 against 0.2000 (25% less than the full recipe's)"]
    noise = (2 * 0.85 * 0.15 / 400) ** 0.5  # the mean accuracy's binomial standard error of a difference
    assert lines[4].startswith("last-epoch validation accuracy: baseline 0.8000, full 0.9000, modern 0.8500; "
                               f"on 400 validation images the standard error of the difference of two is about {noise:.4f}")
    assert len(lines) == 5
