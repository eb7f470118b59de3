"""Where the commands write. An existing target that is not a regular file (a named pipe, a
device, a link, a folder) is refused at start, as is an output that is an input of the same
command or another output of the same run; one training run at a time holds its --checkpoint
folder (a lock that the kernel drops when the process dies, also while a forked child lives on);
a new run does not replace an earlier run's files without --resume or --overwrite; export cleans
up after a killed export and says a full disk in one line; synthetic writes only where it may.
Every refusal ends in one line before any work: the tests check that nothing was written."""
import csv
import io
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, fails_in_process, history, in_process, outputs, run

import train_ddp
import train_dp
import train_single
from src.cli import parse_args
from src.outputs import lock_outputs
from src.tools import export, predict, prepare, synthetic


def _train_fails(argv, monkeypatch, capsys, message, main=train_single.main) -> str:
    return fails_in_process(main, [*TINY, *argv], monkeypatch, capsys, message)


def _special(folder: Path) -> tuple[Path, Path | None]:
    """A named pipe, and a character device with the null device's numbers (None where this
    process may not make one), made in folder: never the machine's own /dev."""
    os.mkfifo(folder / "pipe")
    try:
        os.mknod(folder / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        return folder / "pipe", None
    return folder / "pipe", folder / "null"


def _snapshot(*folders: Path) -> dict:
    """Every entry under the folders: its kind and, for a file, its bytes."""
    return {path: (stat.S_IFMT(os.lstat(path).st_mode), path.read_bytes() if path.is_file() and not path.is_symlink()
                   else None) for folder in folders for path in sorted(folder.rglob("*"))}


def test_training_refuses_a_target_that_is_not_a_regular_file(tiny_data, tmp_path, monkeypatch, capsys):
    """As root, --plot /dev/null had /dev/null replaced by a PNG; --checkpoint naming a folder
    trained a whole epoch, then failed."""
    pipe, device = _special(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "real.png").write_bytes(b"kept")
    (tmp_path / "link.png").symlink_to(tmp_path / "real.png")
    out = tmp_path / "out"
    folder, link, real = tmp_path / "folder", tmp_path / "link.png", tmp_path / "real.png"
    cases = [(["--plot", str(pipe)], f"--plot {pipe} is a named pipe (FIFO), not a regular file"),
             (["--checkpoint", str(folder)], f"--checkpoint {folder} is a folder, not a regular file"),
             (["--plot", str(link)], f"--plot {link} is a symbolic link to {real}"),
             (["--log-dir", str(tmp_path / "real.png")], f"--log-dir {tmp_path / 'real.png'} is a file, not a folder")]
    if device is not None:
        cases.append((["--plot", str(device)], f"--plot {device} is a character device, not a regular file"))
    before = _snapshot(tmp_path)
    for flags, message in cases:
        _train_fails(["--data-dir", str(tiny_data), *outputs(out), *flags], monkeypatch, capsys, message)
    assert _snapshot(tmp_path) == before, "every target as it was, nothing written"


def test_training_refuses_an_output_that_is_an_input_or_another_output(tiny_data, tmp_path, monkeypatch, capsys):
    """--plot naming --checkpoint or last.pth left a best.pth that was a PNG; an output in the
    data folder replaces or adds training images; a hard link is another name of the same file."""
    data, out, cache = tmp_path / "data", tmp_path / "out", tmp_path / "cache"
    shutil.copytree(tiny_data / "train", data / "train")
    (data / "train.csv").write_text("filename,label\n" + "".join(
        f"{p.name},{int(p.name.startswith('dog'))}\n" for p in sorted((data / "train").iterdir())))
    os.link(data / "train.csv", tmp_path / "curves.png")
    (tmp_path / "weights.pth").write_bytes(b"a state_dict")
    cache.mkdir()
    cases = [(["--plot", str(out / "best.pth")], f"--plot {out / 'best.pth'} is also where --checkpoint writes"),
             (["--plot", str(out / "last.pth")], "is also where --checkpoint (last.pth beside it) writes"),
             (["--plot", str(out / "sub" / ".." / "history.json")],
              "is also where --checkpoint (history.json beside it)"),
             (["--checkpoint", str(out / "last.pth")], "is also where --checkpoint writes"),
             (["--plot", str(data / "train" / "cat.0.jpg")], f"is inside --data-dir's train/ ({data / 'train'})"),
             (["--plot", str(data / "train" / "new.png")], "is inside --data-dir's train/"),
             (["--plot", str(data / "train.csv")], "would replace --data-dir's train.csv"),
             (["--plot", str(tmp_path / "curves.png")], "would replace --data-dir's train.csv"),
             (["--weights", str(tmp_path / "weights.pth"), "--checkpoint", str(tmp_path / "weights.pth")],
              "would replace --weights"),
             (["--cache", str(cache), "--plot", str(cache / "curves.png")], f"is inside --cache ({cache})"),
             # One rule for every output of a run: none inside the data folder (these were taken).
             (["--log-dir", str(data / "train" / "tb")], f"--log-dir {data / 'train' / 'tb'} is inside --data-dir's train/"),
             (["--cache", str(data / "train" / "pixels")], f"--cache {data / 'train' / 'pixels'} is inside --data-dir's"),
             (["--track", "mlflow", "--tracking-uri", f"sqlite:///{data / 'train' / 'mlflow.db'}"],
              f"--tracking-uri's database {data / 'train' / 'mlflow.db'} is inside --data-dir's train/ ({data / 'train'})"),
             (["--track", "mlflow", "--tracking-uri", f"sqlite:///{data / 'store' / 'mlflow.db'}", "--log-dir",
               str(data / "store" / "mlartifacts")], "is also where --log-dir writes")]
    before = _snapshot(tmp_path)
    for flags, message in cases:
        _train_fails(["--data-dir", str(data), *outputs(out), *flags], monkeypatch, capsys, message)
    assert _snapshot(tmp_path) == before and not out.exists()


def test_an_output_folder_never_takes_an_input_files_name_or_lands_in_test(tiny_data, tmp_path, monkeypatch, capsys):
    """--log-dir or --cache at DATA_DIR/train.csv, where no CSV was yet, made a folder there that
    stopped every later run on the data ("a folder, not a regular file"); a plot in DATA_DIR/test/
    was classified by predict as a test image. prepare --cache inside train/ wrote train.csv, then
    the cache into train/ (which the next prepare offered to train on): refused first."""
    from src.tools import prepare
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(tiny_data, data)
    assert not (data / "train.csv").exists() and (data / "test").is_dir()
    for flags, message in [
            (["--log-dir", str(data / "train.csv")], f"--log-dir {data / 'train.csv'} would replace --data-dir's "
                                                     f"train.csv ({data / 'train.csv'}), which this command reads: "
                                                     "name another folder"),
            (["--cache", str(data / "train.csv")], "would replace --data-dir's train.csv"),
            (["--plot", str(data / "test" / "7.png")], f"is inside --data-dir's test/ ({data / 'test'})")]:
        _train_fails(["--data-dir", str(data), *outputs(out), *flags], monkeypatch, capsys, message)
    fails_in_process(prepare.main, [str(data), "--cache", str(data / "train" / "c"), "--image-size", "32"],
                     monkeypatch, capsys, f"--cache {data / 'train' / 'c'} is inside DATA_DIR's train/")
    assert not out.exists() and not (data / "train.csv").exists() and not (data / "train" / "c").exists()


def test_predict_refuses_a_special_output_and_writes_to_standard_output_with_a_dash(untrained, tiny_data, tmp_path,
                                                                                 monkeypatch, capsys):
    """`predict --output /dev/stdout` said "wrote /dev/stdout" and replaced it with a file: a link,
    a pipe or a device is refused, and `--output -` writes the CSV to standard output, what predict
    says to standard error."""
    pipe, device = _special(tmp_path)
    (tmp_path / "stdout").symlink_to(pipe)  # as /dev/stdout is a link to where the output goes
    targets = [(pipe, "a named pipe (FIFO)"), (tmp_path / "stdout", f"a symbolic link to {pipe}")]
    before = _snapshot(tmp_path)
    for target, kind in targets + ([(device, "a character device")] if device else []):
        line = fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output",
                                               str(target), "--workers", "0"], monkeypatch, capsys,
                                f"--output {target} is {kind}, not a regular file")
        assert line.endswith("(for standard output: --output -)")
    assert _snapshot(tmp_path) == before

    images = [str(tiny_data / "test" / f"{i}.jpg") for i in range(1, 7)]
    code, out, err = in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output", "-",
                                               "--workers", "0"], monkeypatch, capsys)
    assert code == 0, err
    rows = list(csv.reader(io.StringIO(out, newline="")))
    assert rows[0] == ["path", "p_dog", "label"] and [row[0] for row in rows[1:]] == images
    assert "predicted 6 images" in err and err.rstrip().endswith("wrote standard output")
    code, out, err = in_process(predict.main, ["--data-dir", str(tiny_data), "--checkpoint", str(untrained),
                                               "--output", "-", "--workers", "0"], monkeypatch, capsys)
    assert code == 0 and out.splitlines()[0] == "id,label" and len(out.splitlines()) == 7, (out, err)
    assert err.rstrip().endswith("wrote 6 predictions to standard output")
    assert not (ROOT / "-").exists() and not Path("-").exists()


def test_predict_and_export_refuse_to_write_over_what_they_read(untrained, tiny_data, tmp_path, monkeypatch, capsys):
    """`predict --output` naming the checkpoint or an image, `export mo/best.pth mo/best.pth`."""
    model, test = tmp_path / "model", tmp_path / "test"
    shutil.copytree(untrained.parent, model)
    shutil.copytree(tiny_data / "test", test)
    checkpoint = model / "best.pth"
    before = _snapshot(tmp_path)
    for output, what in [(checkpoint, "--checkpoint"), (model / "best.json", "its best.json"),
                         (test / "3.jpg", "an image to predict")]:
        fails_in_process(predict.main, [str(test), "--checkpoint", str(checkpoint), "--output", str(output),
                                        "--workers", "0"], monkeypatch, capsys,
                         f"--output {output} would replace {what} (")
    fails_in_process(predict.main, ["--data-dir", str(tmp_path), "--checkpoint", str(checkpoint), "--output",
                                    str(test / "1.jpg"), "--workers", "0"], monkeypatch, capsys,
                     "would replace an image to predict")
    for output, what in [(checkpoint, "CHECKPOINT"), (model / "best.json", "its best.json"),
                         (test / "3.jpg", "an image it checks on")]:
        fails_in_process(export.main, [str(checkpoint), str(output), "--images", str(test)], monkeypatch, capsys,
                         f"OUTPUT {output} would replace {what} (")
    assert _snapshot(tmp_path) == before


def test_export_removes_a_killed_exports_folder_and_says_a_full_disk(untrained, tiny_data, tmpfs, monkeypatch, capsys):
    """A SIGKILL during an export left a 43 MB .best.onnx.*.tmp/ that nothing removed; a full disk
    was a traceback (OSError 28). The exporter is replaced by one whose save fills a real full disk."""
    disk = tmpfs("disk", "size=1m")
    stale = disk / ".m.onnx.k1ll3d.tmp"
    stale.mkdir()
    (stale / "m.onnx").write_bytes(b"half an export")

    class Program:  # what torch.onnx.export returns: save() writes the file, more than the disk holds
        def save(self, path):
            Path(path).write_bytes(bytes(4 * 2**20))
    monkeypatch.setattr(export, "export_program", lambda *args: Program())
    line = fails_in_process(export.main, [str(untrained), str(disk / "m.onnx"), "--images", str(tiny_data / "test")],
                            monkeypatch, capsys, f"cannot write {disk / 'm.onnx'} (No space left on device")
    assert "no m.onnx was written" in line
    assert list(disk.iterdir()) == [], "neither the killed export's folder nor this one's is left"


def test_predict_onto_a_full_disk_stops_before_the_pass(untrained, tiny_data, tmpfs, monkeypatch, capsys):
    """Predict onto a full disk ran the whole pass, then failed: the folder's room for the CSV is
    tried at start (a pass here would fail the test)."""
    import src.inference
    disk = tmpfs("disk", "size=64k")
    with open(disk / "filler", "wb", buffering=0) as filler:  # the disk full to its last byte
        try:
            while True:
                filler.write(bytes(4096))
        except OSError:
            pass
    monkeypatch.setattr(src.inference, "predict_files", lambda *args, **kwargs: pytest.fail("the pass ran"))
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(untrained), "--output",
                                    str(disk / "p.csv"), "--workers", "0"], monkeypatch, capsys,
                     f"--output {disk / 'p.csv'}: no room for it (No space left on device; about ")
    assert [p.name for p in disk.iterdir()] == ["filler"]


def _holder(folder: Path, fork: bool = False) -> tuple[subprocess.Popen, int | None]:
    """Another process that holds the lock of folder (src.outputs.hold) until its input closes;
    with fork, it first starts a child that outlives it, as a DataLoader worker outlives a killed
    rank 0 by a few seconds. Returns the process and the child's pid."""
    code = textwrap.dedent("""
        import os, sys, time
        from pathlib import Path
        from src.outputs import hold
        hold(Path(sys.argv[1]))
        child = os.fork() if sys.argv[2] == "fork" else None
        if child == 0:
            time.sleep(300)
            os._exit(0)
        print(child, flush=True)
        sys.stdin.read()
    """)
    process = subprocess.Popen([sys.executable, "-c", code, str(folder), "fork" if fork else "-"], cwd=ROOT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = process.stdout.readline().strip()
    return process, int(child) if child != "None" else None


def _lock_is_free(folder: Path) -> bool:
    from src.outputs import hold
    try:
        hold(folder).release()
        return True
    except Exception:
        return False


@pytest.mark.parametrize("main", [train_single.main, train_dp.main])
def test_a_second_run_in_a_folder_stops_naming_the_first(main, tiny_data, untrained, tmp_path, monkeypatch, capsys):
    """Run B's start-up deleted run A's temporary file mid-save, then replaced its files. B stops
    at start naming A; --evaluate, which writes nothing, takes no lock and runs."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".best.pth.a1b2.tmp").write_bytes(b"run A's save in progress")
    process, _ = _holder(out)
    try:
        line = _train_fails(["--data-dir", str(tiny_data), *outputs(out)], monkeypatch, capsys,
                            f"--checkpoint folder {out} is in use by another run (pid {process.pid} on "
                            f"{socket.gethostname()}, started ", main=main)
        assert line.endswith("wait for it to end, or pass another --checkpoint")
        assert (out / ".best.pth.a1b2.tmp").read_bytes() == b"run A's save in progress"
        code, stdout, err = in_process(main, [*TINY, "--data-dir", str(tiny_data), *outputs(out), "--evaluate",
                                              "--weights", str(untrained)], monkeypatch, capsys)
        assert code == 0 and "validated " in stdout, err
    finally:
        process.kill()
        process.wait()


def test_under_torchrun_rank_0_takes_the_lock_and_says_it_once(tiny_data, tmp_path):
    """Every mode locks the folder on rank 0 (check_writable); under torchrun the other rank waits,
    silent, until torchrun stops it."""
    process, _ = _holder(tmp_path)
    try:
        result = run(["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py", *TINY, "--data-dir",
                      str(tiny_data), *outputs(tmp_path)], timeout=300)
    finally:
        process.kill()
        process.wait()
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count(f"--checkpoint folder {tmp_path} is in use by another run (pid {process.pid} ") == 1
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", result.stderr))
    assert codes == {"0": "2", "1": "-15"}, result.stderr[-3000:]


def test_the_lock_goes_with_the_process_however_it_ends(tmp_path):
    """No stale lock: the kernel drops it when the holder is killed, also while a child that it
    forked (as the DataLoader forks its workers) lives on."""
    for fork in (False, True):
        folder = tmp_path / f"fork-{fork}"
        folder.mkdir()
        process, child = _holder(folder, fork)
        try:
            assert not _lock_is_free(folder)
            process.kill()
            process.wait()
            if child is not None:
                os.kill(child, 0)  # still alive
            assert _lock_is_free(folder)
        finally:
            process.kill()
            if child is not None:
                os.kill(child, 9)


def test_a_new_run_does_not_replace_an_earlier_runs_files_unless_told(tiny_data, tmp_path, monkeypatch, capsys):
    """A run at val acc 0.90 was silently replaced by a --lr 0 run. The line says what the folder
    holds and both ways on; --overwrite and torchrun's restarted workers (which resume on their
    own) pass, --resume too where there is a last.pth to go on from (not here: it says so);
    --overwrite replaces the files."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "best.pth").write_bytes(b"an earlier run's model")
    (out / "history.json").write_text("[{}, {}, {}]")
    argv = ["--data-dir", str(tiny_data), *outputs(out), "--epochs", "1"]
    _train_fails(argv, monkeypatch, capsys,
                 f"{out} holds the files of an earlier run (best.pth, history.json of 3 epoch(s)): pass "
                 "--resume to continue that run, --overwrite to replace it, or another --checkpoint")
    _train_fails([*argv, "--resume", "--overwrite"], monkeypatch, capsys, "pass one of them")
    assert (out / "best.pth").read_bytes() == b"an earlier run's model"
    for flags, restarts in ((["--overwrite"], "0"), ([], "1")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
        with lock_outputs(parse_args("", [*TINY, *argv, *flags])):
            pass
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    _train_fails([*argv, "--resume"], monkeypatch, capsys,
                 f"--resume: {out} holds no last.pth to go on from, only the files of an earlier run (best.pth, "
                 "history.json of 3 epoch(s)): pass --overwrite to start a new run there")
    code, _, err = in_process(train_single.main, [*TINY, *argv, "--overwrite"], monkeypatch, capsys)
    assert code == 0, err
    assert [r["epoch"] for r in history(out)] == [1] and "features.0.weight" in torch.load(out / "best.pth")


def test_an_output_beside_the_inputs_is_not_inside_them_and_a_hard_link_of_another_output_is(tiny_data, tmp_path,
                                                                                             monkeypatch, capsys):
    """"Inside --data-dir's train/" is a path below that folder, not any path that starts with its
    name (train_curves.png, trainings/); two names of one file (a hard link: the test's stand-in
    for a bind mount) are one output."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    for plot, checkpoint in ((data / "train_curves.png", data / "trainings" / "best.pth"),
                             (data / "train.png", tmp_path / "out" / "best.pth")):
        checkpoint.parent.mkdir(exist_ok=True)
        with lock_outputs(parse_args("", [*TINY, "--data-dir", str(data), "--plot", str(plot), "--checkpoint",
                                          str(checkpoint)])):
            pass
    out = tmp_path / "other"
    out.mkdir()
    (out / "best.pth").write_bytes(b"an earlier run's model")
    os.link(out / "best.pth", tmp_path / "curves.png")
    _train_fails(["--data-dir", str(data), *outputs(out), "--plot", str(tmp_path / "curves.png"), "--overwrite"],
                 monkeypatch, capsys, f"--plot {tmp_path / 'curves.png'} is also where --checkpoint writes")


def test_a_run_lets_go_of_its_folder_when_it_ends(tmp_path):
    """A process that trains twice (one run after the other, as a notebook or these tests do)
    holds each run's folder for that run only: once its block has ended another process may take
    the first one, while the second is held."""
    from src.outputs import hold
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    with hold(first):
        pass
    with hold(second):
        take = "import sys; from pathlib import Path; from src.outputs import hold; hold(Path(sys.argv[1]))"
        taken = [subprocess.run([sys.executable, "-c", take, str(folder)], cwd=ROOT, capture_output=True, text=True)
                 for folder in (first, second)]
        assert taken[0].returncode == 0, taken[0].stderr
        assert taken[1].returncode != 0 and "is in use by another run" in taken[1].stderr


def test_a_run_stopped_in_its_first_epoch_is_not_replaced_unless_told(tiny_data, tmp_path, monkeypatch, capsys):
    """A run stopped by a signal (or a step checkpoint) inside its first epoch leaves last.pth
    alone, with no best.pth or history yet: a new run there without --resume would start over it."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "last.pth").write_bytes(b"a stopped run's step checkpoint")
    _train_fails(["--data-dir", str(tiny_data), *outputs(out)], monkeypatch, capsys,
                 f"{out} holds the files of an earlier run (last.pth): pass --resume to continue that run")
    assert sorted(path.name for path in out.iterdir()) == [".run.lock", "last.pth"]
    assert (out / "last.pth").read_bytes() == b"a stopped run's step checkpoint"


def test_prepare_refuses_a_train_csv_that_is_not_a_regular_file(tiny_data, tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    (data / "train").mkdir(parents=True)
    shutil.copy(tiny_data / "train" / "cat.0.jpg", data / "train")
    os.mkfifo(data / "train.csv")
    fails_in_process(prepare.main, [str(data)], monkeypatch, capsys,
                     f"DATA_DIR's train.csv {data / 'train.csv'} is a named pipe (FIFO), not a regular file")
    assert stat.S_ISFIFO(os.lstat(data / "train.csv").st_mode)


def test_synthetic_writes_only_where_it_may(tmp_path, tmpfs, monkeypatch, capsys):
    """`synthetic data` overwrote a user's cat.0.jpg and mixed its images with theirs; a file, /proc
    or a full disk gave tracebacks. Its own folder it rewrites whole (no image nor train.csv of
    the earlier set left); a folder with other files only (a README) is taken."""
    theirs = tmp_path / "theirs"
    (theirs / "train").mkdir(parents=True)
    (theirs / "train" / "cat.0.jpg").write_bytes(b"a real photo")
    (tmp_path / "passwd").write_text("root:x:0:0\n")
    before = _snapshot(tmp_path)

    def fails(folder, message, *flags):
        return fails_in_process(synthetic.main, [str(folder), "--train", "4", "--test", "1", *flags], monkeypatch,
                                capsys, message)
    fails(theirs, f"{theirs} holds train, which src.tools.synthetic did not write")
    fails(tmp_path / "passwd", f"{tmp_path / 'passwd'} exists and is not a folder")
    fails("/proc/synthetic", "cannot write the synthetic set to /proc/synthetic (")
    assert _snapshot(tmp_path) == before

    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "README.md").write_text("a folder's own notes\n")
    assert in_process(synthetic.main, [str(ours), "--train", "6", "--test", "2"], monkeypatch, capsys)[0] == 0
    (ours / "train.csv").write_text("filename,label\n")  # as prepare would write it
    assert in_process(synthetic.main, [str(ours), "--train", "4", "--test", "1"], monkeypatch, capsys)[0] == 0
    assert sorted(p.name for p in (ours / "train").iterdir()) == ["cat.0.jpg", "cat.1.jpg", "dog.0.jpg", "dog.1.jpg"]
    assert [p.name for p in (ours / "test").iterdir()] == ["1.jpg"] and not (ours / "train.csv").exists()
    assert (ours / "README.md").read_text() == "a folder's own notes\n"

    disk = tmpfs("disk", "size=64k")
    fails(disk / "set", f"cannot write the synthetic set to {disk / 'set'} (No space left on device)",
          "--train", "200", "--size", "64")


def test_overwrite_removes_the_earlier_runs_last_pth_before_any_work(tiny_data, tmp_path, monkeypatch):
    """--overwrite replaces an earlier run: its last.pth goes at the start, so that a torchrun restart
    of the new run (which resumes from last.pth without being asked) cannot resume the old one; the
    earlier best.pth and history stay until the new run's first epoch replaces them."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("best.pth", "last.pth", "history.json"):
        (out / name).write_bytes(b"an earlier run's " + name.encode())
    with lock_outputs(parse_args("", [*TINY, "--data-dir", str(tiny_data), *outputs(out), "--overwrite"])):
        pass
    assert sorted(path.name for path in out.iterdir() if not path.name.startswith(".")) == ["best.pth", "history.json"]


def test_launcher_variables_in_part_are_one_line(exact_data, tmp_path, monkeypatch, capsys):
    """RANK and WORLD_SIZE without LOCAL_RANK and the rest (what some cluster launchers give a plain
    `python train_ddp.py`, or a leftover `export RANK=0`) ended in a KeyError traceback."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    _train_fails(["--data-dir", str(exact_data), *outputs(tmp_path)], monkeypatch, capsys,
                 "RANK, WORLD_SIZE set in the environment but not LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                 "MASTER_PORT: launch with torchrun", main=train_ddp.main)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("values, says", [
    ({"RANK": "1", "WORLD_SIZE": "1"}, "RANK=1 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_PORT=29500 in the "
                                       "environment: no launcher sets these"),
    ({"LOCAL_WORLD_SIZE": "2"}, "RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=2"),
    ({"WORLD_SIZE": "0"}, "RANK=0 WORLD_SIZE=0"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 in the environment"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE=abc in the environment is not a whole number: launch with torchrun"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK=-1 in the environment is not a whole number")])
def test_launcher_variables_no_launcher_sets_are_one_line(values, says, exact_data, tmp_path, monkeypatch, capsys):
    """All six set, but as no launcher sets them (a hand-written export): RANK=1 in a world of 1
    waited for its peers for --dist-timeout; WORLD_SIZE=abc ended in a ValueError traceback."""
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", **values}.items():
        monkeypatch.setenv(name, value)
    _train_fails(["--data-dir", str(exact_data), *outputs(tmp_path)], monkeypatch, capsys, says, main=train_ddp.main)
    assert not any(tmp_path.iterdir())
