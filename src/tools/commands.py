"""What the tools share: running a training script as a user would."""
import os
import subprocess
import sys
from pathlib import Path

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
