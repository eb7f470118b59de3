"""The repository itself: no large file in git, every package the code imports pinned, the Python
version stated where tools read it (pyproject.toml) and where people read it (README)."""
import ast
import subprocess
import sys
import tomllib

from conftest import ROOT

MB = 1_000_000
# Import names that differ from the name pip installs.
DISTRIBUTION = {"PIL": "pillow"}
# Imported when present, installed with torch where torch has it (its CUDA builds): src/dropout.py's
# GPU kernel, which falls back to torch's ops without it.
WITH_TORCH = {"triton"}


def test_no_tracked_file_is_over_1_mb():
    """Weights, data, plots and wheels stay out of git (.gitignore); a file committed by accident
    would stay in every clone's history."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True)
    sizes = {name: (ROOT / name).stat().st_size for name in files.stdout.split("\0") if (ROOT / name).is_file()}
    assert len(sizes) > 50, "git lists the project's files"
    assert {name: size for name, size in sizes.items() if size > MB} == {}


def _imported_packages() -> set[str]:
    """The top-level modules that the product's code imports (src/, the scripts, checks/), less
    the standard library's and the project's own."""
    files = [*ROOT.glob("train_*.py"), *(ROOT / "src").rglob("*.py"), *(ROOT / "checks").glob("*.py")]
    names = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names.add(node.module.split(".")[0])
    own = ("src", "gpu_selftest", "train_single")  # the project's (the benchmark measures train_single.py's loader)
    return {name for name in names if name not in sys.stdlib_module_names and name not in own}


def _pinned() -> dict[str, str]:
    pins = {}
    for path in ROOT.glob("requirements*.txt"):
        for line in path.read_text().splitlines():
            line = line.split("#")[0].strip()
            if "==" in line:
                name, version = line.split("==")
                pins[name.strip().lower()] = version.strip()
    return pins


def test_every_imported_package_is_pinned():
    """What the code imports is installed by make install at one version (numpy was imported in
    14 places and came only through torch's and pandas' requirements)."""
    imported = _imported_packages()
    assert {"torch", "numpy", "PIL"} <= imported
    pins = _pinned()
    assert sorted(name for name in imported - WITH_TORCH if DISTRIBUTION.get(name, name).lower() not in pins) == []


def test_the_python_version_is_stated_where_tools_and_people_read_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["requires-python"] == ">=3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["tool"]["mypy"]["python_version"] == "3.11"
    assert "(Python 3.11," in (ROOT / "README.md").read_text()
    assert sys.version_info >= (3, 11)
