"""A rank that stops answering is named (src/heartbeat.py): the others end within --dist-timeout
with one line saying which rank, where it was and when it was last heard from."""
import os
import re
import signal
import subprocess
import time

from conftest import BIN, EXACT, HOOKS, LAUNCH, ROOT, VAL, B, outputs

from src import heartbeat

TORCHRUN = LAUNCH["ddp"]()[:-1]
TIMEOUT = 30  # seconds


def _beat(where: str, order: list, age: float, now: float = 1000.0) -> dict:
    return {"where": where, "order": order, "time": now - age}


def test_the_line_names_the_ranks_that_did_not_arrive_and_the_lowest_other_rank_says_it():
    """Rank 1's beat is stale (stopped), rank 2 is answering but still at an earlier step (stuck in
    its data loader), rank 3 waits where rank 0 waits: ranks 0 and 3 know, rank 0 says it."""
    beats = [_beat("epoch 1 step 8 (training)", [0, 1, 7, 1], 1),
             _beat("epoch 1 step 7 (training)", [0, 1, 6, 1], 63),
             _beat("epoch 1 step 8 (loading its data)", [0, 1, 7, 0], 1),
             _beat("epoch 1 step 8 (training)", [0, 1, 7, 1], 2)]
    line, says = heartbeat.judge(beats, 0, 1000.0, 60)
    assert says and line == (
        "timeout: rank 1 stopped answering at epoch 1 step 7 (training); last heard 63 s ago; rank 2 did not "
        "arrive: it is still at epoch 1 step 8 (loading its data), last heard 1 s ago (the others wait at epoch 1 "
        "step 8 (training); --dist-timeout 1 min)")
    assert heartbeat.judge(beats, 3, 1000.0, 60) == (line, False)
    # Everyone is where this rank is and answering: not theirs to explain, nothing said.
    assert heartbeat.judge([beats[0], beats[3]], 1, 1000.0, 60) == (None, False)
    # A rank never heard from.
    assert heartbeat.judge([beats[0], None], 0, 1000.0, 60)[0].startswith("timeout: rank 1 never answered (")


def test_the_places_of_a_run_are_ordered_as_every_rank_goes_through_them():
    places = [("starting", -1, 0, 0, False), ("training", 0, 0, 0, True), ("training", 0, 0, 0, False),
              ("training", 0, 5, 2, True), ("training", 0, heartbeat.END, 0, False), ("validating", 0, 3, 0, False),
              ("validating", 0, heartbeat.END, 0, False), ("validating the average", 0, 0, 0, False),
              ("saving", 0, 0, 0, False), ("training", 1, 0, 0, True)]
    described = [heartbeat.described(place) for place in places]
    assert [d["order"] for d in described] == sorted(d["order"] for d in described)
    assert [d["where"] for d in described[:5]] == [
        "its start, before training", "epoch 1 step 1 (loading its data)", "epoch 1 step 1 (training)",
        "epoch 1 step 3 (loading its data)", "epoch 1 (training, done)"]
    assert described[5]["where"] == "epoch 1 (validating, batch 4)"


def test_a_rank_stopped_with_sigstop_is_named_within_the_timeout(exact_data, tmp_path):
    """Two DDP processes, a timeout of 30 s (--dist-timeout 0.5): rank 1 stops itself with SIGSTOP at
    its 3rd optimizer step; rank 0 waits for it
    in the next step's gradient all-reduce and, before gloo's timeout, says which rank, where and
    how long ago, in one line, and ends; torchrun ends the job. The stopped process is killed at
    the end whatever happens."""
    stop_log = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": HOOKS, "PYTHONUNBUFFERED": "1", "STOP_AT_STEP": "3", "STOP_RANK": "1",
           "STOP_LOG": str(stop_log), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    command = [*TORCHRUN, "train_ddp.py", "--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "1",
               "--batch-size", str(B), "--dist-timeout", str(TIMEOUT / 60), *outputs(tmp_path / "out")]
    with open(tmp_path / "stderr", "w") as stderr:
        launch = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                  stderr=stderr)
    try:
        deadline = time.time() + 200
        while time.time() < deadline and launch.poll() is None and "timeout:" not in (tmp_path / "stderr").read_text():
            time.sleep(0.5)
        said_at = time.time()
    finally:
        if stop_log.exists():  # torchrun would take 30 s more to SIGKILL it
            os.kill(int(stop_log.read_text().split()[0]), signal.SIGKILL)
        launch.wait(timeout=120)
    stopped = float(stop_log.read_text().split()[1])
    lines = [line for line in (tmp_path / "stderr").read_text().replace("\r", "\n").splitlines()
             if line.startswith("timeout:")]
    assert len(lines) == 1, (tmp_path / "stderr").read_text()[-3000:]
    match = re.fullmatch(r"timeout: rank 1 stopped answering at epoch 1 step 3 \(training\); last heard (\d+) s ago "
                         rf"\(the others wait at epoch 1 step 4 \(training\); --dist-timeout {TIMEOUT / 60:g} min\)", lines[0])
    assert match, lines[0]
    # Said once rank 0's own place has stood still for the timeout less the margin, after rank 1
    # was last heard (its 1 s pause before SIGSTOP, a beat every 0.25 s: a few seconds of slack
    # on a busy machine), and before the timeout.
    assert TIMEOUT - heartbeat.margin(TIMEOUT) - 9 <= int(match.group(1)) <= TIMEOUT, lines[0]
    assert said_at - stopped < TIMEOUT
    assert launch.returncode == 1
