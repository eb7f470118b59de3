"""Train the baseline, the full and the modern recipe for the same steps and compare their validation log loss.

    python -m src.tools.compare_recipes [--data-dir DIR] [--out-dir compare] [--epochs E] [--images N] ...

Runs the real train_single.py three times on the same data, split, data order, architecture,
image size, batch size, epochs, peak learning rate and seed, each from its own fresh
initialisation (the same for all: --seed):

- baseline: the scripts' defaults, plain SGD (momentum 0.9) at a constant learning rate, no
  augmentation, no weight decay, no label smoothing, no clipping;
- full: the same SGD and peak learning rate plus --augment, a cosine schedule after a linear
  warm-up over the first tenth of the steps, weight decay, label smoothing and gradient clipping
  (FULL_RECIPE below says which values and why);
- modern: the full recipe plus the modern augmentation of torchvision's reference recipe:
  TrivialAugmentWide, random erasing, MixUp and CutMix (MODERN_RECIPE below).

Reports, per recipe, the best and the last epoch's validation log loss (Kaggle's metric, p(dog)
clipped to [0.005, 0.995]) and accuracy, read from each run's history.json, as a Markdown table
(printed and written to OUT/compare.md, with the per-epoch figures below it) and OUT/compare.csv,
and compares each recipe with the one before it (full with baseline, modern with full). It
reports what it measured whichever recipe wins; one seed on one validation split, so a small
difference may be noise (the table says how large the noise in accuracy is).

Without --data-dir it writes the --hard synthetic set (src/tools/synthetic.py) of --images labelled
images into OUT/data: on the default set any recipe reaches 1.0 accuracy in a few epochs and
there is nothing to compare. The defaults (2500 images, ResNet-18 from random init at 64 px, batch
32, lr 0.01, 10 epochs) take minutes on a CPU (docs/recipe.md gives the time on the machine it
was measured on). The runs train from one --cache in OUT/cache, decoded once; a
--data-dir without train.csv gets one (as `python -m src.tools.prepare` writes it), so that no run
opens every image to list them.

OUT is this tool's own folder: it marks it (OUT/.compare_recipes) and replaces there only what it
wrote; a folder holding data/, runs/, cache/ or the tables without the mark is refused, and so is
one where a run is in progress (src.outputs.claim_folder).
"""
import csv
import dataclasses
import io
import json
import math
import shlex
import shutil
import sys
import time
from datetime import date
from pathlib import Path

from src.cli import BATCH_SIZES, EPOCHS, IMAGE_COUNTS, IMAGE_SIZES, SEEDS, OneLineParser, between, positive, workers_count
from src.devices import hardware
from src.errors import UserError, exit_on_error
from src.outputs import atomic_write_text, claim_folder
from src.tools.commands import run_script

MARK = ".compare_recipes"  # says that this tool wrote the --out-dir, and may write it again
WRITES = ("data", "runs", "cache", "compare.md", "compare.csv")
INTERRUPTED = "interrupted: the tables were not written; run the command again (the runs start over)"
WARMUP_SHARE = 0.1  # of all epochs: one epoch in ten, and a fraction of one in a 1-epoch run

# The full recipe's flags besides --augment and the schedule, each a common default for training
# a ResNet with SGD, not tuned on this data:
FULL_RECIPE = {
    # The classic ResNet value with SGD (He et al. 2016, CIFAR and ImageNet); here an L2 penalty,
    # on weights only, not on biases and batch-norm parameters.
    "--weight-decay": "5e-4",
    # Inception v3's 0.1 (Szegedy et al. 2016), the usual value: targets 0.95 / 0.05 with two
    # classes, so it costs a right answer at most -log(0.95) = 0.05 of log loss and keeps a wrong
    # one from being confidently wrong, which log loss punishes hardest.
    "--label-smoothing": "0.1",
    # A safety net against the rare exploding step, not a constraint on ordinary ones: ResNet-18's
    # gradient norm from random init on the hard set at 64 px (batch 32, lr 0.01, smoothing 0.1)
    # measured median 9, 90th percentile 12 and at most 20 over the first 60 steps; clipping at 5
    # would have cut every step, i.e. changed the learning rate, not guarded it.
    "--clip-grad-norm": "20",
}
# The modern recipe's augmentation on top of the full recipe: the values of torchvision's reference
# recipe for its ResNet-50 IMAGENET1K_V2 weights (pytorch/vision#3995; the blog post "How to Train
# State-Of-The-Art Models Using TorchVision's Latest Primitives"), which trains with label smoothing
# 0.1 as the full recipe does. Not tuned on this data either.
MODERN_RECIPE = {
    "--auto-augment": "ta_wide",  # TrivialAugmentWide: no magnitude to tune
    "--random-erase": "0.1",
    "--mixup-alpha": "0.2",
    "--cutmix-alpha": "1.0",  # with MixUp: one of the two per image, half and half
}
FIELDS = ["recipe", "flags", "epochs", "steps", "best_val_log_loss", "best_log_loss_epoch",
          "last_val_log_loss", "best_val_acc", "best_acc_epoch", "last_val_acc", "val_images",
          "train_seconds"]


@dataclasses.dataclass(kw_only=True)
class Options:
    """compare_recipes's flags, as parse_args returns them."""

    data_dir: Path | None
    out_dir: Path
    arch: str
    weights: str
    image_size: int
    epochs: int
    batch_size: int
    lr: float
    images: int
    seed: int
    workers: int | None


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--data-dir", type=Path,
        help="a Kaggle-layout folder (default: the --hard synthetic set written into OUT/data)")
    add("--out-dir", type=Path, default=Path("compare"), help="where the table and the runs go")
    add("--arch", default="resnet18", help="torchvision classification model")
    add("--weights", default="none",
        help="as in the scripts: 'none' = random init, 'default' = ImageNet, or a state_dict file")
    add("--image-size", type=between(*IMAGE_SIZES), default=64, help="images are resized to this square")
    add("--epochs", type=between(*EPOCHS), default=10, help="epochs of each run")
    add("--batch-size", type=between(*BATCH_SIZES), default=32, help="images per step, the same in every run")
    add("--lr", type=positive, default=0.01,
        help="learning rate of the baseline recipe and peak of the other two's schedule (the scripts' "
             "0.001 is for ImageNet weights; from random init it barely moves in a few epochs)")
    add("--images", type=between(10, IMAGE_COUNTS[1]), default=2500,
        help="labelled images of the synthetic set (without --data-dir); 20%% are validation")
    add("--seed", type=between(*SEEDS), default=0, help="seeds the synthetic set, the split, the data order and the runs")
    add("--workers", type=workers_count, default=None,
        help="data loader workers of each run (default: the scripts' default)")
    args = parser.parse_args(argv)
    parser.refuse_unless(parser.given(argv), "images", args.data_dir is None,
                         "it is the size of the synthetic set written without --data-dir: drop --data-dir")
    return Options(**vars(args))


def recipes(epochs: int) -> dict[str, list[str]]:
    """Each recipe's flags on top of the shared ones."""
    warmup = f"{WARMUP_SHARE * epochs:g}"
    full = ["--augment", "--lr-schedule", "cosine", "--warmup-epochs", warmup]
    for flag, value in FULL_RECIPE.items():
        full += [flag, value]
    modern = list(full)
    for flag, value in MODERN_RECIPE.items():
        modern += [flag, value]
    return {"baseline": [], "full": full, "modern": modern}


def synthetic_data(args: Options) -> Path:
    """The --hard synthetic set in OUT/data, written unless the same one is already there."""
    from src.tools.synthetic import write_dataset

    data_dir = args.out_dir / "data"
    # Images about 1.5x the model's input, so that they are downscaled as photographs are.
    size = max(48, args.image_size * 3 // 2)
    stamp = {"images": args.images, "size": size, "seed": args.seed, "hard": True}
    stamp_file = data_dir / "synthetic.json"
    if stamp_file.exists() and json.loads(stamp_file.read_text()) == stamp:
        return data_dir
    # write_dataset replaces a synthetic set of its own there, and refuses anything else.
    print(f"writing {args.images} hard synthetic images of about {size} px to {data_dir}", flush=True)
    write_dataset(data_dir, n_train=args.images, n_test=0, size=size, seed=args.seed, hard=True)
    stamp_file.write_text(json.dumps(stamp) + "\n")
    return data_dir


def write_labels(data_dir: Path) -> None:
    """train.csv, if missing, so that neither run scans (opens) every image again."""
    from src.datasets import load_labels

    if not (data_dir / "train.csv").exists():
        atomic_write_text(data_dir / "train.csv", load_labels(data_dir).to_csv(index=False))


def run_recipe(name: str, flags: list[str], args: Options, data_dir: Path) -> list[dict]:
    """Train with train_single.py; returns its history.json."""
    out = args.out_dir / "runs" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [sys.executable, "train_single.py", "--data-dir", str(data_dir.resolve()),
               "--arch", args.arch, "--weights", args.weights, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--epochs", str(args.epochs),
               "--lr", str(args.lr), "--seed", str(args.seed),
               "--cache", str((args.out_dir / "cache").resolve()),
               "--checkpoint", str((out / "best.pth").resolve()),
               "--plot", str((out / "curves.png").resolve())]
    if args.workers is not None:
        command += ["--workers", str(args.workers)]
    command += flags
    print(f"running {name}: {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    run_script(name, command, out)
    history = json.loads((out / "history.json").read_text())
    print(f"  {name}: {_epochs(len(history))} in {time.perf_counter() - start:.0f} s", flush=True)
    return history


def _epochs(n: int) -> str:
    return f"{n} epoch" + ("" if n == 1 else "s")


def summary(name: str, flags: list[str], history: list[dict], steps_per_epoch: int) -> dict:
    """One row: the best (lowest log loss, highest accuracy; the first such epoch) and the last."""
    best_loss = min(history, key=lambda r: r["val_log_loss"])
    best_acc = max(history, key=lambda r: r["val_acc"])
    last = history[-1]
    return {"recipe": name, "flags": " ".join(flags) or "(defaults)", "epochs": len(history),
            "steps": steps_per_epoch * len(history),
            "best_val_log_loss": best_loss["val_log_loss"], "best_log_loss_epoch": best_loss["epoch"],
            "last_val_log_loss": last["val_log_loss"],
            "best_val_acc": best_acc["val_acc"], "best_acc_epoch": best_acc["epoch"],
            "last_val_acc": last["val_acc"], "val_images": last["val_samples"],
            "train_seconds": sum(r["train_seconds"] for r in history)}


def verdict(rows: dict[str, dict]) -> list[str]:
    """What the figures say, in words, whichever way they go: each recipe against the one before
    it (each adds to it), then the accuracies against their noise."""
    lines = []
    names = list(rows)
    for before, name in zip(names, names[1:]):
        for key, label in (("last_val_log_loss", "last-epoch"), ("best_val_log_loss", "best-epoch")):
            a, b = rows[before][key], rows[name][key]
            if f"{a:.4f}" == f"{b:.4f}":  # as printed: no difference to speak of
                lines.append(f"{label} validation log loss: the {before} and {name} recipes tie to four "
                             f"decimals ({a:.4f})")
            else:
                winner, loser = (name, before) if b < a else (before, name)
                share = abs(a - b) / max(a, b)
                lines.append(f"{label} validation log loss: the {winner} recipe is lower, "
                             f"{min(a, b):.4f} against {max(a, b):.4f} "
                             f"({f'{share:.0%}' if share >= 0.01 else 'under 1%'} less than the {loser} recipe's)")
    baseline = rows[names[0]]
    n = baseline["val_images"]
    p = sum(row["last_val_acc"] for row in rows.values()) / len(rows)
    noise = math.sqrt(2 * p * (1 - p) / n)
    accuracies = ", ".join(f"{name} {row['last_val_acc']:.4f}" for name, row in rows.items())
    lines.append(f"last-epoch validation accuracy: {accuracies}; on {n} validation images the standard error "
                 f"of the difference of two is about {noise:.4f} (binomial, one seed), so differences below "
                 f"about {2 * noise:.3f} are within the noise")
    if baseline["best_val_acc"] >= 1.0:
        lines.append(f"the {names[0]} recipe reached 1.0 validation accuracy: this set is too easy to tell "
                     "recipes apart by accuracy")
    return lines


def write_outputs(rows: dict[str, dict], histories: dict[str, list[dict]], args: Options, data_dir: Path,
                  seconds: float) -> str:
    out = args.out_dir
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=FIELDS)
    writer.writeheader()
    for row in rows.values():
        writer.writerow({k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()})
    atomic_write_text(out / "compare.csv", table.getvalue())

    lines = [f"{date.today().isoformat()}, {hardware()}; {seconds:.0f} s in all", "",
             f"`{shlex.join(['python', '-m', 'src.tools.compare_recipes'] + sys.argv[1:])}`", "",
             f"{args.arch} (weights: {args.weights}) at {args.image_size} px, batch {args.batch_size}, "
             f"lr {args.lr:g}, {_epochs(args.epochs)}, seed {args.seed}, data {data_dir}", "",
             "| recipe | best val log loss (epoch) | last val log loss | best val acc (epoch) | "
             "last val acc | steps | train s |",
             "|---|---|---|---|---|---|---|"]
    for row in rows.values():
        lines.append(f"| {row['recipe']} | {row['best_val_log_loss']:.4f} ({row['best_log_loss_epoch']}) | "
                     f"{row['last_val_log_loss']:.4f} | {row['best_val_acc']:.4f} ({row['best_acc_epoch']}) | "
                     f"{row['last_val_acc']:.4f} | {row['steps']} | {row['train_seconds']:.0f} |")
    lines += [""] + [f"- {name}: `{row['flags']}`" for name, row in rows.items()]
    lines += [""] + [f"- {line}" for line in verdict(rows)]
    lines += ["- best = over the epochs, chosen on the validation split itself, so optimistic; "
              "last = the final weights",
              "- train s: wall seconds of the training passes, which other work on the machine "
              "slows down too", "",
              "Per epoch, validation log loss / accuracy:", "",
              "| epoch | " + " | ".join(rows) + " |", "|---|" + "---|" * len(rows)]
    for i in range(max(len(h) for h in histories.values())):
        cells = [f"{h[i]['val_log_loss']:.4f} / {h[i]['val_acc']:.4f}" if i < len(h) else ""
                 for h in histories.values()]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    markdown = "\n".join(lines) + "\n"
    atomic_write_text(out / "compare.md", markdown)
    return markdown


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    claim_folder(args.out_dir, MARK, WRITES, "src.tools.compare_recipes", "the recipe comparison", "--out-dir ")
    if args.data_dir is None:
        data_dir = synthetic_data(args)
    elif not (args.data_dir / "train").is_dir():
        raise UserError(f"--data-dir {args.data_dir}: no train/ folder in it")
    else:
        data_dir = args.data_dir
    write_labels(data_dir)

    histories, rows = {}, {}
    for name, flags in recipes(args.epochs).items():
        histories[name] = run_recipe(name, flags, args, data_dir)
        steps = histories[name][-1]["train_samples"] // args.batch_size
        rows[name] = summary(name, flags, histories[name], steps)
    if len({row["steps"] for row in rows.values()}) != 1:  # the point of the comparison
        raise UserError(f"the runs took different numbers of steps: "
                        f"{ {name: row['steps'] for name, row in rows.items()} }")
    markdown = write_outputs(rows, histories, args, data_dir, time.perf_counter() - start)
    print(markdown)
    print(f"wrote {args.out_dir / 'compare.md'} and {args.out_dir / 'compare.csv'}")


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
