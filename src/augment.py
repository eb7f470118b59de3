"""Training-image augmentation, every draw a function of the sample's key (seed, epoch, index in
the data set) alone, never of a worker's, a rank's, a micro-batch's or the run's random state: every
mode, every --workers value and a resumed run see the same pixels and the same targets.

In the order the images go through it (torchvision's reference script's order,
references/classification/train.py):

- --augment: a random resized crop and a horizontal flip (crop_params, augment), drawn from a
  generator of their own seeded from (seed, epoch, index) without a stream. The crop is taken from the
  resized square that the loader (or --cache) already holds and resized back to --image-size: the
  cached pixels serve augmented training too, at the cost of upsampling the crop.
- --auto-augment ta_wide|ra|augmix (--ra-magnitude, --augmix-severity): torchvision.transforms.v2's
  TrivialAugmentWide, RandAugment and AugMix with the reference script's settings.
- --random-erase P: v2.RandomErasing(p=P), filled with what the reference's erasing after
  Normalize gives (ERASE_FILL).
- --mixup-alpha A, --cutmix-alpha A: v2.MixUp or v2.CutMix (one of the two, half and half, as
  v2.RandomChoice picks, when both are given) of the sample with a partner drawn by key from the
  whole training split (partner), itself augmented as above from its own key. The target becomes
  the mixed soft label.

torchvision's random transforms draw from the process's CPU generator. Each runs here inside
`drawing`: that generator forked, seeded from derive_seed(seed, epoch, index, STREAM), and given
back as it was. Each draw has a stream of its own, so that each is independent of the others and
of dropout's (src/dropout.py, stream 1), and switching one on changes none of the others.
Validation, --evaluate and predict never augment.
"""
import contextlib
import math
from typing import Iterator

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from src.config import Config
from src.dropout import sample_key
from src.seeds import derive_seed
from src.transforms import IMAGENET_MEAN

SCALE = (0.25, 1.0)  # share of the square's area that a crop keeps
RATIO = (3 / 4, 4 / 3)  # its aspect ratio, drawn on a log scale

# The streams of derive_seed(seed, epoch, index, STREAM) that the draws come from; dropout's is 1.
POLICY, ERASE, PARTNER, MIX = 2, 3, 4, 5
# The reference erases after Normalize with value 0, which is the ImageNet mean in pixels. The
# images here stay uint8 until the device normalises them, so the box is filled with the mean's
# nearest uint8 value: 0 in normalised space to within 0.5 / 255 / std (< 0.0023).
ERASE_FILL = tuple(round(255 * mean) for mean in IMAGENET_MEAN)  # (124, 116, 104)
# The reference's interpolation (--interpolation bilinear) for the policies' geometric ops.
INTERPOLATION = v2.InterpolationMode.BILINEAR


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


@contextlib.contextmanager
def drawing(seed: int, epoch: int, index: int, stream: int) -> Iterator[None]:
    """What torch draws from the process's CPU generator inside is a function of (seed, epoch,
    index, stream) alone; the generator is given back as it was.

    The CPU generator only: torch.manual_seed would seed every GPU's too, which fork_rng(devices=[])
    does not give back (and the loader's main process may hold a GPU).
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(derive_seed(seed, epoch, index, stream))
        yield


def partner(seed: int, epoch: int, index: int, position: int, n: int) -> int:
    """The position, in a training split of n, of the sample that the sample at `position` (the data
    set's `index`) is mixed with in `epoch`: uniform over the other n - 1 (itself if n is 1)."""
    if n < 2:
        return position
    generator = torch.Generator().manual_seed(derive_seed(seed, epoch, index, PARTNER))
    drawn = int(torch.randint(n - 1, (), generator=generator))
    return drawn + (drawn >= position)


def policy(args: Config) -> v2.Transform | None:
    """--auto-augment's transform, with the reference's settings; None without it."""
    name = args.auto_augment
    if name is None:
        return None
    if name == "ta_wide":
        return v2.TrivialAugmentWide(interpolation=INTERPOLATION)
    if name == "ra":
        return v2.RandAugment(magnitude=args.ra_magnitude, interpolation=INTERPOLATION)
    if name == "augmix":
        return v2.AugMix(severity=args.augmix_severity, interpolation=INTERPOLATION)
    raise ValueError(f"--auto-augment {name!r}: not a policy (src.cli.POLICIES)")


def eraser(args: Config) -> v2.RandomErasing | None:
    """--random-erase P's transform (the reference's scale and ratio); None without it."""
    p = args.random_erase
    return v2.RandomErasing(p=p, value=list(ERASE_FILL)) if p > 0 else None


def mixer(args: Config) -> v2.Transform | None:
    """v2.MixUp, v2.CutMix or, with both alphas, the reference's RandomChoice of the two; None
    without either. It takes a batch of two (the sample, its partner) and two labels."""
    mixers = []
    if args.mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=args.mixup_alpha, num_classes=2))
    if args.cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=args.cutmix_alpha, num_classes=2))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def augments(args: Config) -> list[str]:
    """The flags on that change a training image from epoch to epoch or mix it with another."""
    on = {"--augment": args.augment,
          "--auto-augment": args.auto_augment is not None,
          "--random-erase": args.random_erase > 0,
          "--mixup-alpha": args.mixup_alpha > 0,
          "--cutmix-alpha": args.cutmix_alpha > 0}
    return [flag for flag, value in on.items() if value]


def mix(first: torch.Tensor, second: torch.Tensor, labels: tuple[int, int],
        mixing: v2.Transform) -> tuple[torch.Tensor, torch.Tensor]:
    """(the uint8 image, the float32 soft target of shape (2,)) of `first` mixed with `second` by
    `mixing` (mixer's), drawing from the process's generator: call it inside `drawing`.

    v2's mixers pair each image of a batch with the one before it (a roll by one): in the batch
    (first, second), first is paired with second, and its target is
    lambda x one_hot(first) + (1 - lambda) x one_hot(second), lambda corrected by v2.CutMix to the
    share of the image its box leaves to `first`. MixUp's blend is rounded to uint8 (within
    0.5 / 255 of the float one); CutMix's pixels are copied.
    """
    images, targets = mixing(torch.stack([first, second]).float(), torch.tensor(labels))
    return images[0].round().clamp(0, 255).to(torch.uint8), targets[0].float()


class TrainSplit(Dataset[tuple[torch.Tensor, int | torch.Tensor, int]]):
    """The training images: item `position` is (image, target, key) of the data set's sample
    indices[position] in the epoch that set_epoch gave, where

    - image: uint8 (3, size, size), augmented as --augment, --auto-augment and --random-erase say,
      and mixed with its partner with --mixup-alpha or --cutmix-alpha;
    - target: the int label, or with mixing the float32 soft label of shape (2,);
    - key: the sample's dropout key (src.dropout.sample_key(seed, epoch, index)).

    `dataset[index]` is (uint8 image, int label); `args` holds the run's flags.
    """

    def __init__(self, dataset: Dataset, indices: list[int], args: Config):
        self.dataset, self.indices, self.seed = dataset, list(indices), args.seed
        self.crop = args.augment
        self.policy, self.eraser, self.mixer = policy(args), eraser(args), mixer(args)
        # In shared memory: a persistent loader worker keeps the copy of this object it started
        # with (fork or spawn), and reads the epoch that set_epoch writes in the main process.
        # Call set_epoch between passes over the loader, not while one has batches in flight.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch.fill_(epoch)

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def __len__(self) -> int:
        return len(self.indices)

    def augmented(self, image: torch.Tensor, epoch: int, index: int) -> torch.Tensor:
        """The data set's image `index` as `epoch` trains on it, before any mixing."""
        if self.crop:
            image = augment(image, crop_params(self.seed, epoch, index, image.shape[-1]))
        if self.policy is not None:
            with drawing(self.seed, epoch, index, POLICY):
                image = self.policy(image)
        if self.eraser is not None:
            with drawing(self.seed, epoch, index, ERASE):
                image = self.eraser(image)
        return image

    def __getitem__(self, position: int) -> tuple[torch.Tensor, int | torch.Tensor, int]:
        epoch, index = self.epoch, self.indices[position]
        image, label = self.dataset[index]
        image = self.augmented(image, epoch, index)
        target = label
        if self.mixer is not None:
            other = self.indices[partner(self.seed, epoch, index, position, len(self.indices))]
            other_image, other_label = self.dataset[other]
            other_image = self.augmented(other_image, epoch, other)  # its own draws, from its own key
            with drawing(self.seed, epoch, index, MIX):
                image, target = mix(image, other_image, (int(label), int(other_label)), self.mixer)
        return image, target, sample_key(self.seed, epoch, index)
