"""Careless input to the training scripts, refused before any work (issue 47, the training side):
an output onto a file that is not a run's (--plot notes.txt, --plot data/test/1.jpg), a micro-batch
that batch norm cannot normalise, and what a launcher's variables left in the environment of a
one-process script change. Every refusal: one line, exit 2, nothing written or replaced."""
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import torch
from conftest import TINY, fails_in_process, in_process, outputs

import train_single
from src.cli import parse_args
from src.outputs import lock_outputs
from src.plot import plot_history


def snapshot(*folders: Path) -> dict:
    """Every entry under the folders: its kind, its bytes (a file), and its time of change."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            info = os.lstat(path)
            found[path] = (stat.S_IFMT(info.st_mode), path.read_bytes() if stat.S_ISREG(info.st_mode) else None,
                           info.st_mtime_ns)
    return found


RECORD = {"epoch": 1, "train_loss": 0.7, "train_acc": 0.5, "val_loss": 0.69, "val_acc": 0.5}


def test_a_run_replaces_no_file_that_is_not_a_runs_output(tiny_data, tmp_path, monkeypatch, capsys):
    """--plot data/test/1.jpg turned a test image into a PNG and --plot notes.txt a user's notes, with
    or without --overwrite; --checkpoint naming a user's file, or a folder whose best.json or
    history.json is not a run's, likewise. Each is one line naming the flag and the file; nothing
    is made or changed (not even the output folder). A plot of a run, and a checkpoint not named
    .pth whose best.json holds its digest, are a run's files, replaced as before."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    notes, image = tmp_path / "notes.txt", data / "test" / "1.jpg"
    notes.write_text("a user's notes\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "best.json").write_text('{"an": "application config"}')
    (theirs / "history.json").write_text("[1, 2]")
    (theirs / "model.ckpt").write_bytes(b"a model of another program")
    (theirs / "settings.json").write_text("{}")
    out = tmp_path / "out"
    cases = [
        (["--plot", str(image)], f"--plot {image} exists and is not a plot of a training run"),
        (["--plot", str(notes)], f"--plot {notes} exists and is not a plot of a training run"),
        (["--plot", str(notes), "--overwrite"], f"--plot {notes} exists and is not a plot"),
        (["--checkpoint", str(notes)], f"--checkpoint {notes} exists and is not a checkpoint of a training run"),
        (["--checkpoint", str(theirs / "best.pth"), "--overwrite"],
         f"--checkpoint (its .json) {theirs / 'best.json'} exists and is not the description of a run's checkpoint"),
        (["--checkpoint", str(theirs / "model.ckpt"), "--overwrite"],
         f"--checkpoint {theirs / 'model.ckpt'} exists and is not a checkpoint of a training run"),
        (["--checkpoint", str(theirs / "settings.pth"), "--resume"],
         f"--checkpoint (its .json) {theirs / 'settings.json'} exists and is not the description"),
    ]
    before = snapshot(tmp_path)
    for flags, message in cases:
        argv = [*TINY, "--data-dir", str(data), *outputs(out), *flags]
        line = fails_in_process(train_single.main, argv, monkeypatch, capsys, message)
        assert "--overwrite or not" in line and line.endswith(f"name another file with {flags[0]}"), line
    theirs_history = [*TINY, "--data-dir", str(data), "--checkpoint", str(theirs / "other.pth"), "--plot",
                      str(out / "curves.png"), "--overwrite"]
    fails_in_process(train_single.main, theirs_history, monkeypatch, capsys,
                     f"--checkpoint (history.json beside it) {theirs / 'history.json'} exists and is not a run's history")
    assert snapshot(tmp_path) == before and not out.exists(), "every file as it was, nothing made"

    # A run's own files: its plot (wherever it is: two runs share the default one), a checkpoint
    # with another suffix that its best.json describes, replaced with --overwrite.
    ours = tmp_path / "ours"
    ours.mkdir()
    plot_history([RECORD], ours / "curves.png")
    torch.save({"w": torch.zeros(1)}, ours / "model.ckpt")
    digest = hashlib.sha256((ours / "model.ckpt").read_bytes()).hexdigest()
    (ours / "model.json").write_text(json.dumps({"arch": "squeezenet1_1", "sha256": digest}))
    (ours / "history.json").write_text(json.dumps([RECORD]))
    for flags in (["--checkpoint", str(tmp_path / "new" / "best.pth"), "--plot", str(ours / "curves.png")],
                  ["--checkpoint", str(ours / "model.ckpt"), "--plot", str(ours / "curves.png"), "--overwrite"]):
        with lock_outputs(parse_args("", [*TINY, "--data-dir", str(data), *flags])):
            pass
