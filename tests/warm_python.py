"""A warm Python for the tests' one-process commands (`python train_single.py ...`,
`python -m src.tools.predict ...`): each runs in a fork of a process that has imported torch and
torchvision already, which every new process spends most of a small run on (3.7 s of a
SqueezeNet run's 5 s on a 2-core CPU, measured 2026-12-05).

Everything else is the command's own, as `python COMMAND` would have it: the script or module,
src, accelerate and the test hooks (tests/hooks, when PYTHONPATH names them) are imported in the
fork; sys.argv, sys.path, the environment, the folder, stdin (empty), stdout and stderr (pipes),
the signal handlers a new process would start with, and its end: the fork ends as Python does
(the threads waited for, the atexit handlers, the modules and objects torn down, the exit code;
killed by SIGINT after an uncaught KeyboardInterrupt), with the traceback Python would print.
What a fork cannot have of its own: the seed of str hashing (one per test worker) and what torch
and OpenMP read from the environment as they load, so a command whose environment differs from
the test worker's in those (OMP_*, TORCH_*, PYTHON* other than PYTHONPATH and PYTHONUNBUFFERED,
...) is started as a process of its own, as are the launchers and every process a test signals
(subprocess.Popen). A server whose imports printed anything (a warning a new process would print
too) is not used. WARM_PYTHON=0 turns it off.

Run as a script, this is the server: `python tests/warm_python.py SOCKET`.
"""
import atexit
import importlib.machinery
import io
import json
import locale
import os
import runpy
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import warnings

# Read as torch, OpenMP, the allocator or Python load: a command that sets them otherwise than the
# server had them needs a process of its own.
LOAD_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "ATEN_", "CUDA_", "NCCL_",
             "NPY_", "NUMPY_", "LD_", "MALLOC_", "GLIBC_", "LC_", "LANG", "TZ", "PYTHON")
# Read when the command runs: PYTHONPATH and PYTHONUNBUFFERED by the fork itself; inductor's cache
# folder as it compiles (torch sets it in the test worker at a first compile).
PER_COMMAND = ("PYTHONPATH", "PYTHONUNBUFFERED", "TORCHINDUCTOR_CACHE_DIR")


_STARTING_ENV = dict(os.environ)  # the test worker's, before any test changes it


def _load_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(LOAD_TIME) and k not in PER_COMMAND}


class Server:
    """The server process of one test worker, started at its first command."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="warm-python-")
        self.path = os.path.join(self.folder, "socket")
        self.env = {k: v for k, v in _STARTING_ENV.items() if k != "PYTHONPATH"}
        self.owner = os.getpid()
        self.process = subprocess.Popen([sys.executable, __file__, self.path], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        ready = b""
        if select.select([self.process.stdout], [], [], 120)[0]:
            ready = self.process.stdout.readline()
        if ready != b"ready\n":
            self.close()
            raise RuntimeError(f"the warm Python did not start: {ready[:3000]!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if os.getpid() != self.owner:
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def takes(self, command: list, env: dict) -> bool:
        """Whether `command` (with its full environment) can run in a fork of this server."""
        if self.process.poll() is not None:
            return False
        if len(command) < 2 or command[0] != sys.executable:
            return False
        if not (command[1] == "-m" and len(command) > 2 or command[1].endswith(".py")):
            return False
        return _load_time(env) == _load_time(self.env)

    def run(self, command: list, env: dict, cwd, timeout: float) -> subprocess.CompletedProcess:
        """subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout), in a fork of the server."""
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(self.path)
            request = json.dumps({"command": command, "env": env, "cwd": os.path.abspath(cwd)}).encode()
            socket.send_fds(connection, [request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        pid = _number(connection.recv(64))
        chunks = {out_r: [], err_r: []}
        readers = [threading.Thread(target=_read_all, args=(fd, chunks[fd]), daemon=True) for fd in chunks]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        connection.settimeout(timeout)
        try:
            code = _number(connection.recv(64))
        except socket.timeout:
            code = None
        finally:
            connection.close()
        for reader in readers:  # the output of processes the command left behind, too, as subprocess.run
            reader.join(max(0.0, deadline - time.monotonic()))
        if code is None or any(reader.is_alive() for reader in readers):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise subprocess.TimeoutExpired(command, timeout, b"".join(chunks[out_r]), b"".join(chunks[err_r]))
        stdout, stderr = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
        return subprocess.CompletedProcess(command, code, stdout, stderr)


def _number(reply: bytes) -> int:
    if not reply:
        raise RuntimeError("the warm Python ended during a command (tests/warm_python.py; WARM_PYTHON=0 "
                           "starts every command as a process of its own)")
    return int(reply)


def _read_all(fd: int, chunks: list) -> None:
    with open(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)


def _text(data: bytes) -> str:
    """As subprocess decodes a text=True command's output: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_server = None
_failed = None  # the test worker (pid) whose server could not start: it runs every command cold


def server() -> Server | None:
    """This test worker's server, started at the first call; None where none can start or
    WARM_PYTHON=0 says not to."""
    global _server, _failed
    if _failed == os.getpid() or os.environ.get("WARM_PYTHON") == "0":
        return None
    if _server is None or _server.owner != os.getpid():
        try:
            _server = Server()
        except (OSError, RuntimeError) as error:
            _failed = os.getpid()
            print(f"tests/warm_python.py: {error}; every command starts as a process of its own", file=sys.stderr)
            return None
    return _server


# The server and its forks.

def _serve(path: str) -> None:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the test worker
    # What a new process started by the test worker would start with.
    handlers = {number: signal.getsignal(number) for number in signal.valid_signals()
                if number not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(number) is not None}
    # A Ctrl-C of the test run reaches every process of its group: the server ends with its test
    # worker instead, without a traceback of its own (each fork gets Python's handler back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # The imports, with what they print kept: a new process would print it in the command's
    # output, a fork would not (nor a warning shown here once), so a server that printed is not used.
    printed = tempfile.TemporaryFile()
    saved = os.dup(2)
    os.dup2(printed.fileno(), 2)
    with warnings.catch_warnings(record=True) as shown:  # the filters a new process has
        import numpy  # noqa: F401
        import pandas  # noqa: F401
        import PIL.Image  # noqa: F401
        import torch  # noqa: F401
        import torchvision  # noqa: F401
    os.dup2(saved, 2)
    os.close(saved)
    printed.seek(0)
    text = printed.read()
    printed.close()
    text += "".join(f"{w.filename}:{w.lineno}: {w.message}\n" for w in shown).encode()
    if text:
        sys.stdout.buffer.write(b"printed at import: " + text.replace(b"\n", b" | ") + b"\n")
        sys.stdout.flush()
        return
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    base_path = sys.path[1:]  # without this file's folder
    streams = [(stream.encoding, stream.errors) for stream in (sys.stdout, sys.stderr)]
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # nobody reads the pipe after this line
    os.close(devnull)  # or every fork would inherit it
    while True:
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            listener.close()
            connection.close()
            # Out of every frame of the server: Python ends the fork as it ends a process.
            raise _command(request, fds, base_path, streams, handlers)
        for fd in fds:
            os.close(fd)
        try:
            connection.send(str(pid).encode())
        except OSError:
            pass
        _, status = os.waitpid(pid, 0)
        try:  # the test worker has gone when it timed out and killed the fork
            connection.send(str(os.waitstatus_to_exitcode(status)).encode())
        except OSError:
            pass
        connection.close()


def _command(request: dict, fds: list, base_path: list, streams: list, handlers: dict) -> BaseException:
    """In the fork: become `python COMMAND` and run it; returns what to raise to end as it would."""
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for number, handler in handlers.items():
            if number != signal.SIGINT:
                signal.signal(number, handler)
        if handlers.get(signal.SIGINT) != signal.SIG_IGN:  # Python's own, unless started with it ignored
            signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding=streams[0][0])
        for number, (name, (encoding, errors)) in enumerate(zip(("stdout", "stderr"), streams), start=1):
            raw = io.FileIO(number, "w", closefd=False)
            binary = raw if unbuffered else io.BufferedWriter(raw)
            stream = io.TextIOWrapper(binary, encoding=encoding, errors=errors,
                                      line_buffering=name == "stderr" and not unbuffered, write_through=unbuffered)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        command = request["command"][1:]
        sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's
        sys.argv = ["-m", *command[2:]] if command[0] == "-m" else list(command)
        # As Python starts: PYTHONPATH's folders, then site's sitecustomize (the test hooks), and
        # only then the command's folder first.
        sys.path[:] = [*(e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e), *base_path]
        site.execsitecustomize()
        sys.path.insert(0, os.getcwd() if command[0] == "-m" else os.path.dirname(os.path.realpath(command[0])))
    except BaseException:
        traceback.print_exc()
        return SystemExit(1)
    try:
        if command[0] == "-m":
            runpy._run_module_as_main(command[1])  # what `python -m` calls
        else:
            _run_script(os.path.abspath(command[0]))
        return SystemExit(0)
    except SystemExit as exit:
        return exit
    except BaseException as error:
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next  # the traceback from the command's own first frame, as Python prints it
        sys.excepthook(type(error), error.with_traceback(tb), tb)
        if isinstance(error, KeyboardInterrupt):
            # Python ends killed by SIGINT after an uncaught one, once it has done its exit work:
            # raised again, with the traceback printed already.
            sys.excepthook = lambda *_: None
            return error
        return SystemExit(1)


def _run_script(path: str) -> None:
    """Run the file as `python FILE` does: module __main__ with an absolute __file__, sys.argv as given."""
    main = sys.modules["__main__"]
    main.__dict__.update(__file__=path, __cached__=None, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    with open(path, "rb") as file:
        source = file.read()
    exec(compile(source, path, "exec"), main.__dict__)


if __name__ == "__main__":
    _serve(sys.argv[1])
