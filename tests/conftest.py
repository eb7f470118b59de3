"""Shared fixtures: a small synthetic dataset and a runner for the real scripts and launchers."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from src.synthetic import write_dataset

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent

# Small and fast, and the property under test does not need VGG16: ResNet-18 learns the
# synthetic set in two epochs at 32 px; AlexNet has no batch norm, so a batch split across
# processes computes exactly what the whole batch does in one process.
LEARN = ["--arch", "resnet18", "--weights", "none", "--image-size", "32", "--lr", "0.01"]
EXACT = ["--arch", "alexnet", "--weights", "none", "--image-size", "64", "--dropout", "0",
         "--lr", "0.01", "--workers", "0"]


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """240 training and 30 test images of about 64 px."""
    path = tmp_path_factory.mktemp("synthetic")
    write_dataset(path, n_train=240, n_test=30, size=64, seed=1)
    return path


@pytest.fixture(scope="session")
def exact_data(tmp_path_factory) -> Path:
    """201 labelled images (with --val-fraction 0.5025: 100 train, 101 validation), 20 test."""
    path = tmp_path_factory.mktemp("exact")
    write_dataset(path, n_train=201, n_test=20, size=64, seed=2)
    return path


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A folder for the runs one test module shares, removed when the module is done: an AlexNet
    run writes 650 MB, and the whole suite's would fill a small disk (it did, on CI)."""
    path = tmp_path_factory.mktemp("module")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(command: list[str], env: dict | None = None, timeout: int = 600, cwd: Path = ROOT):
    """Run a command as a user would (from the repo root), capturing its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def python(*args: str, env: dict | None = None, timeout: int = 600):
    return run([sys.executable, *args], env=env, timeout=timeout)


def outputs(folder: Path, *extra: str) -> list[str]:
    """Flags that send every output file of a run into folder."""
    return ["--checkpoint", str(folder / "best.pth"), "--plot", str(folder / "curves.png"), *extra]


def history(folder: Path) -> list[dict]:
    return json.loads((folder / "history.json").read_text())


def weights(folder: Path, name: str = "best.pth") -> dict:
    return torch.load(folder / name, map_location="cpu", weights_only=True)


def max_relative_difference(a: dict, b: dict) -> float:
    """The largest |a - b| / |b| over all tensors (norms per tensor)."""
    assert a.keys() == b.keys()
    return max(((a[k].float() - b[k].float()).norm() / b[k].float().norm().clamp_min(1e-12)).item()
               for k in a)
