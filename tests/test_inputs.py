"""Hostile and careless input that is not about where outputs go: file names that a spreadsheet
takes for formulas, that split a CSV row, that drive the terminal or are not UTF-8; links to
nothing and loops of links; a hand-edited best.json; a data folder of cats only or a zipped one;
--workers far above the CPUs."""
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import ROOT, TINY, fails, fails_in_process, in_process, outputs, write_checkpoint

import train_single
from src.cli import defaults, parse_args
from src.datasets import load_labels, read_labels_csv
from src.devices import available_cpus
from src.loaders import labelled_data
from src.tools import export, predict, prepare

# File names as an attacker would write them: a spreadsheet evaluates a cell that starts with
# = + - @ (quoted or not); a carriage return split the row in csv.reader and pandas.
FORMULAS = ["=1+2.jpg", "+cmd.jpg", "-2+3.jpg", "@SUM(A1).jpg", '=HYPERLINK("http:evil","x").jpg', "\tTAB.jpg",
            "'quoted.jpg"]
SPLITTERS = ["cr\rhere.jpg", "lf\nhere.jpg", "comma,here.jpg", 'quote"here.jpg']
TERMINAL = ["esc\x1b[2J\x1b[31mred.jpg", "bidi\u202egpj.exe.jpg"]
NOT_UTF8 = os.fsdecode(b"bad\xff.jpg")  # as Python lists a name whose bytes are not UTF-8


@pytest.fixture
def named(tiny_data, tmp_path):
    """A folder of test images under those names, a broken one with an escape sequence in its
    name, a link to nothing and a loop of links."""
    folder = tmp_path / "named"
    folder.mkdir()
    sources = sorted((tiny_data / "test").iterdir())
    for i, name in enumerate(FORMULAS + SPLITTERS + TERMINAL + [NOT_UTF8]):
        shutil.copy(sources[i % len(sources)], folder / name)
    (folder / "broken\x1b[8m.jpg").write_bytes(b"\xff\xd8 not a JPEG")
    (folder / "dangling.jpg").symlink_to("nowhere.jpg")
    (folder / "loop.jpg").symlink_to("loop.jpg")
    return folder


def test_predict_csv_reads_back_row_for_row_and_opens_safely_in_a_spreadsheet(named, untrained, tmp_path, monkeypatch,
                                                                             capsys):
    """Formula names get a ' in front (OWASP), names with line breaks are quoted: csv.reader and
    pandas read one row per image, and dropping one leading ' gives each name back."""
    out = tmp_path / "p.csv"
    monkeypatch.chdir(named)  # `predict .` lists the bare names, which is where a formula can start a cell
    code, _, err = in_process(predict.main, [".", "--checkpoint", str(untrained), "--output", str(out),
                                             "--workers", "0"], monkeypatch, capsys)
    assert code == 0, err
    names = sorted(FORMULAS + SPLITTERS + TERMINAL + [NOT_UTF8])
    data = out.read_bytes().decode("utf-8", "surrogateescape")
    rows = list(csv.reader(io.StringIO(data, newline="")))[1:]
    frame = pd.read_csv(out, dtype=object, keep_default_na=False, encoding_errors="surrogateescape")
    assert len(rows) == len(frame) == len(names)
    written = {row[0] for row in rows}
    assert set(frame["path"]) == written
    for name in names:
        dangerous = name[0] in "=+-@\t'"
        assert ("'" + name if dangerous else name) in written, name
    assert not any(cell[0] in "=+-@\t\r" for row in rows for cell in row)


def test_names_reach_the_terminal_escaped(named, untrained, tmp_path, monkeypatch, capsys):
    """An escape sequence or a carriage return in a name could clear the screen or hide rows of
    predict's table and its "left out" lines; a name that is not UTF-8 raised UnicodeEncodeError
    after the CSV was written. Each is shown as a backslash escape; links to nothing and loops of
    links are left out with the reason, not dropped without a word."""
    for name in FORMULAS:  # the table shows 10 rows: those below
        (named / name).unlink()
    monkeypatch.chdir(named)
    code, out, err = in_process(predict.main, [".", "--checkpoint", str(untrained), "--output", str(tmp_path / "p.csv"),
                                               "--workers", "0"], monkeypatch, capsys)
    assert code == 0, err
    assert not any(char in out for char in "\x1b\r\u202e"), out
    assert "left out broken\\x1b[8m.jpg: cannot decode it" in out
    assert "left out dangling.jpg: cannot decode it (a symbolic link to nowhere.jpg, which does not exist)" in out
    assert "left out loop.jpg: cannot decode it (a loop of symbolic links)" in out
    assert "left out 3 that cannot be decoded" in out
    for shown in ("cr\\rhere.jpg", "esc\\x1b[2J\\x1b[31mred.jpg", "bad\\xff.jpg", "bidi\\u202egpj.exe.jpg"):
        assert shown in out
    # An error message naming a file escapes it too.
    line = fails_in_process(predict.main, [str(named / "esc\x1b[2Jnothing.jpg"), "--checkpoint", str(untrained)],
                            monkeypatch, capsys, "esc\\x1b[2Jnothing.jpg: no such file or folder")
    assert "\x1b" not in line


def test_training_and_prepare_take_names_that_are_not_utf8_or_hold_line_breaks(tiny_data, tmp_path, monkeypatch,
                                                                                capsys):
    """Training on train/Cat/bad\\xff.jpg without train.csv raised UnicodeEncodeError, and after
    prepare the run refused its own train.csv; a carriage return in a name split train.csv's row.
    The scan, prepare's train.csv and the table read back from it agree, as does the digest
    --resume checks."""
    data = tmp_path / "data"
    for kind in ("Cat", "Dog"):
        (data / "train" / kind).mkdir(parents=True)
        for i, source in enumerate(sorted((tiny_data / "train").glob(f"{kind.lower()}.*.jpg"))[:6]):
            shutil.copy(source, data / "train" / kind / f"{i}.jpg")
    shutil.copy(tiny_data / "train" / "cat.7.jpg", data / "train" / "Cat" / NOT_UTF8)
    shutil.copy(tiny_data / "train" / "cat.8.jpg", data / "train" / "Cat" / "cr\rhere.jpg")
    args = defaults(data_dir=str(data), image_size=32, cache=None, val_fraction=0.2, seed=0, workers=0, evaluate=False)
    scanned = labelled_data(args)
    assert f"Cat/{NOT_UTF8}" in list(scanned.dataset.frame["filename"])
    code, out, err = in_process(prepare.main, [str(data)], monkeypatch, capsys)
    assert code == 0 and "8 cats, 6 dogs" in out, err
    table = read_labels_csv(data / "train.csv", data / "train")
    assert len(table) == 14 and {f"Cat/{NOT_UTF8}", "Cat/cr\rhere.jpg"} <= set(table["filename"])
    assert labelled_data(args).digest == scanned.digest


def test_links_to_nothing_in_train_are_counted_and_named(tiny_data, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_data / "train", data / "train")
    (data / "train" / "cat.100.jpg").symlink_to("nowhere.jpg")
    (data / "train" / "dog.100.jpg").symlink_to("dog.100.jpg")
    load_labels(data)
    assert "left out 2 unreadable image(s), first cat.100.jpg" in capsys.readouterr().out
    code, out, err = in_process(prepare.main, [str(data)], monkeypatch, capsys)
    assert code == 0 and "2 left out as unreadable" in out, err
    assert {"left out (unreadable): cat.100.jpg", "left out (unreadable): dog.100.jpg"} <= set(out.splitlines())


def test_a_zipped_train_folder_and_a_folder_of_one_class(tiny_data, tmp_path, monkeypatch, capsys):
    """prepare on Kaggle's download said "not found"; a folder of cats alone trained to val acc 1.0."""
    zipped = tmp_path / "zipped"
    zipped.mkdir()
    (zipped / "train.zip").write_bytes(b"PK\x03\x04")
    fails_in_process(prepare.main, [str(zipped)], monkeypatch, capsys,
                     f"{zipped / 'train'} is not a folder, but {zipped / 'train.zip'} is there: unzip it first")
    cats = tmp_path / "cats"
    (cats / "train").mkdir(parents=True)
    for source in sorted((tiny_data / "train").glob("cat.*.jpg")):
        shutil.copy(source, cats / "train")
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(cats), *outputs(tmp_path / "out")], monkeypatch,
                     capsys, f"{cats} holds cats only (20 images, no dog): training needs both classes")
    assert not (tmp_path / "out" / "best.pth").exists()


def test_workers_above_the_cpus_are_capped_in_one_line(untrained, tiny_data, tmp_path, monkeypatch, capsys):
    """--workers 100000 started 700+ processes and took 16 GB before it was killed. (The runs here
    ask for one worker more than the CPUs: uncapped, they would still end.)"""
    cpus = available_cpus()
    args = parse_args("", ["--workers", "100000"])
    assert args.workers == cpus
    assert capsys.readouterr().err == (f"--workers 100000 is more than the {cpus} CPU(s) this process may "
                                       f"use: using {cpus}\n")
    seen = []
    import src.inference as inference
    predict_files = inference.predict_files
    monkeypatch.setattr(inference, "predict_files", lambda *a, **k: seen.append(a[5]) or predict_files(*a, **k))
    cpus = len(os.sched_getaffinity(0))
    code, out, err = in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output",
                                               str(tmp_path / "p.csv"), "--workers", str(cpus + 1)], monkeypatch, capsys)
    assert code == 0 and err.startswith(f"--workers {cpus + 1} is more than the {cpus} CPU(s)"), err
    assert seen == [cpus], "the loader got the capped count"


# A hand-edited best.json: each bad field, and the line that names it.
BAD_FIELDS = [
    ({"classes": ["dog", "cat"]}, "classes ['dog', 'cat'] must be ['cat', 'dog']"),
    ({"classes": ["cat"]}, "classes ['cat'] must be ['cat', 'dog']"),
    ({"classes": None}, "classes None must be ['cat', 'dog']"),
    ({"mean": "0.5"}, "mean '0.5' must be three finite numbers"),
    ({"mean": [0.5]}, "mean [0.5] must be three finite numbers"),
    ({"std": [0.2, "x", 0.2]}, "std [0.2, 'x', 0.2] must be three finite numbers"),
    ({"std": [0, 0, 0]}, "std [0, 0, 0] must be above 0"),
    ({"image_size": 0}, "image_size 0 must be a whole number from 32 to 2048"),
    ({"image_size": "32"}, "image_size '32' must be a whole number"),
    ({"image_size": 32.5}, "image_size 32.5 must be a whole number"),
    ({"image_size": True}, "image_size True must be a whole number"),
    ({"image_size": 2049}, "image_size 2049 must be a whole number from 32 to 2048"),
    ({"arch": "nosuchnet"}, "arch 'nosuchnet' is not a torchvision classification model"),
    ({"arch": "fasterrcnn_resnet50_fpn"}, "arch 'fasterrcnn_resnet50_fpn' is not a torchvision classification model"),
    ({"arch": "vit_b_16"}, "image_size 32: --arch vit_b_16 takes --image-size 224 only"),
    ({"num_classes": 3}, "num_classes 3 must be 2"),
]


def test_an_image_size_above_the_range_is_refused_as_a_flag(capsys):
    """--image-size has best.json's range: no run writes a best.json that predict refuses."""
    with pytest.raises(SystemExit) as exit:
        parse_args("", ["--image-size", "2049"])
    assert exit.value.code == 2 and "argument --image-size: must be at most 2048, got 2049" in capsys.readouterr().err
    assert parse_args("", ["--image-size", "2048"]).image_size == 2048


@pytest.mark.parametrize("fields, message", BAD_FIELDS)
def test_a_hand_edited_best_json_is_refused_field_by_field_at_start(fields, message, untrained, tiny_data, tmp_path,
                                                                     monkeypatch, capsys):
    """Other classes failed after the whole pass, a bad mean or size gave tracebacks, a zero std
    wrote an empty CSV with exit 0, 60000 px was killed by the OOM killer at 20 GB."""
    checkpoint = write_checkpoint(tmp_path / "model", torch.load(untrained, weights_only=True), **fields)
    for main, argv in ((predict.main, [str(tiny_data / "test"), "--checkpoint", str(checkpoint), "--output",
                                       str(tmp_path / "p.csv"), "--workers", "0"]),
                       (export.main, [str(checkpoint), str(tmp_path / "m.onnx"), "--images", str(tiny_data / "test")])):
        line = fails_in_process(main, argv, monkeypatch, capsys, f"{checkpoint.with_suffix('.json')}: {message}")
        assert line.endswith("fix it, or retrain to have it written again")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"], "nothing written"


def test_a_huge_image_size_is_refused_before_it_fills_the_memory(untrained, tiny_data, tmp_path):
    """image_size 60000 was killed by the OOM killer at about 20 GB. Here predict runs with its
    address space capped at 3 GB above what it has after its imports, so that without the check it
    fails (MemoryError) instead of taking the machine's memory."""
    checkpoint = write_checkpoint(tmp_path / "model", torch.load(untrained, weights_only=True), image_size=60000)
    cap = 3 * 2**30

    def limited():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (cap + 4 * 2**30, cap + 4 * 2**30))  # the imports take about 3.5 GB
    result = subprocess.run([sys.executable, "-m", "src.tools.predict", str(tiny_data / "test"), "--checkpoint",
                             str(checkpoint), "--output", str(tmp_path / "p.csv"), "--workers", "0"],
                            cwd=ROOT, capture_output=True, text=True, preexec_fn=limited, timeout=300)
    fails(result, "image_size 60000 must be a whole number from 32 to 2048 (as --image-size")
    assert not (tmp_path / "p.csv").exists()


def test_a_best_json_that_is_not_an_object(untrained, tiny_data, tmp_path, monkeypatch, capsys):
    checkpoint = write_checkpoint(tmp_path / "model", torch.load(untrained, weights_only=True))
    checkpoint.with_suffix(".json").write_text(json.dumps([1, 2]))
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(checkpoint)], monkeypatch, capsys,
                     "best.json: is not a JSON object")


def test_the_best_json_check_passes_every_model_training_can_write():
    """The check refuses no best.json of a run: every arch at --image-size's smallest (or only) size."""
    from src.inference import _info_problem
    from src.models import MIN_IMAGE_SIZE, ONLY_IMAGE_SIZE, classification_models
    for arch in classification_models():
        size = ONLY_IMAGE_SIZE.get(arch, max(32, MIN_IMAGE_SIZE.get(arch, 32)))
        info = {"arch": arch, "image_size": size, "num_classes": 2, "classes": ["cat", "dog"],
                "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
        assert _info_problem(info) is None, arch


@pytest.mark.parametrize("value", ["1", "2", "-0.1"])
def test_a_momentum_outside_0_to_1_is_refused_as_a_flag(value, capsys):
    """--momentum 2 trained: at 1 and above SGD's velocity grows without bound (torch.optim.SGD
    takes any momentum >= 0)."""
    with pytest.raises(SystemExit) as exit:
        parse_args("", [*TINY, "--momentum", value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: argument --momentum: must be in [0, 1), got {float(value)}" in err, err
    assert parse_args("", [*TINY, "--momentum", "0.99"]).momentum == 0.99


@pytest.fixture
def pipes():
    """pipes(path, ...): named pipes (FIFOs) made there; pipes.opened: those a command opened.
    Opening one to read waits for a writer: should a command open
    one, a thread of the test opens its other end after 10 s and closes it at once, so that the
    command reads an empty file rather than wait for ever, and the test fails."""
    import threading
    import time
    made, done, opened = [], threading.Event(), []

    def unblock():
        if done.wait(10):
            return
        while not done.is_set():
            for path in made:
                try:
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only if a reader has it open
                    opened.append(path)
                except OSError:
                    pass
            time.sleep(0.1)

    def make(*paths: Path) -> list[Path]:
        for path in paths:
            os.mkfifo(path)
            made.append(path)
        return list(paths)
    make.opened = opened
    thread = threading.Thread(target=unblock, daemon=True)
    thread.start()
    yield make
    done.set()
    thread.join()


def test_a_named_pipe_is_named_for_what_it_is_and_never_opened(pipes, untrained, tiny_data, tmp_path, monkeypatch,
                                                                 capsys):
    """`predict fifo.jpg` said "no such file or folder", `--weights fifo.pth` "no such file"; a FIFO
    named cat.200.jpg in train/ was skipped without being named. Opening a pipe waits for a
    writer: none is opened, each is named as a named pipe (FIFO) in one line, and a pipe among
    the files of a folder is left out with that reason, as an image that cannot be decoded is."""
    fifo_jpg, fifo_pth = pipes(tmp_path / "fifo.jpg", tmp_path / "fifo.pth")
    fails_in_process(predict.main, [str(fifo_jpg), "--checkpoint", str(untrained), "--output", str(tmp_path / "p.csv")],
                     monkeypatch, capsys, f"error: {fifo_jpg}: a named pipe (FIFO), not a regular file or folder")
    folder = tmp_path / "images"
    folder.mkdir()
    shutil.copy(sorted((tiny_data / "test").iterdir())[0], folder / "real.jpg")
    pipes(folder / "pipe.jpg")
    code, out, err = in_process(predict.main, [str(folder), "--checkpoint", str(untrained), "--output",
                                               str(tmp_path / "p.csv")], monkeypatch, capsys)
    assert code == 0 and f"left out {folder / 'pipe.jpg'}: cannot decode it (a named pipe (FIFO), not a regular " \
                          "file)" in out and "predicted 1 images" in out, (out, err)
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), "--weights", str(fifo_pth),
                                         *outputs(tmp_path / "out")], monkeypatch, capsys,
                     f"--weights {fifo_pth}: a named pipe (FIFO), not a regular file (use `default`")
    data = tmp_path / "data"
    shutil.copytree(tiny_data / "train", data / "train")
    pipes(data / "train" / "cat.200.jpg")
    code, out, err = in_process(prepare.main, [str(data)], monkeypatch, capsys)
    assert code == 0 and "left out (unreadable): cat.200.jpg" in out and "1 left out as unreadable" in out, (out, err)
    (data / "train.csv").unlink()
    pipes(data / "train.csv")
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(data), *outputs(tmp_path / "out")], monkeypatch,
                     capsys, f"{data / 'train.csv'}: a named pipe (FIFO), not a regular file: remove it")
    pipes(tmp_path / "data-pipe")
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tmp_path / "data-pipe"), *outputs(tmp_path / "out")],
                     monkeypatch, capsys, f"data folder {tmp_path / 'data-pipe'}: a named pipe (FIFO), not a regular file "
                     "or folder: pass --data-dir")
    checkpoint = tmp_path / "run" / "best.pth"
    checkpoint.parent.mkdir()
    shutil.copy(untrained, checkpoint)
    pipes(checkpoint.with_suffix(".json"))
    fails_in_process(predict.main, [str(folder), "--checkpoint", str(checkpoint), "--output", str(tmp_path / "q.csv")],
                     monkeypatch, capsys, f"{checkpoint.with_suffix('.json')}: a named pipe (FIFO), not a regular file")
    assert not (tmp_path / "out" / "best.pth").exists() and not (tmp_path / "q.csv").exists()
    assert pipes.opened == []


def test_predict_and_export_given_a_last_pth_say_it_is_a_training_checkpoint(untrained, tiny_data, tmp_path,
                                                                             monkeypatch, capsys):
    """predict and export given last.pth said "last.json is missing or unreadable"; it is a
    training checkpoint (what --resume goes on from), and best.pth is beside it."""
    last = tmp_path / "last.pth"
    state = torch.load(untrained, weights_only=True)
    torch.save({"model": state, "optimizer": {"state": {}, "param_groups": []}, "history": [], "epoch": 1}, last)
    said = f"error: {last} is a training checkpoint (a last.pth: the model with its optimizer and history, for " \
           "--resume): give the best.pth beside it"
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(last), "--output",
                                    str(tmp_path / "p.csv")], monkeypatch, capsys, said)
    fails_in_process(export.main, [str(last), str(tmp_path / "m.onnx")], monkeypatch, capsys, said)
    torch.save(state, last)  # a state_dict named last.pth: no best.json, as before
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(last)], monkeypatch, capsys,
                     f"{tmp_path / 'last.json'} is missing or unreadable")
    # best.json given for best.pth: it said best.json "is not the file that best.json describes"
    (tmp_path / "best.json").write_text("{}")
    said = f"error: {tmp_path / 'best.json'} describes a checkpoint: give the weights it describes, {tmp_path / 'best.pth'}"
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(tmp_path / "best.json")],
                     monkeypatch, capsys, said)
    fails_in_process(export.main, [str(tmp_path / "best.json"), str(tmp_path / "m.onnx")], monkeypatch, capsys, said)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["best.json", "last.pth"]
