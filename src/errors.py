"""Bad input ends a run with one line on stderr and exit code 2, never a traceback."""
import os
import signal
import sys
import threading
import time
from typing import Callable

from src.terminal import shown

# EX_TEMPFAIL (sysexits.h: "temporary failure, the user is invited to retry"): stopped on a signal
# after writing last.pth; the same command with --resume goes on (docs/reliability.md).
EXIT_STOPPED = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


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


def before_a_silent_exit() -> None:
    """Under a launcher, a rank other than 0 that ends without a word (rank 0 says why) waits for
    the launcher to stop it (at most a minute). torchrun stops every process once one has failed
    (SIGTERM, checking every 0.1 s): had this rank exited first, rank 0 could be stopped before it
    printed its line, and the user would see none."""
    if os.environ.get("RANK", "0") != "0" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(60)


# What Ctrl-C outside a run's steps says by default: the training scripts' advice. Each tool
# passes its own (a tool has no --resume; its outputs are written whole or not at all).
INTERRUPTED = "interrupted: the files last saved are intact; rerun with --resume"


def exit_on_error(main: Callable[[], None], interrupted: str = INTERRUPTED) -> None:
    """Run `main`; a UserError becomes `error: ...` and exit 2, a stop on a signal (src/stopping.py)
    exit EXIT_STOPPED, Ctrl-C before training exit 130 with the line `interrupted` (what the
    command left and how to go on). The handlers of the stop signals that `main` set are put back
    (a run inside a test process), unless it stopped on one."""
    handlers, stopped = {number: signal.getsignal(number) for number in STOP_SIGNALS}, False
    try:
        try:
            main()
        except Stopped:
            stopped = True
            raise
        finally:  # first: a launcher's SIGTERM ends a rank that waits below, as before the run
            if not stopped and threading.current_thread() is threading.main_thread():
                for number, handler in handlers.items():
                    signal.signal(number, handler)
    except UserError as error:
        if error.quiet:
            before_a_silent_exit()
        else:
            print(f"error: {one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except Stopped:  # rank 0 said where and how to go on
        # Ignored, not caught, as the process ends: Python puts back the default handlers as it
        # finalises, and a launcher's SIGTERM to a rank that ends later than another would kill it.
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                signal.signal(number, signal.SIG_IGN)
        sys.exit(EXIT_STOPPED)
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        sys.exit(130)
