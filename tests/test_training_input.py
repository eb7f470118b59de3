"""Careless input to the training scripts, refused before any work (issue 47, the training side):
an output onto a file that is not a run's (--plot notes.txt, --plot photo.jpg), a micro-batch
that batch norm cannot normalise, and what a launcher's variables left in the environment of a
one-process script change. Every refusal: one line, exit 2, nothing written or replaced."""
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
from conftest import TINY, fails_in_process, mode_run, outputs

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
    """--plot photo.jpg turned a user's image into a PNG and --plot notes.txt a user's notes, with
    or without --overwrite; --checkpoint naming a user's file, or a folder whose best.json or
    history.json is not a run's, likewise. Each is one line naming the flag and the file; nothing
    is made or changed (not even the output folder). A plot of a run, and a checkpoint not named
    .pth whose best.json holds its digest, are a run's files, replaced as before."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    notes, image = tmp_path / "notes.txt", tmp_path / "photo.jpg"  # (data/test/ is refused as a place for outputs)
    notes.write_text("a user's notes\n")
    shutil.copyfile(data / "test" / "1.jpg", image)
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "best.json").write_text('{"an": "application config"}')
    (theirs / "history.json").write_text("[1, 2]")
    (theirs / "model.ckpt").write_bytes(b"a model of another program")
    (theirs / "settings.json").write_text("{}")
    (theirs / "data.bin").write_bytes(b"a file a best.json of another file names")
    (theirs / "data.json").write_text(json.dumps({"sha256": hashlib.sha256(b"another file").hexdigest()}))
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
        (["--checkpoint", str(theirs / "data.bin"), "--overwrite"],
         f"--checkpoint {theirs / 'data.bin'} exists and is not a checkpoint of a training run"),
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


def test_a_micro_batch_that_batch_norm_cannot_normalise_is_refused_before_any_work(tiny_data, tmp_path, monkeypatch,
                                                                                   capsys, fake_gpus):
    """--arch resnet18 --image-size 32 --batch-size 1 failed at the first step with batch norm's
    ValueError (its last layers see a 1 x 1 map: one value per channel). Refused when parsed,
    naming the layer, where torch itself refuses it (checked on the real model); let through where
    batch norm gets more than one value (a larger image, two images), runs in eval mode (--freeze,
    --evaluate) or over several processes (--sync-bn under a launcher; without it each process
    normalises its own image: refused). DataParallel's replicas get a piece of each batch: one of 1
    image is refused too."""
    import torchvision

    from src.data_parallel import check_data_parallel
    from src.errors import UserError
    out = tmp_path / "out"
    argv = ["--data-dir", str(tiny_data), "--arch", "resnet18", "--weights", "none", "--image-size", "32", "--workers",
            "0", *outputs(out)]
    layer = "batch norm layer layer4.0.bn1 of resnet18 would get 1 value per channel (its input is 1 x 512 x 1 x 1 at "
    line = fails_in_process(train_single.main, [*argv, "--batch-size", "1"], monkeypatch, capsys,
                            f"--batch-size 1: {layer}--image-size 32), which torch refuses in training")
    assert line.endswith("use a --batch-size of 2 or more per process, a larger --image-size, or --freeze (batch norm "
                         "in eval mode) (see --help)"), line
    assert not out.exists()
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=2).train()
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        model(torch.randn(1, 3, 32, 32))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 64)), model(torch.randn(2, 3, 32, 32))  # one image of 64 px, two of 32: fine
    for flags in (["--batch-size", "1", "--image-size", "64"], ["--batch-size", "2"], ["--batch-size", "1", "--freeze"],
                  ["--batch-size", "1", "--evaluate"]):
        parse_args("", [*argv, *flags])
    monkeypatch.setenv("WORLD_SIZE", "2")  # two processes of train_ddp.py, batch norm over both
    parse_args("", [*argv, "--batch-size", "1", "--sync-bn"], script="train_ddp.py", distributed=True)
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # without --sync-bn each process normalises its own image
        parse_args("", [*argv, "--batch-size", "1"], script="train_ddp.py", distributed=True)
    assert refused.value.code == 2 and f"--batch-size 1: {layer}" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # train_single.py is one process, whatever WORLD_SIZE says
        parse_args("", [*argv, "--batch-size", "1", "--sync-bn"], script="train_single.py")
    monkeypatch.delenv("WORLD_SIZE")
    fake_gpus(2)
    with pytest.raises(UserError, match=f"--batch-size 3 split over 2 GPUs by DataParallel gives a replica 1 image: "
                                        f"{layer}".replace("(", r"\(")):
        check_data_parallel(parse_args("", [*argv, "--batch-size", "3"], script="train_dp.py"))
    check_data_parallel(parse_args("", [*argv, "--batch-size", "4"], script="train_dp.py"))  # 2 images a replica
    capsys.readouterr()


def test_a_launchers_variables_left_in_a_one_process_run_change_nothing(tiny_data, tmp_path, monkeypatch, capsys):
    """WORLD_SIZE=2 left in the environment of train_single.py (an `export` for another job) was
    recorded in best.json as 2 processes; with RANK=1 left too a bad flag ended without a word
    (after waiting a minute for a launcher that was not there), and the line of a stop said to
    launch the same way. train_single.py is one process: none of that."""
    import signal

    import src.state as state
    from src.errors import run_command
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    argv = [*TINY, "--data-dir", str(tiny_data), *outputs(tmp_path), "--epochs", "1"]
    fails_in_process(train_single.main, [*argv, "--batch-size", "0"], monkeypatch, capsys,
                     "train_single.py: error: argument --batch-size: must be at least 1, got 0")
    save_step = state.TrainingState.save_step

    def signalled(self, sums):  # SIGTERM arrives as the first step checkpoint is written
        save_step(self, sums)
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(state.TrainingState, "save_step", signalled)
    assert run_command(train_single.main, [*argv, "--save-every-steps", "2"]) == 75
    said = capsys.readouterr().err
    assert f"{tmp_path / 'last.pth'} saved there; to go on: python train_single.py " in said, said[-2000:]
    monkeypatch.setattr(state.TrainingState, "save_step", save_step)
    assert run_command(train_single.main, [*argv, "--save-every-steps", "2", "--resume"]) == 0, capsys.readouterr().err
    info = json.loads((tmp_path / "best.json").read_text())
    assert info["processes"] == 1 and info["mode"] == "single"


@pytest.mark.parametrize("mode", ["ddp", "accelerate"])
def test_best_json_counts_the_processes_of_the_group_and_the_plot_is_a_runs(mode, runs):
    """best.json's `processes` is the process group's size (2 here), not the environment's; the
    plot and the profile a run wrote are known as a run's (a later run may replace them, and
    nothing else)."""
    from src.plot import is_plot
    from src.profiling import is_profile
    out = mode_run(runs, mode)[0]
    info = json.loads((out / "best.json").read_text())
    assert (info["mode"], info["processes"]) == (mode, 2)
    assert is_plot(out / "curves.png") and not is_plot(out / "best.pth")
    assert is_profile(out.parent / "tensorboard" / "profile"), "the profile a run wrote is one a later run may replace"


def test_profile_writes_only_into_a_folder_of_profiles(tiny_data, tmp_path, monkeypatch, capsys):
    """--profile writes profile/ (its trace, profile.md, profile.json) after the steps it records: a
    file named profile there failed the run in the middle of its first epoch, and a user's
    profile.md in --log-dir's profile/ was replaced. Both refused at start, nothing made or
    changed; a folder of an earlier profile is written again."""
    out, logs = tmp_path / "out", tmp_path / "tb"
    out.mkdir()
    (out / "profile").write_text("a file named profile")
    (logs / "profile").mkdir(parents=True)
    (logs / "profile" / "profile.md").write_text("a user's notes on profiling")
    argv = [*TINY, "--data-dir", str(tiny_data), "--profile"]
    before = snapshot(tmp_path)
    fails_in_process(train_single.main, [*argv, *outputs(out)], monkeypatch, capsys,
                     f"--profile writes into the folder {out / 'profile'}, which is a file: move it away, or pass --log-dir")
    fails_in_process(train_single.main, [*argv, *outputs(tmp_path / "new"), "--log-dir", str(logs)], monkeypatch, capsys,
                     f"--profile's folder {logs / 'profile'} holds profile.md, which --profile did not write")
    assert snapshot(tmp_path) == before
    (logs / "profile" / "profile.json").write_text(json.dumps({"trace": "rank0.pt.trace.json",
                                                               "schedule": {"wait": 2, "warmup": 2, "active": 6}}))
    with lock_outputs(parse_args("", [*argv, *outputs(tmp_path / "new"), "--log-dir", str(logs)])):
        pass


def test_dropout_for_a_model_without_dropout_layers_is_refused(tiny_data, tmp_path, monkeypatch, capsys):
    """--arch resnet18 --dropout 0.3 trained without dropout (no nn.Dropout layer for the flag to
    set) while best.json recorded dropout 0.3. Refused when parsed; --dropout 0 (what the model
    does anyway) and a model with dropout layers pass."""
    import torchvision
    out = tmp_path / "out"
    argv = ["--data-dir", str(tiny_data), "--weights", "none", "--image-size", "32", "--workers", "0", "--batch-size", "8",
            *outputs(out)]
    fails_in_process(train_single.main, [*argv, "--arch", "resnet18", "--dropout", "0.3"], monkeypatch, capsys,
                     "--dropout 0.3: --arch resnet18 has no dropout layer (nn.Dropout) for it to set, and would train "
                     "without dropout")
    assert not out.exists()
    assert not any(isinstance(m, torch.nn.Dropout) for m in torchvision.models.resnet18().modules())
    assert any(isinstance(m, torch.nn.Dropout) for m in torchvision.models.squeezenet1_1().modules())
    assert parse_args("", [*argv, "--arch", "resnet18", "--dropout", "0"]).dropout == 0
    assert parse_args("", [*argv, "--arch", "squeezenet1_1", "--dropout", "0.3"]).dropout == 0.3
