"""Image preprocessing: resize in the loader workers, normalise on the device."""
import torch
from torchvision import transforms

# torchvision's ImageNet statistics: the pretrained weights expect inputs normalised with these.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def image_transform(image_size: int) -> transforms.Compose:
    """PIL image -> uint8 tensor (3, size, size); uint8 keeps worker-to-device traffic 4x smaller."""
    return transforms.Compose([
        transforms.Resize((image_size, image_size), antialias=True),
        transforms.PILToTensor(),
    ])


def normalize(images: torch.Tensor, channels_last: bool = False, mean: tuple = IMAGENET_MEAN,
              std: tuple = IMAGENET_STD) -> torch.Tensor:
    """uint8 batch (already on the device) -> float batch normalised per channel."""
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    mean = torch.tensor(mean, device=images.device).view(1, 3, 1, 1)
    std = torch.tensor(std, device=images.device).view(1, 3, 1, 1)
    return (images.float() / 255 - mean) / std


def memory_format(args) -> torch.memory_format:
    """What --channels-last asks for the model's weights."""
    return torch.channels_last if args.channels_last else torch.preserve_format
