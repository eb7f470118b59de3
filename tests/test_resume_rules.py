"""The rules of --resume, each on both sides of its boundary, on the last.pth of shared runs: a
last.pth of as many epochs as --epochs resumes with nothing left to train, one of more is refused;
--epochs may change under a constant learning rate but not under a schedule that spans the run;
a worker that torchrun restarted resumes without --resume, a first attempt does not."""
import re
import shutil

import pytest
import torch
from conftest import EXACT, MICRO, RECIPE, VAL, B, mode_run, recipe_run, weights

from src import checkpoint
from src.cli import parse_args
from src.ema import WeightAverage
from src.errors import UserError
from src.models import build_model
from src.recipe import make_optimizer, make_schedule


def _resume(out, flags: list[str]):
    """checkpoint.load_last() with `flags` into a model, optimizer, schedule and weight average made as
    the scripts make them; returns (history, what it printed)."""
    args = parse_args("", [*flags, "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")])
    saved = weights(out, "last.pth")["info"]
    info = checkpoint.run_info(args, saved["batch_size"], saved["data"])
    torch.manual_seed(args.seed)
    model = build_model(args.arch, args.weights, args.dropout)
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    schedule = make_schedule(optimizer, args, 5)
    return checkpoint.load_last(args, info, model, optimizer, None, schedule,
                                WeightAverage(model, optimizer, args.ema_decay)).history


@pytest.mark.parametrize("epochs, said", [(2, "after epoch 2 of 2: nothing left to train"),
                                          (3, "after epoch 2 of 3: going on")])
def test_a_run_resumes_up_to_and_beyond_the_epochs_it_finished(epochs, said, runs, capsys):
    out = mode_run(runs, "single")[0]  # 2 epochs, constant learning rate
    flags = [*EXACT, *VAL, "--batch-size", str(2 * B), "--epochs", str(epochs), "--resume"]
    history = _resume(out, flags)
    assert [record["epoch"] for record in history] == [1, 2]
    assert said in capsys.readouterr().out


def test_a_run_that_finished_more_epochs_is_refused(runs):
    out = mode_run(runs, "single")[0]
    with pytest.raises(UserError, match="has finished 2 epochs, more than --epochs 1; pass --epochs above 2"):
        _resume(out, [*EXACT, *VAL, "--batch-size", str(2 * B), "--epochs", "1", "--resume"])


def test_a_schedule_that_spans_the_run_keeps_its_epochs(runs, tmp_path):
    """The full recipe's cosine schedule is a function of --epochs, and so is the step schedule: the
    same --epochs resumes, another is refused (a constant rate resumes with another: above)."""
    out = recipe_run(runs, "single")[0]
    batch, accumulate = MICRO["single"]
    flags = [*EXACT, *VAL, *RECIPE, "--batch-size", str(batch), "--accumulate", str(accumulate), "--resume"]
    assert len(_resume(out, [*flags, "--epochs", "2"])) == 2
    with pytest.raises(UserError, match=r"was trained with --epochs 2, not 3 \(the schedule spans the run\)"):
        _resume(out, [*flags, "--epochs", "3"])
    # the step schedule's x0.1 points are fractions of the run too: the same run as if trained with it
    stepped = tmp_path / "stepped"
    shutil.copytree(out, stepped)
    last = torch.load(stepped / "last.pth", weights_only=True)
    last["info"]["lr_schedule"] = "step"
    torch.save(last, stepped / "last.pth")
    flags = [word if word != "cosine" else "step" for word in flags]
    assert len(_resume(stepped, [*flags, "--epochs", "2"])) == 2
    with pytest.raises(UserError, match=r"was trained with --epochs 2, not 3 \(the schedule spans the run\)"):
        _resume(stepped, [*flags, "--epochs", "3"])


@pytest.mark.parametrize("restarts, resumed", [("0", False), ("1", True)])
def test_a_restarted_worker_resumes_without_being_asked(restarts, resumed, runs, monkeypatch, capsys):
    """torchrun's TORCHELASTIC_RESTART_COUNT: 0 in the first attempt (a new run: nothing read),
    1 after a restart (the run's last.pth, without --resume)."""
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restarts)
    out = mode_run(runs, "single")[0]
    history = _resume(out, [*EXACT, *VAL, "--batch-size", str(2 * B), "--epochs", "2"])
    assert len(history) == (2 if resumed else 0)
    assert ("resumed from" in capsys.readouterr().out) == resumed


def _removed_before_it_is_read(monkeypatch, removed):
    """checkpoint.from_rank as it runs without a process group, `removed` deleted first: a last
    that the scan found and that is gone when it is read."""
    def from_rank(source, make):
        shutil.rmtree(removed) if removed.is_dir() else removed.unlink()
        return make()
    monkeypatch.setattr(checkpoint, "from_rank", from_rank)


def test_a_last_pth_removed_between_its_scan_and_its_read_is_one_line(tmp_path, monkeypatch):
    """_newest_last finds last.pth (its epoch), then reads it: gone by then, it was a TypeError
    (`**None`) and a traceback."""
    last = tmp_path / "last.pth"
    torch.save({"epoch": 2, "step": 0}, last)
    _removed_before_it_is_read(monkeypatch, last)
    with pytest.raises(UserError, match=rf"^cannot resume from {re.escape(str(last))}: it was removed while this run "
                                        "started; start the run again$"):
        checkpoint._newest_last(last)


def test_a_last_dcp_removed_between_its_scan_and_its_read_is_one_line(tmp_path, monkeypatch):
    """The same of last.dcp: its read was given no folder (None) and said "TypeError: ..."."""
    folder = tmp_path / "last.dcp"
    folder.mkdir()
    monkeypatch.setattr(checkpoint.sharded_checkpoint, "position", lambda found: (3, 0) if found == folder else None)
    _removed_before_it_is_read(monkeypatch, folder)
    with pytest.raises(UserError, match=rf"^cannot resume from {re.escape(str(folder))}: it was removed while this "
                                        "run started; start the run again$"):
        checkpoint._newest_last(tmp_path / "last.pth", sharded=True)
