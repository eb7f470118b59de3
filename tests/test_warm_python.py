"""tests/warm_python.py: a command run in a fork of the warm Python ends as the same command run
as a process of its own: the same exit code, stdout and stderr, for every way a script ends
(its threads, atexit handlers and objects' teardown included), with its arguments, folder,
environment, stdin, signal handlers, sys.path and the test hooks."""
import os
import subprocess
import sys
import time

import pytest
import warm_python
from conftest import HOOKS

PROBE = '''
import atexit, os, signal, sys, threading, time
print("argv", sys.argv, "file", __file__, "name", __name__)
print("cwd", os.getcwd(), "path", sys.path[:2])
print("env", os.environ.get("PROBE"), os.environ.get("PYTHONPATH"))
print("handlers", signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN)
print("hooks", "sitecustomize" in sys.modules, "src" in sys.modules, "stdin", repr(sys.stdin.read()))
print("to stderr, é", file=sys.stderr)
atexit.register(lambda: print("atexit ran"))


class TornDown:
    def __del__(self):
        print("torn down", file=sys.stderr)


kept = TornDown()  # until Python tears __main__ down at exit
threading.Thread(target=lambda: (time.sleep(0.2), print("the thread ended"))).start()
end = os.environ["PROBE_END"]
if end == "exit 3":
    sys.exit(3)
if end == "exit text":
    sys.exit("a message")
if end == "raise":
    def inner():
        raise ValueError("probe")
    inner()
if end == "ctrl-c":
    raise KeyboardInterrupt
if end == "kill":
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
'''


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(PROBE)
    (folder / "mod").mkdir()
    (folder / "mod" / "__init__.py").write_text("")
    (folder / "mod" / "probe.py").write_text(PROBE)
    return folder


def _both(command, env, cwd):
    env = {**os.environ, **env}
    cold = subprocess.run(command, env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=60)
    server = warm_python.server()
    assert server is not None and server.takes(command, env)
    warm = server.run(command, env, cwd, 60)
    return warm, cold


@pytest.mark.parametrize("end", ["none", "exit 3", "exit text", "raise", "ctrl-c", "kill"])
@pytest.mark.parametrize("how", ["script", "module"])
def test_a_warm_run_ends_as_a_process_of_its_own(probe, end, how):
    command = ([sys.executable, "probe.py", "--flag", "a b"] if how == "script"
               else [sys.executable, "-m", "mod.probe", "--flag", "a b"])
    warm, cold = _both(command, {"PROBE": "x", "PROBE_END": end, "PYTHONPATH": HOOKS}, probe)
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.returncode == {"none": 0, "exit 3": 3, "exit text": 1, "raise": 1, "ctrl-c": -2, "kill": -15}[end]
    assert "env x " + HOOKS in cold.stdout and "hooks True False stdin ''" in cold.stdout
    assert "handlers True True True" in cold.stdout and "to stderr, é" in cold.stderr
    assert ("atexit ran" in cold.stdout) == ("the thread ended" in cold.stdout) == ("torn down" in cold.stderr) == (end != "kill")


def test_a_command_that_changes_how_torch_loads_gets_a_process_of_its_own(probe):
    server = warm_python.server()
    command = [sys.executable, "probe.py"]
    assert server.takes(command, {**os.environ, "PYTHONPATH": HOOKS, "WRITE_LOG": "x"})
    for changed in ({"OMP_NUM_THREADS": "1"}, {"TORCH_LOGS": "+dynamo"}, {"PYTHONHASHSEED": "0"}):
        assert not server.takes(command, {**os.environ, **changed}), changed
    assert not server.takes(["torchrun", "train_ddp.py"], dict(os.environ))
    assert not server.takes([sys.executable, "-c", "pass"], dict(os.environ))


def test_a_warm_run_past_its_timeout_is_killed(probe):
    server = warm_python.server()
    (probe / "slow.py").write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        server.run([sys.executable, "slow.py"], dict(os.environ), probe, 2)
    assert time.monotonic() - start < 10 and b"started" in expired.value.output
    # and the server goes on serving
    assert server.run([sys.executable, "-m", "mod.probe"], {**os.environ, "PROBE_END": "none"}, probe, 60).returncode == 0
