"""--augment: a random resized crop and a horizontal flip of every training image; the training
split as the model sees it (TrainSplit).

Each image's draw comes from a generator seeded with (seed, epoch, sample index) alone, never from
a worker's, a rank's or the run's random state, so every mode, every --workers value and a resumed
run see the same pixels. The crop is taken from the resized square that the loader (or --cache)
already holds and resized back to --image-size: the cached pixels serve augmented training too,
at the cost of upsampling the crop (at most the square's resolution). Validation and predict are
never augmented.
"""
import math

import torch
from torch.utils.data import Dataset
from torchvision.transforms.v2 import functional as TF

from src.dropout import sample_key
from src.seeds import derive_seed

SCALE = (0.25, 1.0)  # share of the square's area that a crop keeps
RATIO = (3 / 4, 4 / 3)  # its aspect ratio, drawn on a log scale


def crop_params(seed: int, epoch: int, index: int, size: int) -> tuple[int, int, int, int, bool]:
    """(top, left, height, width, flip) of sample `index` in `epoch`, for a size x size image.

    Like torchvision's RandomResizedCrop.get_params (ten tries, then the whole image), with its
    own generator.
    """
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, index))
    flip = bool(torch.rand(1, generator=generator).item() < 0.5)
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        area, ratio, y, x = torch.rand(4, generator=generator).tolist()
        area = size * size * (SCALE[0] + (SCALE[1] - SCALE[0]) * area)
        ratio = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * ratio)
        width, height = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < width <= size and 0 < height <= size:
            top = min(int(y * (size - height + 1)), size - height)
            left = min(int(x * (size - width + 1)), size - width)
            return top, left, height, width, flip
    return 0, 0, size, size, flip


def augment(image: torch.Tensor, params: tuple[int, int, int, int, bool]) -> torch.Tensor:
    """Crop a uint8 (3, size, size) image, resize it back to size and flip it as params say."""
    top, left, height, width, flip = params
    size = list(image.shape[-2:])
    image = TF.resized_crop(image, top, left, height, width, size, antialias=True)
    return image.flip(-1) if flip else image


class TrainSplit(Dataset):
    """The training split as the model sees it: item `position` is the sample `indices[position]` of
    `dataset` as (image, label, its dropout key: src.dropout.sample_key), the image augmented with
    --augment; every draw a function of (seed, epoch, index in the data set). set_epoch(epoch)
    before each epoch's pass: the loader's workers start with the split as it is then."""

    def __init__(self, dataset: Dataset, indices: list[int], args):
        self.dataset, self.indices, self.seed, self.augment = dataset, indices, args.seed, args.augment
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, position: int):
        index = self.indices[position]
        image, label = self.dataset[index]
        if self.augment:
            image = augment(image, crop_params(self.seed, self.epoch, index, image.shape[-1]))
        return image, label, sample_key(self.seed, self.epoch, index)
