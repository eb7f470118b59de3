"""A warm Python for the tests' one-process commands (`python train_single.py ...`,
`python -m src.tools.predict ...`): each runs in a fork of a process that has imported torch and
torchvision already, which every new process spends most of a small run on (3.7 s of a
SqueezeNet run's 5 s on a 2-core CPU, measured 2026-12-05).

Everything else is the command's own, as `python COMMAND` would have it: the script or module,
src, accelerate and the test hooks (tests/hooks, when PYTHONPATH names them) are imported in the
fork; sys.argv, sys.path, the environment, the folder, stdin (empty), stdout and stderr (pipes),
the signal handlers Python starts with, the exit code (SystemExit, 1 after an uncaught exception
with its traceback, killed by SIGINT after an uncaught KeyboardInterrupt), the wait for the
threads and the atexit handlers at the end. What a fork cannot have of its own: the seed of str
hashing (one per test worker) and what torch and OpenMP read from the environment as they load,
so a command whose environment differs from the test worker's in those (OMP_*, TORCH_*, PYTHON*
other than PYTHONPATH and PYTHONUNBUFFERED, ...) is started as a process of its own, as are the
launchers and every process a test signals (subprocess.Popen). WARM_PYTHON=0 turns it off.

Run as a script, this is the server: `python tests/warm_python.py SOCKET`.
"""
import atexit
import importlib.machinery
import io
import json
import locale
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types

# Read as torch, OpenMP, the allocator or Python load: a command that sets them otherwise than the
# server had them needs a process of its own.
LOAD_TIME = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_", "NCCL_", "LD_",
             "MALLOC_", "LC_", "LANG", "PYTHON")
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
        self.process = subprocess.Popen([sys.executable, __file__, self.path], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        ready = self.process.stdout.readline()
        if ready != b"ready\n":
            raise RuntimeError(f"the warm Python did not start: {ready!r}")
        self.owner = os.getpid()
        atexit.register(self.close)

    def close(self) -> None:
        if os.getpid() == self.owner and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        if os.getpid() == self.owner:
            shutil.rmtree(self.folder, ignore_errors=True)

    def takes(self, command: list, env: dict) -> bool:
        """Whether `command` (with its full environment) can run in a fork of this server."""
        if os.environ.get("WARM_PYTHON") == "0" or self.process.poll() is not None:
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
            request = json.dumps({"command": command, "env": env, "cwd": os.fspath(cwd)}).encode()
            socket.send_fds(connection, [request], [null, out_w, err_w])
        finally:
            for fd in (null, out_w, err_w):
                os.close(fd)
        pid = int(connection.recv(64))
        chunks = {out_r: [], err_r: []}
        readers = [threading.Thread(target=_read_all, args=(fd, chunks[fd]), daemon=True) for fd in chunks]
        for reader in readers:
            reader.start()
        deadline = time.monotonic() + timeout
        connection.settimeout(timeout)
        try:
            code = int(connection.recv(64))
        except (socket.timeout, ValueError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            for reader in readers:
                reader.join(5)
            stdout, stderr = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
        finally:
            connection.close()
        for reader in readers:
            reader.join(max(1.0, deadline - time.monotonic()))
        stdout, stderr = (_text(b"".join(chunks[fd])) for fd in (out_r, err_r))
        return subprocess.CompletedProcess(command, code, stdout, stderr)


def _read_all(fd: int, chunks: list) -> None:
    with open(fd, "rb", buffering=0) as pipe:
        while chunk := pipe.read(1 << 16):
            chunks.append(chunk)


def _text(data: bytes) -> str:
    """As subprocess decodes a text=True command's output: the locale's encoding, universal newlines."""
    return data.decode(locale.getpreferredencoding(False)).replace("\r\n", "\n").replace("\r", "\n")


_server = None


def server() -> Server | None:
    """This test worker's server, started at the first call; None where none can start."""
    global _server
    if _server is None or _server.owner != os.getpid():
        try:
            _server = Server()
        except (OSError, RuntimeError):
            return None
    return _server


# The server and its forks.

def _serve(path: str) -> None:
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: end with the test worker
    # A Ctrl-C of the test run reaches every process of its group: the server ends with its test
    # worker instead, without a traceback of its own (each fork gets Python's handler back).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import numpy  # noqa: F401
    import pandas  # noqa: F401
    import PIL.Image  # noqa: F401
    import torch  # noqa: F401
    import torchvision  # noqa: F401
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    base_path = sys.path[1:]  # without this file's folder
    streams = [(stream.encoding, stream.errors) for stream in (sys.stdout, sys.stderr)]
    sys.stdout.buffer.write(b"ready\n")
    sys.stdout.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads the pipe after this line
    while True:
        connection, _ = listener.accept()
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
        request = json.loads(message)
        pid = os.fork()
        if pid == 0:
            listener.close()
            connection.close()
            _command(request, fds, base_path, streams)  # does not return
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


def _command(request: dict, fds: list, base_path: list, streams: list) -> None:
    """In the fork: become `python COMMAND` and run it; exit as it would."""
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGQUIT,
                       signal.SIGALRM, signal.SIGCHLD):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as Python starts
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
        extra = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
        first = os.getcwd() if command[0] == "-m" else os.path.dirname(os.path.abspath(command[0]))
        sys.path[:] = [first, *extra, *base_path]
        if any(os.path.exists(os.path.join(entry, "sitecustomize.py")) for entry in extra):
            import sitecustomize  # noqa: F401 (the test hooks, as Python's site imports them at start)
        sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's
        try:
            if command[0] == "-m":
                sys.argv = ["-m", *command[2:]]
                runpy._run_module_as_main(command[1])  # what `python -m` calls
            else:
                sys.argv = list(command)
                _run_script(os.path.abspath(command[0]))
            code = 0
        except SystemExit as exit:
            if exit.code is None:
                code = 0
            elif isinstance(exit.code, int):
                code = exit.code
            else:
                print(exit.code, file=sys.stderr)
                code = 1
        except BaseException as error:
            tb = error.__traceback__
            while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                tb = tb.tb_next  # the traceback from the command's own first frame, as Python prints it
            sys.excepthook(type(error), error.with_traceback(tb), tb)
            if isinstance(error, KeyboardInterrupt):  # Python ends killed by SIGINT, after its exit work
                _finish()
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            code = 1
        _finish()
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _run_script(path: str) -> None:
    """Run the file as `python FILE` does: module __main__ with an absolute __file__, sys.argv as given."""
    main = sys.modules["__main__"]
    main.__dict__.update(__file__=path, __cached__=None, __spec__=None, __package__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    with open(path, "rb") as file:
        source = file.read()
    exec(compile(source, path, "exec"), main.__dict__)


def _finish() -> None:
    """What Python does at exit: wait for the threads, run the atexit handlers, flush."""
    try:
        threading._shutdown()
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass


if __name__ == "__main__":
    _serve(sys.argv[1])
