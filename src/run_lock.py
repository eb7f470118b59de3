"""One training run at a time in an output folder.

Two runs writing to one folder destroy each other: the second one's start-up cleanup deletes the
first one's temporary file in the middle of a save, and each replaces the other's best.pth,
last.pth and history. So rank 0 of a run holds a lock on LOCK_NAME in the --checkpoint folder
for the run's life, and a second run there stops at its start with one line naming the first
(pid, host, start time and command, which the holder writes into the file).

The lock is a POSIX record lock (fcntl.lockf): the kernel drops it when the process ends however
it ends (a SIGKILL, a crash, the OOM killer), so a killed run never leaves a stale lock, and the
file that stays behind means nothing by itself. Not flock(): a flock lock belongs to the open file,
which forked children share, so DataLoader workers that outlive a killed rank 0 by a few seconds
would keep it and refuse torchrun's restart; a record lock belongs to the process alone. Advisory:
it stops our own runs, not other programs; on NFS it needs the lock service (lockd), as any lock.
"""
import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

from src.errors import UserError

LOCK_NAME = ".run.lock"

_held: int | None = None  # the descriptor of the lock file this process holds


def release() -> None:
    """Let go of the lock this process holds, if any. (Closing any descriptor of the file would
    drop a record lock too: the lock's descriptor is the only one this module opens while holding.)"""
    global _held
    if _held is not None:
        os.close(_held)
        _held = None


def hold(folder: Path, flag: str = "--checkpoint") -> None:
    """Lock `folder` (which exists) for this process until it ends, or refuse in one line naming
    the run that holds it. A process holds one folder at a time: a new hold() releases the last
    (a test may run several trainings in one process, one after the other)."""
    global _held
    release()
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
    _held = fd
    who = (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
           + " ".join(sys.argv))
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, who.encode("utf-8", "surrogateescape") + b"\n", 0)
    except OSError:  # a full disk: the lock holds all the same, without its note
        pass


def holder(path: Path) -> str:
    """The note the holder of the lock file wrote: who it is."""
    try:
        with open(path, "rb") as file:
            note = file.read(1000).decode("utf-8", "replace").strip()
    except OSError:
        note = ""
    return note.splitlines()[0] if note else "it has not written its name yet"
