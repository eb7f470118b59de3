"""A Python that has imported torch, torchvision and pytest once and runs each pytest it is asked
for in a fork of itself: checks/mutations.py's runs of an entry's tests start in a fraction of a
second instead of the seconds of those imports (docs/measurements.md, "The mutation check").

Nothing of the project is imported here (src/, the scripts, the tests): the fork imports them
from the folder it runs in, after the entry's change was made there. The fork is a new process
group, set up as `python -m pytest ARGS` would be in that folder (its sys.path, its __main__,
the environment asked for), its output written to a log file; the server reports the fork's pid,
then its exit code, and then ends whatever the fork left running in its group.

Protocol, one JSON object per line: the client writes {"cwd", "args", "log", "env"}; the server
answers {"pid"} when the fork has started and {"code"} when it has ended (pytest's exit code;
-N for a signal N).
"""
import json
import os
import signal
import sys

# What tests/conftest.py sets before torch is imported, which matters only then (OpenMP reads its
# wait policy when torch loads it): set here before the imports below.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.dont_write_bytecode = True  # a changed file and its restored original may share a second and a size

import numpy  # noqa: E402,F401
import pandas  # noqa: E402,F401
import PIL.Image  # noqa: E402,F401
import pytest  # noqa: E402
import torch  # noqa: E402,F401
import torchvision  # noqa: E402,F401 (with its ops, torch._dynamo: the largest import)


def run_pytest(cwd: str, args: list[str], log: str, env: dict) -> None:
    """In the fork: become `python -m pytest ARGS` in cwd, writing to log; never returns."""
    code = 3
    try:
        os.setpgid(0, 0)
        os.chdir(cwd)
        output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(output, 1)
        os.dup2(output, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.environ.update(env)
        import importlib.util
        import types
        main = types.ModuleType("__main__")  # as `python -m pytest` has it (multiprocessing's spawn reads it)
        spec = importlib.util.find_spec("pytest.__main__")
        assert spec is not None and spec.origin is not None  # pytest is installed: it imported above
        main.__spec__, main.__file__ = spec, spec.origin
        sys.modules["__main__"] = main
        sys.path[0] = cwd  # python -m puts the current folder first, not this file's
        sys.argv = [main.__file__, *args]
        code = pytest.main(args)
    except BaseException as error:  # said in the log; the exit code tells the rest
        print(f"warm_pytest: {error!r}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(code))


def serve() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_pytest(request["cwd"], request["args"], request["log"], request.get("env", {}))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        try:
            os.killpg(pid, signal.SIGKILL)  # what the run left in its process group (a loader worker)
        except (ProcessLookupError, PermissionError):
            pass
        print(json.dumps({"code": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
