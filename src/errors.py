"""How a command ends: bad input with one line on stderr and exit code 2, never a traceback; a stop on a
signal with EXIT_STOPPED; the process group after an error."""
import gc
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Callable

from src.terminal import shown

# EX_TEMPFAIL (sysexits.h: "temporary failure, the user is invited to retry"): stopped on a signal
# after writing last.pth; the same command with --resume goes on (docs/reliability.md).
EXIT_STOPPED = 75
# SIGHUP: the terminal of the run was closed (or its SSH connection dropped). Its default action
# ended the run where it was, with no line and nothing saved; a user who closes the terminal of a
# run means it to stop, and a stop saves the step it reached (`nohup`, tmux or screen keep a run
# going past its terminal instead).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


class Stopped(Exception):
    """The run stopped at an optimizer step on a signal, last.pth saved there (src/stopping.py)."""


class UserError(Exception):
    """A problem the user can fix (a flag, a file, the data); the message says what to do.

    `quiet`: exit 2 without printing, for the ranks that share a problem with one that says it.
    """

    def __init__(self, message: str, quiet: bool = False):
        super().__init__(message)
        self.quiet = quiet


def one_line(error: BaseException) -> str:
    """The user's message, also when a DataLoader worker re-raised it with its traceback attached
    (then it follows the last "UserError: "); another error's last line. On one line, printable:
    control characters and bytes that are not UTF-8 (in the file names it quotes) are escaped
    (src.terminal.shown), so a name cannot split it, hide it or fail to print."""
    text = str(error)
    if "UserError: " in text:
        return shown(text.rsplit("UserError: ", 1)[-1].strip())
    if isinstance(error, UserError) and text.strip():
        return shown(text.strip())
    lines = [line for line in text.split("\n") if line.strip()]
    return shown(lines[-1].strip() if lines else type(error).__name__)


# Set by src.stopping's handler when a stop signal comes during a run (cleared as a run installs
# it): torchrun sends its SIGTERM once, and one that came while the run's steps still took it for
# a stop request does not come again.
signalled = False


def before_a_silent_exit() -> None:
    """Under a launcher, a rank other than 0 that ends without a word (rank 0 says why) waits for
    the launcher to stop it (at most a minute). torchrun stops every process once one has failed
    (SIGTERM, checking every 0.1 s): had this rank exited first, rank 0 could be stopped before it
    printed its line, and the user would see none. Not after a stop signal came during the run:
    the launcher has sent its SIGTERM already (a rank that waited for another was SIGKILLed after
    torchrun's 30 s, on a busy machine)."""
    if signalled:
        return
    if os.environ.get("RANK", "0") != "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(60)


# Pillow's warnings about odd data in real photos (corrupt EXIF, a palette's transparency, a large
# image), by the module that warns: ignored while a command runs, and in its loader workers. One
# filter for the command, not one around each image: every change of the filters resets Python's
# once-per-place registry of every warning (FSDP2's "returned a view tensor" was printed at every
# step of a run with --workers 0).
PILLOW = r"PIL\."


def ignore_pillow_warnings() -> None:
    """Pillow's warnings ignored from here on, in this process (a loader worker: its own)."""
    warnings.filterwarnings("ignore", module=PILLOW)


# What Ctrl-C outside a run's steps says by default: the training scripts' advice. Each tool
# passes its own (a tool has no --resume; its outputs are written whole or not at all).
INTERRUPTED = "interrupted: the files last saved are intact; rerun with --resume"


def run_command(main: Callable[[list[str] | None], None], argv: list[str] | None = None,
                interrupted: str = INTERRUPTED) -> int:
    """Run main(argv) as a command and return its exit code: 0; a UserError's line on stderr and
    2; a stop on a signal (src/stopping.py: rank 0 said where and how to go on) EXIT_STOPPED; Ctrl-C
    before training `interrupted` (what the command left and how to go on) and 130. A process
    group left by an error is ended. Nothing else of the process changes: main(argv) can run
    again in it (the warnings' filters are put back: ignore_pillow_warnings)."""
    try:
        with warnings.catch_warnings():
            ignore_pillow_warnings()
            main(argv)
        return 0
    except UserError as error:
        if error.quiet:
            before_a_silent_exit()
        else:
            tell_the_other_ranks()
            print(f"error: {one_line(error)}", file=sys.stderr)
        return 2
    except Stopped:
        leave_together()
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BaseException as error:  # a traceback to show: what its frames hold goes before the group
        traceback.clear_frames(error.__traceback__)
        if not isinstance(error, Exception) or not another_rank_said_why():
            raise
        before_a_silent_exit()
        return 2
    finally:
        mark_ended()  # for the stopped ranks waiting in leave_together, if another rank fails
        end_process_group()  # after an error (a run that ends well has ended it)


# A rank that ends on bad input in the middle of an epoch (an image that turned unreadable, met by
# its own loader) leaves the others inside a collective, which fails when its connections close
# (gloo: "Connection closed by peer", a traceback). So it leaves a note in the process group's
# store first (the launcher's, which outlives it), and a rank whose error comes with such a note
# from another ends without a word: the rank that knows has said it. PEER_NOTE_WAIT: how long a
# failed rank looks for the note (the failing rank writes it before it exits, but through another
# connection to the store); an error with no note after it is raised as it is.
PEER_NOTE = "failed on bad input/"
PEER_NOTE_WAIT = 5.0


def _group_store():
    """(store, rank, world size) of this process's group of two or more processes, else None. The
    store's keys carry the torchrun restart attempt, as src.process_group's stores do: torchrun's
    agent keeps its store across restarts, and a note or a mark of an earlier attempt must not
    count in this one (under accelerate, whose group's store has no attempt of its own)."""
    if sys.modules.get("torch") is None:
        return None
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        return dist.PrefixStore(f"attempt{attempt}", store), dist.get_rank(), dist.get_world_size()
    except (RuntimeError, ValueError):
        return None


def _leave_own_key(prefix: str) -> None:
    """Set `prefix` + this rank's number in the group's store (nothing without a group)."""
    group = _group_store()
    if group is None:
        return
    store, rank, _ = group
    try:
        store.set(f"{prefix}{rank}", "1")
    except Exception:  # the store is gone: nobody is left to read the key
        pass


def tell_the_other_ranks() -> None:
    """Leave the note that this rank ends on bad input and has said why (see PEER_NOTE)."""
    _leave_own_key(PEER_NOTE)


def another_rank_said_why() -> bool:
    """Whether another rank of the group left the note that it ended on bad input and said why."""
    group = _group_store()
    if group is None:
        return False
    store, rank, world_size = group
    keys = [f"{PEER_NOTE}{other}" for other in range(world_size) if other != rank]
    deadline = time.monotonic() + PEER_NOTE_WAIT
    try:
        while True:
            if any(store.check([key]) for key in keys):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
    except Exception:  # the store is gone with the rank that held it: nothing to go by
        return False


# A stop ends every rank with EXIT_STOPPED, which a launcher takes for a failure: torchrun sends
# SIGTERM to the ranks still running when the first one exits. Rank 0 ends last (it ends the
# tracked run, which waits for the store), and was killed there (-15): the tracked run left
# RUNNING. So each rank marks in the group's store that it has ended (a stop, or an error), and a
# stopped rank exits only once every rank has, or after LEAVE_WAIT seconds (a rank that died).
LEFT = "ended/"
LEAVE_WAIT = 300.0


def mark_ended() -> None:
    """Mark in the group's store that this rank has ended (see LEFT)."""
    _leave_own_key(LEFT)


def leave_together() -> None:
    """After a stop: wait until every rank of the group has ended (see LEFT)."""
    group = _group_store()
    if group is None:
        return
    store, rank, world_size = group
    mark_ended()
    _wait_for_the_others(store, rank, world_size, LEAVE_WAIT)


def _wait_for_the_others(store, rank: int, world_size: int, seconds: float) -> None:
    """Until every other rank of the group has marked its end in `store` (see LEFT), for at most
    `seconds`."""
    try:
        others = [f"{LEFT}{other}" for other in range(world_size) if other != rank]
        deadline = time.monotonic() + seconds
        while not all(store.check([key]) for key in others) and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # the store is gone with the launcher: nobody is left to be killed by it
        pass
    except KeyboardInterrupt:  # Ctrl-C again while waiting: what was saved stays, exit now
        pass


# Under Ray Train (and a group joined at tcp://) the group's store lives in rank 0's process, not
# in a launcher's: rank 0 ending its group after its note ended the store too, and a rank whose
# collective then failed found no store to read the note in, and raised that failure (a
# traceback; for Ray a failed worker). So the rank that said why keeps its store until every other
# rank has marked its end (it has read the note), for at most NOTE_READ_WAIT seconds.
NOTE_READ_WAIT = 30.0


def end_group_after_the_note() -> None:
    """end_process_group() for a rank that has said why (tell_the_other_ranks): its end marked, its
    store kept until the others have read the note (see NOTE_READ_WAIT)."""
    group = _group_store()
    mark_ended()
    end_process_group()
    if group is not None:
        store, rank, world_size = group
        _wait_for_the_others(store, rank, world_size, NOTE_READ_WAIT)


def end_process_group() -> None:
    """destroy_process_group() after an error, once what still held the group's tensors is freed:
    measured, gloo ranks can abort at exit when the model outlives the group."""
    if sys.modules.get("torch") is None:  # a command without torch (predict --onnx) has no process group
        return
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        end_loader_workers()
        gc.collect()
        dist.destroy_process_group()


def end_loader_workers() -> None:
    """End the workers of every loader iterator still alive, as freeing the iterator does. Before a
    garbage collection: one that frees an iterator held in a reference cycle (an error's traceback
    holds the training loop's frames) first runs the finalizers that close the iterator's queues,
    and its __del__ then sends a stop its workers never get and waits for each one twice 5 s
    (measured: a rank that met an unreadable image took 10 s more to end than one without workers)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    for found in gc.get_objects():
        # type(), not isinstance(): isinstance asks each object its __class__, and some of torch's
        # (the deprecated torch.distributed.reduce_op) warn when asked. One that failed to start
        # has no _shutdown: nothing to end.
        if issubclass(type(found), _MultiProcessingDataLoaderIter) and not getattr(found, "_shutdown", True):
            found._shutdown_workers()


def exit_on_error(main: Callable[[list[str] | None], None], interrupted: str = INTERRUPTED) -> None:
    """The command line's way to run main: run_command, then exit with its code (return on 0)."""
    code = run_command(main, interrupted=interrupted)
    if code == 0:
        return
    if code == EXIT_STOPPED and threading.current_thread() is threading.main_thread():
        # The stop signals are ignored, not caught, as the process ends: Python puts back the default
        # handlers as it finalises, and a launcher's SIGTERM to a rank that ends later than another
        # would kill it.
        for number in STOP_SIGNALS:
            signal.signal(number, signal.SIG_IGN)
    sys.exit(code)
