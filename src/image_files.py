"""Image files to predict: found under the paths a user names, and decoded as training decodes
them. Pillow and numpy only, no torch: `predict --onnx` runs where only onnxruntime is installed.

decode() gives the same bytes as training's open_rgb(path, draft_size=size) followed by
image_transform(size) (tests/test_predict.py checks it on JPEG, PNG, grayscale, CMYK, RGBA,
palette and oversized images): a draft decode, RGB, then Pillow's bilinear resize to a square,
which is what torchvision's Resize does with a Pillow image.
"""
import errno
import os
import re
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from src.errors import UserError

# Files are taken as images by their suffix (any case); every other file is counted and skipped.
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def natural_key(name: str) -> list:
    """Sort key that puts cat.2.jpg before cat.10.jpg."""
    return [int(part) if part.isdigit() else part.lower() for part in re.split(r"(\d+)", name)]


def broken_link(path: Path) -> bool:
    """Whether path is a symbolic link to nothing, or a loop of links."""
    return path.is_symlink() and not path.exists()


def find_images(paths: list[Path]) -> tuple[list[Path], int]:
    """The image files among `paths` (files, and folders searched recursively), each once, in the
    order given, a folder's files in natural order of their path in it; and how many other files
    there were. A path that does not exist, or no image at all, is a UserError. A link to nothing,
    or a loop of links, named as an image is listed too: it cannot be decoded, and is left out
    with the reason (try_decode) rather than dropped without a word."""
    images, seen, others = [], set(), 0
    for path in paths:
        if path.is_dir():
            found = sorted((p for p in path.rglob("*") if p.is_file() or broken_link(p)),
                           key=lambda p: natural_key(p.relative_to(path).as_posix()))
        elif path.is_file():
            found = [path]
        else:
            raise UserError(f"{path}: no such file or folder")
        for file in found:
            if file.suffix.lower() not in IMAGE_SUFFIXES:
                others += 1
            elif os.path.realpath(file) not in seen:  # realpath: Path.resolve raises on a loop of links
                seen.add(os.path.realpath(file))
                images.append(file)
    if not images:
        names = " ".join(str(path) for path in paths)
        raise UserError(f"no images in {names} ({others} other file(s)); images are files named "
                        f"{', '.join(sorted(IMAGE_SUFFIXES))} (any case)")
    return images, others


def decode(path: Path, size: int) -> np.ndarray:
    """The image as training sees it: uint8 RGB, (3, size, size). Raises OSError, ValueError or
    Image.DecompressionBombError for a file that cannot be decoded."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Pillow warns about odd EXIF data in real photos
        with Image.open(path) as image:
            image.draft("RGB", (size, size))  # libjpeg decodes at 1/2, 1/4 or 1/8 scale if that still covers size
            image = image.convert("RGB").resize((size, size), Image.BILINEAR)
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1).copy()


def try_decode(path: Path, size: int) -> tuple[np.ndarray | None, str]:
    """decode(), or (None, why) for a broken file."""
    try:
        return decode(path, size), ""
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        if isinstance(error, OSError) and broken_link(Path(path)):
            return None, ("a loop of symbolic links" if error.errno == errno.ELOOP
                          else f"a symbolic link to {os.readlink(path)}, which does not exist")
        return None, str(error).splitlines()[0] if str(error) else type(error).__name__
