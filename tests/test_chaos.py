"""python -m src.tools.chaos: a run stopped at random steps of random ranks, by SIGINT to torchrun
and SIGKILL of a worker under --max-restarts, resumed each time, ends bit for bit where the
uninterrupted run (the session's) does; with --change-world, resumed each time in another mode
and number of processes, it ends within the float floor of the uninterrupted runs."""
import random
import re
import shutil

import pytest
import torch
from conftest import EXACT, RESUMABLE, VAL, B, python, resumable_run, run_main

from src.checkpoint import read_last
from src.errors import UserError
from src.tools import chaos
from src.tools.chaos import WORLDS, compare, ended_as_straight, next_stop, plan, verdict


def test_two_stops_end_bit_for_bit_where_the_straight_run_does(runs, exact_data, tmp_path):
    """Seed 0's plan: SIGINT to torchrun from rank 0 after step 4, which torchrun forwards to both
    ranks: if every rank's flag was up when step 4's all-reduce started, they stop after step 5, the
    epoch's last (a step checkpoint there); if one rank got the forwarded signal later, they agree
    at step 5 and stop at the epoch's end (last.pth of epoch 1): the same place in the run, reached
    either way; --resume, then SIGKILL of rank 1 after step 8: torchrun restarts the workers, which
    go on from the step checkpoint after step 6 (--save-every-steps 3) and redo steps 7 and 8."""
    reference = resumable_run(runs, "ddp")[0]
    result = run_main(chaos.main, ["--stops", "2", "--seed", "0", "--epochs", "2", "--batch-size", str(B),
                                   "--data-dir", str(exact_data), "--reference", str(reference), "--work-dir",
                                   str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[1] in ("launch 1: sigint (rank 0) after step 4; exit 1, last.pth at epoch 1 + 0 steps",
                        "launch 1: sigint (rank 0) after step 4; exit 1, last.pth at epoch 0 + 5 steps")
    assert lines[2] == "launch 2: sigkill (rank 1) after step 8; exit 0, last.pth at epoch 2 + 0 steps"
    assert lines[3].startswith("chaos: 2 stops (0 sigterm, 1 sigint, 1 sigkill) in 2 launches, ")
    assert lines[3].endswith("; 2 of 10 steps done twice; distance to the uninterrupted run: 0 (weights), "
                             "0 (average); history the same")
    assert "resumed from" in (tmp_path / "launch-2.log").read_text().split("exitcode: -9")[1], "the restart resumed"


def test_the_plan_spreads_the_stops_over_the_run_and_splits_it_into_launches():
    for seed in range(20):
        launches = plan(random.Random(seed), 5, 30)
        events = [event for launch in launches for event in launch]
        assert len(events) == 5 and all(1 <= e["step"] <= 28 for e in events)
        assert [e["step"] for e in events] == sorted({e["step"] for e in events})
        for launch in launches:  # a launch ends at its signal; its kills begin the next attempts
            assert [e["attempt"] for e in launch] == list(range(len(launch)))
            assert all(e["means"] == "sigkill" for e in launch[:-1])
    with pytest.raises(UserError, match="10 optimizer steps leave no room for 9 stops"):
        plan(random.Random(0), 9, 10)


def test_another_run_is_not_at_distance_0(runs):
    """The verdict's control: one process and two processes of the same job end apart (float sums
    in another order), and a run of other flags is refused as a reference."""
    single, ddp = resumable_run(runs, "single")[0], resumable_run(runs, "ddp")[0]
    weights, average, same_history = compare(single, ddp)
    assert weights > 0 and average > 0 and not same_history
    assert not ended_as_straight(weights, average, same_history)
    other = runs("single", *EXACT, *VAL, "--epochs", "2", "--batch-size", str(B))[0]  # conftest's `far` run
    with pytest.raises(UserError, match="is another run: its batch_size is 10, not 20"):
        compare(single, other)


# --change-world: 100 training images in global batches of 10, 10 steps an epoch (a signal to two
# processes is agreed on within 2 x CHECK_EVERY steps: room for two stops in 20).
WORLD_FLAGS = [*RESUMABLE, *VAL, "--epochs", "2"]


def _world_runs(runs):
    """The uninterrupted runs --change-world compares with: two DDP processes of 5 images, one
    process of 10 (the float floor), and two processes of 10 (another global batch: the control)."""
    return (runs("ddp", *WORLD_FLAGS, "--batch-size", "5")[0], runs("single", *WORLD_FLAGS, "--batch-size", "10")[0],
            runs("ddp", *WORLD_FLAGS, "--batch-size", "10")[0])


def test_stops_that_change_the_world_end_within_the_float_floor(runs, exact_data, tmp_path):
    """Seed 3: two stops, each ending its launch, each launch in another world than the one before
    (a step checkpoint of one mode and number of processes resumed by another: last.pth or FSDP's
    last.dcp), the steps each done once or redone after a kill; the run ends within the float floor
    of an uninterrupted run, weights, average and history."""
    reference, alone, far = _world_runs(runs)
    result = python("-m", "src.tools.chaos", "--change-world", "--stops", "2", "--seed", "3", "--epochs", "2",
                    "--batch-size", "5", "--data-dir", str(exact_data), "--reference", str(reference), "--alone",
                    str(alone), "--far", str(far), "--work-dir", str(tmp_path), timeout=1200)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    launches = [re.match(r"launch (\d): (train_\w+\.py) x (\d): (.*); exit (-?\d+), (last\.\w+) at epoch (\d) \+ (\d+) steps",
                         line) for line in lines[1:4]]
    assert all(launches), lines
    worlds = [(match[2], int(match[3])) for match in launches]
    assert all(world in WORLDS for world in worlds) and worlds[0] != worlds[1] != worlds[2]
    assert [match[5] != "0" for match in launches] == [True, True, False]
    assert launches[2][4] == "no stop" and launches[2].group(6, 7, 8) == (
        "last.dcp" if worlds[2][0] == "train_fsdp.py" else "last.pth", "2", "0")
    assert lines[4].startswith("chaos: 2 stops (") and " in 3 launches in 3 worlds, " in lines[4]
    assert lines[5].startswith("chaos: distance to the uninterrupted run on 2 processes ")
    assert lines[5].count(": within") == 2, lines[5]


def test_the_world_verdict_refuses_a_run_of_another_global_batch(runs, tmp_path):
    """The control: a run of the job that ends at the weights of the run of another global batch is 1
    control distance from the uninterrupted run on 2 processes (by definition) and not within the
    float floor of either; the run on 1 process is within it (its own floor); a control of the run's
    own global batch is refused."""
    reference, alone, far = _world_runs(runs)
    # The run's flags (the verdict refuses a run of other flags), the control's weights and average.
    shutil.copytree(reference, tmp_path / "ended-far")
    last, control = torch.load(reference / "last.pth", weights_only=True), read_last(far)
    last["model"], last["average"]["model"] = control["model"], control["average"]["model"]
    torch.save(last, tmp_path / "ended-far" / "last.pth")
    found = verdict(tmp_path / "ended-far", reference, alone, far)
    assert found["to two"][0] == 1.0 and not found["ends"]
    found = verdict(alone, reference, alone, far)
    assert found["ends"] and found["to one"] == (0.0, 0.0) and found["history"]
    with pytest.raises(UserError, match="has the global batch of the run"):
        verdict(alone, reference, alone, reference)


def test_each_stop_is_planned_in_the_steps_left_and_another_world():
    for seed in range(20):
        rng, done, previous = random.Random(seed), 0, None
        for left in range(5, 0, -1):
            chosen = next_stop(rng, done, left, 100, previous)
            event = chosen["event"]
            assert chosen["world"] != previous and chosen["world"] in WORLDS
            assert done < event["step"] <= 100 - (8 if event["means"] != "sigkill" else 0)
            assert 0 <= event["rank"] < chosen["world"][1]
            done, previous = event["step"], chosen["world"]
        assert next_stop(rng, done, 0, 100, previous)["event"] is None
    with pytest.raises(UserError, match="20 optimizer steps leave no room for 1 more stop.s. after step 20"):
        next_stop(random.Random(0), 20, 1, 20, None)
def test_the_verdict_passes_only_the_same_weights_average_and_history():
    """The check's exit code: a resumed run that ends with other weights, another weight average or
    another history fails, each on its own (the smallest float above 0 is not 0)."""
    tiny = 5e-324
    assert ended_as_straight(0.0, 0.0, True)
    assert not ended_as_straight(tiny, 0.0, True)
    assert not ended_as_straight(0.0, tiny, True)
    assert not ended_as_straight(0.0, 0.0, False)


@pytest.mark.parametrize("missing", ["--reference", "--alone", "--far"])
def test_a_folder_without_a_last_is_one_line_naming_its_flag(missing, tmp_path):
    """--reference, --alone or --far naming a folder that holds no last (a typo, a run that never
    saved): a TypeError traceback ('NoneType' object is not subscriptable) before; now one line."""
    ran = tmp_path / "ran"
    ran.mkdir()
    torch.save({"epoch": 1, "step": 0, "info": {}}, ran / "last.pth")
    empty = tmp_path / "empty"
    empty.mkdir()
    folders = {flag: (empty if flag == missing else ran) for flag in ("--reference", "--alone", "--far")}
    with pytest.raises(UserError, match=rf"^{missing} {re.escape(str(empty))} holds no last.pth or last.dcp: pass the "
                                        "output folder of a finished run$"):
        if missing == "--reference":
            compare(ran, empty)
        verdict(ran, folders["--reference"], folders["--alone"], folders["--far"])
