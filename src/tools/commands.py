"""What the tools share: running a training script as a user would, and naming the machine."""
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

from src.errors import UserError

ROOT = Path(__file__).resolve().parents[2]  # the repository: the scripts run from there


def run_script(name: str, command: list[str], out: Path, env: dict | None = None) -> None:
    """Run `command` from the repository root with this Python's folder first on PATH (torchrun,
    accelerate), keep its output in out/log.txt, and fail in one line naming that log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1].split("\r")[-1].strip()
        raise UserError(f"the {name} run failed ({tail}); its output is in {out / 'log.txt'}")


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), which decides float rounding and speed on a CPU."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware() -> str:
    """One line naming the machine and the versions a measurement was made with."""
    cpus = len(os.sched_getaffinity(0))
    gpus = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
            if torch.cuda.is_available() else "no GPU")
    return (f"{cpu_model()}, {cpus} CPU cores, {gpus}; torch {torch.__version__}, "
            f"Python {platform.python_version()}")
