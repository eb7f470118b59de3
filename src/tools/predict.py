"""Predict the Kaggle test set with a trained checkpoint and write submission.csv.

    python -m src.tools.predict [--data-dir data] [--checkpoint model/best.pth] [--output submission.csv] [--tta]

The architecture, image size and normalisation come from best.json, which every training script
writes beside best.pth. Each row is `id,label` with label = p(dog), clipped to [EPS, 1 - EPS]
(see src/metrics.py): Kaggle's log loss punishes a confident mistake without bound.
"""
import hashlib
import json
from pathlib import Path

import torch
import torchvision
from torch.utils.data import DataLoader
from tqdm import tqdm

from src.atomic import atomic_write_text
from src.cli import OneLineParser, at_least
from src.datasets import DogCatTestDataset
from src.errors import UserError, exit_on_error
from src.loaders import default_workers
from src.metrics import EPS
from src.models import model_kwargs
from src.transforms import image_transform, normalize


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_checkpoint(checkpoint: Path) -> tuple[torch.nn.Module, dict]:
    """The trained model and its best.json description."""
    info_path = Path(checkpoint).with_suffix(".json")
    if not Path(checkpoint).is_file():
        raise UserError(f"checkpoint {checkpoint} not found: train first, or pass --checkpoint")
    try:
        info = json.loads(info_path.read_text())
        arch, num_classes = info["arch"], info["num_classes"]
    except (OSError, ValueError, KeyError):
        raise UserError(f"{info_path} is missing or unreadable: the training scripts write it "
                        "beside best.pth; retrain, or write it by hand") from None
    if "sha256" in info and _sha256(checkpoint) != info["sha256"]:
        raise UserError(f"{checkpoint} is not the file that {info_path} describes (a run stopped "
                        "between writing them?): rerun the training with --resume to rewrite both")
    model = torchvision.models.get_model(arch, num_classes=num_classes, **model_kwargs(arch))
    try:
        model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True))
    except Exception:  # pickle, shape or key errors: many types
        raise UserError(f"{checkpoint} is not a {num_classes}-class {arch} state_dict, "
                        f"as {info_path} says") from None
    return model.eval(), info


@torch.no_grad()
def predict(model: torch.nn.Module, info: dict, test_dir: Path, batch_size: int = 100,
            workers: int | None = None, tta: bool = False) -> tuple[list[int], torch.Tensor]:
    """Ids in numeric order and p(dog) for each test image (unclipped)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    size = info["image_size"]
    dataset = DogCatTestDataset(test_dir, image_transform(size), draft_size=size)
    loader = DataLoader(dataset, batch_size=batch_size,
                        num_workers=default_workers() if workers is None else workers)
    ids, probabilities = [], []
    for images, batch_ids in tqdm(loader, desc="predicting", leave=False):
        images = normalize(images.to(device), mean=info["mean"], std=info["std"])
        p_dog = model(images).float().softmax(dim=1)[:, 1]
        if tta:  # the class does not change under a horizontal flip
            p_dog = (p_dog + model(images.flip(dims=[3])).float().softmax(dim=1)[:, 1]) / 2
        ids += batch_ids.tolist()
        probabilities.append(p_dog.cpu())
    return ids, torch.cat(probabilities)


def submission_text(ids: list[int], p_dog: torch.Tensor) -> str:
    rows = [f"{i},{p:.6f}" for i, p in zip(ids, p_dog.clamp(EPS, 1 - EPS).tolist())]
    return "id,label\n" + "\n".join(rows) + "\n"


def main() -> None:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="folder holding test/")
    parser.add_argument("--checkpoint", type=Path, default=Path("model/best.pth"))
    parser.add_argument("--output", type=Path, default=Path("submission.csv"))
    parser.add_argument("--batch-size", type=at_least(1), default=100)
    parser.add_argument("--workers", type=at_least(0), default=None, help="default: this machine's CPUs")
    parser.add_argument("--tta", action="store_true", help="average over the image and its mirror")
    args = parser.parse_args()
    model, info = load_checkpoint(args.checkpoint)
    ids, p_dog = predict(model, info, args.data_dir / "test", args.batch_size, args.workers, args.tta)
    atomic_write_text(args.output, submission_text(ids, p_dog))
    print(f"wrote {len(ids)} predictions to {args.output}")


if __name__ == "__main__":
    exit_on_error(main)
