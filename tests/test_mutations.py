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
