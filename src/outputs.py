"""The files a command writes: where they may go (checked at its start, before any work), one run
at a time in a folder, and each file written whole or not at all. No torch at import: predict
--onnx uses it.

- Written whole: to a temporary file in the target's folder, flushed to disk, then renamed onto
  the target. A crash or a full disk leaves the old file, never half a new one.
- Where: the rename replaces whatever the name holds, so an existing target must be a regular
  file: a device (/dev/null, /dev/full), a named pipe, a socket or a folder would be replaced by a
  file (as root, /dev/null turned into a PNG), and a symbolic link would be replaced itself, not
  the file it points to (/dev/stdout is a link). And no output may be an input of the same command
  (the checkpoint, an image, the data folder's files, the cache) or another output of the same run.
- One run at a time: two runs writing to one folder destroy each other (the second one's start-up
  cleanup deletes the first one's temporary file in the middle of a save, and each replaces the
  other's best.pth, last.pth and history). So rank 0 of a run holds a lock on LOCK_NAME in the
  --checkpoint folder for the run's life, and a second run there stops at its start with one line
  naming the first (pid, host, start time and command, which the holder writes into the file).
  The lock is a POSIX record lock (fcntl.lockf): the kernel drops it when the process ends however
  it ends (a SIGKILL, a crash, the OOM killer), so a killed run never leaves a stale lock, and the
  file that stays behind means nothing by itself. Not flock(): a flock lock belongs to the open
  file, which forked children share, so DataLoader workers that outlive a killed rank 0 by a few
  seconds would keep it and refuse torchrun's restart; a record lock belongs to the process alone.
  Advisory: it stops our own runs, not other programs; on NFS it needs the lock service (lockd).
"""
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import BinaryIO, cast

from src.config import Config
from src.errors import UserError, one_line

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


def input_problem(path: Path, folder: bool = False) -> str | None:
    """Why `path` cannot be read as a file a command reads (or, with `folder`, a folder), or None:
    "no such file" ("... or folder"), "a link to nothing", or what it is instead ("a named pipe
    (FIFO), not a regular file": opening a pipe waits for a writer, forever; a device; a folder).
    Links are followed."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symbolic link to nothing ({os.readlink(path)})"
        return "no such file or folder" if folder else "no such file"
    except OSError as error:  # a loop of links, a name too long, a folder that cannot be searched
        return error.strerror or one_line(error)
    if stat.S_ISREG(mode) or (folder and stat.S_ISDIR(mode)):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    return f"{kind}, not a regular file" + (" or folder" if folder else "")


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


def check_outputs(files: Sequence[Named], folders: Sequence[Named] = (), inputs: Sequence[Named] = (),
                  input_folders: Sequence[Named] = (), advice: str | None = None,
                  others: Sequence[Named] = ()) -> None:
    """Refuse, in one line, an output file or folder that exists as something else (a device, a
    pipe, a link, a file where a folder is meant), an output file that is another output (of
    `files` or `folders`) or one of the `inputs`, and any output inside one of the
    `input_folders` (a folder that is both, as --cache, aside). `others`: outputs that another
    part writes as it must (a tracker's store), held to the rules of another output's name and of
    the input folders. `advice`: what to do instead of a target that is not a regular file."""
    for flag, path in files:
        check_file_target(flag, path, *([advice] if advice else []))
    for flag, path in folders:
        check_folder_target(flag, path)
    by_path: dict[str, Named] = {}
    by_inode: dict[tuple[int, int], Named] = {}
    for what, path in inputs:
        real, inode = _identity(path)
        by_path.setdefault(real, (what, path))
        if inode is not None:
            by_inode.setdefault(inode, (what, path))
    seen: list[tuple[str, Path, str, tuple[int, int] | None]] = []
    for flag, path in [*files, *folders, *others]:
        real, inode = _identity(path)
        for other_flag, other, other_real, other_inode in seen:
            if real == other_real or (inode is not None and inode == other_inode):
                raise UserError(f"{flag} {path} is also where {other_flag} writes ({other}): give each "
                                "output its own name")
        seen.append((flag, path, real, inode))
        if (flag, path) in others:
            continue
        # A folder made where an input file is read, even one not there yet (train.csv), would
        # stop every later run that reads it.
        read = by_path.get(real) or (by_inode.get(inode) if inode is not None else None)
        if read is not None:
            raise UserError(f"{flag} {path} would replace {read[0]} ({read[1]}), which this command "
                            "reads: name another " + ("folder" if (flag, path) in folders else "file"))
    for flag, path in [*files, *folders, *others]:  # one rule for every output: none in a folder it reads
        for what, folder in input_folders:
            if what != flag and _inside(os.path.realpath(path), os.path.realpath(folder)):
                raise UserError(f"{flag} {path} is inside {what} ({folder}), which this command reads: "
                                "write elsewhere")


_UMASK = os.umask(0)
os.umask(_UMASK)


class _WriteRecorder:
    """A file that remembers why a write failed (torch.save reports that as a RuntimeError,
    "unexpected pos ...", without the errno, "No space left on device") and, where asked, hashes
    what is written."""

    def __init__(self, file: BinaryIO, hashed: bool):
        self.file: BinaryIO = file
        self.error: OSError | None = None
        self.sha256 = hashlib.sha256() if hashed else None

    def write(self, data: bytes) -> int:
        try:
            written = self.file.write(data)
        except OSError as error:
            self.error = error
            raise
        if self.sha256 is not None:
            self.sha256.update(data)
        return written

    def __getattr__(self, name: str):
        return getattr(self.file, name)


# A file name's bytes at most (NAME_MAX of Linux's file systems): a temporary name longer than
# that fails where the output's own name fits, after the work (a 249-byte --checkpoint lost an
# epoch at its first save). The random part mkstemp adds is 8 characters, then ".tmp".
NAME_MAX = 255
_TEMP_TAIL = len(".") + 8 + len(".tmp")


def temp_prefix(path: Path) -> str:
    """The start of the names of `path`'s temporary files, in its folder: `.NAME.` when that leaves
    room for the random part and ".tmp" within NAME_MAX bytes, else `.` + the name's first bytes +
    `~` + 8 hex of the whole name's sha256 + `.` (the same for the same name: a later run finds
    what a killed one left)."""
    name = os.fsencode(Path(path).name)
    room = NAME_MAX - _TEMP_TAIL - 2  # the leading and trailing dots
    if len(name) > room:
        name = name[:room - 9] + b"~" + hashlib.sha256(name).hexdigest()[:8].encode()
    return "." + os.fsdecode(name) + "."


def temporaries(path: Path) -> list[Path]:
    """The temporary files (or an export's folders) of `path` in its folder: what a write killed
    before its rename left. Matched by name, not glob: a name holding [ ] * ? is no pattern."""
    prefix, folder = temp_prefix(path), Path(path).parent
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return [folder / name for name in names if name.startswith(prefix) and name.endswith(".tmp")]


def atomic_write(path: Path, write: Callable[[BinaryIO], object], hashed: bool = False) -> str | None:
    """write(file) into a temporary file beside path, then rename it onto path: path holds the
    old or the new content, never half of one. `hashed`: returns the sha256 of what was written
    (None without: hashing a GB of checkpoint costs seconds that only a checked file repays).

    Any failure (a full disk, a folder that cannot be made) becomes a one-line UserError naming
    path; the old file stays.
    """
    path = Path(path)
    tmp = file = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temp_prefix(path), suffix=".tmp")
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes it private; outputs get the usual mode
        with os.fdopen(fd, "wb") as raw:
            file = _WriteRecorder(raw, hashed)
            write(cast(BinaryIO, file))  # a stand-in for the file: torch.save and write() call its write()
            raw.flush()
            os.fsync(raw.fileno())  # the data is on disk before the rename makes it the file
        os.replace(tmp, path)
        return file.sha256.hexdigest() if file.sha256 is not None else None
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


def atomic_torch_save(obj, path: Path, hashed: bool = False) -> str | None:
    import torch  # here: predict --onnx writes its CSV without torch
    return atomic_write(path, lambda file: torch.save(obj, file), hashed)


def atomic_write_text(path: Path, text: str) -> None:
    # surrogateescape: file names that are not UTF-8 (read from disk that way) are written back as they were
    atomic_write(path, lambda file: file.write(text.encode("utf-8", "surrogateescape")))


def probe_folder(folder: Path) -> None:
    """Make the folder and write and remove a file there, or raise OSError: os.access answers yes
    to root where nothing can be created, as in /proc. A file where a folder of the path should be
    is named (mkdir alone says "File exists")."""
    for above in [Path(folder), *Path(folder).parents]:
        if os.path.lexists(above):
            if not os.path.isdir(above):
                raise NotADirectoryError(errno.ENOTDIR, f"{above} is {kind_of(above) or 'a file'}, not a folder")
            break
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=folder):
        pass


def probe_names(path: Path) -> None:
    """Create and remove `path` (where nothing is there yet) and a temporary file of it, by the
    names atomic_write will use, or raise OSError: a name the file system refuses (too long, a
    byte it does not take) fails now, not after the work."""
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        os.unlink(path)
    fd, tmp = tempfile.mkstemp(dir=Path(path).parent, prefix=temp_prefix(path), suffix=".tmp")
    os.close(fd)
    os.unlink(tmp)


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
    """Fail before the work, not after it, when `path` cannot be written (probe_folder), or its
    name or its temporary file's cannot be made there (probe_names)."""
    path = Path(path)
    try:
        if os.path.isdir(path):  # False for a name too long to look up: probe_names says why
            raise IsADirectoryError(21, "it is a folder")
        probe_folder(path.parent)
        probe_names(path)
    except OSError as error:
        raise UserError(f"{flag} {path}: cannot write there ({error.strerror or one_line(error)})") from None


LOCK_NAME = ".run.lock"

class RunLock:
    """The lock on a folder (LOCK_NAME in it), held from hold() until release() (or the end of the
    process, however it ends). `held`: the descriptors of the locks this process holds (closing any
    other descriptor of a locked file would drop its lock: check_not_in_use must not open one)."""

    held: set[int] = set()

    def __init__(self, fd: int | None):
        self.fd: int | None = fd
        if fd is not None:
            RunLock.held.add(fd)

    def release(self) -> None:
        """Let go of the lock. (Closing any descriptor of the file drops a record lock too: this is
        the only one opened while holding.)"""
        if self.fd is not None:
            RunLock.held.discard(self.fd)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "RunLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def hold(folder: Path, flag: str = "--checkpoint") -> RunLock:
    """Lock `folder` (which exists) until the returned lock is released or the process ends, or
    refuse in one line naming the run that holds it."""
    path = Path(folder) / LOCK_NAME
    try:
        # O_NOFOLLOW: a link planted there must not make us truncate the file it points to.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as error:
        raise UserError(f"{flag} folder {folder}: cannot open its lock file {path} ({error.strerror}); "
                        "if it is a link or not a file, remove it") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(fd)
        if error.errno not in (errno.EACCES, errno.EAGAIN):
            raise UserError(f"{flag} folder {folder}: cannot lock {path} ({error.strerror})") from None
        raise UserError(f"{flag} folder {folder} is in use by another run ({holder(path)}): wait for it "
                        f"to end, or pass another {flag}") from None
    who = (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
           + " ".join(sys.argv))
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, who.encode("utf-8", "surrogateescape") + b"\n", 0)
    except OSError:  # a full disk: the lock holds all the same, without its note
        pass
    return RunLock(fd)


def holder(path: Path) -> str:
    """The note the holder of the lock file wrote: who it is."""
    try:
        with open(path, "rb") as file:
            note = file.read(1000).decode("utf-8", "replace").strip()
    except OSError:
        note = ""
    return note.splitlines()[0] if note else "it has not written its name yet"


def check_not_in_use(folder: Path, flag: str) -> None:
    """Refuse, in one line naming the run, a folder whose lock a running training holds: a tool
    writing there would race the run's saves (and the run's clean-up of temporary files). Only
    looks: a folder without a lock file is no run's, and none is made."""
    path = Path(folder) / LOCK_NAME
    if not os.path.isfile(path) or os.path.islink(path):
        return
    if any(os.path.samestat(os.fstat(fd), os.stat(path)) for fd in RunLock.held):
        return  # this process's own (closing another descriptor of it would drop the lock)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        # A shared lock conflicts with the holder's exclusive one, and needs read access only.
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as error:
        if error.errno in (errno.EACCES, errno.EAGAIN):
            raise UserError(f"{flag} {folder} is the folder of a training run in progress ({holder(path)}): "
                            "wait for it to end, or write elsewhere") from None
    finally:
        os.close(fd)  # drops the shared lock, if it was taken


def run_file(path: Path) -> str | None:
    """What of a training run the existing file `path` is ("a checkpoint (.pth)", ...), or None: a
    tool never writes over these, --overwrite or not (the next --resume, predict or export needs
    them): any .pth file, the .json beside one (best.json), history.json beside last.pth or a
    run's lock, the lock file."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    if path.name == LOCK_NAME:
        return "the lock file"
    if path.suffix == ".pth":
        return "a checkpoint (.pth)"
    if path.suffix == ".json" and path.with_suffix(".pth").exists():
        return f"the description of the checkpoint {path.with_suffix('.pth').name} beside it"
    if path.name == "history.json" and any((path.parent / name).exists() for name in ("last.pth", "last.dcp", LOCK_NAME)):
        return "the history"
    return None


def check_tool_output(flag: str, path: Path, ours: Callable[[Path], bool], what: str, overwrite: bool,
                      inputs: Sequence[Named] = (), advice: str = "name a new file or a regular one") -> None:
    """The one rule of the tools' output files (predict's CSV, export's ONNX file, the report),
    checked before any work:

    - nothing in the folder of a training run in progress (check_not_in_use);
    - never a device, pipe, socket, link or folder (before anything reads it: a named pipe would
      block the read), nor one of the command's `inputs` (check_outputs);
    - never a training run's files (run_file), --overwrite or not;
    - an existing regular file only if the tool wrote it (`ours(path)`: it is `what`, e.g. "a CSV
      of predict"), or with --overwrite (`overwrite`);
    - last, the folder and the exact names it will write can be made (check_can_write).
    """
    path = Path(path)
    if os.path.isdir(path):  # "cannot write there (it is a folder)", as for any output that cannot be written
        check_can_write(path, flag)
    # What can be seen without writing first: a refusal leaves the folder as it was.
    check_not_in_use(path.parent, flag)
    check_outputs([(flag, path)], inputs=inputs, advice=advice)
    found = run_file(path)
    if found is not None:
        raise UserError(f"{flag} {path} is {found} of a training run: the tools never write over a run's "
                        "files; name another file")
    if os.path.lexists(path) and not overwrite and not ours(path):
        raise UserError(f"{flag} {path} exists and is not {what}: name another file, or pass --overwrite "
                        "to replace it")
    check_can_write(path, flag)


def starts_with(path: Path, heads: tuple[bytes, ...]) -> bool:
    """Whether the file begins with one of `heads` (False where it cannot be read)."""
    try:
        with open(path, "rb") as file:
            begin = file.read(max(map(len, heads)))
    except OSError:
        return False
    return begin.startswith(heads)


def claim_folder(folder: Path, mark: str, writes: tuple[str, ...], tool: str, what: str, flag: str = "") -> None:
    """Make `folder` the tool's own, to write `writes` (names in it) and replace them later: refuse
    a path that is not a folder, or a folder holding any of `writes` without the tool's `mark`
    file (a folder of the user's, or of another tool), or one where a training run is in progress
    (in one of `writes` or a folder right below it: the tools' runs); then write the mark. What
    the tool wrote there before is then its own to replace or remove. The rule of the tools that
    own a whole folder (synthetic, benchmark, compare_recipes). `flag`: how the user named the
    folder ("--out-dir ")."""
    folder = Path(folder)
    if os.path.lexists(folder) and not folder.is_dir():
        raise UserError(f"{flag}{folder} exists and is not a folder: name a new folder for {what}")
    if folder.is_dir() and not (folder / mark).is_file():
        found = [name for name in writes if os.path.lexists(folder / name)]
        if found:
            raise UserError(f"{flag}{folder} holds {', '.join(found)}, which {tool} did not write (a folder of "
                            f"yours?): name a new or empty folder for {what}")
    for name in writes:
        inside = folder / name
        if inside.is_dir() and not inside.is_symlink():
            for sub in [inside, *sorted(p for p in inside.iterdir() if p.is_dir() and not p.is_symlink())]:
                check_not_in_use(sub, flag.strip() or "the folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / mark).write_text(f"written by python -m {tool}, which may rewrite this folder\n")
    except OSError as error:
        why = error.strerror or one_line(error)
        raise UserError(f"{flag}{folder}: cannot create it ({why})" if flag else
                        f"cannot write {what} to {folder} ({why}): name a folder where files can be written") from None


# How a message names each output of output_paths: the flag that places it.
OUTPUT_FLAGS = {"best": "--checkpoint", "info": "--checkpoint (its .json)", "last": "--checkpoint (last.pth beside it)",
                "history": "--checkpoint (history.json beside it)", "plot": "--plot"}


def output_paths(args: Config) -> dict[str, Path]:
    folder = Path(args.checkpoint).parent
    return {"best": Path(args.checkpoint), "info": Path(args.checkpoint).with_suffix(".json"),
            "last": folder / "last.pth", "history": folder / "history.json", "plot": Path(args.plot)}


@contextlib.contextmanager
def lock_outputs(args: Config) -> Iterator[None]:
    """A training run's outputs, checked before any work, and their folder locked for the run.

    Refuses outputs that are not regular files, or that are inputs or other outputs of the run,
    tries each folder (probe_folder), locks the --checkpoint folder until the block ends (hold),
    applies the rule of an earlier run's files there (_check_overwrite), and removes the temporary
    files that a killed run of these outputs left behind. Rank 0 checks and holds the lock; every
    rank gets its verdict. Under --evaluate, which writes nothing, it does nothing (a save in
    progress in the folder is left alone).
    """
    held = []
    if not args.evaluate:
        from src.ranks import from_rank_0  # here: it loads torch.distributed
        from_rank_0(lambda: held.append(_try_outputs(args)))
    try:
        yield
    finally:
        for lock in held:
            lock.release()


def _try_outputs(args: Config) -> RunLock:
    paths = output_paths(args)
    data = Path(args.data_dir)
    weights = [] if args.weights in ("default", "none") else [("--weights", Path(args.weights))]
    from src.tracking import store_outputs  # here: a tracker's store is an output of the run too
    check_outputs([(OUTPUT_FLAGS[name], path) for name, path in paths.items()],
                  folders=[(flag, Path(folder)) for flag, folder in (("--log-dir", args.log_dir), ("--cache", args.cache))
                           if folder],
                  inputs=[("--data-dir's train.csv", data / "train.csv"), *weights],
                  # test/: predict's images (a plot there would be classified as one)
                  input_folders=[("--data-dir's train/", data / "train"), ("--data-dir's test/", data / "test")]
                  + ([("--val-dir", Path(args.val_dir))] if args.val_dir else [])
                  + ([("--cache", Path(args.cache))] if args.cache else []),
                  others=store_outputs(args))
    check_run_outputs(paths)  # before anything is made: a refusal leaves every folder as it was
    from src import sharded_checkpoint  # here: it loads torch
    sharded_checkpoint.check_ours(sharded_checkpoint.folder_of(args))  # FSDP's folders: a user's is never replaced
    if args.profile:
        from src.profiling import check_profile_folder  # here: it loads torch
        check_profile_folder(args)
    for name, path in paths.items():
        flag = "--plot" if name == "plot" else "--checkpoint"
        try:
            probe_folder(path.parent)
        except OSError as error:
            raise UserError(f"{flag}: cannot write to folder {path.parent} ({error.strerror})") from None
    lock = hold(paths["best"].parent)  # before the clean-up below: another run's temporary files are not stale
    try:
        _check_overwrite(args, paths)
        for name, path in paths.items():
            try:  # the names the saves will use, temporary ones included (temp_prefix); in the folder we hold
                probe_names(path)
            except OSError as error:
                flag = "--plot" if name == "plot" else "--checkpoint"
                raise UserError(f"{flag} {path}: cannot make a file of that name there ({error.strerror})") from None
    except BaseException:
        lock.release()
        raise
    for path in paths.values():
        for stale in temporaries(path):  # from a run killed while saving
            stale.unlink(missing_ok=True)
    sharded_checkpoint.repair(sharded_checkpoint.folder_of(args))  # FSDP's last.dcp, after a crash in a save
    return lock


# What each output of a run is, for the line that refuses a file in its place that is not one.
RUN_OUTPUTS = {"best": "a checkpoint of a training run (a .pth file, or one its .json describes)",
               "info": "the description of a run's checkpoint (a best.json)",
               "last": "a run's last.pth", "history": "a run's history (a JSON list of records)",
               "plot": "a plot of a training run (src/plot.py marks the PNGs it writes)"}


def check_run_outputs(paths: dict[str, Path]) -> None:
    """Refuse, in one line, an existing file at an output of a training run (output_paths) that
    is not that output of an earlier run: --plot notes.txt, --plot data/test/1.jpg or --checkpoint
    naming a file of the user's. A run replaces only what an earlier run wrote (and the files
    beside --checkpoint only with --resume or --overwrite: _check_overwrite); --overwrite replaces
    an earlier run, never another file. What is a run's file: src.outputs.run_file's rule (any
    .pth file, the .json beside one), or the content a run writes there. Only looks."""
    for name, path in paths.items():
        if os.path.lexists(path) and not _is_run_output(name, path):
            flag = OUTPUT_FLAGS[name]
            raise UserError(f"{flag} {path} exists and is not {RUN_OUTPUTS[name]}: a run replaces only an earlier "
                            f"run's files, --overwrite or not; move it away, or name another file with {flag.split()[0]}")


def _is_run_output(name: str, path: Path) -> bool:
    """Whether the existing file `path` at the output `name` of output_paths is one a run wrote there."""
    if name == "plot":
        from src.plot import is_plot  # here: it loads matplotlib
        return is_plot(path)
    if run_file(path) is not None:  # a .pth file (best, last), the .json beside one, history.json beside last.pth
        return True
    if name == "history":
        records = _json(path)
        return isinstance(records, list) and all(isinstance(record, dict) for record in records)
    if name == "info":
        info = _json(path)
        return isinstance(info, dict) and isinstance(info.get("sha256"), str)
    if name == "best":  # a checkpoint not named .pth: ours where the .json beside it holds its digest
        info = _json(path.with_suffix(".json"))
        try:
            return isinstance(info, dict) and info.get("sha256") == sha256_of(path)
        except OSError:
            return False
    return False


def _json(path: Path):
    """The JSON value in the file, None where there is none (not a regular file, not JSON)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        with open(path, "rb") as file:
            return json.loads(file.read())
    except (OSError, ValueError):
        return None


def sha256_of(path: Path) -> str:
    """The file's sha256 (hex), read in blocks; OSError where it cannot be read."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check_overwrite(args: Config, paths: dict[str, Path]) -> None:
    """A new run does not replace an earlier run's files without being told: --resume continues
    that run (from its last.pth: a folder of best.pth and history.json alone has nothing to go on
    from, and a new run would replace them), --overwrite replaces it. (torchrun's restarted
    workers and requeued SLURM jobs resume on their own.)"""
    from src import sharded_checkpoint
    from src.ranks import restarted
    if restarted():
        return
    shards = sharded_checkpoint.folder_of(args)  # FSDP's last: a folder (or, after a crash in a save, the one before)
    held = [paths[name] for name in ("best", "info", "last", "history") if os.path.lexists(paths[name])]
    held += [shards] if sharded_checkpoint.whole_folder(shards) else []
    if args.overwrite:
        # The earlier run's resumable state goes now: a restart of this run must not resume it.
        paths["last"].unlink(missing_ok=True)
        sharded_checkpoint.remove(shards)
        return
    if not held or (args.resume and (paths["last"] in held or shards in held)):
        return
    try:
        epochs = f" of {len(json.loads(paths['history'].read_text()))} epoch(s)"
    except (OSError, ValueError, TypeError):
        epochs = ""
    names = ", ".join(path.name for path in held) + (epochs if paths["history"] in held else "")
    if args.resume:
        raise UserError(f"--resume: {paths['best'].parent} holds no last.pth to go on from, only the files of an "
                        f"earlier run ({names}): pass --overwrite to start a new run there, replacing them, or "
                        "another --checkpoint")
    raise UserError(f"{paths['best'].parent} holds the files of an earlier run ({names}): pass --resume to "
                    "continue that run, --overwrite to replace it, or another --checkpoint")
