"""Where a command writes, checked at its start, before any work (no torch: predict --onnx uses it).

Every output file is written to a temporary file beside it and renamed onto its name
(src/atomic.py), which replaces whatever the name holds. So an existing target must be a regular
file: a device (/dev/null, /dev/full), a named pipe, a socket or a folder would be replaced by a
file (as root, /dev/null turned into a PNG), and a symbolic link would be replaced itself, not
the file it points to (/dev/stdout is a link). And no output may be an input of the same command
(the checkpoint, an image, the data folder's files, the cache) or another output of the same run.
"""
import os
import stat
from pathlib import Path

from src.errors import UserError

Named = tuple[str, Path]  # (how the user names it: a flag, or what it is; the path)

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"))


def kind_of(path: Path) -> str | None:
    """What an existing path that is not a regular file is ("a folder", "a symbolic link to X",
    ...); None for a regular file or nothing."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # nothing there (or a parent that is not a folder: the folder probe says so)
        return None
    if stat.S_ISLNK(mode):
        return f"a symbolic link to {os.readlink(path)}"
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_file_target(flag: str, path: Path, advice: str = "name a new file, or a regular file to replace") -> None:
    """Refuse an existing `path` that is not a regular file (see the module's docstring)."""
    kind = kind_of(path)
    if kind is not None:
        why = ("the output would replace the link, not its target" if kind.startswith("a symbolic link")
               else "the output would replace it with a file")
        raise UserError(f"{flag} {path} is {kind}, not a regular file ({why}): {advice}")


def check_folder_target(flag: str, path: Path) -> None:
    """Refuse an existing `path` that is not a folder (nor a link to one)."""
    if os.path.lexists(path) and not os.path.isdir(path):
        kind = kind_of(path) or "a file"
        raise UserError(f"{flag} {path} is {kind}, not a folder: name a new folder or an existing one")


def _identity(path: Path) -> tuple[str, tuple[int, int] | None]:
    """The path with links and `..` resolved, and the (device, inode) of what it names, if it exists:
    two names of one file (a hard link, a bind mount) share the second."""
    try:
        info = os.stat(path)
        inode = (info.st_dev, info.st_ino)
    except OSError:
        inode = None
    return os.path.realpath(path), inode


def _inside(real: str, folder_real: str) -> bool:
    return real == folder_real or real.startswith(folder_real.rstrip(os.sep) + os.sep)


def check_outputs(files: list[Named], folders: list[Named] = (), inputs: list[Named] = (),
                  input_folders: list[Named] = (), advice: str | None = None) -> None:
    """Refuse, in one line, an output file or folder that exists as something else (a device, a
    pipe, a link, a file where a folder is meant), an output file that is another output (of
    `files` or `folders`), one of the `inputs`, or inside one of the `input_folders`. `advice`:
    what to do instead of a target that is not a regular file."""
    for flag, path in files:
        check_file_target(flag, path, *([advice] if advice else []))
    for flag, path in folders:
        check_folder_target(flag, path)
    by_path, by_inode = {}, {}
    for what, path in inputs:
        real, inode = _identity(path)
        by_path.setdefault(real, (what, path))
        if inode is not None:
            by_inode.setdefault(inode, (what, path))
    seen = []
    for flag, path in [*files, *folders]:
        real, inode = _identity(path)
        for other_flag, other, other_real, other_inode in seen:
            if real == other_real or (inode is not None and inode == other_inode):
                raise UserError(f"{flag} {path} is also where {other_flag} writes ({other}): give each "
                                "output its own name")
        seen.append((flag, path, real, inode))
        if (flag, path) in folders:
            continue
        read = by_path.get(real) or (by_inode.get(inode) if inode is not None else None)
        if read is not None:
            raise UserError(f"{flag} {path} would replace {read[0]} ({read[1]}), which this command "
                            "reads: name another file")
        for what, folder in input_folders:
            if _inside(real, os.path.realpath(folder)):
                raise UserError(f"{flag} {path} is inside {what} ({folder}), which this command reads: "
                                "write elsewhere")
