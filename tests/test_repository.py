"""The repository itself: no large file in git, every package the code imports pinned, the Python
version stated where tools read it (pyproject.toml) and where people read it (README)."""
import ast
import json
import subprocess
import sys
import tomllib

from conftest import ROOT, TINY, outputs, python

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
                pins[name.split("[")[0].strip().lower()] = version.strip()  # ray[train]: the package ray
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


def test_make_test_installs_chromium_as_root_and_elsewhere_says_what_to_install(tmp_path, monkeypatch, capsys):
    """checks/browser.py, which make test runs first: chromium on PATH, nothing; missing as root
    with apt-get, apt-get installs it (and a failed install is an error, exit 1); missing
    otherwise (not root, or no apt-get), one line saying what to install and exit 0, so that
    the rest of the suite runs. PATH here holds a folder of fakes: no real apt-get runs."""
    import browser
    assert browser.plan(found=True, root=True, apt=True) == browser.plan(found=True, root=False, apt=False) == "nothing"
    assert browser.plan(found=False, root=True, apt=True) == "install"
    assert browser.plan(found=False, root=False, apt=True) == browser.plan(found=False, root=True, apt=False) == "advise"

    def fake(name: str) -> None:
        (tmp_path / name).write_text("#!/bin/sh\n")
        (tmp_path / name).chmod(0o755)
    ran, install_code = [], [0]

    def apt_get(command, **options):
        ran.append(command)
        if command[:2] == ["apt-get", "install"] and install_code[0] == 0:
            fake("chromium")
        return subprocess.CompletedProcess(command, install_code[0] if "install" in command else 0)
    monkeypatch.setattr(browser.subprocess, "run", apt_get)
    monkeypatch.setenv("PATH", str(tmp_path))  # chromium hidden
    for root, apt in ((False, True), (True, False)):
        if apt:
            fake("apt-get")
        monkeypatch.setattr(browser.os, "geteuid", lambda root=root: 0 if root else 1000)
        assert browser.main() == 0
        assert capsys.readouterr().err == browser.MISSING + "\n" and ran == [], (root, apt)
        (tmp_path / "apt-get").unlink(missing_ok=True)

    fake("apt-get")
    monkeypatch.setattr(browser.os, "geteuid", lambda: 0)
    install_code[0] = 100
    assert browser.main() == 1 and ran[-1] == ["apt-get", "install", "-y", "-qq", "chromium"]
    assert "apt-get could not install chromium" in capsys.readouterr().err
    install_code[0], ran[:] = 0, []
    assert browser.main() == 0 and ran == [["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]]
    assert browser.find() == str(tmp_path / "chromium") and capsys.readouterr().err == ""
    ran.clear()
    assert browser.main() == 0 and ran == [], "found: nothing to do"


def test_make_test_sees_to_the_browser_before_the_tests_and_ci_runs_only_readme_commands():
    """make test runs checks/browser.py before pytest (a new user's `make test` got 5 errors
    without chromium), and shows the reasons of skipped tests; CI (.ci/run) runs README's
    commands and nothing that they do not (it installed chromium itself)."""
    from doc_commands import commands
    planned = subprocess.run(["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "test"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert [line.split()[1:] for line in planned] == [["checks/browser.py"], ["-m", "pytest", "-q", "-rs", "-n", "2",
                                                                             "tests"]], planned
    readme = {command.text.split("#")[0].strip() for command in commands(ROOT) if command.page == "README.md"}
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert "make test" in ci and "make lint" in ci
    assert [line for line in ci if line not in readme] == []


def _installed_by(requirements: str) -> set[str]:
    """The distributions `pip install -r requirements` brings (its pins, the files it includes with
    -r, and everything they require, with the extras they ask for, on this platform), read from the
    installed packages' metadata."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    lines = [line.split("#")[0].strip() for line in (ROOT / requirements).read_text().splitlines()]
    pending = [(Requirement(line), tuple(Requirement(line).extras)) for line in lines if line and not line.startswith("-r ")]
    found: set[str] = set().union(*(_installed_by(line.removeprefix("-r ")) for line in lines if line.startswith("-r ")))
    while pending:
        requirement, extras = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found and not extras:
            continue
        found.add(name)
        for text in metadata.requires(name) or []:
            needed = Requirement(text)
            if needed.marker is None or any(needed.marker.evaluate({"extra": extra}) for extra in ("", *extras)):
                pending.append((needed, tuple(needed.extras)))
    return found


# Run in a fresh interpreter: the top-level modules that only the other installed distributions
# provide are absent as a package not installed is (None in sys.modules: `import x` raises
# ModuleNotFoundError, importlib.util.find_spec("x") answers None); then the code of argv[2] runs.
ONLY = """
import json, sys
sys.modules.update(dict.fromkeys(json.loads(sys.argv[1])))
exec(sys.argv[2])
"""


def test_training_predict_and_the_report_need_only_requirements_txt(tiny_data, tmp_path):
    """`pip install -r requirements.txt` installs training alone (the trackers, ONNX and the tests
    have files of their own): with only its distributions importable, train_single.py trains,
    predict predicts a folder and the report is written; --track mlflow is one line naming the file
    that installs it. requirements.txt held MLflow and W&B (630 MB), the tests' packages and ONNX
    came with make demo's install."""
    from importlib import metadata

    from packaging.utils import canonicalize_name
    training = _installed_by("requirements.txt")
    assert {"torch", "torchvision", "accelerate", "pandas", "pillow", "tqdm", "matplotlib", "jinja2"} <= training
    assert not {"mlflow", "wandb", "onnx", "onnxruntime", "pytest", "playwright"} & training
    assert {"mlflow", "wandb"} <= _installed_by("requirements-track.txt")
    tests = _installed_by("requirements-test.txt")
    assert training | {"mlflow", "wandb", "onnx", "onnxruntime", "pytest"} <= tests
    others = sorted(module for module, names in metadata.packages_distributions().items()
                    if not any(canonicalize_name(name) in training for name in names))
    assert {"mlflow", "wandb", "onnx", "pytest"} <= set(others)
    out = tmp_path / "run"
    predicted = [str(tiny_data / "test"), "--checkpoint", str(out / "best.pth"), "--output", str(tmp_path / "p.csv"),
                 "--workers", "0"]
    program = (f"import train_single\nfrom src.tools import predict, report\n"
               f"train_single.main({[*TINY, '--data-dir', str(tiny_data), *outputs(out)]!r})\n"
               f"predict.main({predicted!r})\nreport.main({[str(out), '--workers', '0']!r})\n")
    result = python("-c", ONLY, json.dumps(others), program)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (out / "report.html").is_file() and (tmp_path / "p.csv").read_text().count("\n") == 1 + 6
    tracked = python("-c", ONLY, json.dumps(others), f"import train_single\ntrain_single.main({[*TINY, '--track', 'mlflow']!r})")
    assert tracked.returncode == 2 and tracked.stderr.splitlines() == [
        "train_single.py: error: argument --track: mlflow is not installed in this environment: "
        "pip install -r requirements-track.txt (see --help)"], tracked.stderr


# NVIDIA's minimum Linux x86_64 driver of each CUDA release (the CUDA Toolkit release notes' table).
CUDA_DRIVERS = {"13.0": "580.65.06"}


def test_the_docs_name_the_cuda_and_driver_of_the_pinned_torch():
    """The driver torch 2.14.1 needs was named nowhere: docs/gpus.md and requirements.txt name the
    CUDA release the installed torch wheel requires (its cuda-toolkit pin) and NVIDIA's minimum
    driver for it."""
    from importlib import metadata
    pins = [text for text in metadata.requires("torch") or [] if text.startswith("cuda-toolkit")]
    assert pins, "torch's wheel here is a CUDA one (its cuda-toolkit requirement)"
    cuda = ".".join(pins[0].split("==")[1].split(";")[0].strip().split(".")[:2])
    page = " ".join((ROOT / "docs" / "gpus.md").read_text().split())
    assert f"built for **CUDA {cuda}**" in page and f"driver must be {CUDA_DRIVERS[cuda]} or newer" in page
    assert f"CUDA {cuda}" in (ROOT / "requirements.txt").read_text() and CUDA_DRIVERS[cuda] in (ROOT / "README.md").read_text()


def test_make_demo_installs_training_alone_and_make_test_everything(tmp_path):
    """`make -n` on a machine without .venv: make demo installs requirements.txt alone (it was the
    whole test environment, trackers and ONNX included), make test requirements-test.txt."""
    for name in ("Makefile", *(path.name for path in ROOT.glob("requirements*.txt"))):
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())

    def installs(target: str) -> list[str]:
        made = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True, text=True, check=True)
        return [line.split(" -r ", 1)[1] for line in made.stdout.splitlines() if "pip install -r " in line]

    assert installs("demo") == ["requirements.txt"]
    assert installs("test") == ["requirements-test.txt"]
