"""A run that diverges: flags that are not finite are refused; a loss that is not finite stops the
run at the end of its epoch (on every rank, from the all-reduced sums) before anything of it is
saved; weights that are not finite are refused by predict, export and --resume, and predict writes
no CSV row of a probability that is not finite. A last.pth whose history or info is not ours is
one line too."""
import json
import math
import re

import pytest
import torch
import torchvision
from conftest import HOOKS, TINY, fails_in_process, history, in_process, outputs, run, write_checkpoint
from hooks.sitecustomize import poisoning

import train_single
from src.cli import build_parser
from src.divergence import check_finite_loss
from src.errors import UserError
from src.metrics import LOSS
from src.tools import export, predict

STEPS = 4  # optimizer steps an epoch: tiny_data's 32 training images in batches of 8 (TINY)


def _takes_a_float(action) -> bool:
    try:
        return isinstance(action.type("0.5"), float)
    except (TypeError, ValueError):  # no type, an int
        return False


def _float_flags() -> list[str]:
    """The training flags that take a number with a fraction."""
    parser = build_parser("", distributed=True)
    return sorted(option for action in parser._actions if _takes_a_float(action) for option in action.option_strings)


def test_every_float_flag_refuses_values_that_are_not_finite(capsys):
    """--lr nan was taken and trained NaN weights; --warmup-epochs nan gave a traceback. (A range
    check alone lets nan through: every comparison with it is false.)"""
    from src.cli import parse_args
    flags = _float_flags()
    assert {"--lr", "--momentum", "--dropout", "--val-fraction", "--weight-decay", "--warmup-epochs",
            "--label-smoothing", "--clip-grad-norm"} <= set(flags)
    for flag in flags:
        for value in ("nan", "inf", "-inf", "NaN"):
            with pytest.raises(SystemExit) as exit:
                parse_args("", [f"{flag}={value}", "--epochs", "3"], distributed=True)  # =: "-inf" is no flag
            err = capsys.readouterr().err
            assert exit.value.code == 2 and err.count("\n") == 1
            assert f"error: argument {flag}: must be a finite number, got {value} (see --help)" in err


@pytest.mark.parametrize("step, part", [(STEPS + 1, "training"), (2 * STEPS, "validation")])
def test_a_diverged_epoch_stops_the_run_and_saves_nothing_of_it(step, part, tiny_data, tmp_path, monkeypatch, capsys):
    """The weights turn NaN after the first step of epoch 2 (its training loss is NaN), or after
    its last step (its training loss is finite, its validation loss NaN). Either way epoch 2 is
    not saved: best.pth and last.pth stay epoch 1's, finite, and the run ends with exit 2 and a
    line naming the epoch and what to try."""
    monkeypatch.setattr(torch.optim.SGD, "step", poisoning(torch.optim.SGD, step))
    line = fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), "--epochs", "3",
                                                *outputs(tmp_path)], monkeypatch, capsys,
                            f"error: epoch 2: the {part} loss is nan, the run diverged")
    assert "try a lower --lr, --clip-grad-norm" in line and "--amp bf16 instead of fp16" in line
    assert [record["epoch"] for record in history(tmp_path)] == [1]
    last = torch.load(tmp_path / "last.pth", weights_only=True)
    best = torch.load(tmp_path / "best.pth", weights_only=True)
    assert last["epoch"] == 1 and json.loads((tmp_path / "best.json").read_text())["epoch"] == 1
    for state in (best, last["model"]):
        assert all(torch.isfinite(tensor).all() for tensor in state.values() if tensor.is_floating_point())
    assert all(torch.equal(best[key], last["model"][key]) for key in best)


def test_under_torchrun_every_rank_stops_on_one_ranks_nan(tiny_data, tmp_path):
    """Rank 1's weights alone turn NaN, after the last step of epoch 1 (4 steps of 2 x 4 images):
    rank 0's own validation sums stay finite, the all-reduced ones hold the NaN on both ranks, both
    stop, rank 0 says it once, and nothing of epoch 1 is written."""
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py", *TINY, "--batch-size", "4",
                  "--data-dir", str(tiny_data), "--epochs", "2", *outputs(tmp_path)],
                 env={"PYTHONPATH": HOOKS, "NAN_AT_STEP": "4", "NAN_RANK": "1"}, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "the run diverged" in line]
    assert len(said) == 1 and "error: epoch 1: the validation loss is nan" in said[0], result.stderr[-3000:]
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", result.stderr))
    assert codes == {"0": "2", "1": "-15"}, result.stderr[-3000:]  # rank 1 waited, silent, to be stopped
    assert not any((tmp_path / name).exists() for name in ("best.pth", "last.pth", "history.json"))


@pytest.mark.parametrize("loss", [math.inf, -math.inf, math.nan])
def test_an_infinite_loss_stops_the_run_as_a_nan_one_does(loss):
    """fp16 logits that overflow give a loss of inf (logsumexp inf minus a finite logit), not
    only NaN: it diverged all the same. A finite loss, however large, goes on."""
    sums = torch.tensor([0.0, 3.0, 8.0, 1.0])
    sums[LOSS] = loss
    with pytest.raises(UserError) as caught:
        check_finite_loss(sums, "epoch 2", "validation")
    assert str(caught.value).startswith(f"epoch 2: the validation loss is {loss}, the run diverged; ")
    sums[LOSS] = 3e38
    check_finite_loss(sums, "epoch 2")


def _state(overflow: bool = False, nan: bool = False) -> dict:
    """An untrained SqueezeNet's weights; overflow: its last layer's all 1e38 (finite), so that
    its logits, sums of 512 non-negative features x 1e38, are infinite."""
    torch.manual_seed(0)
    state = torchvision.models.squeezenet1_1(num_classes=2).state_dict()
    if overflow:
        state["classifier.1.weight"].fill_(1e38)
    if nan:
        state["features.0.bias"][0] = float("nan")
    return state


def test_predict_export_and_resume_refuse_weights_that_are_not_finite(tiny_data, tmp_path, monkeypatch, capsys):
    """A diverged best.pth made predict write 0 of 24 rows with exit 0 and the Kaggle mode write
    `1,nan` rows. Refused at load, in one line naming the file and its first bad tensor."""
    checkpoint = write_checkpoint(tmp_path / "model", _state(nan=True))
    message = f"{checkpoint} holds weights that are not finite (NaN or infinity) in 1 tensor(s), first features.0.bias"
    fails_in_process(predict.main, [str(tiny_data / "test"), "--checkpoint", str(checkpoint), "--output",
                                    str(tmp_path / "p.csv"), "--workers", "0"], monkeypatch, capsys, message)
    fails_in_process(predict.main, ["--data-dir", str(tiny_data), "--checkpoint", str(checkpoint), "--output",
                                    str(tmp_path / "s.csv"), "--workers", "0"], monkeypatch, capsys, message)
    fails_in_process(export.main, [str(checkpoint), str(tmp_path / "m.onnx"), "--images", str(tiny_data / "test")],
                     monkeypatch, capsys, message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_predict_refuses_probabilities_that_are_not_finite(tiny_data, tmp_path, monkeypatch, capsys):
    """Finite weights whose outputs overflow (infinite logits: softmax NaN), as in fp16: no CSV,
    no submission with `nan`."""
    checkpoint = write_checkpoint(tmp_path / "model", _state(overflow=True))
    for argv in ([str(tiny_data / "test"), "--output", str(tmp_path / "p.csv")],
                 ["--data-dir", str(tiny_data), "--output", str(tmp_path / "s.csv")]):
        line = fails_in_process(predict.main, [*argv, "--checkpoint", str(checkpoint), "--workers", "0"],
                                monkeypatch, capsys, "the model's probabilities are not finite for 6 of 6 images")
        assert line.endswith("nothing written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def _last(tmp_path, **changes) -> None:
    """A last.pth for TINY's run, with `changes` to what train_single.py would write there."""
    state = {"model": _state(), "optimizer": {}, "scaler": {}, "schedule": {}, "epoch": 1, "info": {},
             "history": [{key: 0.5 for key in ("epoch", "train_loss", "train_acc", "train_samples", "val_loss",
                                               "val_acc", "val_log_loss", "val_samples", "lr", "train_seconds",
                                               "data_wait_seconds", "val_seconds", "seconds")}]}
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.save({**state, **changes}, tmp_path / "last.pth")


@pytest.mark.parametrize("changes, message", [
    ({"info": ["a", "list"]}, "(TypeError: its info is a list, not a dict)"),
    ({"history": [{"epoch": 1}]}, "(ValueError: a record of its history lacks train_loss, "),
    ({"history": []}, "(ValueError: its history is not a list of its 1 epochs' records)"),
])
def test_resume_refuses_a_last_pth_whose_history_or_info_is_not_ours(changes, message, tiny_data, tmp_path,
                                                                     monkeypatch, capsys):
    """A last.pth whose records lack keys gave a KeyError, one whose info is a list an AttributeError."""
    _last(tmp_path, **changes)
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), *outputs(tmp_path), "--resume"],
                     monkeypatch, capsys, f"cannot resume from {tmp_path / 'last.pth'} {message}")


def test_resume_refuses_a_last_pth_that_diverged(tiny_data, tmp_path, monkeypatch, capsys):
    code, _, err = in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), *outputs(tmp_path)],
                              monkeypatch, capsys)
    assert code == 0, err
    saved = torch.load(tmp_path / "last.pth", weights_only=True)
    saved["model"]["features.0.weight"][0, 0, 0, 0] = math.inf
    torch.save(saved, tmp_path / "last.pth")
    fails_in_process(train_single.main, [*TINY, "--data-dir", str(tiny_data), *outputs(tmp_path), "--resume",
                                         "--epochs", "2"], monkeypatch, capsys,
                     f"{tmp_path / 'last.pth'} holds weights that are not finite (NaN or infinity) in 1 tensor(s), "
                     "first features.0.weight")
    assert [r["epoch"] for r in history(tmp_path)] == [1]
