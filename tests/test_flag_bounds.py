"""Every command's flags, read as a careless user or an attacker gives them: each number bounded
when parsed (one line naming the flag, exit 2, before any work), and a flag that cannot act
refused, also when it is given at its default value."""
import argparse

import pytest
from conftest import fails_in_process

import train_accelerate
import train_ddp
import train_dp
import train_fsdp
import train_ray
import train_single
from src.cli import OneLineParser, parse_args
from src.tools import (
    benchmark,
    chaos,
    checkpoint_cost,
    compare_recipes,
    export,
    plain_loop,
    predict,
    prepare,
    report,
    synthetic,
)

COMMANDS = [train_single, train_dp, train_ddp, train_fsdp, train_accelerate, train_ray, synthetic, chaos, benchmark,
            compare_recipes, report, export, checkpoint_cost, predict, prepare, plain_loop]


class _Parsed(Exception):
    pass


def parser_of(command) -> OneLineParser:
    """The parser that command.main() builds (caught at its first parse: nothing runs)."""
    made = []

    def caught(self, *args, **kwargs):
        made.append(self)
        raise _Parsed

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OneLineParser, "parse_args", caught)
        with pytest.raises(_Parsed):
            command.main(["--help"])
    return made[0]


def numeric_flags(parser) -> list[tuple[str, object]]:
    """(flag, its type) for each flag that takes a number: a type that is not str, Path or a choice."""
    return [(action.option_strings[0], action.type) for action in parser._actions
            if action.option_strings and action.type not in (None, str, argparse.FileType) and action.choices is None
            and getattr(action.type, "__name__", "") in ("int", "float")]


def refused(parser, flag: str, value: str, capsys) -> str:
    with pytest.raises(SystemExit) as exit:
        parser.parse_args([f"{flag}={value}"])  # =: a negative value is no flag
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and f"argument {flag}" in err, (flag, value, err)
    return err


@pytest.mark.parametrize("command", COMMANDS, ids=lambda module: module.__name__)
def test_every_number_a_flag_takes_is_bounded_when_parsed(command, capsys, monkeypatch):
    """synthetic's --size 100000 asked numpy for 69.6 GB and died in its traceback; --seed -1 died
    in numpy's seeding; --dist-timeout 1e300 overflowed timedelta. Every flag of every command that
    takes a number has bounds, and a value past either is one line naming the flag."""
    monkeypatch.setenv("RANK", "0")  # the launched commands' rank 0 says it
    parser = parser_of(command)
    flags = numeric_flags(parser)
    assert flags or command in (export,), command
    for flag, kind in flags:
        low, high = kind.bounds
        whole = kind.__name__ == "int"
        below = str(low - 1) if whole else f"{low - 1:g}"
        refused(parser, flag, below, capsys)
        if isinstance(high, str):  # a count of this machine's CPUs: checked against them
            if "cap_workers" in high:  # --workers: capped to them, in one line (test_inputs.py)
                continue
            refused(parser, flag, "1000000", capsys)
        elif high != float("inf"):
            refused(parser, flag, str(high + 1) if whole else f"{high * 2 + 1:g}", capsys)
        if not whole:
            for value in ("nan", "inf"):
                refused(parser, flag, value, capsys)


# The ends of each flag that takes a float in a range, as its help and docs/flags.md state them: an
# open end ("(" or ")") is refused, a closed one taken (at 1, --label-smoothing's target is uniform
# and nothing is learned; --ema-decay 1 would never move the average).
ENDS = {"--momentum": "[0, 1)", "--dropout": "[0, 1)", "--val-fraction": "(0, 1)", "--random-erase": "[0, 1]",
        "--label-smoothing": "[0, 1)", "--ema-decay": "(0, 1)", "--dist-timeout": "(0, 1e+06]"}


@pytest.mark.parametrize("command", [train_single, train_ddp, train_ray], ids=lambda module: module.__name__)
def test_each_end_of_a_range_is_taken_or_refused_as_stated(command, capsys, monkeypatch):
    """Past the bounds is tested above; here each end itself. Every ranged float flag is in ENDS."""
    monkeypatch.setenv("RANK", "0")
    parser = parser_of(command)
    ranged_flags = [flag for flag, kind in numeric_flags(parser) if kind.__name__ == "float"
                    and isinstance(kind.bounds[1], float | int) and kind.bounds[1] != float("inf")]
    assert ranged_flags and set(ranged_flags) <= set(ENDS), set(ranged_flags) - set(ENDS)
    for flag in ranged_flags:
        ends = ENDS[flag]
        low, high = ends[1:-1].split(", ")
        for value, is_open in ((low, ends[0] == "("), (high, ends[-1] == ")")):
            if is_open:
                assert f"must be in {ends}, got {float(value)}" in refused(parser, flag, value, capsys)
            else:
                dest = flag.removeprefix("--").replace("-", "_")
                assert getattr(parser.parse_args([f"{flag}={value}"]), dest) == float(value), (flag, value)


@pytest.mark.parametrize("command, flag, value, says", [
    (synthetic, "--size", "100000", "must be at most 2048"),
    (synthetic, "--seed", "-1", "must be at least 0"),
    (train_ddp, "--dist-timeout", "1e300", "must be in (0, 1e+06]"),
    (predict, "--dist-timeout", "1e300", "must be in (0, 1e+06]"),
    (train_single, "--seed", "-5", "must be at least 0"),
    (train_single, "--batch-size", "1000000000000", "must be at most 65536"),
    (prepare, "--image-size", "100000", "must be at most 2048"),
    (train_single, "--lr", "1e39", "must be at most 3.403e+38 (float32's largest)"),  # overflowed at the first step
    (train_single, "--mixup-alpha", "1e-46", "must be 0 or at least 1.175e-38"),  # a Dirichlet of zeros
])
def test_a_number_past_its_bound_is_one_line_before_any_work(command, flag, value, says, tmp_path, monkeypatch,
                                                             capsys):
    """The cases that died deep inside (a traceback, a 70 GB allocation) or wrote before refusing
    (prepare wrote train.csv, then said the cache has no room): refused as parsed, nothing written."""
    monkeypatch.chdir(tmp_path)
    positional = {synthetic: [str(tmp_path / "set")], prepare: [str(tmp_path)]}.get(command, [])
    fails_in_process(command.main, [*positional, flag, value], monkeypatch, capsys, f"argument {flag}: {says}")
    assert list(tmp_path.iterdir()) == []


TUNES = [(["--ra-magnitude", "9"], "--ra-magnitude: it tunes --auto-augment ra alone"),
         (["--auto-augment", "ta_wide", "--ra-magnitude", "12"], "--ra-magnitude: it tunes --auto-augment ra alone"),
         (["--augmix-severity", "3"], "--augmix-severity: it tunes --auto-augment augmix alone"),
         (["--auto-augment", "ra", "--augmix-severity", "5"], "--augmix-severity: it tunes --auto-augment augmix"),
         (["--optimizer", "adamw", "--momentum", "0.9"], "--momentum: it is SGD's"),
         (["--sync-bn"], "--sync-bn: one process normalises its whole micro-batch already"),
         (["--evaluate", "--save-every-steps", "5"], "--evaluate trains nothing and writes nothing: drop --save-every-steps")]


@pytest.mark.parametrize("argv, says", TUNES)
def test_a_flag_that_cannot_act_is_refused_even_at_its_default(argv, says, capsys):
    """--ra-magnitude without --auto-augment ra did nothing while best.json recorded it (the
    --dropout rule: refuse a flag that cannot act). Its default (9) is refused too when given;
    left out, the default is recorded as before; with the policy it tunes, it is taken."""
    with pytest.raises(SystemExit) as exit:
        parse_args("", argv, script="train_single.py")
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and says in err, err
    defaults = parse_args("", [])
    assert (defaults.ra_magnitude, defaults.augmix_severity, defaults.momentum) == (9, 3, 0.9)
    assert parse_args("", ["--auto-augment", "ra", "--ra-magnitude", "9"]).ra_magnitude == 9
    assert parse_args("", ["--auto-augment", "augmix", "--augmix-severity", "5"]).augmix_severity == 5
    assert parse_args("", ["--optimizer", "adamw"]).optimizer == "adamw"


def test_sync_bn_of_a_model_without_batch_norm_is_refused(capsys, monkeypatch):
    """vgg16 (the default --arch) has no batch norm layer: --sync-bn under a launcher synchronised
    nothing while best.json recorded it. resnet18 has some: taken. The benchmark leaves its
    ddp-sync-bn run out of the default runs of such a model, and refuses it when named."""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit):
        parse_args("", ["--sync-bn"], script="train_ddp.py", distributed=True)
    assert "--arch vgg16 has no batch norm layer for it to synchronise" in capsys.readouterr().err
    assert parse_args("", ["--sync-bn", "--arch", "resnet18", "--weights", "none"], script="train_ddp.py",
                      distributed=True).sync_bn
    assert "ddp-sync-bn" not in benchmark.parse_args([]).modes.split(",")
    assert "ddp-sync-bn" in benchmark.parse_args(["--arch", "resnet18"]).modes.split(",")
    with pytest.raises(SystemExit):
        benchmark.parse_args(["--modes", "ddp,ddp-sync-bn"])
    assert "ddp-sync-bn: --arch vgg16 has no batch norm layer to synchronise" in capsys.readouterr().err


def test_tools_refuse_a_flag_that_cannot_act(tmp_path, monkeypatch, capsys):
    """predict reads --data-dir's test/ only without PATH, and --overwrite replaces no file on
    standard output; prepare's --image-size is the size of the --cache it builds; the benchmark's
    and the recipe comparison's --images, of the synthetic set they write without --data-dir;
    chaos's --far and --alone are runs of --change-world."""
    cases = [(predict, [str(tmp_path), "--data-dir", str(tmp_path)],
              "argument --data-dir: it names the folder of Kaggle's test/, which predict reads without PATH"),
             (predict, [str(tmp_path), "--output", "-", "--overwrite"],
              "argument --overwrite: --output - writes to standard output, which replaces no file"),
             (prepare, [str(tmp_path), "--image-size", "64"], "argument --image-size: it is the image size of the --cache"),
             (benchmark, ["--data-dir", str(tmp_path), "--images", "100"],
              "argument --images: it is the size of the synthetic set written without --data-dir"),
             (compare_recipes, ["--data-dir", str(tmp_path), "--images", "100"],
              "argument --images: it is the size of the synthetic set written without --data-dir"),
             (chaos, ["--far", str(tmp_path)], "argument --far: it is a run of --change-world: add it, or drop it")]
    for command, argv, said in cases:
        fails_in_process(command.main, argv, monkeypatch, capsys, said)
    assert list(tmp_path.iterdir()) == []
