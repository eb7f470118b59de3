"""The command-line flags shared by all four training scripts."""
import argparse
import os
import sys


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line (exit code 2), without the usage block."""

    def error(self, message: str) -> None:
        # Under a launcher every rank parses the same flags: rank 0 alone says what is wrong.
        first = os.environ.get("RANK", "0") == "0"
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n" if first else None)


def at_least(minimum: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def _open_fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1 (exclusive), got {value}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser(description: str, amp: bool = True, local_rank: bool = False) -> argparse.ArgumentParser:
    parser = OneLineParser(description=description,
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--data-dir", default="data", help="folder holding train/ (and optional train.csv, test/)")
    add("--epochs", type=at_least(1), default=1, help="epochs to train")
    add("--batch-size", type=at_least(1), default=50,
        help="images per process and step (the global batch is this times the processes)")
    add("--lr", type=_non_negative, default=0.001, help="SGD learning rate")
    add("--momentum", type=_non_negative, default=0.9, help="SGD momentum")
    add("--image-size", type=at_least(32), default=224, help="images are resized to this square")
    add("--arch", default="vgg16", help="torchvision classification model; its last layer gets 2 outputs")
    add("--weights", default="default",
        help="'default' = torchvision's ImageNet weights, 'none' = random init, or a state_dict file")
    add("--dropout", type=_non_negative, default=None,
        help="dropout probability of the classifier (default: torchvision's)")
    add("--val-fraction", type=_open_fraction, default=0.2, help="share of images held out for validation")
    add("--seed", type=int, default=42, help="seeds the split, the data order and the new layers")
    add("--workers", type=at_least(0), default=None,
        help="data loader workers per process (default: this node's CPUs / its processes)")
    add("--checkpoint", default="model/best.pth",
        help="best model's state_dict; last.pth, history.json and best.json go beside it")
    add("--plot", default="training_results.png", help="accuracy and loss curves (PNG)")
    add("--resume", action="store_true", help="continue from last.pth beside --checkpoint if it exists")
    add("--cache", metavar="DIR", default=None,
        help="decode and resize every image once into DIR (uint8, memory-mapped) and train from it")
    add("--channels-last", action="store_true",
        help="channels-last memory format for the model and the batches (faster convolutions on GPUs)")
    add("--compile", action="store_true", help="torch.compile the model (the first steps compile it)")
    if amp:
        add("--amp", choices=["no", "bf16", "fp16"], default="no",
            help="mixed precision with torch.autocast (fp16 adds a gradient scaler)")
    if local_rank:
        # torch.distributed.launch passes this; torchrun sets the LOCAL_RANK variable instead.
        add("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(description: str, argv: list[str] | None = None, **options) -> argparse.Namespace:
    return build_parser(description, **options).parse_args(sys.argv[1:] if argv is None else argv)


AMP_DTYPES = {"no": None, "bf16": "bfloat16", "fp16": "float16"}


def amp_dtype(args: argparse.Namespace):
    """The torch dtype that --amp asks autocast for, or None for full precision."""
    import torch
    name = AMP_DTYPES[getattr(args, "amp", "no")]
    return getattr(torch, name) if name else None
