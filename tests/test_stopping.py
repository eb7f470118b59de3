"""Step checkpoints (--save-every-steps) and stops on SIGTERM, SIGUSR1 and SIGINT (src/stopping.py):
under torchrun a stop at any step, then --resume, ends bit for bit where the uninterrupted run
does; every mode resumes a mid-epoch last.pth; the ranks agree on the step; a stop between the
micro-batches of a step waits for the step; bad input. Ctrl-C of train_single.py:
test_reliability.py; the chaos check: test_chaos.py; a rank that stops answering: test_hung_rank.py."""
import os
import shutil
import signal

import pytest
import torch
import torch.nn as nn
from conftest import (
    EXACT,
    HOOKS,
    LAUNCH,
    TOLERANCE,
    VAL,
    B,
    assert_same_best,
    assert_same_run,
    distance,
    fails_in_process,
    history,
    in_process,
    mode_run,
    on_threads,
    outputs,
    read_last_copy,
    run,
    run_main,
    same_end,
    script_loader,
    script_pass,
    stepped_run,
    stop_line,
    stops_straight,
    weights,
)

import train_ddp
import train_dp
import train_single
from src.cli import defaults, parse_args
from src.ema import WeightAverage
from src.errors import Stopped
from src.metrics import COUNT
from src.ranks import restarted
from src.recipe import make_optimizer, make_schedule
from src.state import TrainingState
from src.stopping import CHECK_EVERY, StopSignals, how_to_go_on


def _at(folder) -> tuple[int, int]:
    state = weights(folder, "last.pth")
    return state["epoch"], state["step"]


def test_signals_under_torchrun_stop_every_rank_at_one_step_and_resume_to_the_same_end(ddp_stops, runs):
    """Two DDP processes, 10 steps an epoch, 2 epochs, --save-every-steps 3 (conftest.ddp_stops;
    after a step, the ranks start an all-reduce of their flags every CHECK_EVERY = 4 steps of the
    run and read it at the next check, whatever --log-every says; at an epoch's start they agree
    at once):
    1. SIGUSR1 to rank 1 alone in step 1: the check after step 4 carries it, the one after step 8
       reads it, and both stop after step 8 (not at the next epoch's start); a signal to rank 0
       during the stop's save changes nothing;
    2. --resume; SIGUSR1 to rank 1 alone in the run's step 9 (torchrun does not see it): both stop
       at the next epoch's start, epoch 1's files saved;
    3. --resume under torchrun started as docs/slurm/train.sbatch starts it (--signals-to-handle with
       SIGUSR1); SIGUSR1 to torchrun in step 11, which forwards it: both stop after step 16 (epoch 2
       step 6) (Ctrl-C to torchrun: test_chaos.py);
    4. --resume (a worker killed and restarted on the way: test_reliability.py) ends with the
       weights, weight average, history and best.pth of the straight run."""
    assert CHECK_EVERY == 4  # the steps below
    where = ddp_stops["at step 8"].out.parent / "out"  # the folder the launches wrote, as they name it

    out, result = ddp_stops["at step 8"]
    assert result.returncode == 1, result.stderr[-3000:]  # torchrun's own code when a worker exits non-zero
    assert result.stderr.count("exitcode  : 75") == 2 and "received by PID" not in result.stderr, result.stderr[-3000:]
    said, command = stop_line(result.stderr).split("; to go on, launch the same way: ")
    assert said == f"stopped by SIGUSR1 at epoch 1 step 8 of 10: {where}/last.pth saved there"
    assert command.endswith(" --resume") and command.startswith("train_ddp.py --data-dir ")
    assert _at(out) == (0, 8) and not (out / "history.json").exists()
    assert not list(out.glob(".*.tmp"))

    out, result = ddp_stops["after epoch 1"]
    assert f"resumed from {where}/last.pth in epoch 1 of 2 after its step 8: going on" in result.stdout
    assert stop_line(result.stderr).startswith(f"stopped by SIGUSR1 after epoch 1 of 2: {where}/last.pth holds it; ")
    assert "exitcode: 75" in result.stderr and "received by PID" not in result.stderr, result.stderr[-3000:]
    assert _at(out) == (1, 0) and [r["epoch"] for r in history(out)] == [1]

    out, result = ddp_stops["at step 16"]
    assert stop_line(result.stderr).startswith(f"stopped by SIGUSR1 at epoch 2 step 6 of 10: {where}/last.pth saved")
    assert "got signal: 10" in result.stderr and _at(out) == (1, 6)
    assert result.stderr.count("Traceback") == 1, "torchrun's, no worker's"

    out, result = ddp_stops["restarted"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in epoch 2 of 2 after its step 6: going on" in result.stdout
    straight = stops_straight(runs, "ddp")
    same_end(out, straight)
    assert_same_best(out, straight)


@pytest.fixture(scope="module")
def stepped(runs):
    return stepped_run(runs)


def test_step_checkpoints_hold_the_steps_and_change_nothing(stepped, runs):
    """last.pth after every 3rd optimizer step and at each epoch's end, with the steps done and the
    partial sums (step 3: 3 x 20 images); the run ends bit for bit as without them."""
    copies = sorted((stepped.parent / "copies").iterdir(), key=lambda path: int(path.name.split(".")[1]))
    states = [torch.load(path, weights_only=True) for path in copies]
    assert [(s["epoch"], s["step"]) for s in states] == [(0, 3), (1, 0), (1, 1), (1, 4), (2, 0)]
    assert [len(s["history"]) for s in states] == [0, 1, 1, 1, 2]
    assert states[0]["partial"]["sums"].shape == (1, 4) and states[0]["partial"]["sums"][0, COUNT] == 60
    assert states[3]["partial"]["sums"][0, COUNT] == 80 and states[3]["partial"]["train_seconds"] > 0
    assert "partial" not in states[1] and "partial" not in states[4]
    same_end(stepped, mode_run(runs, "single")[0])


@pytest.mark.parametrize("mode", ["dp", "ddp", "fsdp", "accelerate"])
def test_every_mode_resumes_a_mid_epoch_checkpoint_to_the_same_end(mode, stepped, far, runs, tmp_path):
    """train_single.py's last.pth after step 6 (epoch 2's first), resumed in another mode with the
    same global batch in micro-batches of half of it (--accumulate 2: the finished step's two
    micro-batches are skipped), ends where the stepped run does, within the modes' tolerance; so
    does the step checkpoint it writes after step 9 (FSDP gathers its shards). train_dp.py and
    train_ddp.py (without a launcher: a world of one) run in this process; train_dp.py resumes
    without --resume, in a requeued SLURM job."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(stepped.parent / "copies" / "last.3.pth", out / "last.pth")
    one_process = mode in ("dp", "ddp")
    flags = ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--epochs", "2", "--batch-size",
             str(B if one_process else B // 2), "--accumulate", "2", "--save-every-steps", "3", *outputs(out)]
    env = {"COPY_LAST": str(tmp_path / "copies")}
    if mode == "dp":
        result = run_main(train_dp.main, flags, env={**env, "SLURM_RESTART_COUNT": "1"})
    elif mode == "ddp":
        result = run_main(train_ddp.main, [*flags, "--resume"], env=env)
    else:
        result = run([*LAUNCH[mode](), *flags, "--resume"],
                     env={"ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": HOOKS, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in epoch 2 of 2 after its step 1: going on" in result.stdout and "epoch 1/2" not in result.stdout
    (first,) = (tmp_path / "copies").glob("last.1.*")  # FSDP's: its last.dcp folder
    step_9 = read_last_copy(first)
    assert (step_9["epoch"], step_9["step"]) == (1, 4)
    assert distance(step_9["model"], weights(stepped.parent / "copies", "last.4.pth")["model"]) < TOLERANCE * far
    assert_same_run(out, stepped, far)


def test_a_two_rank_step_checkpoint_resumes_in_one_process_with_both_ranks_sums(stepped, runs, tmp_path, monkeypatch,
                                                                                  capsys):
    """A step checkpoint holds each rank's metric sums of the finished steps (one row each); one
    process going on takes their total. The stepped run's last.pth after step 6 (epoch 2's first),
    its row cut into two halves as two ranks would hold it, ends with epoch 2's metrics of the
    stepped run, bit for bit (halving is exact)."""
    state = torch.load(stepped.parent / "copies" / "last.3.pth", weights_only=True)
    rows = state["partial"]["sums"]
    state["partial"]["sums"] = torch.cat([rows / 2, rows / 2])
    out = tmp_path / "out"
    out.mkdir()
    torch.save(state, out / "last.pth")
    code, stdout, stderr = in_process(train_single.main, ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--epochs",
                                                          "2", "--batch-size", str(2 * B), *outputs(out), "--resume"],
                                      monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    assert "in epoch 2 of 2 after its step 1: going on" in stdout
    fields = ("train_loss", "train_acc", "train_samples", "val_loss", "val_acc")
    assert [{key: r[key] for key in fields} for r in history(out)] == [{key: r[key] for key in fields}
                                                                       for r in history(stepped)]


def test_restarted_is_a_torchrun_restart_or_a_requeued_slurm_job(monkeypatch):
    """A first start resumes nothing; torchrun's restart count or SLURM's requeue count above 0 does."""
    for torchrun, slurm, expected in [(None, None, False), ("0", "0", False), (None, "0", False),
                                      (None, "1", True), ("1", None, True), ("0", "2", True)]:
        for name, value in (("TORCHELASTIC_RESTART_COUNT", torchrun), ("SLURM_RESTART_COUNT", slurm)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        assert restarted() is expected, (torchrun, slurm)


def _tiny_run(args, saved: list, signal_at: int | None, signals: tuple = (signal.SIGTERM,)):
    """train_single.train_epoch over 48 images of a tiny model, inside the training state's stop
    signals, its step checkpoints recorded in `saved` as (epoch, step, the sums) instead of written;
    `signals` to this process, one after the other, as micro-batch `signal_at` (from 0) is handed out."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(48)]
    loader = script_loader(train_single, dataset, args)
    device = torch.device("cpu")
    optimizer = make_optimizer(model, args, device)
    steps = 48 // (args.batch_size * args.accumulate)
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainingState(args, {}, model, optimizer, scaler, schedule, WeightAverage(model, optimizer, None), steps)
    state.save_step = lambda sums: saved.append((state.epoch, state.step, sums.clone()))

    class Signalling:
        def __len__(self):
            return len(loader)

        def __iter__(self):
            for i, batch in enumerate(loader):
                if i == signal_at:
                    for number in signals:
                        os.kill(os.getpid(), number)
                yield batch
    with state.stop_signals():
        script_pass(train_single, model, Signalling(), args, optimizer, scaler, schedule, state=state)
    return schedule


def test_a_signal_between_micro_batches_stops_after_the_optimizer_step(stop_signals, tmp_path):
    """--accumulate 3: SIGTERM as the 2nd micro-batch of step 2 starts; the run finishes step 2
    (its 3rd micro-batch too), saves there (2 steps x 12 images) and stops; without a signal it
    saves every --save-every-steps 3 steps and runs to the end."""
    args = parse_args("", ["--batch-size", "4", "--accumulate", "3", *outputs(tmp_path)])
    saved = []
    with pytest.raises(Stopped):
        _tiny_run(args, saved, signal_at=4)
    assert [(epoch, step) for epoch, step, _ in saved] == [(0, 2)] and saved[0][2][COUNT] == 24
    args = parse_args("", ["--batch-size", "4", "--accumulate", "1", "--save-every-steps", "5", *outputs(tmp_path)])
    saved.clear()
    schedule = _tiny_run(args, saved, signal_at=None)
    assert schedule.last_epoch == 12 and [step for _, step, _ in saved] == [5, 10]


def test_a_second_signal_before_the_stop_is_acted_on_keeps_the_first(stop_signals, tmp_path, capsys):
    """Ctrl-C, then SIGTERM before the run stopped: the stop is Ctrl-C's, and its line names it.
    StopSignals keeps the first signal's number; --accumulate 3, both as the 2nd micro-batch of
    step 2 starts: the run stops after step 2 (of 48 // 12 = 4), saying SIGINT."""
    with StopSignals() as signals:
        for number in (signal.SIGINT, signal.SIGTERM):
            os.kill(os.getpid(), number)
        assert signals.requested == signal.SIGINT
        assert signals.agreed_at(1) and signals.agreed == signal.SIGINT
    args = parse_args("", ["--batch-size", "4", "--accumulate", "3", *outputs(tmp_path)])
    saved = []
    with pytest.raises(Stopped):
        _tiny_run(args, saved, signal_at=4, signals=(signal.SIGINT, signal.SIGTERM))
    assert [(epoch, step) for epoch, step, _ in saved] == [(0, 2)]
    assert stop_line(capsys.readouterr().err).startswith(f"stopped by SIGINT at epoch 1 step 2 of 4: {tmp_path}/last.pth ")


@pytest.mark.parametrize("value, message", [
    ("0", "argument --save-every-steps: must be at least 1, got 0"),
    ("-3", "argument --save-every-steps: must be at least 1, got -3"),
    ("nan", "argument --save-every-steps: invalid int value: 'nan'"),
])
def test_a_bad_save_every_steps_is_one_line(value, message, exact_data, tmp_path, monkeypatch, capsys):
    fails_in_process(train_single.main, ["--data-dir", str(exact_data), *EXACT, "--save-every-steps", value,
                                         *outputs(tmp_path)], monkeypatch, capsys, message)


def test_a_mid_epoch_checkpoint_with_another_global_batch_is_refused(stepped, runs, tmp_path, monkeypatch, capsys):
    shutil.copy(stepped.parent / "copies" / "last.3.pth", tmp_path / "last.pth")
    fails_in_process(train_single.main, ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--epochs", "2",
                                         "--batch-size", str(B), "--resume", *outputs(tmp_path)], monkeypatch, capsys,
                     "was trained with --batch-size (x processes x --accumulate) 20, not 10")


def test_a_mid_epoch_checkpoint_past_the_epochs_asked_for_has_nothing_left_to_train(stepped, runs, tmp_path,
                                                                                    monkeypatch, capsys):
    """The stepped run's last.pth after step 6 (epoch 2's first) resumed with --epochs 1: epoch 1 is
    done, so the run has nothing left to train; it does not go on inside epoch 2, and writes no file
    (but its lock, .run.lock)."""
    shutil.copy(stepped.parent / "copies" / "last.3.pth", tmp_path / "last.pth")
    before = {"last.pth": (tmp_path / "last.pth").read_bytes()}
    code, stdout, stderr = in_process(train_single.main, ["--data-dir", str(runs.exact_data), *EXACT, *VAL, "--epochs",
                                                          "1", "--batch-size", str(2 * B), "--resume", *outputs(tmp_path)],
                                      monkeypatch, capsys)
    assert code == 0, stderr[-3000:]
    assert f"resumed from {tmp_path}/last.pth after epoch 1 of 1: nothing left to train" in stdout, stdout
    assert "in epoch 2" not in stdout, stdout
    assert {path.name: path.read_bytes() for path in tmp_path.iterdir() if path.name != ".run.lock"} == before


class _Collective:
    """A collective in flight, as gloo's Work (is_completed, wait) or a CUDA event behind NCCL's
    (query, synchronize): done when `done` says so; a wait for it is recorded."""

    def __init__(self, done: bool):
        self.done, self.waited = done, 0

    def is_completed(self) -> bool:
        return self.done

    query = is_completed

    def wait(self) -> bool:
        self.waited += 1
        self.done = True
        return True

    synchronize = wait


def test_the_agreement_is_read_a_check_late_without_waiting_when_it_is_done(monkeypatch, stop_signals):
    """Two ranks (the collective faked): a signal before step 4; the all-reduce started at step 4's
    check is read at step 8's, without a wait when it is done by then (asked, not waited for), with
    one (counted) when it is not; none is started between the checks. Under NCCL the read asks the
    event the same way."""
    import src.stopping as stopping
    for done in (True, False):
        started = []

        def all_reduce(tensor, op=None, async_op=False, _done=done):
            started.append(_Collective(_done))
            return started[-1]
        monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
        with stopping.StopSignals() as signals:
            signals.distributed = True
            signals.requested = signal.SIGTERM
            agreed = [signals.agreed_at(step) for step in range(1, 9)]
        assert agreed == [False] * 7 + [True] and len(started) == 2
        assert (started[0].waited, signals.waits) == ((0, 0) if done else (1, 1))
    signals = stopping.StopSignals()
    signals.on_gpu = True
    for done in (True, False):
        event = _Collective(done)
        assert signals._read(torch.ones(1), event) == 1 and event.waited == (0 if done else 1)


def test_a_signal_to_one_rank_early_in_a_long_epoch_stops_every_rank_within_two_checks():
    """A stop signal that reaches one rank only (`kill -USR1` to one worker, a scheduler signalling
    one node), before step 1 of a 40-step epoch, on two ranks (threads of this process, their
    agreement's collectives run between them): the check after step 4 carries it, the one after
    step 8 reads it, and both ranks stop after step 8, not at the next epoch's start (where the
    grace period may have run out). At an epoch's start the blocking agreement of a flag on one
    rank stops both too; with no signal, no rank stops."""
    assert CHECK_EVERY == 4

    def steps_until_stop(rank: int, signalled: bool):
        signals = StopSignals()
        assert signals.distributed and not signals.on_gpu
        if signalled and rank == 1:
            signals._note(signal.SIGUSR1, None)  # what the handler does when the signal comes
        stopped = next((step for step in range(1, 41) if signals.agreed_at(step)), None)
        return stopped, signals.agreed
    assert on_threads(2, lambda rank: steps_until_stop(rank, True)) == [(8, signal.SIGUSR1)] * 2
    assert on_threads(2, lambda rank: steps_until_stop(rank, False)) == [(None, 0)] * 2

    def at_an_epochs_start(rank: int):
        signals = StopSignals()
        if rank == 1:
            signals._note(signal.SIGTERM, None)
        return signals.agreed_now(), signals.agreed
    assert on_threads(2, at_an_epochs_start) == [(True, signal.SIGTERM)] * 2


def _bare_state(steps_per_epoch: int, **flags) -> TrainingState:
    """A TrainingState of a one-weight model, for the verbs that count steps and seconds."""
    model = nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainingState(defaults(**flags), {}, model, optimizer, None, None, WeightAverage(model, optimizer, None),
                         steps_per_epoch)


def test_a_step_checkpoint_is_due_every_n_steps_of_the_run_but_never_at_an_epochs_last_step():
    """--save-every-steps 2 with 4 steps an epoch: after run steps 2 and 6; run steps 4 and 8 are
    epochs' last steps, which the epoch's own save writes after validation (a step checkpoint there
    would be a second save of the same step, and a stop in validation would go back to it)."""
    state = _bare_state(4, save_every_steps=2)
    due = []
    for epoch in range(2):
        for step in range(1, 5):
            state.epoch, state.step = epoch, step
            due.append(state.checkpoint_due())
    assert [run_step for run_step, saved in enumerate(due, 1) if saved] == [2, 6]


def test_a_resumed_epochs_record_counts_the_seconds_trained_before_the_stop():
    """The epoch's train_seconds: the seconds of its steps before the stop (last.pth's partial
    record) and those after the resume, as a straight epoch counts them all."""
    state = _bare_state(4)
    sums = torch.tensor([2.0, 3.0, 4.0, 1.0])  # loss, correct, count, log loss summed over 4 images
    state.partial = {"train_seconds": 3.25, "data_wait_seconds": 0.5, "sums": sums}
    record = state.record(sums, sums, None, train_seconds=2.5, val_seconds=1.0)
    assert record["train_seconds"] == 3.25 + 2.5 and record["seconds"] == 3.25 + 2.5 + 1.0


def test_the_command_to_go_on_has_resume_in_place_of_overwrite(monkeypatch):
    """A run started with --overwrite and stopped: going on must not replace what it saved."""
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    said = how_to_go_on(["train_single.py", "--epochs", "3", "--overwrite"])
    assert said == "to go on: python train_single.py --epochs 3 --resume"
    assert how_to_go_on(["train_single.py", "--resume"]) == "to go on: python train_single.py --resume"
