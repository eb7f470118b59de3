"""The command-line flags shared by all six training scripts."""
import argparse
import dataclasses
import math
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from src.config import Config
from src.errors import UserError, before_a_silent_exit
from src.tracking import BACKENDS

if TYPE_CHECKING:
    import torch


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit code 2), without the usage block.
    `ranks`: the command runs as one rank of several under a launcher (train_ddp.py, train_fsdp.py,
    train_accelerate.py); a one-process script says its line whatever RANK is left in its
    environment."""

    ranks = False

    def error(self, message: str) -> NoReturn:
        # Under a launcher every rank parses the same flags: rank 0 alone says what is wrong.
        if self.ranks and os.environ.get("RANK", "0") != "0":
            before_a_silent_exit()
            self.exit(2)
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def given(self, argv: list[str] | None) -> set[str]:
        """The dests of the flags that argv gives, whatever their values (a flag given with its
        default value counts): for the flags refused where they cannot act. argv parses (the
        first parse said so); argparse fills in a default only where the namespace has no value."""
        unset = object()
        # An append or count action adds to the value there: it starts from None, as argparse's own.
        adds = (argparse._AppendAction, argparse._CountAction)
        namespace = argparse.Namespace(**{action.dest: None if isinstance(action, adds) else unset
                                          for action in self._actions if action.dest != argparse.SUPPRESS})
        self.parse_args(argv, namespace)
        return {dest for dest, value in vars(namespace).items() if value is not unset and value is not None}

    def refuse_unless(self, given: set[str], flag: str, acts: bool, why: str) -> None:
        """The one line for a flag (its dest) given where it cannot act (`acts` False): `why` says
        what it needs and what to do, then "or drop it"."""
        if flag in given and not acts:
            self.error(f"argument --{flag.replace('_', '-')}: {why}, or drop it")


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each option's default after its text, unless the text says its
    default in its own words ("default: model/best.pth; with --onnx ...")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "default" in text else super()._get_help_string(action)


# The bounds of the numbers the commands take, checked at parse time (one line naming the flag):
# past them a value fails deep inside (a negative seed in numpy's seeding, --dist-timeout 1e300 in
# timedelta, synthetic's --size 100000 in a 70 GB array) or asks for what no run can hold. Each
# parse function below keeps its bounds as `bounds` (the tests read them).
# --image-size's range. The top: a 2048 px image is 12.6 MB as uint8 and 50 MB as float32 at the
# model's input (5 GB for predict's batch of 100), four times the largest size torchvision's
# weights were trained at (518 px, ViT-H/14); best.json's image_size is held to the same range.
IMAGE_SIZES = (32, 2048)
# A seed: numpy takes no negative one, torch's generators 64 bits (the scripts add the epoch to it).
SEEDS = (0, 2**63 - 1)
# Images in a batch: 65536 of the smallest size (32 px) are 805 MB as float32 at the model's input;
# the training set must hold a global batch too (src.loaders says so once the images are counted).
BATCH_SIZES = (1, 65536)
# Images of a set the tools write or read: 40 times Kaggle's 25,000.
IMAGE_COUNTS = (1, 10**6)
EPOCHS = (1, 10**6)
# Optimizer steps between two things (--save-every-steps, --log-every): beyond any run's steps.
STEPS = (1, 10**9)
# Minutes a process waits for the others: about two years; past it timedelta overflows (1e300 did)
# and threading's waits (threading.TIMEOUT_MAX) refuse it.
DIST_TIMEOUT_MINUTES = 10**6
# Processes that Ray Train starts, and its restarts after a lost worker (-1: no limit).
RAY_WORKERS = (1, 4096)
RAY_FAILURES = (-1, 10**6)

# --auto-augment's policies (src/augment.py), the reference script's names; RandAugment's magnitude
# is a bin of its 31 (num_magnitude_bins), AugMix's severity what v2.AugMix accepts.
POLICIES = ("ta_wide", "ra", "augmix")
RA_MAGNITUDES = (0, 30)
AUGMIX_SEVERITIES = (1, 10)


def between(minimum: int, maximum: int) -> Callable[[str], int]:
    """An int in [minimum, maximum]."""
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        if value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum}, got {value}")
        return value
    parse.__name__ = "int"
    parse.bounds = (minimum, maximum)  # type: ignore[attr-defined]  # read by the tests of every parser
    return parse


def workers_count(text: str) -> int:
    """--workers: at least 0; above this node's CPUs it is capped by cap_workers, with a line."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


workers_count.__name__ = "int"
workers_count.bounds = (0, "this node's CPUs (cap_workers)")  # type: ignore[attr-defined]  # as between's


def processes_count(text: str) -> int:
    """--processes of a tool that starts them on this machine: one per CPU at most (or per GPU,
    where there are more GPUs): more only wait for a CPU, and 1000 would start 1000 interpreters."""
    import torch  # here: the training scripts' parsers do not need it
    most = max(len(os.sched_getaffinity(0)), torch.cuda.device_count())
    value = int(text)
    if not 1 <= value <= most:
        raise argparse.ArgumentTypeError(f"must be from 1 to {most} (this machine's CPUs), got {value}")
    return value


processes_count.__name__ = "int"
processes_count.bounds = (1, "this machine's CPUs or GPUs")  # type: ignore[attr-defined]  # as between's


# What a float32 holds: the flags' numbers become float32 tensors (the optimizer's, the mixup
# Dirichlet's), where --lr 1e39 overflowed at the first step and --mixup-alpha 1e-46 became 0.
FLOAT32_MAX, FLOAT32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38


def _finite(text: str) -> float:
    """float(text), refusing nan and infinities: comparisons with nan are all false, so a range
    check alone lets it through (--lr nan trained NaN weights)."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
    return value


def _float32(text: str) -> float:
    """_finite(text), refusing what float32 cannot hold (the unbounded flags below: --lr,
    --weight-decay, the mixing alphas, ...)."""
    value = _finite(text)
    if abs(value) > FLOAT32_MAX:
        raise argparse.ArgumentTypeError(f"must be at most {FLOAT32_MAX:.4g} (float32's largest), got {text}")
    if value != 0 and abs(value) < FLOAT32_TINY:
        raise argparse.ArgumentTypeError(f"must be 0 or at least {FLOAT32_TINY:.4g} (float32's smallest normal "
                                         f"number), got {text}")
    return value


def ranged(low: float, high: float, low_open: bool, high_open: bool) -> Callable[[str], float]:
    """A finite float in the range from low to high, each end included unless it is open."""
    def parse(text: str) -> float:
        value = _finite(text)
        if value < low or value > high or (low_open and value == low) or (high_open and value == high):
            ends = ("(" if low_open else "[") + f"{low:g}, {high:g}" + (")" if high_open else "]")
            raise argparse.ArgumentTypeError(f"must be in {ends}, got {value}")
        return value
    parse.__name__ = "float"
    parse.bounds = (low, high)  # type: ignore[attr-defined]  # as between's
    return parse


def _fraction(low_open: bool, high_open: bool) -> Callable[[str], float]:
    """A float in [0, 1], each end included unless it is open."""
    return ranged(0, 1, low_open, high_open)


open_fraction = _fraction(True, True)


def _non_negative(text: str) -> float:
    value = _float32(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive(text: str) -> float:
    value = _float32(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


for _parse in (_non_negative, positive):
    _parse.bounds = (0, FLOAT32_MAX)  # type: ignore[attr-defined]  # as between's


def build_parser(description: str, amp: bool = True, distributed: bool = False, ray: bool = False,
                 prog: str | None = None) -> OneLineParser:
    parser = OneLineParser(prog=prog, description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.ranks = distributed
    add = parser.add_argument
    add("--data-dir", default="data", help="folder holding train/ (and optional train.csv, test/)")
    add("--epochs", type=between(*EPOCHS), default=1, help="epochs to train")
    add("--batch-size", type=between(*BATCH_SIZES), default=50,
        help="images per process and micro-batch (the global batch is this times the processes "
             "times --accumulate)")
    add("--lr", type=_non_negative, default=0.001, help="learning rate (the peak of --lr-schedule)")
    # Below 1: at 1 and above each step adds to the velocity more than it loses, and it grows
    # without bound (the weights go to inf, then NaN), which torch.optim.SGD does not refuse.
    add("--momentum", type=_fraction(False, True), default=0.9, help="SGD momentum, in [0, 1)")
    add("--image-size", type=between(*IMAGE_SIZES), default=224,
        help="images are resized to this square")
    add("--arch", default="vgg16", help="torchvision classification model; its last layer gets 2 outputs")
    add("--weights", default="default",
        help="'default' = torchvision's ImageNet weights, 'none' = random init, or a state_dict file")
    add("--dropout", type=_fraction(False, True), default=None,
        help="dropout probability of the classifier (default: torchvision's)")
    add("--val-fraction", type=open_fraction, default=0.2,
        help="share of --data-dir's images held out for validation (seeded split; not with --val-dir)")
    add("--val-dir", metavar="DIR", default=None,
        help="validate on the labelled images of DIR (laid out as train/, no CSV) instead of a split of "
             "--data-dir's; every image of train/ trains")
    add("--seed", type=between(*SEEDS), default=42,
        help="seeds the split, the data order, the new layers, dropout and augmentation")
    add("--workers", type=workers_count, default=None,
        help="data loader workers per process (default: this node's CPUs / its processes)")
    add("--checkpoint", default="model/best.pth",
        help="best model's state_dict; last.pth, history.json and best.json go beside it")
    add("--plot", default="training_results.png", help="accuracy and loss curves (PNG)")
    add("--resume", action="store_true", help="continue from last.pth beside --checkpoint if it exists")
    add("--save-every-steps", metavar="N", type=between(*STEPS), default=None,
        help="also write last.pth every N optimizer steps, where --resume goes on inside the epoch "
             "(default: at each epoch's end only)")
    add("--evaluate", action="store_true",
        help="validate --checkpoint (checked against its best.json), or the state_dict --weights FILE, "
             "on the validation split and print the record; nothing trains, nothing is written")
    add("--cache", metavar="DIR", default=None,
        help="decode and resize every image once into DIR (uint8, memory-mapped) and train from it")
    add("--channels-last", action="store_true",
        help="channels-last memory format for the model and the batches (faster convolutions on GPUs)")
    add("--compile", action="store_true", help="torch.compile the model (the first steps compile it)")
    add("--deterministic", action="store_true",
        help="IEEE float32 (no TF32) and deterministic kernels on GPUs, to compare runs exactly")
    add("--overwrite", action="store_true",
        help="replace the files of an earlier run beside --checkpoint (without it or --resume, a run "
             "refuses to start over them)")
    recipe = parser.add_argument_group("recipe (defaults: plain SGD, the blog post's)")
    add = recipe.add_argument
    add("--augment", action="store_true",
        help="random resized crop and horizontal flip of training images, drawn per (seed, epoch, image)")
    add("--auto-augment", choices=POLICIES, default=None,
        help="torchvision's TrivialAugmentWide, RandAugment or AugMix on training images, drawn per "
             "(seed, epoch, image)")
    add("--ra-magnitude", type=between(*RA_MAGNITUDES), default=9,
        help="the magnitude (bin) of --auto-augment ra's operations")
    add("--augmix-severity", type=between(*AUGMIX_SEVERITIES), default=3,
        help="the severity of --auto-augment augmix's operations")
    add("--random-erase", metavar="P", type=_fraction(False, False), default=0.0,
        help="erase a random box of a training image with probability P (filled with the mean)")
    add("--mixup-alpha", metavar="A", type=_non_negative, default=0.0,
        help="MixUp each training image with a partner drawn per (seed, epoch, image), lambda from "
             "Beta(A, A); 0: off")
    add("--cutmix-alpha", metavar="A", type=_non_negative, default=0.0,
        help="CutMix each training image with a partner, as --mixup-alpha (with both: one of the two "
             "per image, half and half); 0: off")
    add("--optimizer", choices=["sgd", "adamw"], default="sgd", help="SGD with --momentum, or AdamW")
    add("--weight-decay", type=_non_negative, default=0.0,
        help="decoupled for AdamW, L2 for SGD; never on biases and normalisation weights")
    add("--lr-schedule", choices=["constant", "cosine", "step"], default="constant",
        help="per optimizer step: constant, cosine to 0, or x0.1 at 50%% and 75%% of the steps")
    add("--warmup-epochs", type=_non_negative, default=0.0,
        help="linear warm-up from 0 to --lr over this many epochs (fractions allowed)")
    add("--label-smoothing", type=_fraction(False, True), default=0.0,
        help="cross-entropy label smoothing")
    add("--clip-grad-norm", type=positive, default=None, help="clip the gradient's norm to this")
    add("--accumulate", type=between(*BATCH_SIZES), default=1,
        help="micro-batches of --batch-size per optimizer step (gradient accumulation)")
    add("--sync-bn", action="store_true",
        help="batch norm over the micro-batches of all the processes (train_ddp.py, train_fsdp.py, "
             "train_accelerate.py; one process already normalises its whole micro-batch)")
    add("--ema-decay", type=open_fraction, default=None, metavar="D",
        help="also keep an exponential moving average of the weights (decay D, e.g. 0.999, with a "
             "warm-up), validated every epoch beside them; --best-by picks either for best.pth")
    add("--best-by", choices=["val_acc", "val_log_loss"], default="val_acc",
        help="the validation metric that picks best.pth")
    add("--freeze", action="store_true",
        help="train the new last layer only; the pretrained backbone stays fixed (with --cache: "
             "its outputs are computed once)")
    add("--freeze-epochs", type=between(0, EPOCHS[1]), default=0,
        help="train the last layer only for this many epochs, then every layer")
    watch = parser.add_argument_group("watching a run")
    add = watch.add_argument
    add("--log-dir", metavar="DIR", default=None,
        help="TensorBoard event files (open with `tensorboard --logdir DIR`)")
    add("--log-every", type=between(*STEPS), default=10, help="optimizer steps between step scalars")
    add("--profile", action="store_true",
        help="torch.profiler over a few steps of epoch 1 on rank 0: a trace and a table of where the time went")
    add("--track", action="append", choices=BACKENDS, default=None,
        help="track the run in MLflow (a SQLite store beside --checkpoint unless --tracking-uri) or "
             "W&B (offline unless WANDB_MODE says otherwise), from rank 0; repeat for both")
    add("--tracking-uri", metavar="URI", default=None,
        help="--track mlflow's store: a server http(s)://HOST:PORT or a database such as "
             "sqlite:///PATH/mlflow.db (default: MLFLOW_TRACKING_URI, else mlflow.db beside --checkpoint)")
    if amp:
        parser.add_argument("--amp", choices=["no", "bf16", "fp16"], default="no",
                            help="mixed precision with torch.autocast (fp16 adds a gradient scaler)")
    if distributed:
        add_dist_timeout(parser, "in a collective, or for its node's --cache build")
    if ray:
        add_ray_flags(parser.add_argument_group("Ray Train (train_ray.py)").add_argument)
    # torch.distributed.launch passes this (and sets LOCAL_RANK, which the scripts read).
    parser.add_argument("--local-rank", "--local_rank", type=between(0, 2**16 - 1), default=None, help=argparse.SUPPRESS)
    return parser


def config_from(namespace: argparse.Namespace, command: list[str], mode: str, workers: int) -> Config:
    """The Config of a parsed namespace of build_parser: its flags, `workers` resolved."""
    # --val-dir's images are the validation set: no split, and best.json and last.pth record none
    val_fraction = None if namespace.val_dir is not None else float(namespace.val_fraction)
    parsed = {**vars(namespace), "workers": workers, "val_fraction": val_fraction}
    return Config(**parsed, command=command, mode=mode, flags=tuple(vars(namespace)))


def defaults(argv: list[str] | None = None, amp: bool = True, distributed: bool = False, **changes: Any) -> Config:
    """The Config of a training script's flags at their defaults (or as `argv` gives them),
    `changes` set over them, without parse_args's checks: for the commands that run part of a
    training run (benchmark, report) and for tests. --workers's default: 0 (the loading in the
    calling process)."""
    namespace = build_parser("", amp=amp, distributed=distributed).parse_args(argv or [])
    config = config_from(namespace, ["train_single.py", *(argv or [])], "single",
                         namespace.workers if namespace.workers is not None else 0)
    return dataclasses.replace(config, **changes)


def parse_args(description: str, argv: list[str] | None = None, script: str | None = None,
               amp: bool = True, distributed: bool = False, ray: bool = False) -> Config:
    """The flags of a training script: argv (sys.argv[1:] when None), `script` its file (for the
    messages, the mode it records and the command that goes on after a stop). `.command` is the
    command line as typed (the script and argv); `.mode` the script's name without "train_" ("ddp")."""
    argv = sys.argv[1:] if argv is None else list(argv)
    name = Path(script).name if script else Path(sys.argv[0]).name
    parser = build_parser(description, amp=amp, distributed=distributed, ray=ray, prog=name)
    args = parser.parse_args(argv)
    if args.freeze and args.freeze_epochs:
        parser.error("--freeze trains the last layer only in every epoch; --freeze-epochs K only "
                     "in the first K: pass one of them")
    if args.warmup_epochs and args.warmup_epochs >= args.epochs:
        parser.error(f"argument --warmup-epochs: {args.warmup_epochs} is not less than --epochs "
                     f"{args.epochs}, so the learning rate would never reach --lr")
    if args.resume and args.overwrite:
        parser.error("--resume continues the run beside --checkpoint, --overwrite replaces it: pass one of them")
    check_tracking(parser, args.track, args.tracking_uri)
    # A flag that cannot act is refused (best.json would record it): given, even at its default.
    given = parser.given(argv)
    if args.val_dir is not None and "val_fraction" in given:
        parser.error("--val-dir's images are the validation set, --val-fraction splits --data-dir's: "
                     "pass one of them")
    for flag, policy in (("ra_magnitude", "ra"), ("augmix_severity", "augmix")):
        parser.refuse_unless(given, flag, args.auto_augment == policy,
                             f"it tunes --auto-augment {policy} alone: add --auto-augment {policy}")
    parser.refuse_unless(given, "momentum", args.optimizer == "sgd",
                         "it is SGD's (AdamW keeps its own averages): use --optimizer sgd")
    if args.sync_bn and Path(name).stem == "train_single":  # train_dp.py says its own (src.data_parallel)
        parser.error("argument --sync-bn: one process normalises its whole micro-batch already; it synchronises "
                     "the processes of train_ddp.py, train_fsdp.py or train_accelerate.py: drop --sync-bn")
    if args.evaluate and ray:
        parser.error("--evaluate validates without a cluster: run it with train_ddp.py or train_single.py, which "
                     "read train_ray.py's checkpoints")
    evaluate_file = None
    if args.evaluate:
        for flag in ("resume", "overwrite", "cache", "log_dir", "profile", "track", "save_every_steps"):
            if flag in given:
                parser.error(f"--evaluate trains nothing and writes nothing: drop --{flag.replace('_', '-')}")
        # The file to validate: the model is built without weights (nothing to download) and that
        # file is loaded into it (src.inference.load_evaluated).
        evaluate_file = args.weights if args.weights not in ("default", "none") else args.checkpoint
        args.weights = "none"
    from src.models import check_batch_norm, check_dropout, check_image_size, check_sync_bn  # here: they load torchvision
    try:
        check_image_size(args.arch, args.image_size)
        check_dropout(args.arch, args.dropout)
        check_sync_bn(args.arch, args.sync_bn)
        # A micro-batch of one image per process (the last incomplete batch is dropped: only
        # --batch-size counts), unless batch norm runs in eval mode (--freeze, --evaluate) or
        # over several processes (--sync-bn under a launcher).
        together = int(os.environ.get("WORLD_SIZE", "1")) if distributed and args.sync_bn else 1
        together = args.num_workers if ray and args.sync_bn else together
        if not (args.freeze or args.evaluate):
            check_batch_norm(args.arch, args.image_size, args.batch_size * together, f"--batch-size {args.batch_size}")
    except UserError as error:
        parser.error(str(error))
    from src.devices import available_cpus
    workers = args.workers
    if workers is None:
        from src.devices import default_workers
        workers = default_workers()
    config = config_from(args, [name, *argv], Path(name).stem.removeprefix("train_"),
                         cap_workers(workers, available_cpus()))
    config.evaluate_file = evaluate_file
    return config


# What --track's packages are installed from (a training-only install, requirements.txt, lacks them).
TRACKERS_FILE = "requirements-track.txt"

def check_tracking(parser: argparse.ArgumentParser, track: list[str] | None, uri: str | None) -> None:
    """What can be known of --track and --tracking-uri before anything starts: the URI's form
    (src.tracking.uri_problem; MLFLOW_TRACKING_URI's too, where it gives the store), that it goes
    with --track mlflow, the trackers' packages. What is there and whether the store answers:
    src.tracking."""
    import importlib.util

    from src.tracking import uri_problem
    if uri is not None and "mlflow" not in (track or []):
        parser.error("argument --tracking-uri: it is MLflow's store: add --track mlflow, or drop it")
    if uri is not None and uri_problem(uri):
        parser.error(f"argument --tracking-uri: {uri!r} {uri_problem(uri)}: pass http(s)://HOST:PORT, "
                     "sqlite:///PATH/mlflow.db or another database's URI")
    variable = os.environ.get("MLFLOW_TRACKING_URI")
    if uri is None and "mlflow" in (track or []) and variable and uri_problem(variable):
        parser.error(f"MLFLOW_TRACKING_URI={variable!r} {uri_problem(variable)}: set it to a server's "
                     "http(s)://HOST:PORT or a database such as sqlite:///PATH/mlflow.db, or unset it for the "
                     "store beside --checkpoint")
    for name in dict.fromkeys(track or []):
        if importlib.util.find_spec(name) is None:
            parser.error(f"argument --track: {name} is not installed in this environment: "
                         f"pip install -r {TRACKERS_FILE}")


def add_ray_flags(add: Callable[..., argparse.Action]) -> None:
    """train_ray.py's own flags: its workers, its cluster, where Ray Train keeps the checkpoints."""
    add("--num-workers", type=between(*RAY_WORKERS), default=1,
        help="training processes that Ray Train starts, one CPU each, or one GPU each where the cluster has GPUs")
    add("--address", default=None,
        help="a running Ray cluster: HOST:PORT of its head (ray start --head), ray://HOST:PORT or auto "
             "(default: RAY_ADDRESS, else a Ray instance started on this machine for the run)")
    add("--storage-path", metavar="PATH", default=None,
        help="where Ray Train keeps the reported checkpoints: a folder every node sees, or a URI such as "
             "s3://BUCKET/PATH (default: the folder ray/ beside --checkpoint)")
    add("--max-failures", type=between(*RAY_FAILURES), default=3,
        help="times Ray Train restarts the workers after one is lost (each time from the last checkpoint; "
             "-1: no limit)")


def add_dist_timeout(parser: argparse.ArgumentParser, waits_for: str) -> None:
    """--dist-timeout, for a command that may run under a launcher (src.process_group)."""
    parser.add_argument("--dist-timeout", metavar="MINUTES", type=ranged(0, DIST_TIMEOUT_MINUTES, True, False), default=60,
                        help=f"how long a process waits for the others ({waits_for}) before it fails")


def cap_workers(workers: int, cpus: int, flag: str = "--workers") -> int:
    """`workers`, or the `cpus` of this node if there are fewer, saying so in one line (rank 0):
    more loader workers than CPUs only add processes that wait for a CPU (--workers 100000 started
    700 processes and took 16 GB before it was killed)."""
    if workers <= cpus:
        return workers
    if os.environ.get("RANK", "0") == "0":
        print(f"{flag} {workers} is more than the {cpus} CPU(s) this process may use: using {cpus}",
              file=sys.stderr)
    return cpus


def dist_timeout(minutes: float) -> timedelta:
    """--dist-timeout (`minutes`), for the process group and for the processes that wait for their
    node's cache: neither wait outlasts the other."""
    return timedelta(minutes=minutes)


AMP_DTYPES = {"no": None, "bf16": "bfloat16", "fp16": "float16"}


def amp_dtype(amp: str) -> "torch.dtype | None":
    """The torch dtype that --amp (`amp`) asks autocast for, or None for full precision."""
    import torch
    name = AMP_DTYPES[amp]
    return getattr(torch, name) if name else None
