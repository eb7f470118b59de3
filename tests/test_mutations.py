"""checks/mutations.py's own logic: an entry that does not apply (its text not found once, a test it
names missing) is refused before anything runs, and `--check` reports every such entry in seconds
(CI runs it; the test suite does not read the list's text, which would fail on any edit of a listed
line, right or wrong); the verdict is "caught" only when pytest named a failed test; the runner
reads those names from a real pytest run."""
import shutil
import subprocess
import sys
import threading

import mutations
import pytest

BEHAVIOUR = "tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog"


def _tree(tmp_path, monkeypatch, entries):
    """A repository of a.py and tests/test_a.py (test_a_passes) in tmp_path, whose list is `entries`."""
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    (tmp_path / "tests").mkdir(exist_ok=True)
    (tmp_path / "tests" / "test_a.py").write_text("def test_a_passes():\n    pass\n")
    monkeypatch.setattr(mutations, "ROOT", tmp_path)
    monkeypatch.setattr(mutations, "MUTATIONS", entries)
    monkeypatch.setattr(mutations, "scratch_copy", lambda: pytest.fail("it ran"))


APPLIES = ("a.py", "y = 2", "y = 3", ["tests/test_a.py::test_a_passes"])
STALE = [
    (("a.py", "x = 1", "x = 2", ["tests/test_a.py"]), "a.py: the original text 'x = 1' occurs 2 times, not once"),
    (("a.py", "z = 3", "z = 4", ["tests/test_a.py"]), "a.py: the original text 'z = 3' occurs 0 times, not once"),
    (("b.py", "y = 2", "y = 3", ["tests/test_a.py"]), "b.py: no such file"),
    (("a.py", "y = 2", "y = 2", ["tests/test_a.py"]), "a.py: 'y = 2' is replaced by itself"),
    (("a.py", "y = 2", "y = 3", []), "a.py: 'y = 2' names no tests, or a test outside tests/: []"),
    (("a.py", "y = 2", "y = 3", ["tests/test_a.py::test_gone"]),
     "a.py: 'y = 2' names tests that do not exist: ['tests/test_a.py::test_gone']"),
    (("a.py", "y = 2", "y = 3", ["tests/test_b.py"]), "a.py: 'y = 2' names tests that do not exist: ['tests/test_b.py']"),
    (("a.py", "y = 2", "y = 3", ["gpu:no-such-check"]),
     "a.py: 'y = 2' names tests that do not exist: ['gpu:no-such-check']"),
]


@pytest.mark.parametrize("entry, problem", STALE)
@pytest.mark.parametrize("flag", [[], ["--check"]])
def test_an_entry_that_does_not_apply_is_refused_before_anything_runs(entry, problem, flag, tmp_path, monkeypatch,
                                                                        capsys):
    _tree(tmp_path, monkeypatch, [entry, APPLIES])
    monkeypatch.setattr(sys, "argv", ["mutations.py", *flag])
    assert mutations.main() == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "refused, nothing was run; fix these entries of checks/mutations.py:"
    assert lines[1:] == [f"  {problem}"], "the other entry applies"


def test_check_reports_every_stale_entry_and_runs_nothing(tmp_path, monkeypatch, capsys):
    """--check of the whole list: each stale entry once, in the list's order; a list that applies
    passes (a test named with its parameters counts as its function)."""
    _tree(tmp_path, monkeypatch, [APPLIES, *(entry for entry, _ in STALE)])
    monkeypatch.setattr(sys, "argv", ["mutations.py", "--check"])
    assert mutations.main() == 2
    assert capsys.readouterr().err.splitlines()[1:] == [f"  {problem}" for _, problem in STALE]
    _tree(tmp_path, monkeypatch, [APPLIES, ("a.py", "y = 2", "y = 4", ["tests/test_a.py::test_a_passes[x-1]"])])
    assert mutations.main() == 0
    assert capsys.readouterr().out == "2 entries apply: each text found once, each named test there\n"


@pytest.mark.parametrize("outcome, failed, said", [
    ("failed", [BEHAVIOUR], "caught"),
    ("passed", [], "SURVIVED"),
    ("failed", [], "ERROR"),  # a failure pytest did not name: the run crashed
    ("error", [], "ERROR"),
    ("no GPU", [], "no GPU"),
    ("failed", ["gpu:fused"], "caught"),
])
def test_the_verdict_says_caught_only_when_pytest_named_a_failed_test(outcome, failed, said):
    assert mutations.verdict(outcome, failed) == said


@pytest.mark.parametrize("warm", [False, True], ids=["a new python", "a fork of a warm one"])
def test_the_runner_reads_which_tests_failed_from_pytest(warm, tmp_path, monkeypatch):
    """run_tests on a real pytest run, started as a new Python or forked from checks/warm_pytest.py:
    a failing test and one whose fixture fails are named, the passing one is not, and -x stops
    before the rest. The fork runs as `python -m pytest` in the copy would (its folder first on
    sys.path, pytest's __main__), and one that runs past the timeout is killed and said to."""
    monkeypatch.setattr(mutations, "PYTHON", sys.executable)  # in the runner's copy there is no .venv
    server = mutations.WarmPytest() if warm else None
    try:
        (tmp_path / "test_a.py").write_text(
            "import os, sys\nimport pytest\n\n@pytest.fixture\ndef broken():\n    raise OSError('no')\n\n"
            "def test_passes():\n    assert sys.path[0] in ('', os.getcwd()) and os.getcwd() == " + repr(str(tmp_path))
            + "\n    assert sys.modules['__main__'].__spec__.name == 'pytest.__main__'\n\n"
            "def test_fails():\n    assert 1 == 2\n\ndef test_never_runs():\n    assert False\n")
        outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 120, server)
        assert (outcome, failed) == ("failed", ["test_a.py::test_fails"]), (tmp_path / "log").read_text()
        (tmp_path / "test_a.py").write_text(
            "import pytest\n\n@pytest.fixture\ndef broken():\n    raise OSError('no')\n\n"
            "def test_passes():\n    pass\n\ndef test_setup(broken):\n    pass\n")
        outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 120, server)
        assert (outcome, failed) == ("failed", ["test_a.py::test_setup"])
        (tmp_path / "test_a.py").write_text("import time\n\ndef test_sleeps():\n    time.sleep(600)\n")
        outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 3, server)
        assert (outcome, failed) == ("error", []) and "timed out after 3 s" in (tmp_path / "log").read_text()
    finally:
        if server is not None:
            server.close()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_each_entry_is_run_after_the_baseline_and_reported(jobs, tmp_path, monkeypatch, capsys):
    """The named tests run once unchanged, then once per entry with its change made (and undone
    after), each entry in one of `jobs` scratch copies; the table says caught or SURVIVED in the
    list's order, and the exit code that not every one was caught."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _tree(repo, monkeypatch, [("a.py", "y = 2", "y = 3", [BEHAVIOUR]), ("a.py", "y = 2", "y = 4", [BEHAVIOUR])])
    (repo / "tests" / "test_predict.py").write_text("def test_a_mixed_folder_gives_the_validation_pass_p_dog():\n")
    copies = []

    def scratch_copy():
        copies.append(shutil.copytree(repo, tmp_path / f"copy-{len(copies)}"))
        return copies[-1]
    monkeypatch.setattr(mutations, "scratch_copy", scratch_copy)
    ran = []

    started = threading.Barrier(int(jobs))  # each copy's thread has taken an entry (not one thread both)

    def run_tests(copy, tests, log, timeout, server=None):
        ran.append((copy.name, tests, (copy / "a.py").read_text()))
        if len(ran) > 1:  # an entry's run, not the baseline's
            started.wait(timeout=120)
        broken = "y = 3" in (copy / "a.py").read_text()
        return ("failed", 1.0, [BEHAVIOUR]) if broken else ("passed", 1.0, [])
    monkeypatch.setattr(mutations, "run_tests", run_tests)
    monkeypatch.setattr(sys, "argv", ["mutations.py", "--keep", "--cold", "-j", jobs])
    assert mutations.main() == 1
    assert len(copies) == int(jobs)
    assert ran[0] == ("copy-0", [BEHAVIOUR], "x = 1\nx = 1\ny = 2\n"), "the baseline first, unchanged"
    assert sorted(text for _, _, text in ran[1:]) == ["x = 1\nx = 1\ny = 3\n", "x = 1\nx = 1\ny = 4\n"]
    assert {name for name, _, _ in ran[1:]} == {copy.name for copy in copies}, "each copy ran an entry"
    assert all((copy / "a.py").read_text() == "x = 1\nx = 1\ny = 2\n" for copy in copies), "each change undone"
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "`" in line]
    assert [row[3] for row in rows] == ["caught", "SURVIVED"]


def test_a_run_that_times_out_logs_its_output_as_text_and_names_what_failed(tmp_path, monkeypatch):
    """subprocess.run's TimeoutExpired holds bytes whatever text=True said: the log held "b'...'"
    with its line breaks as \\n, and the tests that had failed before the timeout went unread."""
    said = b"test_a.py .F\nFAILED test_a.py::test_fails - assert 1 == 2\n"

    def run(command, **kwargs):
        raise subprocess.TimeoutExpired(command, kwargs["timeout"], output=said, stderr=b"")
    monkeypatch.setattr(mutations.subprocess, "run", run)
    outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 5)
    assert (outcome, failed) == ("error", ["test_a.py::test_fails"])
    assert (tmp_path / "log").read_text().split("\n\n", 1)[1] == said.decode() + "\ntimed out after 5 s"
