"""Image files to predict: found under the paths a user names, and decoded as training decodes
them. Pillow and numpy only, no torch: `predict --onnx` runs where only onnxruntime is installed.

decode() gives the same bytes as training's open_rgb(path, draft_size=size) followed by
image_transform(size) (tests/test_predict.py checks it on JPEG, PNG, grayscale, CMYK, RGBA,
palette and oversized images): a draft decode, to_rgb() (which training's open_rgb calls too),
then Pillow's bilinear resize to a square, which is what torchvision's Resize does with a Pillow
image.
"""
import errno
import os
import re
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from src.errors import UserError
from src.outputs import input_problem
from src.terminal import shown

# Files are taken as images by their suffix (any case); every other file is counted and skipped.
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


# EXIF's orientation tag: how to turn the stored pixels to show the photo as its owner sees it.
ORIENTATION = 0x0112
# Pillow's modes of 16-bit grayscale (a 16-bit PNG or TIFF): convert("RGB") clips each value at
# 255, so all but the darkest pixels came out white.
SIXTEEN_BIT = {"I;16", "I;16L", "I;16B", "I;16N"}


def to_rgb(image: Image.Image) -> Image.Image:
    """The opened image (after any draft()) as 8-bit RGB, as it is meant to be seen: turned by
    its EXIF orientation (a phone's portrait photo is stored sideways with a tag saying so), a
    16-bit grayscale image scaled to 8 bits (its high byte, as Pillow reads a 16-bit RGB PNG),
    then grayscale, CMYK, RGBA or palette converted to RGB. The one path of training, predict,
    export's check and the report's thumbnails."""
    if image.getexif().get(ORIENTATION, 1) != 1:
        image = ImageOps.exif_transpose(image)
    if image.mode in SIXTEEN_BIT:
        image = Image.fromarray((np.asarray(image).astype(np.uint16) >> 8).astype(np.uint8), "L")
    return image.convert("RGB")


def natural_key(name: str) -> list:
    """Sort key that puts cat.2.jpg before cat.10.jpg. isdecimal, not isdigit: a superscript ²
    is a digit to str.isdigit, which int() refuses (a file named ² was a traceback)."""
    return [int(part) if part.isdecimal() else part.lower() for part in re.split(r"(\d+)", name)]


def broken_link(path: Path) -> bool:
    """Whether path is a symbolic link to nothing, or a loop of links."""
    return path.is_symlink() and not path.exists()


def files_under(folder: Path) -> list[str]:
    """Every file under folder (links to nothing, named pipes, sockets and devices included: files
    that cannot be read as images), as paths relative to it with / separators. A link to a folder
    is followed, as torchvision's ImageFolder follows it, each real folder once, under the first of
    its names in natural order (so a loop of links ends, and no image is listed twice); a folder
    inside that cannot be listed is listed itself, to be named among the files not used. OSError if
    folder itself cannot be listed."""
    found: list[str] = []
    seen: set[str] = set()

    def walk(path: str, relative: str) -> None:
        real = os.path.realpath(path)
        if real in seen:
            return
        seen.add(real)
        try:
            entries = sorted(os.scandir(path), key=lambda entry: natural_key(entry.name))
        except OSError:
            if not relative:
                raise
            found.append(relative.rstrip("/"))
            return
        for entry in entries:
            try:
                is_folder = entry.is_dir()  # a link to a folder too
            except OSError:
                is_folder = False
            if is_folder:
                walk(entry.path, f"{relative}{entry.name}/")
            else:
                found.append(f"{relative}{entry.name}")

    walk(str(folder), "")
    return found


def find_images(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    """The image files among `paths` (files, and folders searched recursively), each once, in the
    order given, a folder's files in natural order of their path in it; and the other files (not
    images), for the line that names them. A path that does not exist, or no image at all, is a
    UserError. A link to nothing, or a loop of links, named as an image is listed too: it cannot
    be decoded, and is left out with the reason (try_decode) rather than dropped without a word;
    so is a named pipe, a socket or a device in a folder (PATH itself must be a file or folder)."""
    images, seen, others = [], set(), []
    for path in paths:
        if path.is_dir():
            try:
                found = [path / name for name in sorted(files_under(path), key=natural_key)]
            except OSError as error:
                raise UserError(f"{path}: cannot list it ({error.strerror or type(error).__name__})") from None
        elif path.is_file():
            found = [path]
        else:
            raise UserError(f"{path}: {input_problem(path, folder=True)}")
        for file in found:
            if file.suffix.lower() not in IMAGE_SUFFIXES:
                others.append(file)
            elif os.path.realpath(file) not in seen:  # realpath: Path.resolve raises on a loop of links
                seen.add(os.path.realpath(file))
                images.append(file)
    if not images:
        names = " ".join(str(path) for path in paths)
        raise UserError(f"no images in {names} ({len(others)} other file(s)); images are files named "
                        f"{', '.join(sorted(IMAGE_SUFFIXES))} (any case)")
    return images, others


def decode(path: Path, size: int) -> np.ndarray:
    """The image as training sees it: uint8 RGB, (3, size, size). Raises OSError, ValueError or
    Image.DecompressionBombError for a file that cannot be decoded."""
    with Image.open(path) as image:  # Pillow's warnings about odd EXIF data: src.errors.ignore_pillow_warnings
        image.draft("RGB", (size, size))  # libjpeg decodes at 1/2, 1/4 or 1/8 scale if that still covers size
        rgb = to_rgb(image).resize((size, size), Image.Resampling.BILINEAR)
    return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1).copy()


def some(names: list, count: int = 3) -> str:
    """The first `count` names, shown (src.terminal.shown), and how many more: for the one line
    that names what a command does not use."""
    text = ", ".join(shown(name) for name in names[:count])
    return text + (f" and {len(names) - count} more" if len(names) > count else "")


def try_decode(path: Path, size: int) -> tuple[np.ndarray | None, str]:
    """decode(), or (None, why) for a broken file (or one that is not a regular file: opening a
    named pipe would wait for a writer)."""
    problem = input_problem(path)
    if problem is not None and not broken_link(Path(path)):
        return None, problem
    try:
        return decode(path, size), ""
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as error:
        if isinstance(error, OSError) and broken_link(Path(path)):
            return None, ("a loop of symbolic links" if error.errno == errno.ELOOP
                          else f"a symbolic link to {os.readlink(path)}, which does not exist")
        return None, str(error).splitlines()[0] if str(error) else type(error).__name__
