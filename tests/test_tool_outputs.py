"""What the tools write, and where (src.outputs.check_tool_output, claim_folder): a tool replaces
only a file it wrote itself (a CSV with predict's header, an ONNX file with export's metadata, a
report with its mark) or any file with --overwrite, never a training run's files, nothing in the
folder of a training run in progress; a tool that owns a whole folder (benchmark, compare_recipes,
chaos) refuses one it did not mark. The names a command will write, temporary ones included, are
tried at its start; a named pipe is never opened, a link never replaced; Ctrl-C says what the
tool left, not training's --resume. Every refusal: one line, exit 2, nothing written or replaced."""
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest
from conftest import ROOT, TINY, fails_in_process, in_process, mode_run, outputs, python, run_main

import train_single
from src.outputs import atomic_write_text, lock_outputs
from src.tools import benchmark, chaos, compare_recipes, export, predict, report
from src.tools.onnx_model import FORMAT


def temporaries(path: Path) -> list[Path]:
    """The temporary files in path's folder: names starting with a dot, ending in .tmp, holding
    path's name or a shortening of it (src.outputs.temp_prefix)."""
    return [p for p in path.parent.iterdir() if p.name.startswith(".") and p.name.endswith(".tmp")
            and (path.name in p.name or "~" in p.name)]


def snapshot(*folders: Path) -> dict:
    """Every entry under the folders: its kind, its bytes (a file) or target (a link), and its
    time of change."""
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            info = os.lstat(path)
            content = (os.readlink(path) if stat.S_ISLNK(info.st_mode)
                       else path.read_bytes() if stat.S_ISREG(info.st_mode) else None)
            found[path] = (stat.S_IFMT(info.st_mode), content, info.st_mtime_ns)
    return found


def holder(folder: Path) -> subprocess.Popen:
    """Another process holding the run lock of folder (src.outputs.hold), as a training run in
    progress does, until it is killed."""
    code = textwrap.dedent("""
        import sys
        from pathlib import Path
        from src.outputs import hold
        hold(Path(sys.argv[1]))
        print("held", flush=True)
        sys.stdin.read()
    """)
    process = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "held"
    return process


@pytest.fixture
def run_folder(untrained, tmp_path) -> Path:
    """A training run's folder: best.pth and best.json (untrained), last.pth, history.json."""
    folder = tmp_path / "m"
    shutil.copytree(untrained.parent, folder)
    shutil.copy(folder / "best.pth", folder / "last.pth")
    (folder / "history.json").write_text("[]\n")
    return folder


def _onnx_file(path: Path, ours: bool, props: dict | None = None) -> Path:
    """A tiny ONNX model (an identity), with export's format mark or without, or with the metadata `props`."""
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "g",
                                   [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])])
    model = onnx.helper.make_model(graph)
    props = props if props is not None else {"format": FORMAT} if ours else {}
    if props:
        onnx.helper.set_model_props(model, props)
    onnx.save(model, str(path))
    return path


def test_the_tools_never_write_over_a_runs_files_nor_a_file_not_theirs(run_folder, tiny_data, tmp_path,
                                                                      monkeypatch, capsys):
    """`export m/best.pth m/last.pth` turned last.pth into an ONNX file (the next --resume failed);
    `predict --output` replaced any file. A run's files are refused with --overwrite too; another
    file of the user's without it."""
    test, notes = tiny_data / "test", tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    foreign = _onnx_file(tmp_path / "theirs.onnx", ours=False)
    before = snapshot(tmp_path)
    for target, what in [(run_folder / "last.pth", "is a checkpoint (.pth) of a training run"),
                         (run_folder / "history.json", "is the history of a training run")]:
        for overwrite in ([], ["--overwrite"]):
            fails_in_process(export.main, [str(run_folder / "best.pth"), str(target), "--images", str(test),
                                           *overwrite], monkeypatch, capsys, f"OUTPUT {target} {what}")
            fails_in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"), "--output",
                                            str(target), "--workers", "0", *overwrite], monkeypatch, capsys,
                             f"--output {target} {what}: the tools never write over a run's files")
    line = fails_in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"), "--output",
                                           str(notes), "--workers", "0"], monkeypatch, capsys,
                            f"--output {notes} exists and is not a CSV of predict")
    assert line.endswith("name another file, or pass --overwrite to replace it")
    for target in (notes, foreign):
        fails_in_process(export.main, [str(run_folder / "best.pth"), str(target), "--images", str(test)],
                         monkeypatch, capsys, f"OUTPUT {target} exists and is not an ONNX file of src.tools.export")
    assert snapshot(tmp_path) == before, "nothing written, nothing replaced"

    # What they wrote themselves they replace; another file with --overwrite.
    old = tmp_path / "old.csv"
    old.write_text("path,p_dog,label\nx.jpg,0.5,cat\n")
    for target, flags in ((old, []), (notes, ["--overwrite"])):
        code, out, err = in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"),
                                                   "--output", str(target), "--workers", "0", *flags],
                                    monkeypatch, capsys)
        assert code == 0 and target.read_text().startswith("path,p_dog,label\n") and len(target.read_text().splitlines()) == 7, err
    ours = _onnx_file(tmp_path / "ours.onnx", ours=True)
    assert export.is_export(ours) and not export.is_export(foreign) and not export.is_export(notes)
    assert predict.is_predict_csv(old) and not predict.is_predict_csv(foreign)


def test_an_onnx_file_whose_format_is_another_tools_is_not_exports(run_folder, tiny_data, tmp_path, monkeypatch,
                                                                     capsys):
    """An ONNX file with a "format" in its metadata that is not export's FORMAT is another tool's:
    export refuses to replace it without --overwrite (one line, exit 2, nothing written)."""
    other = _onnx_file(tmp_path / "other.onnx", ours=False, props={"format": "another-tool/1"})
    assert not export.is_export(other)
    before = snapshot(tmp_path)
    fails_in_process(export.main, [str(run_folder / "best.pth"), str(other), "--images", str(tiny_data / "test")],
                     monkeypatch, capsys, f"OUTPUT {other} exists and is not an ONNX file of src.tools.export")
    assert snapshot(tmp_path) == before, "nothing written, nothing replaced"


def test_no_tool_writes_into_the_folder_of_a_run_in_progress(run_folder, tiny_data, runs, tmp_path, monkeypatch,
                                                            capsys):
    """Export and predict neither checked nor took the run's lock: a file written into the folder
    of a run that is saving there. The line names the run; the folder is as it was."""
    trained = tmp_path / "trained"
    shutil.copytree(mode_run(runs, "single")[0], trained)
    test = tiny_data / "test"
    processes = [holder(run_folder), holder(trained)]
    try:
        before = snapshot(tmp_path)
        message = "is the folder of a training run in progress (pid {} on "
        fails_in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"), "--output",
                                        str(run_folder / "p.csv"), "--workers", "0"], monkeypatch, capsys,
                         f"--output {run_folder} " + message.format(processes[0].pid))
        fails_in_process(export.main, [str(run_folder / "best.pth"), str(run_folder / "m.onnx"), "--images",
                                       str(test)], monkeypatch, capsys, f"OUTPUT {run_folder} "
                         + message.format(processes[0].pid))
        line = fails_in_process(report.main, [str(trained)], monkeypatch, capsys,
                                f"--output {trained} " + message.format(processes[1].pid))
        assert line.endswith("wait for it to end, or write elsewhere")
        assert snapshot(tmp_path) == before
    finally:
        for process in processes:
            process.kill()
            process.wait()
    # Once the run has ended (the kernel dropped its lock), the folder takes the tool's file.
    code, _, err = in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"), "--output",
                                             str(run_folder / "p.csv"), "--workers", "0"], monkeypatch, capsys)
    assert code == 0 and (run_folder / "p.csv").exists(), err


def test_a_name_that_fits_is_saved_and_one_that_does_not_is_refused_at_start(tiny_data, untrained, tmp_path,
                                                                             monkeypatch, capsys):
    """A --checkpoint of 249 bytes passed the start checks, then the first save failed on its
    temporary name (.NAME.XXXXXXXX.tmp, over 255 bytes): an epoch lost. Now its temporary name
    fits, and a name the file system refuses (256 bytes) is refused before the epoch, as predict's
    --output is before its pass."""
    import src.inference
    long_name = "c" * 245 + ".pth"  # 249 bytes
    out = tmp_path / "out"
    code, stdout, err = in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), "--checkpoint",
                                                       str(out / long_name), "--plot", str(out / "curves.png")],
                                   monkeypatch, capsys)
    assert code == 0, err
    assert (out / long_name).is_file() and (out / ("c" * 245 + ".json")).is_file() and not temporaries(out / long_name)

    too_long = tmp_path / "out2" / ("d" * 252 + ".pth")  # 256 bytes
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), "--checkpoint", str(too_long),
                                         "--plot", str(tmp_path / "c2.png")], monkeypatch, capsys,
                     f"--checkpoint {too_long}: cannot make a file of that name there (File name too long)")
    csv = tmp_path / ("p" * 252 + ".csv")
    with monkeypatch.context() as patch:
        patch.setattr(src.inference, "predict_files", lambda *args, **kwargs: pytest.fail("the pass ran"))
        fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output",
                                        str(csv), "--workers", "0"], monkeypatch, capsys,
                         f"--output {csv}: cannot write there (File name too long)")
    assert not (tmp_path / "c2.png").exists() and not list(tmp_path.glob("p*"))
    assert [path.name for path in (tmp_path / "out2").iterdir()] == [".run.lock"], "no epoch was saved"
    csv = tmp_path / ("p" * 246 + ".csv")  # 250 bytes: written, through a temporary name that fits
    assert in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output", str(csv),
                                     "--workers", "0"], monkeypatch, capsys)[0] == 0
    assert csv.read_text().startswith("path,p_dog,label\n")


def test_temporary_names_fit_and_are_found_by_name_not_by_pattern(tmp_path):
    """A run's start removes what a killed save of its outputs left: by glob, a name holding [ ]
    was a pattern, and the clean-up removed another file's temporary file (.best1.pth.*.tmp for
    best[1].pth) and left its own. Every name up to 255 bytes has a temporary name within 255
    bytes, the same each time (a later run finds what a killed one left)."""
    from src.cli import parse_args
    ours, other = tmp_path / ".best[1].pth.k1ll3d.tmp", tmp_path / ".best1.pth.k1ll3d.tmp"
    ours.write_bytes(b"a save of best[1].pth that was killed")
    other.write_bytes(b"another run's save in progress")
    backup = tmp_path / ".best[1].pth.backup"  # a user's file whose name starts as a temporary one does
    backup.write_bytes(b"the user's copy")
    with lock_outputs(parse_args("", [*TINY, "--checkpoint", str(tmp_path / "best[1].pth"), "--plot",
                                      str(tmp_path / "c.png"), "--overwrite"])):
        pass
    assert not ours.exists() and other.read_bytes() == b"another run's save in progress"
    assert backup.read_bytes() == b"the user's copy", "only a temporary file (.tmp) is removed"
    backup.unlink()

    from src.outputs import temp_prefix, temporaries
    for length in (1, 100, 240, 241, 242, 250, 255):
        for char in ("a", "é"):
            name = (char * length).encode()[:length].decode(errors="ignore") or "a"
            prefix = temp_prefix(tmp_path / name)
            assert len(os.fsencode(prefix)) + 8 + len(".tmp") <= 255 and prefix == temp_prefix(tmp_path / name)
            assert prefix == f".{name}." or len(os.fsencode(name)) > 240
    long_name = tmp_path / ("x" * 250 + ".pth")
    stale = tmp_path / (temp_prefix(long_name) + "k1ll3d.tmp")
    stale.write_bytes(b"a save of the long name that was killed")
    assert temporaries(long_name) == [stale] and temporaries(tmp_path / "best1.pth") == [other]
    atomic_write_text(long_name, "x")
    assert long_name.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".run.lock", long_name.name, stale.name, other.name])


def test_report_output_that_is_a_named_pipe_or_a_link_is_refused_without_opening_it(runs, tmp_path):
    """`report --output` naming a FIFO hung for ever (it read the target before checking its
    kind); a link to a report was replaced by a file."""
    run = tmp_path / "run"
    shutil.copytree(mode_run(runs, "single")[0], run)
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "real.html").write_text(f"<!-- {report.GENERATOR} --> an earlier report")
    (tmp_path / "link.html").symlink_to(tmp_path / "real.html")
    before = snapshot(tmp_path)
    for target, kind in ((tmp_path / "link.html", f"a symbolic link to {tmp_path / 'real.html'}"),
                         (tmp_path / "pipe", "a named pipe (FIFO)")):
        if "link" in kind:
            result = run_main(report.main, [str(run), "--output", str(target)])
        else:  # a process of its own: opening the FIFO would wait for a writer for ever
            result = python("-m", "src.tools.report", str(run), "--output", str(target), timeout=120)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.strip().endswith("not a regular file (the output would replace "
                                              + ("the link, not its target" if "link" in kind else "it with a file")
                                              + "): name a new file or a regular one"), result.stderr
        assert f"--output {target} is {kind}" in result.stderr
    assert snapshot(tmp_path) == before


def test_messages_name_what_the_command_has(run_folder, tiny_data, runs, tmp_path, monkeypatch, capsys):
    """Ctrl-C in predict, export or report said "rerun with --resume", which they do not have; a
    report of a folder without best.pth said "pass --checkpoint"; `--output afile/p.csv` said
    "(File exists)"."""
    test = tiny_data / "test"
    afile = tmp_path / "afile"
    afile.write_text("a file\n")
    fails_in_process(predict.main, [str(test), "--checkpoint", str(run_folder / "best.pth"), "--output",
                                    str(afile / "p.csv"), "--workers", "0"], monkeypatch, capsys,
                     f"--output {afile / 'p.csv'}: cannot write there ({afile} is a file, not a folder)")
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), *outputs(afile / "out")],
                     monkeypatch, capsys, f"cannot write to folder {afile / 'out'} ({afile} is a file, not a folder)")
    empty = tmp_path / "empty"
    empty.mkdir()
    line = fails_in_process(report.main, [str(empty)], monkeypatch, capsys, f"RUN_DIR {empty} holds no best.pth")
    assert "--checkpoint " not in line.replace("--checkpoint's", "")
    assert afile.read_text() == "a file\n" and list(empty.iterdir()) == []

    trained = tmp_path / "trained"
    shutil.copytree(mode_run(runs, "single")[0], trained)
    commands = {predict: ([str(test), "--checkpoint", str(run_folder / "best.pth"), "--output", str(tmp_path / "p.csv"),
                           "--workers", "0"], "p.csv", "no CSV written (an earlier --output file"),
                export: ([str(run_folder / "best.pth"), str(tmp_path / "m.onnx"), "--images", str(test)], "m.onnx",
                         "nothing written (an earlier OUTPUT"),
                report: ([str(trained), "--output", str(tmp_path / "r.html")], "r.html",
                         "no report written (an earlier --output file")}
    for name, (argv, target, said) in commands.items():
        result = run_main(name.main, argv, env={"INTERRUPT_AT_REPLACE": f"{target}:1"})
        assert result.returncode == 130, (name, result.stderr[-2000:])
        last = result.stderr.strip().splitlines()[-1]
        assert last == f"interrupted: {said} is as it was); run the command again", (name, last)
        assert not (tmp_path / target).exists() and not temporaries(tmp_path / target), name


@pytest.mark.parametrize("tool", ["benchmark", "compare_recipes", "chaos"])
def test_a_tool_that_owns_a_folder_refuses_one_it_did_not_write(tool, tmp_path, monkeypatch, capsys):
    """`benchmark --out-dir .` or `compare_recipes --out-dir .` removed ./data (a user's Kaggle
    images) to write a synthetic set there; chaos's --work-dir likewise. A folder holding what the
    tool writes, without its mark, is refused before anything is removed."""
    from conftest import Asked
    folder = tmp_path / "mine"
    (folder / "data" / "train").mkdir(parents=True)
    (folder / "data" / "train" / "cat.0.jpg").write_bytes(b"a user's photo")
    (folder / "chaos").mkdir()
    (folder / "chaos" / "notes.txt").write_text("a user's notes\n")
    before = snapshot(tmp_path)

    def stop(*args, **kwargs):  # where the tool would go on to train: the test has seen enough
        raise Asked
    module, argv = {"benchmark": (benchmark, ["--out-dir", str(folder), "--images", "4"]),
                    "compare_recipes": (compare_recipes, ["--out-dir", str(folder), "--images", "10"]),
                    "chaos": (chaos, ["--work-dir", str(folder), "--reference", str(tmp_path / "reference")])}[tool]
    monkeypatch.setattr(module, "write_dataset", stop, raising=False)
    for name in ("labelled_images", "run_script", "launch"):
        monkeypatch.setattr(module, name, stop, raising=False)
    try:
        code, _, err = in_process(module.main, argv, monkeypatch, capsys)
    except Asked:
        code, err = None, "went on"
    flag = "--work-dir" if tool == "chaos" else "--out-dir"
    assert code == 2 and err.count("\n") == 1, (code, err)
    assert f"{flag} {folder} holds data, " in err and f"which src.tools.{tool} did not write" in err, err
    assert snapshot(tmp_path) == before
