"""checks/mutations.py's list stays applicable: each entry's text occurs exactly once in its file and
names tests that exist, so a change to a mutated line shows here, in `make test`, not an hour into
the mutation check; and the script refuses an entry that does not apply before running anything."""
import sys

import mutations
import pytest


def test_every_mutation_applies_once_and_names_existing_tests():
    assert mutations.problems(mutations.MUTATIONS) == []
    for _, _, _, tests in mutations.MUTATIONS:
        for test in mutations.split(tests)[0]:  # the make test-gpu checks' keys: problems() knows them
            path, _, name = test.partition("::")
            assert (mutations.ROOT / path).is_file(), test
            assert not name or f"def {name}(" in (mutations.ROOT / path).read_text(), test


@pytest.mark.parametrize("entry, problem", [
    (("a.py", "x = 1", "x = 2", ["tests/test_a.py"]), "a.py: the original text 'x = 1' occurs 2 times, not once"),
    (("a.py", "z = 3", "z = 4", ["tests/test_a.py"]), "a.py: the original text 'z = 3' occurs 0 times, not once"),
    (("b.py", "y = 2", "y = 3", ["tests/test_a.py"]), "b.py: no such file"),
    (("a.py", "y = 2", "y = 2", ["tests/test_a.py"]), "a.py: 'y = 2' is replaced by itself"),
    (("a.py", "y = 2", "y = 3", []), "a.py: 'y = 2' names no tests, or a test outside tests/: []"),
])
def test_an_entry_that_does_not_apply_is_refused_before_anything_runs(entry, problem, tmp_path, monkeypatch, capsys):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    monkeypatch.setattr(mutations, "ROOT", tmp_path)
    monkeypatch.setattr(mutations, "MUTATIONS", [entry, ("a.py", "y = 2", "y = 3", ["tests/test_a.py"])])
    monkeypatch.setattr(mutations, "scratch_copy", lambda: pytest.fail("it ran"))
    monkeypatch.setattr(sys, "argv", ["mutations.py"])
    assert mutations.main() == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "refused, nothing was run; fix these entries of checks/mutations.py:"
    assert lines[1:] == [f"  {problem}"], "the other entry applies"


# The verdict: caught only by a test of behaviour. test_mutations.py's check that an entry's text
# exists fails on any edit of the line, right or wrong: no catch, except for an entry of the runner.
APPLIES = "tests/test_mutations.py::test_every_mutation_applies_once_and_names_existing_tests"
BEHAVIOUR = "tests/test_predict.py::test_a_mixed_folder_gives_the_validation_pass_p_dog"


@pytest.mark.parametrize("path, tests, outcome, failed, said", [
    ("src/a.py", [BEHAVIOUR, APPLIES], "failed", [BEHAVIOUR], "caught"),
    ("src/a.py", [BEHAVIOUR, APPLIES], "failed", [APPLIES], "SURVIVED (text only)"),
    ("src/a.py", ["tests/test_mutations.py"], "failed", [APPLIES], "SURVIVED (text only)"),
    ("src/a.py", [APPLIES], "passed", [], "SURVIVED (text only)"),  # nothing of behaviour named
    ("src/a.py", [BEHAVIOUR, APPLIES], "passed", [], "SURVIVED"),
    ("src/a.py", [BEHAVIOUR], "failed", [], "ERROR"),  # a failure pytest did not name
    ("src/a.py", [BEHAVIOUR], "error", [], "ERROR"),
    ("src/a.py", ["gpu:fused"], "no GPU", [], "no GPU"),
    ("src/a.py", [BEHAVIOUR, "gpu:fused"], "failed", ["gpu:fused"], "caught"),
    # The runner's own entries: test_mutations.py runs its code.
    ("checks/mutations.py", [APPLIES], "failed", [APPLIES], "caught"),
])
def test_only_a_test_of_behaviour_catches_a_mutation(path, tests, outcome, failed, said):
    assert mutations.verdict(path, tests, outcome, failed) == said


def test_the_runner_reads_which_tests_failed_from_pytest(tmp_path, monkeypatch):
    """run_tests on a real pytest run: a failing test and one whose fixture fails are named, the
    passing one is not, and -x stops before the rest."""
    monkeypatch.setattr(mutations, "PYTHON", sys.executable)  # in the runner's copy there is no .venv
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef broken():\n    raise OSError('no')\n\n"
        "def test_passes():\n    pass\n\ndef test_fails():\n    assert 1 == 2\n\n"
        "def test_never_runs():\n    assert False\n")
    outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 120)
    assert (outcome, failed) == ("failed", ["test_a.py::test_fails"])
    (tmp_path / "test_a.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef broken():\n    raise OSError('no')\n\n"
        "def test_passes():\n    pass\n\ndef test_setup(broken):\n    pass\n")
    outcome, _, failed = mutations.run_tests(tmp_path, ["test_a.py"], tmp_path / "log", 120)
    assert (outcome, failed) == ("failed", ["test_a.py::test_setup"])


def test_a_mutation_caught_only_by_the_text_check_is_reported_survived(tmp_path, monkeypatch, capsys):
    """The text check is not even run; an entry whose behaviour test passes survives, one whose
    behaviour test fails is caught; the exit code says not every one was caught."""
    (tmp_path / "a.py").write_text("x = 1\ny = 2\n")
    monkeypatch.setattr(mutations, "ROOT", tmp_path)
    monkeypatch.setattr(mutations, "MUTATIONS", [("a.py", "x = 1", "x = 3", [BEHAVIOUR, APPLIES]),
                                                 ("a.py", "y = 2", "y = 3", [BEHAVIOUR, APPLIES]),
                                                 ("a.py", "y = 2", "y = 4", [APPLIES])])
    monkeypatch.setattr(mutations, "scratch_copy", lambda: tmp_path)
    ran = []

    def run_tests(copy, tests, log, timeout):
        ran.append(tests)
        broken = "x = 3" in (copy / "a.py").read_text()
        return ("failed", 1.0, [BEHAVIOUR]) if broken else ("passed", 1.0, [])
    monkeypatch.setattr(mutations, "run_tests", run_tests)
    monkeypatch.setattr(sys, "argv", ["mutations.py", "--keep"])
    assert mutations.main() == 1
    assert ran == [[BEHAVIOUR]] * 3, "the baseline and the two entries that name a test of behaviour"
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "`" in line]
    assert [row[3] for row in rows] == ["caught", "SURVIVED", "SURVIVED (text only)"]
