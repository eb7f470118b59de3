"""Under a launcher the ranks agree before any work, and an error in the middle of an epoch is one
line (issue 47): ranks launched with different flags are refused at start in one line naming each
flag and the ranks (they trained silently with rank 0's record, or died in gloo with three
tracebacks); an image that turns unreadable in the middle of an epoch is the line of the rank that
met it, the others ending without a traceback of their own. Rank 0's exit code 2 (or the rank that
says it), the launcher's 1; nothing written."""
import re
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import TINY, fails_in_process, in_process, on_threads, outputs, run

from src.errors import UserError
from src.process_group import check_same_flags

# Each launch: a shell that adds rank 1's own flags and starts the script (torchrun and accelerate
# launch run it as it is: --no-python, --no_python).
PER_RANK = 'if [ "$RANK" = 1 ]; then set -- "$@" $RANK_1_FLAGS; fi; exec python "$@"'
LAUNCHERS = {
    "train_ddp.py": ["torchrun", "--standalone", "--nproc_per_node=2", "--no-python", "sh", "-c", PER_RANK, "sh"],
    "train_fsdp.py": ["torchrun", "--standalone", "--nproc_per_node=2", "--no-python", "sh", "-c", PER_RANK, "sh"],
    "train_accelerate.py": ["accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--main_process_port", "0",
                            "--no_python", "sh", "-c", PER_RANK, "sh"],
}


def exit_codes(stderr: str) -> dict[str, str]:
    """Each rank's exit code, as the launcher's report gives it."""
    return dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", stderr))


def launch(script: str, argv: list[str], tmp_path: Path, rank_1_flags: str = ""):
    return run([*LAUNCHERS[script], script, *argv], timeout=400,
               env={"RANK_1_FLAGS": rank_1_flags, "ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf")})


def no_rank_traceback(stderr: str) -> None:
    """The launcher's own traceback (its ChildFailedError) and no other: none of a rank's."""
    assert stderr.count("Traceback (most recent call last)") == 1, stderr[-4000:]
    assert "ChildFailedError" in stderr.split("Traceback (most recent call last)")[1], stderr[-4000:]


@pytest.mark.parametrize("script, rank_1, named", [
    ("train_ddp.py", "--lr 0.5 --batch-size 4", "--batch-size: 8 on rank 0, 4 on rank 1; --lr: 0.01 on rank 0, 0.5 on rank 1"),
    ("train_fsdp.py", "--batch-size 4", "--batch-size: 8 on rank 0, 4 on rank 1"),
    ("train_accelerate.py", "--lr 0.5 --resume", "--lr: 0.01 on rank 0, 0.5 on rank 1; --resume: not given on rank 0, given on rank 1"),
])
def test_ranks_launched_with_different_flags_are_one_line(script, rank_1, named, tiny_data, tmp_path):
    """Two nodes started with --lr 0.01 and --lr 0.5 trained silently (best.json records rank 0's);
    another --batch-size ended in gloo's SIGABRT and three tracebacks. Rank 1's paths differ
    from rank 0's (each node its own --checkpoint folder): they may."""
    out = tmp_path / "out"
    result = launch(script, [*TINY, "--data-dir", str(tiny_data), "--lr", "0.01", *outputs(out)], tmp_path,
                    f"{rank_1} --checkpoint {tmp_path / 'node1' / 'best.pth'} --workers 1")
    assert result.returncode == 1, result.stderr[-3000:]
    line = f"error: the ranks were launched with different flags ({named}): launch every process with the same flags"
    assert result.stderr.count(line) == 1 and result.stderr.count("error: ") == 1, result.stderr[-3000:]
    assert exit_codes(result.stderr)["0"] == "2", result.stderr[-3000:]
    no_rank_traceback(result.stderr)
    assert not out.exists() and not (tmp_path / "node1").exists(), "nothing written"


def test_a_named_pipe_compared_by_content_is_named_not_opened(tmp_path):
    """predict's ranks compare its --checkpoint by content before loading it: a named pipe there
    hung predict for ever, silently (opening one waits for a writer). by_content names it instead,
    and the load then refuses it in one line."""
    import os
    import threading

    from src.process_group import by_content
    pipe = tmp_path / "best.pth"
    os.mkfifo(pipe)
    found: list = []
    compare = threading.Thread(target=lambda: found.append(by_content({"checkpoint": pipe}, ("checkpoint",))),
                               daemon=True)
    compare.start()
    compare.join(60)  # returns at once; a wait for a writer would never end (the daemon thread stays)
    assert found == [{"checkpoint": "a file that cannot be read (a named pipe (FIFO), not a regular file)"}]


def test_paths_and_workers_may_differ_per_node_and_weights_are_compared_by_content(tmp_path, monkeypatch):
    """check_same_flags between two ranks (their flags as gather hands them over): each node's own
    paths, --workers and spelling of a value pass; a --weights file is the same where its bytes
    are; every other flag that differs is named with the ranks that gave each value."""
    import src.process_group as ranks
    from src.cli import parse_args
    (tmp_path / "a.pth").write_bytes(b"the same weights")
    (tmp_path / "b.pth").write_bytes(b"the same weights")
    (tmp_path / "c.pth").write_bytes(b"other weights")
    base = ["--arch", "squeezenet1_1", "--image-size", "32", "--workers", "0"]
    rank_0 = parse_args("", [*base, "--lr", "0.01", "--weights", str(tmp_path / "a.pth"), "--data-dir", "/data",
                             "--checkpoint", "a/best.pth", "--plot", "a.png", "--cache", "/scratch/a", "--log-dir", "tb"],
                        script="train_ddp.py")

    def refused(argv, script="train_ddp.py"):
        """The line of rank 0 when rank 1 parsed `argv` of `script`; None if they agree."""
        other = parse_args("", [*base, *argv], script=script)
        monkeypatch.setattr(ranks.dist, "is_initialized", lambda: True)
        monkeypatch.setattr(ranks.dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(ranks.dist, "get_rank", lambda: 0)
        monkeypatch.setattr(ranks, "gather", lambda mine: [mine, ranks.compared_flags(other)])
        try:
            check_same_flags(rank_0)
        except UserError as error:
            return str(error)
        return None

    assert refused(["--lr=1e-2", "--weights", str(tmp_path / "b.pth"), "--data-dir", "/mnt/data", "--checkpoint",
                    "b/best.pth", "--plot", "b.png", "--cache", "/scratch/b", "--workers", "1"]) is None
    assert refused(["--lr", "0.01", "--weights", str(tmp_path / "c.pth")]).startswith(
        "the ranks were launched with different flags (--weights: a file of sha256 ")
    said = refused(["--lr", "0.01", "--weights", str(tmp_path / "a.pth"), "--epochs", "3", "--track", "mlflow"],
                   script="train_fsdp.py")
    assert said == ("the ranks were launched with different flags (--epochs: 1 on rank 0, 3 on rank 1; --track: the "
                    "default on rank 0, mlflow on rank 1; the script: train_ddp.py on rank 0, train_fsdp.py on "
                    "rank 1): launch every process with the same flags (paths and --workers may differ per node)"), said


def first_epoch_files(data: Path, rank: int, batch: int) -> list[list[str]]:
    """The training images that `rank` of two DDP ranks reads in the first epoch, batch by batch
    (train_ddp.py's split and DistributedSampler, computed here)."""
    import pandas as pd
    from torch.utils.data import DistributedSampler

    from src.loaders import split_indices
    names = list(pd.read_csv(data / "train.csv")["filename"])
    train_idx, _ = split_indices(len(names), 0.2, 42)
    sampler = DistributedSampler(range(len(train_idx)), num_replicas=2, rank=rank, shuffle=True, seed=42,
                                 drop_last=True)
    sampler.set_epoch(0)
    order = [names[train_idx[i]] for i in sampler]
    return [order[i:i + batch] for i in range(0, len(order) - batch + 1, batch)]


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py", "train_accelerate.py"])
def test_an_image_unreadable_in_the_middle_of_an_epoch_is_one_line_under_a_launcher(script, tiny_data, tmp_path):
    """An image that turns unreadable during training, read by rank 1's loader worker in its
    second batch: rank 1 said it, and rank 0, whose next collective then failed, printed gloo's
    "Connection closed by peer" traceback. Now the one line, from the rank that met it; the other
    ends without a word; no file of the run is written."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    names = sorted(path.name for path in (data / "train").iterdir())
    (data / "train.csv").write_text("filename,label\n" + "".join(f"{n},{int(n.startswith('dog'))}\n" for n in names))
    batch = 4
    rank_0 = {name for batches in first_epoch_files(data, 0, batch) for name in batches}
    broken = next(name for name in first_epoch_files(data, 1, batch)[1] if name not in rank_0)
    if script == "train_accelerate.py":  # its own sampler: any image of the split's first epoch will do
        broken = first_epoch_files(data, 1, batch)[1][0]
    (data / "train" / broken).write_bytes(b"no longer an image")
    out = tmp_path / "out"
    result = launch(script, [*TINY, "--data-dir", str(data), "--batch-size", str(batch), "--workers", "1",
                             *outputs(out)], tmp_path)
    assert result.returncode == 1, result.stderr[-3000:]
    line = f"error: cannot read image {data / 'train' / broken} (cannot identify image file"
    assert result.stderr.count(line) == 1 and result.stderr.count("error: ") == 1, result.stderr[-4000:]
    no_rank_traceback(result.stderr)
    assert set(exit_codes(result.stderr).values()) <= {"2", "-15"}, result.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == [".run.lock"], "no file of the run written"



def test_the_ranks_that_gave_a_value_are_named_in_spans():
    from src.process_group import _ranks
    assert _ranks([1]) == "rank 1"
    assert _ranks([0, 2]) == "ranks 0, 2"
    assert _ranks([0, 1, 2, 3, 6]) == "ranks 0-3, 6"
    assert _ranks([2, 3, 5, 6, 7]) == "ranks 2-3, 5-7"


def test_a_rank_that_ends_on_bad_input_leaves_the_note_the_others_end_quietly_on(monkeypatch, capsys):
    """Rank 1 of two meets bad input: it says the line and leaves its note in the group's store;
    rank 0, whose collective then fails, finds the note and ends without a traceback of its own
    (under torchrun the launcher's SIGTERM often ends rank 0 first: the launches above may not
    reach this)."""
    import torch.distributed as dist

    import src.errors as errors
    store = dist.HashStore()
    monkeypatch.setattr(errors, "PEER_NOTE_WAIT", 0.0)
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 0, 2))
    assert not errors.another_rank_said_why(), "no note yet"
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 1, 2))

    def bad_input(argv):
        raise UserError("cannot read image x.jpg: it is not an image")
    assert errors.run_command(bad_input, []) == 2
    assert capsys.readouterr().err == "error: cannot read image x.jpg: it is not an image\n"
    assert store.check([f"{errors.PEER_NOTE}1"])
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 0, 2))
    monkeypatch.delenv("RANK", raising=False)  # rank 0 of the launcher: it does not wait to be stopped

    def collective_failed(argv):
        raise RuntimeError("[gloo] Connection closed by peer")
    assert errors.run_command(collective_failed, []) == 2
    assert capsys.readouterr().err == "", "rank 0 ends without a word: rank 1 has said why"
    monkeypatch.setattr(errors, "_group_store", lambda: (dist.HashStore(), 0, 2))
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        errors.run_command(collective_failed, [])  # no note: the error is raised as it is


def test_a_quiet_rank_waits_for_the_launcher_and_rank_0_does_not(monkeypatch):
    """A rank other than 0 that ends without a word waits (up to a minute) for torchrun to stop it:
    had it exited first, torchrun could stop rank 0 before rank 0 printed the line. Rank 0, and a
    process alone, end at once."""
    import src.errors as errors
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setattr(errors, "signalled", False)  # no stop signal came in this run
    for rank, world_size, waits in (("1", "2", [60]), ("0", "2", []), ("0", "1", [])):
        slept.clear()
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", world_size)
        errors.before_a_silent_exit()
        assert slept == waits, (rank, world_size)


def test_rank_0_alone_says_a_refusal_that_every_rank_finds_and_the_others_end_quietly():
    """Two ranks (threads of this process, their collectives run between them) launched with
    different flags, or with fewer validation images or training images than they need: every
    rank refuses with the same line, rank 0 prints it (quiet=False) and rank 1 ends without a
    word (quiet=True), whose exit then waits for the launcher (before_a_silent_exit). Under a
    launcher, which of the two exits first is a race: the launches above cannot tell who spoke."""
    import torch

    from src.cli import parse_args
    from src.loaders import Data, check_batches

    def refusal(check):
        try:
            check()
        except UserError as error:
            return str(error), error.quiet
        return None

    def different_flags(rank: int):
        argv = ["--arch", "squeezenet1_1", "--lr", "0.01" if rank == 0 else "0.5"]
        return refusal(lambda: check_same_flags(parse_args("", argv, script="train_ddp.py")))
    said = on_threads(2, different_flags)
    assert [quiet for _, quiet in said] == [False, True] and said[0][0] == said[1][0]
    assert said[0][0].startswith("the ranks were launched with different flags (--lr: 0.01 on rank 0, 0.5 on rank 1)")

    dataset = [(torch.zeros(1), i) for i in range(10)]
    for train, val, batch, line in (
            (8, 1, 1, "2 processes but only 1 validation images"),
            (3, 2, 2, "--batch-size 2 x 2 process(es) = 4 is more than the 3 training images")):
        data = Data(dataset, list(range(train)), list(range(train, train + val)), "")
        args = parse_args("", ["--batch-size", str(batch), "--workers", "0"])
        said = on_threads(2, lambda rank: refusal(lambda: check_batches(data, args, 2)))
        assert [quiet for _, quiet in said] == [False, True] and said[0][0].startswith(line), said


def test_one_rank_of_three_with_another_flag_is_named(monkeypatch):
    """Three ranks, rank 2 alone launched with --lr 0.5: refused, naming it (a check that asked
    whether every other rank differs from rank 0 would let it train)."""
    import src.process_group as ranks
    from src.cli import parse_args
    base = ["--arch", "squeezenet1_1", "--image-size", "32", "--workers", "0"]
    same = parse_args("", [*base, "--lr", "0.01"], script="train_ddp.py")
    other = parse_args("", [*base, "--lr", "0.5"], script="train_ddp.py")
    monkeypatch.setattr(ranks.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ranks.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(ranks.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(ranks, "gather", lambda mine: [mine, ranks.compared_flags(same), ranks.compared_flags(other)])
    with pytest.raises(UserError, match=r"different flags \(--lr: 0.01 on ranks 0-1, 0.5 on rank 2\)"):
        check_same_flags(same)


def test_predicts_ranks_agree_on_flags_and_on_the_checkpoints_content(untrained, tiny_data, tmp_path, monkeypatch,
                                                                       capsys):
    """predict under a launcher compared nothing: rank 1 with --tta (or another --checkpoint) wrote
    a CSV whose rows 1-4 were without TTA and 5-8 with it, exit 0. Rank 0 here runs in this
    process, rank 1's flags handed over as gather hands them (what predict's own check on rank 1
    sends). Another --tta, --batch-size or checkpoint content: one line, no CSV. Another path to
    the same bytes (each node its own copy) and another --output or --workers: predicted."""
    import src.process_group as ranks
    from src.tools import predict
    copy = tmp_path / "node1" / "best.pth"
    copy.parent.mkdir()
    shutil.copy(untrained, copy)
    shutil.copy(untrained.with_suffix(".json"), copy.with_suffix(".json"))
    other = tmp_path / "other" / "best.pth"
    other.parent.mkdir()
    other.write_bytes(untrained.read_bytes() + b"\0")
    images = str(tiny_data / "test")
    rank_0 = [images, "--checkpoint", str(untrained), "--output", str(tmp_path / "p.csv"), "--workers", "0"]

    def sent_by_rank_1(argv: list[str]) -> dict:
        """What predict's check of rank 1 hands to gather, launched with `argv`."""
        sent = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ranks, "gather", lambda mine: sent.append(mine) or [mine])
            predict.check_ranks_agree(predict.parse_args(argv))
        return sent[0]

    # A world of two as src.process_group sees it (the rest of predict runs as one process).
    monkeypatch.setattr(ranks, "dist", SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda: 2,
                                                       get_rank=lambda: 0))
    same = "launch every process with the same flags (--output and --workers may differ per node)"
    for rank_1, named in ([[*rank_0, "--tta"], "--tta: not given on rank 0, given on rank 1"],
                          [[*rank_0, "--batch-size", "4"], "--batch-size: 100 on rank 0, 4 on rank 1"],
                          [[images, "--checkpoint", str(other)], "--checkpoint: a file of sha256 "]):
        monkeypatch.setattr(ranks, "gather", lambda mine, theirs=sent_by_rank_1(rank_1): [mine, theirs])
        line = fails_in_process(predict.main, rank_0, monkeypatch, capsys, "the ranks were launched with different flags (")
        assert named in line and line.endswith(same), line
    assert not (tmp_path / "p.csv").exists()
    agree = sent_by_rank_1([images, "--checkpoint", str(copy), "--output", str(tmp_path / "q.csv"), "--workers", "1"])
    monkeypatch.setattr(ranks, "gather", lambda mine: [mine, agree])
    code, out, err = in_process(predict.main, rank_0, monkeypatch, capsys)
    assert code == 0 and "predicted 6 images" in out, err


def test_a_stopped_rank_exits_once_every_rank_has_ended(monkeypatch):
    """A stop ends each rank with EXIT_STOPPED, and torchrun SIGTERMs the ranks still running when
    the first one exits: rank 0, still ending the tracked run, was killed there. So a stopped rank
    waits until every rank has marked its end (a stop, or an error) in the group's store, for at
    most LEAVE_WAIT seconds."""
    import threading

    import torch.distributed as dist

    import src.errors as errors
    from src.errors import EXIT_STOPPED, Stopped
    store = dist.HashStore()

    def stopped(argv):
        raise Stopped()
    codes: list[int] = []
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 1, 2))  # rank 1, ended first
    waiting = threading.Thread(target=lambda: codes.append(errors.run_command(stopped, [])))
    waiting.start()
    waiting.join(1.0)
    assert waiting.is_alive() and store.check([f"{errors.LEFT}1"]), "rank 1 has marked its end and waits for rank 0"
    store.set(f"{errors.LEFT}0", "1")  # rank 0 has ended
    waiting.join(10.0)
    assert not waiting.is_alive() and codes == [EXIT_STOPPED]

    def bad_input(argv):
        raise UserError("cannot read image x.jpg: it is not an image")
    store = dist.HashStore()
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 0, 2))
    assert errors.run_command(bad_input, []) == 2
    assert store.check([f"{errors.LEFT}0"]), "a rank that ends on an error marks its end too"
    monkeypatch.setattr(errors, "_group_store", lambda: (store, 1, 2))
    assert errors.run_command(stopped, []) == EXIT_STOPPED  # at once: rank 0 has ended

    monkeypatch.setattr(errors, "LEAVE_WAIT", 0.5)
    monkeypatch.setattr(errors, "_group_store", lambda: (dist.HashStore(), 0, 2))
    started = time.monotonic()
    assert errors.run_command(stopped, []) == EXIT_STOPPED  # rank 1 died: after LEAVE_WAIT
    assert 0.5 <= time.monotonic() - started


def test_the_marks_and_notes_of_an_earlier_restart_attempt_do_not_count(monkeypatch):
    """torchrun's agent keeps its store across restarts, and accelerate's group store carries no
    attempt of its own: attempt 0's end marks let attempt 1's stopped ranks leave at once (and its
    bad-input notes silenced attempt 1's errors). The group store's keys carry the attempt
    (TORCHELASTIC_RESTART_COUNT). A second Ctrl-C while a stopped rank waits ends the wait, exit 75."""
    import torch.distributed as dist

    import src.errors as errors
    from src.errors import EXIT_STOPPED, Stopped
    launcher, rank = dist.HashStore(), [0]
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: rank[0])
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: launcher)
    monkeypatch.setattr(errors, "end_process_group", lambda: None)  # the group is a stand-in
    monkeypatch.setattr(errors, "LEAVE_WAIT", 0.5)
    monkeypatch.setattr(errors, "PEER_NOTE_WAIT", 0.0)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    errors.mark_ended()  # rank 0 of attempt 0
    errors.tell_the_other_ranks()

    def stopped(argv):
        raise Stopped()
    rank[0] = 1
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    started = time.monotonic()
    assert errors.run_command(stopped, []) == EXIT_STOPPED
    assert time.monotonic() - started >= 0.5, "attempt 0's mark counted in attempt 1"
    assert not errors.another_rank_said_why(), "attempt 0's note counted in attempt 1"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    started = time.monotonic()
    assert errors.run_command(stopped, []) == EXIT_STOPPED and time.monotonic() - started < 0.5
    assert errors.another_rank_said_why()

    def interrupted(seconds):
        raise KeyboardInterrupt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setattr(errors, "LEAVE_WAIT", 600.0)
    monkeypatch.setattr(errors.time, "sleep", interrupted)
    try:
        code: int | str = errors.run_command(stopped, [])
    except KeyboardInterrupt:  # as a test's failure, not as pytest's own Ctrl-C
        code = "KeyboardInterrupt raised"
    assert code == EXIT_STOPPED


def test_a_quiet_rank_that_took_the_launchers_sigterm_for_a_stop_does_not_wait_for_another(monkeypatch):
    """torchrun sends its SIGTERM once. One that came while a rank's run still took it for a stop
    request (StopSignals) left the rank waiting a minute in before_a_silent_exit for a SIGTERM that
    never came: torchrun SIGKILLed it after 30 s (exitcode -9, beside two CPU hogs). After a stop
    signal in the run it ends at once; a later run without one waits again."""
    import signal

    import src.errors as errors
    from src.stopping import StopSignals
    slept: list[float] = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(errors, "signalled", False)
    with StopSignals() as signals:
        signal.raise_signal(signal.SIGTERM)  # the launcher's, as the run's handler takes it
    assert signals.requested == signal.SIGTERM
    errors.before_a_silent_exit()
    assert slept == []
    with StopSignals():
        pass
    errors.before_a_silent_exit()
    assert slept == [60]
