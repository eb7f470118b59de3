"""python -m src.tools.chaos: a run stopped at random steps of random ranks, by SIGINT to torchrun
and SIGKILL of a worker under --max-restarts, resumed each time, ends bit for bit where the
uninterrupted run (the session's) does."""
import random

import pytest
from conftest import EXACT, VAL, B, resumable_run, run_main

from src.errors import UserError
from src.tools import chaos
from src.tools.chaos import compare, ended_as_straight, plan


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


def test_the_verdict_passes_only_the_same_weights_average_and_history():
    """The check's exit code: a resumed run that ends with other weights, another weight average or
    another history fails, each on its own (the smallest float above 0 is not 0)."""
    tiny = 5e-324
    assert ended_as_straight(0.0, 0.0, True)
    assert not ended_as_straight(tiny, 0.0, True)
    assert not ended_as_straight(0.0, tiny, True)
    assert not ended_as_straight(0.0, 0.0, False)
