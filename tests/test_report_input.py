"""What the report reads from the disk: every field of best.json and history.json that the page
uses is checked first (a hand-edited or older file is one line naming the file and the field,
exit 2, no page written); predict's CSV is read back as predict guarded it (one leading ' dropped),
and its images are shown only from the CSV's folder, the current folder and the runs' data
folders (src.tools.report)."""
import html
import json
import re
import shutil

import pytest
from conftest import fails_in_process, in_process, mode_run

from src.errors import UserError
from src.safe_csv import csv_text
from src.tools import report


@pytest.fixture
def run(runs, tmp_path):
    """A copy of the shared one-device run's folder."""
    folder = tmp_path / "run"
    shutil.copytree(mode_run(runs, "single")[0], folder)
    return folder


def _edit(path, change):
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


# (file, change, what the line says after "FILE: ")
EDITS = {
    "val_fraction missing": ("best.json", lambda info: info.pop("val_fraction"),
                             "val_fraction is missing (it must be a number in (0, 1)"),
    "val_fraction 0": ("best.json", lambda info: info.update(val_fraction=0), "val_fraction 0 must be a number in (0, 1)"),
    "val_fraction 1": ("best.json", lambda info: info.update(val_fraction=1.0),
                       "val_fraction 1.0 must be a number in (0, 1)"),
    "seed a string": ("best.json", lambda info: info.update(seed="x"), "seed 'x' must be a whole number"),
    "flags a string": ("best.json", lambda info: info.update(flags="x"), "flags 'x' must be an object of the run's flags"),
    "best_by unknown": ("best.json", lambda info: info.update(best_by="loss"), "best_by 'loss' must be val_acc or val_log_loss"),
    "batch_size missing": ("best.json", lambda info: info.pop("batch_size"), "batch_size is missing"),
    "data a number": ("best.json", lambda info: info.update(data=3), "data 3 must be the digest of the labelled images"),
    "seconds a string": ("history.json", lambda history: history[0].update(seconds="3"),
                         "record 1: seconds '3' is not a finite number"),
    "val_acc null": ("history.json", lambda history: history[1].update(val_acc=None),
                     "record 2: val_acc None is not a finite number"),
    "train_samples missing": ("history.json", lambda history: history[0].pop("train_samples"),
                              "record 1: train_samples is missing (it must be a whole number)"),
    "epoch a fraction": ("history.json", lambda history: history[0].update(epoch=1.5),
                         "record 1: epoch 1.5 is not a whole number from 1"),
    "epoch 0": ("history.json", lambda history: history[0].update(epoch=0),
                "record 1: epoch 0 is not a whole number from 1"),
    "a record not an object": ("history.json", lambda history: history.append(7), "record 3 is not an object"),
}


@pytest.mark.parametrize("edit", EDITS)
def test_a_hand_edited_or_older_run_file_is_one_line_naming_the_field(edit, run, monkeypatch, capsys):
    """7 of 8 such variants were tracebacks (KeyError, TypeError, ValueError) somewhere in the
    page's making, some after the validation pass."""
    name, change, said = EDITS[edit]
    _edit(run / name, change)
    before = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
    line = fails_in_process(report.main, [str(run)], monkeypatch, capsys, f"{run / name}: {said}")
    assert line.endswith("the training scripts write it so: retrain, or fix it by hand")
    assert {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()} == before, "no report written"


def test_a_run_that_does_not_say_its_data_folder_needs_data_dir(run, monkeypatch, capsys):
    _edit(run / "best.json", lambda info: info.update(flags={}))
    fails_in_process(report.main, [str(run)], monkeypatch, capsys,
                     f"{run / 'best.json'} does not say which data folder the run was trained on (its flags' "
                     "data_dir): pass --data-dir")
    assert not (run / "report.html").exists()


def test_predictions_come_back_unguarded_and_images_only_from_the_folders_of_the_page(run, exact_data, tmp_path,
                                                                                     monkeypatch, capsys):
    """Names that predict's CSV guarded (a leading ') showed guarded and without their image; a
    CSV naming any image of the disk (an absolute path, ../) had it embedded in the page."""
    csv_folder, outside = tmp_path / "csv", tmp_path / "outside"
    csv_folder.mkdir()
    outside.mkdir()
    source = exact_data / "test" / "1.jpg"
    names = ["'quoted.jpg", "=1+2.jpg", "plain.jpg"]
    for name in names:
        shutil.copy(source, csv_folder / name)
    shutil.copy(source, outside / "secret.jpg")
    rows = [[name, 0.5, "dog"] for name in names] + [[str(outside / "secret.jpg"), 0.5, "dog"],
                                                     ["../outside/secret.jpg", 0.5, "dog"]]
    (csv_folder / "p.csv").write_text(csv_text(["path", "p_dog", "label"], rows))
    monkeypatch.chdir(csv_folder)  # the current folder holds no image of outside/ (tmp_path may be below ours)
    page = tmp_path / "page.html"
    code, out, err = in_process(report.main, [str(run), "--output", str(page), "--predictions",
                                              str(csv_folder / "p.csv")], monkeypatch, capsys)
    assert code == 0, err
    assert (f"--predictions {csv_folder / 'p.csv'}: 2 of the 5 images shown lie outside the CSV's folder, the "
            "current folder and the data folders") in out
    text = page.read_text()
    gallery = text[text.index("<h2>Your images"):]
    figures = re.findall(r'<figure.*?</figure>', gallery, flags=re.S)
    shown = {html.unescape(re.search(r'<span class="name">(.*?)</span>', figure).group(1)): "<img " in figure
             for figure in figures}
    assert shown == {"'quoted.jpg": True, "=1+2.jpg": True, "plain.jpg": True, str(outside / "secret.jpg"): False,
                     "../outside/secret.jpg": False}, shown
    assert text.count("no preview (outside the CSV&#39;s folder") == 2


def test_predictions_of_exactly_0_and_1_are_read_and_outside_them_refused(tmp_path):
    """p_dog in [0, 1], its ends included (a sure cat, a sure dog: what a float32 softmax can
    give): read back with those values, the most uncertain first; just outside, the line named."""
    path = tmp_path / "p.csv"
    path.write_text(csv_text(["path", "p_dog", "label"], [["cat.jpg", 0.0, "cat"], ["dog.jpg", 1.0, "dog"],
                                                            ["half.jpg", 0.5, "dog"]]))
    assert [(row["name"], row["p_dog"], row["label"]) for row in report.read_predictions(path)] == [
        ("half.jpg", 0.5, "dog"), ("cat.jpg", 0.0, "cat"), ("dog.jpg", 1.0, "dog")]
    for outside in (-1e-9, 1 + 1e-9):
        path.write_text(csv_text(["path", "p_dog", "label"], [["cat.jpg", 0.0, "cat"], ["x.jpg", outside, "dog"]]))
        with pytest.raises(UserError, match=rf"^--predictions {re.escape(str(path))}: line 3 is not path,p_dog,label "
                                            r"with p_dog in \[0, 1\]$"):
            report.read_predictions(path)
