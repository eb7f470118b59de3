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
    planned = subprocess.run(["make", "-n", "-o", ".venv/.installed", "test"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.splitlines()
    assert [line.split()[1:] for line in planned] == [["checks/browser.py"], ["-m", "pytest", "-q", "-rs", "-n", "2",
                                                                             "tests"]], planned
    readme = {command.text.split("#")[0].strip() for command in commands(ROOT) if command.page == "README.md"}
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert "make test" in ci and "make lint" in ci
    assert [line for line in ci if line not in readme] == []
