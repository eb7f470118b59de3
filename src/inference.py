"""Using a trained model with torch: best.pth with its best.json, class probabilities for image
files, computed as training computes them (the same decode, uint8 batches normalised on the
device, --amp, --channels-last) and shared out over the processes of a launcher, and --evaluate:
a checkpoint validated once on a training run's validation split, in any mode (nothing trains,
nothing is written; the scripts return before their epoch loop once it is done).
"""
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
import torchvision
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from src.cli import IMAGE_SIZES
from src.config import Config
from src.datasets import CLASSES, DogCatTestDataset, worker_options
from src.divergence import ADVICE, check_finite_weights
from src.errors import UserError
from src.history import evaluation_record, format_evaluation
from src.image_files import try_decode
from src.loaders import ShardSampler
from src.metrics import EPS
from src.models import check_image_size, classification_models, model_kwargs, read_state_dict
from src.outputs import input_problem, sha256_of
from src.ranks import from_rank_0, is_first
from src.safe_csv import csv_text
from src.transforms import normalize


def read_info(checkpoint: Path) -> dict:
    """best.json beside best.pth, checked field by field (check_info) and to describe this very
    best.pth (its sha256)."""
    info_path = Path(checkpoint).with_suffix(".json")
    if info_path == Path(checkpoint):  # best.json itself given: its sha256 would be checked against itself
        raise UserError(f"{checkpoint} describes a checkpoint: give the weights it describes, "
                        f"{Path(checkpoint).with_suffix('.pth')}")
    problem = input_problem(checkpoint)
    if problem == "no such file":
        raise UserError(f"checkpoint {checkpoint} not found: train first, or pass --checkpoint")
    if problem is not None:
        raise UserError(f"checkpoint {checkpoint}: {problem}: pass the best.pth of a training run")
    if os.path.lexists(info_path) and input_problem(info_path) is not None:  # a named pipe would wait for a writer
        raise UserError(f"{info_path}: {input_problem(info_path)}: the training scripts write best.json "
                        "there, a JSON file")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        if training_checkpoint(checkpoint):
            raise UserError(f"{checkpoint} is a training checkpoint (a last.pth: the model with its optimizer "
                            "and history, for --resume): give the best.pth beside it") from None
        raise UserError(f"{info_path} is missing or unreadable: the training scripts write it "
                        "beside best.pth; retrain, or write it by hand") from None
    check_info(info, info_path)
    if "sha256" in info and sha256_of(checkpoint) != info["sha256"]:
        raise UserError(f"{checkpoint} is not the file that {info_path} describes (a run stopped "
                        "between writing them?): rerun the training with --resume to rewrite both")
    return info


def training_checkpoint(path: Path) -> bool:
    """Whether the file holds what a training run saves to go on from (last.pth: a dict of the
    model, the optimizer and the history), not a model's state_dict. Read without copying (mmap)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a torch file, or not one of ours: many types
        return False
    return isinstance(state, dict) and {"model", "optimizer", "history"} <= set(state)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _info_problem(info: dict) -> str | None:
    """What is wrong with the first bad field of a best.json, or None."""
    if not isinstance(info, dict):
        return "is not a JSON object"
    arch = info.get("arch")
    if not isinstance(arch, str) or arch not in classification_models():
        return f"arch {arch!r} is not a torchvision classification model"
    if info.get("classes") != list(CLASSES):
        return (f"classes {info.get('classes')!r} must be {list(CLASSES)!r}, the order of the model's "
                "outputs in training")
    if info.get("num_classes") != len(CLASSES) or isinstance(info.get("num_classes"), bool):
        return f"num_classes {info.get('num_classes')!r} must be {len(CLASSES)}"
    for key in ("mean", "std"):
        value = info.get(key)
        if not isinstance(value, list) or len(value) != 3 or not all(_number(v) for v in value):
            return f"{key} {value!r} must be three finite numbers (red, green, blue)"
    if not all(v > 0 for v in info["std"]):
        return f"std {info['std']!r} must be above 0 (the images are divided by it)"
    size, (low, high) = info.get("image_size"), IMAGE_SIZES
    if not isinstance(size, int) or isinstance(size, bool) or not low <= size <= high:
        return (f"image_size {size!r} must be a whole number from {low} to {high} (as --image-size: "
                f"above it one image alone takes tens of MB)")
    try:
        check_image_size(arch, size)
    except UserError as error:
        return f"image_size {size}: {error}"
    return None


def check_info(info, path: Path) -> None:
    """Refuse a best.json (hand-edited, or another program's) whose fields predict, export and
    --evaluate could not use, in one line naming the first bad field, before any work: a wrong
    class list or normalisation gave wrong rows or none at all, a huge image size the OOM killer."""
    problem = _info_problem(info)
    if problem is not None:
        raise UserError(f"{path}: {problem}; fix it, or retrain to have it written again")


class LoadsState(Protocol):
    """What a state_dict is loaded into: a module, or a sharded one's src.fsdp.WholeModel."""

    def load_state_dict(self, state: dict[str, Any], /) -> Any: ...


M = TypeVar("M", bound=LoadsState)


def load_state(model: M, state: dict, path: Path, what: str) -> M:
    """model.load_state_dict(state), or a UserError saying that `path` is not `what`."""
    try:
        model.load_state_dict(state)
    except Exception:  # shape or key errors, or not a dict at all
        raise UserError(f"{path} is not {what}") from None
    return model


def load_checkpoint(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """The trained model (on the CPU, in eval mode) and its best.json description."""
    info = read_info(checkpoint)
    arch, num_classes = info["arch"], info["num_classes"]
    try:
        model = torchvision.models.get_model(arch, num_classes=num_classes, **model_kwargs(arch))
    except Exception:  # an unknown name, a class count it cannot take
        raise UserError(f"{Path(checkpoint).with_suffix('.json')} describes a {num_classes}-class {arch}, "
                        "which torchvision cannot build") from None
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception:  # pickle errors: many types
        state = None
    if isinstance(state, dict):
        check_finite_weights(state, checkpoint, f"retrain ({ADVICE})")
    what = f"a {num_classes}-class {arch} state_dict, as {Path(checkpoint).with_suffix('.json')} says"
    return load_state(model, state, checkpoint, what).eval(), info


class ImageFiles(Dataset):
    """Image files decoded as training decodes them; yields (uint8 image, index, why), where `why`
    is "" or what is wrong with a file that cannot be decoded (its image is then zeros)."""

    def __init__(self, files: list[Path], image_size: int):
        self.files, self.image_size = files, image_size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, str]:
        image, why = try_decode(self.files[index], self.image_size)
        if image is None:
            return torch.zeros(3, self.image_size, self.image_size, dtype=torch.uint8), index, why
        return torch.from_numpy(image), index, ""


def batch_probabilities(model: torch.nn.Module, images: torch.Tensor, info: dict, device: torch.device,
                        tta: bool = False, amp_dtype: torch.dtype | None = None,
                        channels_last: bool = False) -> torch.Tensor:
    """Class probabilities (float32, on the device) of a uint8 batch; with tta, the mean of the
    image's and its mirror image's (the class does not change under a horizontal flip)."""
    images = normalize(images.to(device, non_blocking=True), channels_last, info["mean"], info["std"])
    with torch.autocast(device.type, amp_dtype, enabled=amp_dtype is not None):
        p = model(images).float().softmax(dim=1)
        if tta:
            p = (p + model(images.flip(dims=[3])).float().softmax(dim=1)) / 2
    return p


@torch.no_grad()
def predict_files(model: torch.nn.Module, info: dict, files: list[Path], device: torch.device,
                  batch_size: int = 100, workers: int = 0, tta: bool = False,
                  amp_dtype: torch.dtype | None = None, channels_last: bool = False,
                  rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, dict[int, str]] | None:
    """Class probabilities of every file in order (NaN rows for the files that cannot be decoded)
    and why each of those cannot be, by index; `model` is on `device`.

    With world_size > 1 every rank computes a contiguous share of the files, without padding,
    and rank 0 gets the whole (the others get None): the rows of a one-process run, in its order.
    """
    model.eval()
    sampler = ShardSampler(len(files), world_size, rank)
    loader = DataLoader(ImageFiles(files, info["image_size"]), batch_size=batch_size, sampler=sampler,
                        num_workers=workers, pin_memory=device.type == "cuda", **(worker_options() if workers else {}))
    chunks, broken = [], {}
    for images, indices, whys in tqdm(loader, desc="predicting", leave=False, disable=rank != 0):
        chunks.append(batch_probabilities(model, images, info, device, tta, amp_dtype, channels_last))
        broken.update({int(i): why for i, why in zip(indices, whys) if why})
    share = torch.cat(chunks).cpu() if chunks else torch.zeros(0, info["num_classes"])  # waits once
    share[[i - sampler.start for i in broken]] = float("nan")
    if world_size == 1:
        return share, broken
    shares: list[tuple[torch.Tensor, dict[int, str]]] | None = [(share, broken)] * world_size if rank == 0 else None
    dist.gather_object((share, broken), shares, dst=0)  # every rank takes part; rank 0's list is filled
    if shares is None:
        return None
    return torch.cat([s for s, _ in shares]), {i: why for _, b in shares for i, why in b.items()}


def kaggle_test_files(test_dir: Path) -> tuple[list[int], list[Path], list[str]]:
    """Kaggle's test/N.jpg: ids in numeric order, their files, and the names of what else test/
    holds (not predicted: predict names them in one line)."""
    test = DogCatTestDataset(test_dir)
    return test.ids, [test.root_dir / test.files[i] for i in test.ids], test.others


def check_complete(files: list[Path], broken: dict[int, str]) -> None:
    """A submission needs every test image."""
    if broken:
        first = min(broken)
        raise UserError(f"cannot read test image {files[first]} ({broken[first]}; {len(broken)} "
                        "unreadable): a submission needs a prediction for every test image")


def submission_text(ids: list[int], p_dog) -> str:
    """submission.csv: `id,label` with label = p(dog) clipped to [EPS, 1 - EPS] (see src/metrics.py):
    Kaggle's log loss punishes a confident mistake without bound. p_dog: a tensor or an array."""
    return csv_text(["id", "label"], ([i, f"{min(max(float(p), EPS), 1 - EPS):.6f}"] for i, p in zip(ids, p_dog)))


def load_evaluated(args: Config, info: dict, model: LoadsState) -> str:
    """--evaluate: load the file to validate (args.evaluate_file, see src.cli) into `model`;
    returns how the record names it.

    --checkpoint (best.pth) must be the file its best.json describes, and best.json must describe
    this run's model and validation split (--arch, --image-size, --seed, --val-fraction and the
    images of --data-dir); --weights FILE is any 2-class state_dict of --arch, or a last.pth.
    Rank 0 reads and checks the file and sends it to every rank: on nodes without a shared disk
    only rank 0's node has it.
    """
    from src.checkpoint import flag_of  # here: predict does not need the training side
    if args.evaluate_file is None:
        raise ValueError("load_evaluated runs with --evaluate alone (src.cli.parse_args sets evaluate_file)")
    path = Path(args.evaluate_file)

    def read() -> tuple[dict, str]:
        if path != Path(args.checkpoint):
            return read_state_dict(path), str(path)
        saved = read_info(path)
        for key in ("arch", "num_classes", "image_size", "seed", "val_fraction", "data", "val_data"):
            if saved.get(key) != info[key]:
                raise UserError(f"{path.with_suffix('.json')} says {path} was trained with {flag_of(key)} "
                                f"{saved.get(key)}, not {info[key]}: pass the flags it was trained "
                                f"with to validate it on its split, or --weights {path} to validate "
                                "it on this one")
        return read_state_dict(path, "--checkpoint"), f"{path} (epoch {saved.get('epoch')})"

    state, named = from_rank_0(read)
    load_state(model, state, path,
               f"a {info['num_classes']}-class {info['arch']} state_dict (--arch {info['arch']})")
    return named


def show_evaluation(named: str, val_sums: torch.Tensor, seconds: float) -> None:
    """Print --evaluate's result on rank 0: a line as an epoch's, then the record as JSON."""
    if is_first():
        record = evaluation_record(val_sums, seconds)
        print(format_evaluation(named, record))
        print(json.dumps(record))
