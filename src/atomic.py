"""Files written whole or not at all: to a temporary file in the target's folder, flushed to disk,
then renamed onto the target. A crash or a full disk leaves the old file, never half a new one."""
import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

from src.errors import UserError, one_line

_UMASK = os.umask(0)
os.umask(_UMASK)


class _WriteRecorder:
    """A file that hashes what is written and remembers why a write failed: torch.save reports
    that as a RuntimeError ("unexpected pos ...") without the errno ("No space left on device")."""

    def __init__(self, file: BinaryIO):
        self.file, self.error, self.sha256 = file, None, hashlib.sha256()

    def write(self, data) -> int:
        try:
            written = self.file.write(data)
        except OSError as error:
            self.error = error
            raise
        self.sha256.update(data)
        return written

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def atomic_write(path: Path, write: Callable[[BinaryIO], None]) -> str:
    """write(file) into a temporary file beside path, then rename it onto path: path holds the
    old or the new content, never half of one. Returns the sha256 of what was written.

    Any failure (a full disk, a folder that cannot be made) becomes a one-line UserError naming
    path; the old file stays.
    """
    path = Path(path)
    tmp = file = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes it private; outputs get the usual mode
        with os.fdopen(fd, "wb") as raw:
            file = _WriteRecorder(raw)
            write(file)
            raw.flush()
            os.fsync(raw.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
        return file.sha256.hexdigest()
    except BaseException as error:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(error, (OSError, RuntimeError)):
            raise UserError(cannot_write(path, getattr(file, "error", None) or error)) from None
        raise


def cannot_write(path: Path, error: BaseException) -> str:
    kept = f"the previous {path.name} is intact" if path.exists() else f"no {path.name} was written"
    if not isinstance(error, OSError):  # not the disk: say what it was, without advice about room
        return f"cannot write {path} ({one_line(error)}); {kept}"
    try:
        free = f"; {shutil.disk_usage(path.parent).free / 1e6:.1f} MB free there"
    except OSError:
        free = ""
    return f"cannot write {path} ({error.strerror or one_line(error)}{free}): make room or write elsewhere; {kept}"


def atomic_torch_save(obj, path: Path) -> str:
    import torch  # here: predict --onnx writes its CSV without torch
    return atomic_write(path, lambda file: torch.save(obj, file))


def atomic_write_text(path: Path, text: str) -> str:
    # surrogateescape: file names that are not UTF-8 (read from disk that way) are written back as they were
    return atomic_write(path, lambda file: file.write(text.encode("utf-8", "surrogateescape")))


def probe_folder(folder: Path) -> None:
    """Make the folder and write and remove a file there, or raise OSError: os.access answers yes
    to root where nothing can be created, as in /proc."""
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def check_room(path: Path, size: int, flag: str) -> None:
    """Fail before the work, not after it, when the folder of `path` has no room for `size` bytes:
    they are written to a temporary file there and flushed to disk (where a file system allocates
    late, the write alone would succeed), then removed."""
    path = Path(path)
    try:
        with tempfile.TemporaryFile(dir=path.parent) as file:
            file.write(bytes(size))
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        raise UserError(f"{flag} {path}: no room for it ({error.strerror or one_line(error)}; about "
                        f"{size / 1e6:.1f} MB needed): make room or write elsewhere") from None


def check_can_write(path: Path, flag: str) -> None:
    """Fail before the work, not after it, when `path` cannot be written (probe_folder)."""
    path = Path(path)
    try:
        if path.is_dir():
            raise IsADirectoryError(21, "it is a folder")
        probe_folder(path.parent)
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write there ({error.strerror or one_line(error)})") from None
