"""The diff is the tutorial: `diff train_single.py train_X.py` shows what mode X changes and
nothing else, so each diff's size is pinned (as accelerate's tests/test_examples.py pins its
examples against cv_example.py). What is the same in every script lives in src/; a line that
grows a diff has to be a line of that mode's recipe.

Ceilings: the sizes now (NOW) plus a margin of 2 added lines and 1 removed line for the modes
that new flags still reach (a DDP-only flag such as a SyncBatchNorm conversion adds a line to
train_ddp.py), never above the sizes before the torchrun join moved into src/process_group.py
(BEFORE); train_dp.py's diff has no margin. A script that grows past its ceiling fails here: move
what is shared into src/, or raise NOW in the same change, saying why.
"""
import shutil
import subprocess

import pytest
from conftest import ROOT

# (base, script): (added, removed) lines of `diff base script` now, and their ceilings.
NOW = {("train_single.py", "train_dp.py"): (5, 2),
       ("train_single.py", "train_ddp.py"): (38, 20),
       ("train_single.py", "train_accelerate.py"): (74, 38),
       ("train_ddp.py", "train_fsdp.py"): (23, 17)}
BEFORE = {("train_single.py", "train_dp.py"): (5, 2),
          ("train_single.py", "train_ddp.py"): (54, 20),
          ("train_single.py", "train_accelerate.py"): (75, 40),
          ("train_ddp.py", "train_fsdp.py"): (28, 18)}
MARGIN = {"train_dp.py": (0, 0)}  # the others: (2, 1)


def ceiling(pair: tuple[str, str]) -> tuple[int, int]:
    margin = MARGIN.get(pair[1], (2, 1))
    return tuple(min(now + more, before) for now, more, before in zip(NOW[pair], margin, BEFORE[pair]))


def diff_size(base: str, script: str) -> tuple[int, int]:
    """(added, removed) lines of `diff base script`, as a reader runs it."""
    if shutil.which("diff") is None:
        pytest.fail("the diff command (GNU diffutils) is needed: the README's tutorial runs it")
    result = subprocess.run(["diff", base, script], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode in (0, 1), result.stderr
    lines = result.stdout.splitlines()
    return sum(line.startswith("> ") or line == ">" for line in lines), \
        sum(line.startswith("< ") or line == "<" for line in lines)


@pytest.mark.parametrize("pair", list(NOW), ids=lambda pair: f"{pair[0]}-{pair[1]}")
def test_each_scripts_diff_stays_within_its_ceiling(pair):
    added, removed = diff_size(*pair)
    most_added, most_removed = ceiling(pair)
    assert added <= most_added and removed <= most_removed, (
        f"diff {pair[0]} {pair[1]}: +{added} -{removed} lines, more than +{most_added} -{most_removed}: "
        "what is not this mode's recipe belongs in src/")

