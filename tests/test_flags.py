"""docs/flags.md, the flag reference, against the `--help` of every training script: each flag a
script's --help lists is in the table, with that script among those the table says take it and
the default --help shows; no flag the table lists is missing from a script it names. README's
"the same for every script" was not true (--dist-timeout is not in train_single.py nor
train_dp.py, --amp not in train_accelerate.py); nothing said so."""
import importlib
import re

import pytest
from conftest import ROOT, in_process

SCRIPTS = sorted(path.name for path in ROOT.glob("train_*.py"))
PAGE = ROOT / "docs" / "flags.md"
# argparse's help line of an option (two spaces in), and the default ArgumentDefaultsHelpFormatter appends
# (the last one: a help text may say a default of its own words before it).
OPTION = re.compile(r"^  (-\w, )?(--[a-z][a-z-]*)")
DEFAULT = re.compile(r".*\(default: (.*)\)$")


def help_flags(script: str, monkeypatch, capsys) -> dict[str, str]:
    """Each option of the script's --help (-h aside) and the default it shows."""
    module = importlib.import_module(script.removesuffix(".py"))
    code, out, err = in_process(module.main, ["--help"], monkeypatch, capsys)
    assert code == 0, err
    flags, current, text = {}, None, []

    def close():
        if current:
            found = DEFAULT.search(" ".join(text))
            flags[current] = found.group(1) if found else ""

    for line in out.splitlines():
        match = OPTION.match(line)
        if match or not line.startswith("  "):
            close()
            current, text = (match.group(2), [line]) if match else (None, [])
        elif current:
            text.append(line.strip())
    close()
    flags.pop("--help")
    return flags


def table() -> dict[str, tuple[str, list[str]]]:
    """docs/flags.md's rows: flag -> (its default cell, the scripts that take it)."""
    rows = {}
    for line in PAGE.read_text().splitlines():
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) != 4 or not cells[0].startswith("`--"):
            continue
        flag = re.match(r"`(--[a-z][a-z-]*)", cells[0]).group(1)
        assert flag not in rows, f"{flag} twice in {PAGE.name}"
        scripts = SCRIPTS if cells[2] == "all" else re.findall(r"`(train_\w+\.py)`", cells[2])
        assert scripts, f"{flag}: no script named in {cells[2]!r}"
        rows[flag] = (cells[1], scripts)
    return rows


def default_agrees(cell: str, shown: str) -> bool:
    """The table's default cell against --help's: "off" for a switch or an unset option (False,
    None), else its first `code` is what --help shows."""
    if cell.startswith("off"):
        return shown in ("False", "None")
    first = re.search(r"`([^`]*)`", cell)
    return first is not None and first.group(1) == shown


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_flag_page_lists_each_scripts_flags_and_defaults(script, monkeypatch, capsys):
    shown = help_flags(script, monkeypatch, capsys)
    assert len(shown) > 40 and "--data-dir" in shown
    rows = table()
    missing = sorted(flag for flag in shown if flag not in rows or script not in rows[flag][1])
    assert not missing, f"{script} takes {missing}; docs/flags.md does not say so"
    extra = sorted(flag for flag, (_, scripts) in rows.items() if script in scripts and flag not in shown)
    assert not extra, f"docs/flags.md says {script} takes {extra}; its --help does not list them"
    wrong = {flag: (rows[flag][0], default) for flag, default in shown.items() if not default_agrees(rows[flag][0], default)}
    assert not wrong, f"docs/flags.md's defaults differ from {script} --help's: {wrong}"


def test_the_scripts_differ_where_the_page_says():
    """The two flags that not every script takes, as the page says; README points to it and does not
    say the flags are the same for every script."""
    rows = table()
    assert sorted(rows["--amp"][1]) == [s for s in SCRIPTS if s != "train_accelerate.py"]
    assert "train_single.py" not in rows["--dist-timeout"][1] and "train_ddp.py" in rows["--dist-timeout"][1]
    readme = (ROOT / "README.md").read_text()
    assert "the same for every script" not in readme and "(docs/flags.md)" in readme
