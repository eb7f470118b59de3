"""What the tools share: running a training script as a user would."""
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable

from src.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the repository: the scripts run from there


def run_script(name: str, command: list[str], out: Path, env: dict | None = None,
               watch: Callable[[int], None] | None = None, every: float = 0.25) -> str:
    """Run `command` from the repository root with this Python's folder first on PATH (torchrun,
    accelerate), keep its output in out/log.txt, and fail in one line naming that log; its
    standard output. `watch(pid)`, if given, is called every `every` seconds while it runs."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            while True:
                try:  # communicate() again after its timeout loses no output
                    stdout, stderr = process.communicate(timeout=None if watch is None else every)
                    break
                except subprocess.TimeoutExpired:
                    if watch is not None:
                        watch(process.pid)
        except BaseException:  # Ctrl-C, an error in watch(): the command does not outlive this one
            process.kill()
            raise
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(stdout + stderr)
    if process.returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1].split("\r")[-1].strip()
        raise UserError(f"the {name} run failed ({tail}); its output is in {out / 'log.txt'}")
    return stdout
