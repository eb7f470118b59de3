"""What guards Ray Train's calls on train_ray.py's driver (`python train_ray.py`: the process that
connects to Ray and starts the run; the workers' side is src/ray_worker.py).

- Ray not installed: one line saying what to install (requirements-ray.txt), before any work.
- --address: a running cluster that does not answer is one line within ADDRESS_TIMEOUT seconds
  (ray.init itself retries for a minute or more); --num-workers larger than the CPUs (or GPUs)
  the cluster has is one line before anything starts, where Ray Train would wait for them for ever.
- SIGTERM, SIGUSR1 and SIGHUP to the driver (a scheduler's stop, a closed terminal) go to the
  workers through a small actor (RunControl): rank 0 reads it and raises its stop flag, and the
  ranks agree on the optimizer step as in every mode (src/stopping.py). Ctrl-C stays Ray Train's
  own: its handler aborts the run (the workers end; last.pth as last saved).
- How the run ended: rank 0's return value (train_loop_per_worker's), which Ray Train hands to
  the driver in its Result: finished, stopped (exit 75: rank 0 said where and how to go on) or
  bad input (the line, exit 2).
- A worker that stops answering (hung in a collective, stopped, swapped out) is named by the
  others' heartbeat (src/heartbeat.py), which ends the worker that says it: its line goes to
  RunControl too, and where Ray Train then gives up on the group (--max-failures spent) the
  driver ends with that line and exit 1 (EXIT_HUNG, as under torchrun), not with Ray's traceback
  of a dead actor. Within --max-failures Ray Train restarts the group from the last checkpoint.
"""
import contextlib
import importlib
import os
import signal
import socket
import sys
from pathlib import Path
from types import FrameType
from typing import Any, Iterator

from src.config import Config
from src.errors import EXIT_STOPPED, Stopped, UserError
from src.heartbeat import EXIT_HUNG

INSTALL = "pip install -r requirements-ray.txt"
ADDRESS_TIMEOUT = 10.0  # seconds to connect to --address's head before it is called unreachable
DRIVER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP)  # Ctrl-C (SIGINT) is Ray Train's own


# Ray Train's settings for train_ray.py, unless the environment says otherwise: the workers keep
# the working directory they start in (Ray Train would move them to its run folder, and relative
# paths such as --data-dir data would point elsewhere), and their print() stays print() (Ray
# Train reroutes it through a logger, which also printed each stderr line twice).
RAY_SETTINGS = {"RAY_CHDIR_TO_TRIAL_DIR": "0", "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}


def require_ray(found: bool) -> None:
    """Ray Train is an extra: without it, one line saying what to install; an installed one that
    failed as it imported (an error other than ImportError: versions that do not fit), one line
    naming the error. With it, RAY_SETTINGS (read by the driver, which passes the second on to
    the workers)."""
    if not found:
        try:  # again, for its error: a module that failed as it imported is not kept, and runs again
            importlib.import_module("ray.train.torch")
        except ImportError:
            pass
        except Exception as error:
            raise UserError(f"train_ray.py cannot import Ray Train ({type(error).__name__}: {error}): "
                            f"reinstall it in this environment: {INSTALL}") from None
        raise UserError(f"train_ray.py needs Ray Train, which is not installed in this environment: {INSTALL}")
    for name, value in RAY_SETTINGS.items():
        os.environ.setdefault(name, value)


def reachable(address: str | None) -> str | None:
    """--address as ray.init takes it, once its head answers: HOST:PORT (or ray://HOST:PORT, Ray
    Client's) is tried with a TCP connection and HTTP/2's preface (gRPC's) for ADDRESS_TIMEOUT
    seconds each; "auto" and None (a local instance, or RAY_ADDRESS's cluster) are Ray's to find."""
    if address in (None, "auto"):
        return address
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.strip("[]")
    if not host or not is_host_name(host) or not (port.isascii() and port.isdigit() and 0 < int(port) < 2**16):
        raise UserError(f"--address {address}: expected HOST:PORT of a Ray cluster's head (its GCS port, 6379 "
                        "by default), ray://HOST:PORT, or auto")
    try:
        with socket.create_connection((host, int(port)), timeout=ADDRESS_TIMEOUT) as connection:
            # A cluster with TLS (RAY_USE_TLS) answers a TLS handshake, not HTTP/2 in the clear.
            tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")
            first = None if tls else speaks_grpc(connection)
    except OSError as error:
        why = "no answer" if isinstance(error, TimeoutError) else error.strerror or type(error).__name__
        raise UserError(f"--address {address}: no Ray cluster answers there ({why} within {ADDRESS_TIMEOUT:g} s): "
                        "start one with `ray start --head` on that machine, or leave --address out for a local "
                        "Ray instance") from None
    if first is not None:  # ray.init would retry there for ever
        raise UserError(f"--address {address}: something listens there but not a Ray cluster's head ({first}): give "
                        "the port that `ray start --head` printed (the GCS's, 6379 by default; ray:// its client "
                        "server's, 10001)")
    return address


def is_host_name(host: str) -> bool:
    """Whether the socket library can look host up: IDNA encodes it (no empty label, as in
    head..example, and none over 63 characters)."""
    try:
        host.encode("idna")
    except UnicodeError:
        return False
    return True


# HTTP/2's client preface and an empty SETTINGS frame (RFC 9113, 3.4): a gRPC server, as Ray's GCS
# and its client server are, answers with a SETTINGS frame (type 4) of its own.
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def speaks_grpc(connection: socket.socket) -> str | None:
    """None if the server at the other end answers HTTP/2's preface with a SETTINGS frame; else
    what it did instead (within the connection's timeout)."""
    connection.sendall(HTTP2_PREFACE)
    head = b""
    try:
        while len(head) < 9 and (more := connection.recv(9 - len(head))):
            head += more
    except TimeoutError:
        return f"no HTTP/2 answer within {ADDRESS_TIMEOUT:g} s"
    except OSError as error:
        return f"it closed the connection: {error.strerror or type(error).__name__}"
    if len(head) < 9:
        return "it closed the connection" if not head else f"it answered {head!r}"
    return None if head[3] == 4 else f"it answered {head!r}"


def check_workers(num_workers: int, resources: dict) -> bool:
    """Whether the workers use GPUs (the cluster has some: ray.cluster_resources()), once
    --num-workers is no more than the cluster has: a worker takes one GPU, or one CPU without
    (ScalingConfig's defaults), and more than there are would wait for ever."""
    use_gpu = resources.get("GPU", 0) > 0
    kind = "GPU" if use_gpu else "CPU"
    have = int(resources.get(kind, 0))
    if num_workers > have:
        raise UserError(f"--num-workers {num_workers}: the Ray cluster has {have} {kind}(s), one per worker: "
                        f"ask for at most {have}, or add nodes to the cluster")
    return use_gpu


def storage_path(args: Config) -> str:
    """RunConfig's storage_path: --storage-path (a folder every node sees, or a URI such as
    s3://BUCKET/PATH), else the folder ray/ beside --checkpoint (absolute, as Ray Train wants it)."""
    if args.storage_path:
        return args.storage_path if "://" in args.storage_path else str(Path(args.storage_path).resolve())
    return str((Path(args.checkpoint).parent / "ray").resolve())


# The driver's side of a stop.

class RunControl:
    """A Ray actor between the driver and the workers: the stop signal the driver got (0: none),
    the worker groups Ray Train started (a group after the first is a restart), and the last line
    of a heartbeat that named a worker that stopped answering ("": none)."""

    def __init__(self) -> None:
        self.signal = 0
        self.groups = 0
        self.hang = ""

    def group_started(self) -> int:
        """Called once by each group's rank 0: the number of groups that started before it."""
        self.groups += 1
        return self.groups - 1

    def stop(self, number: int) -> None:
        self.signal = self.signal or number

    def requested(self) -> int:
        return self.signal

    def hung(self, line: str) -> None:
        self.hang = line

    def hang_said(self) -> str:
        return self.hang


@contextlib.contextmanager
def stops_to_workers(control: Any) -> Iterator[None]:
    """Within the block, SIGTERM, SIGUSR1 and SIGHUP to the driver ask the workers to stop at an
    optimizer step (through `control`, a RunControl actor) instead of ending the driver, which
    would take the workers with it; the handlers before come back when it ends."""
    def note(number: int, frame: FrameType | None) -> None:
        control.stop.remote(number)
    before = {number: signal.signal(number, note) for number in DRIVER_SIGNALS}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler)


@contextlib.contextmanager
def hangs_end_the_run(control: Any) -> Iterator[None]:
    """A run that fails (trainer.fit() raises: Ray Train gave up on the worker group) after a
    worker's heartbeat named one that stopped answering ends with the heartbeat's line (RunControl)
    on stderr and EXIT_HUNG; any other failure is raised as it is."""
    try:
        yield
    except Exception:
        import ray
        line = ray.get(control.hang_said.remote(), timeout=60)
        if not line:
            raise
        print(line, file=sys.stderr, flush=True)
        raise SystemExit(EXIT_HUNG) from None


def end_as_told(outcome: dict | None) -> None:
    """The driver ends as rank 0 says (train_loop_per_worker's return value): finished (None),
    stopped (EXIT_STOPPED: rank 0 said where and how to go on), bad input (exit 2, with its
    line, or quietly where another worker said it)."""
    if not outcome:
        return
    if outcome.get("exit") == EXIT_STOPPED:
        raise Stopped()
    raise UserError(outcome.get("error", ""), quiet="error" not in outcome)
