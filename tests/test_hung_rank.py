"""A rank that stops answering is named (src/heartbeat.py): the others end within --dist-timeout
with one line saying which rank, where it was and when it was last heard from."""
import os
import pickle
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


class _Event:
    """A CUDA event as the heartbeat's thread asks it: done or not (query), never waited for."""

    def __init__(self, done: bool):
        self.done = done

    def query(self) -> bool:
        return self.done

    def synchronize(self):
        raise AssertionError("the heartbeat waited for the GPU")


def test_on_a_gpu_the_place_told_is_the_last_one_the_device_reached():
    """The host queued steps 5 to 8 and waits at step 9; the GPU has reached step 6 (its event for
    step 7 is not done: it waits there in a collective). The beat says step 6, not the host's step
    9; once the GPU has done everything queued, the host's place; nothing is waited for."""
    beat = heartbeat.Heartbeat()
    places = [("training", 0, i, i, False) for i in range(4, 8)]
    beat.recorded.extend((place, _Event(i < 2)) for i, place in enumerate(places))
    beat.at("training", 0, 8, 8, loading=True)
    assert beat.where() == places[1] and heartbeat.described(beat.where())["where"] == "epoch 1 step 6 (training)"
    assert len(beat.recorded) == 2
    for _, event in beat.recorded:
        event.done = True
    assert beat.where() == beat.place == ("training", 0, 8, 8, True) and not beat.recorded


def test_with_a_stop_pending_a_rank_not_heard_from_for_stale_seconds_ends_the_others():
    """A stop signal is pending: rank 1 not heard from for more than STALE seconds (dead or
    stopped) means no step can be agreed; rank 0 says so, rank 2 ends quietly. A rank heard from
    recently, wherever it is, will come: nothing is said."""
    stale = heartbeat.STALE + 1
    beats = [_beat("epoch 1 step 8 (training)", [0, 1, 7, 1], 1), _beat("epoch 1 step 5 (training)", [0, 1, 4, 1], stale),
             _beat("epoch 1 step 8 (training)", [0, 1, 7, 1], 1)]
    line, says = heartbeat.judge_stop(beats, 0, 1000.0)
    assert says and line == (f"stop: rank 1 stopped answering at epoch 1 step 5 (training); last heard {stale:.0f} s ago: "
                             "no step can be agreed without it, so the others end now, last.pth as last saved (the "
                             "others were at epoch 1 step 8 (training))")
    assert heartbeat.judge_stop(beats, 2, 1000.0) == (line, False)
    beats[1] = _beat("epoch 1 step 2 (loading its data)", [0, 1, 1, 0], heartbeat.STALE - 1)
    assert heartbeat.judge_stop(beats, 0, 1000.0) == (None, False)


def test_the_flight_recorder_is_dumped_where_torch_dumps_it(tmp_path, monkeypatch):
    """A world of one over gloo, one all-reduce: its flight recorder goes to TORCH_FR_DUMP_TEMP_FILE +
    the rank, pickled as torch dumps it, holding that all-reduce; without a process group nothing."""
    import torch
    import torch.distributed as dist
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", str(tmp_path / "trace_"))
    assert heartbeat.dump_flight_recorder(0) is None
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        dist.all_reduce(torch.ones(3))
        path = heartbeat.dump_flight_recorder(0)
    finally:
        dist.destroy_process_group()
    assert path == str(tmp_path / "trace_0")
    entries = pickle.loads((tmp_path / "trace_0").read_bytes())["entries"]
    assert [(entry["profiling_name"], entry["input_sizes"]) for entry in entries][-1] == ("gloo:all_reduce", [[3]])


def test_a_rank_stopped_with_sigstop_is_named_within_the_timeout(exact_data, tmp_path):
    """Two DDP processes, a timeout of 30 s (--dist-timeout 0.5): rank 1 stops itself with SIGSTOP at
    its 3rd optimizer step; rank 0 waits for it
    in the next step's gradient all-reduce and, before gloo's timeout, says which rank, where and
    how long ago, in one line, and ends, after dumping its flight recorder (where
    TORCH_FR_DUMP_TEMP_FILE says: the all-reduce it waits in, not completed, last); torchrun ends
    the job. The stopped process is killed at the end whatever happens."""
    stop_log = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": HOOKS, "PYTHONUNBUFFERED": "1", "STOP_AT_STEP": "3", "STOP_RANK": "1",
           "STOP_LOG": str(stop_log), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
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
    # was last heard (its beat rewritten at most every BEAT = 2 s until its SIGSTOP, which rank 0
    # may reach its collective before: a few seconds of slack on a busy machine), and before the
    # timeout.
    assert TIMEOUT - heartbeat.margin(TIMEOUT) - 9 <= int(match.group(1)) <= TIMEOUT, lines[0]
    assert said_at - stopped < TIMEOUT
    assert launch.returncode == 1
    assert f"each rank's last collectives: {tmp_path}/trace_N " in (tmp_path / "stderr").read_text()
    last = pickle.loads((tmp_path / "trace_0").read_bytes())["entries"][-1]
    assert last["profiling_name"].startswith("gloo:") and last["state"] != "completed", last


def test_a_stop_signal_is_seen_through_the_wakeup_pipe_when_the_handler_cannot_run(stop_signals):
    """A rank whose main thread waits in a collective cannot run its Python signal handler, so its
    stop flag stays down; the heartbeat's thread still sees the signal in StopSignals' wakeup pipe,
    where Python's C-level handler writes it (pending_since). Here the Python handler is one that
    notes nothing, as one that never got to run; the control: without a signal, nothing pending.
    After the block the previous wakeup descriptor is back."""
    from src.stopping import StopSignals
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    signals = StopSignals()
    signals.distributed = True  # as in a process group of two: the pipe is made for one
    with signals:
        assert signals.wakeup is not None and signals.pending_since() is None
        signal.signal(signal.SIGTERM, lambda number, frame: None)  # the handler that did not run
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.requested == 0, "the flag stayed down"
        since = signals.pending_since()
        assert since is not None and since <= time.monotonic()
    assert signals.wakeup is None and signal.set_wakeup_fd(before) == before


def test_a_stop_that_no_rank_can_agree_on_ends_before_the_launchers_sigkill(exact_data, tmp_path):
    """train_accelerate.py, two processes (its heartbeat in the store of the group accelerate
    joined): rank 1 stops itself with SIGSTOP at its 3rd step, rank 0 waits for it in the next
    collective (--dist-timeout 5: its own timeout is minutes away); then SIGTERM to the launcher,
    which sends SIGTERM to the workers and would SIGKILL them 30 s later. Rank 0 cannot agree on a
    stop without rank 1 (its main thread, in or on its way to the collective, never reads the
    agreement); its heartbeat sees the signal, and rank 1 not heard from, and ends rank 0 with one
    line (printed only on that path: without it rank 0 stays until the SIGKILL, silent). Whether
    the signal finds rank 0's main thread in the collective already (its Python handler cannot
    run: the wakeup pipe, the test above) or before it, the end is the same."""
    stop_log = tmp_path / "stopped"
    env = {**os.environ, "PYTHONPATH": HOOKS, "PYTHONUNBUFFERED": "1", "STOP_AT_STEP": "3", "STOP_RANK": "1",
           "STOP_LOG": str(stop_log), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "ACCELERATE_USE_CPU": "1",
           "HF_HOME": str(tmp_path / "hf"), "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "trace_")}
    command = [*LAUNCH["accelerate"](), "--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "1",
               "--batch-size", str(B), "--dist-timeout", "5", *outputs(tmp_path / "out")]
    with open(tmp_path / "stderr", "w") as stderr:
        launch = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.time() + 200
        while time.time() < deadline and launch.poll() is None and not stop_log.exists():
            time.sleep(0.5)
        launch.send_signal(signal.SIGTERM)
        deadline = time.time() + 120
        while time.time() < deadline and launch.poll() is None and "stop:" not in (tmp_path / "stderr").read_text():
            time.sleep(0.5)
    finally:
        if stop_log.exists():
            os.kill(int(stop_log.read_text().split()[0]), signal.SIGKILL)
        launch.wait(timeout=120)
    lines = [line for line in (tmp_path / "stderr").read_text().replace("\r", "\n").splitlines()
             if line.startswith("stop:")]
    assert len(lines) == 1, (tmp_path / "stderr").read_text()[-3000:]
    assert re.fullmatch(r"stop: rank 1 stopped answering at epoch 1 step 3 \(training\); last heard \d+ s ago: no step "
                        r"can be agreed without it, so the others end now, last.pth as last saved \(the others were at "
                        r"epoch 1 step 4 \(training\)\)", lines[0]), lines[0]
    assert (tmp_path / "trace_0").exists()
