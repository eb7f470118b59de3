"""Step checkpoints written in the background (src/checkpoint_writer.py): the steps after a save
train while it is written, and the file holds the state of the save's step; a write that fails
says so in the training thread; a process killed in the middle of a write leaves the previous
last.pth whole, and --resume from it ends as the run never stopped."""
import io
import threading

import pytest
import torch
import torch.nn as nn
from conftest import (
    HOOKS,
    RESUMABLE,
    VAL,
    B,
    HostReads,
    HostWaits,
    outputs,
    python,
    resumable_run,
    same_end,
    script_loader,
    script_pass,
)

import src.checkpoint as checkpoint
import src.checkpoint_writer as checkpoint_writer
import train_single
from src.checkpoint_writer import CheckpointWriter
from src.cli import parse_args
from src.ema import WeightAverage
from src.errors import UserError
from src.history import epoch_record
from src.metrics import COUNT
from src.recipe import make_optimizer, make_schedule
from src.state import TrainingState

# Seconds a held write waits for the steps after its save before giving up: only a writer that
# blocks training ever waits this long (the steps it waits for are a tiny model's).
HOLD = 60


def _tiny(args, steps: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    dataset = [(torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8), torch.tensor(i % 2)) for i in range(4 * steps)]
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    state = TrainingState(args, {}, model, optimizer, scaler, schedule, WeightAverage(model, optimizer, 0.9), steps)
    return model, script_loader(train_single, dataset, args), optimizer, scaler, schedule, state


def test_the_steps_after_a_save_train_while_it_is_written(stop_signals, tmp_path, monkeypatch):
    """--save-every-steps 2 over 6 steps: the write of step 2's last.pth is held until two more
    optimizer steps have run (or HOLD seconds): a writer in the training thread would hold the
    steps too. Steps 3 and 4 ran during that write, and the file holds step 2's weights, weight
    average and sums all the same (copies made at the save), not the live tensors of a later
    step; the block ends with every write on disk (step 4's, the last)."""
    args = parse_args("", ["--batch-size", "4", "--save-every-steps", "2", "--ema-decay", "0.9", *outputs(tmp_path)])
    model, loader, optimizer, scaler, schedule, state = _tiny(args, 6)
    after = {}  # optimizer step: the weights after it
    stepped = threading.Condition()

    def record(optimizer, *_):
        with stepped:
            after[len(after) + 1] = {name: value.clone() for name, value in model.state_dict().items()}
            stepped.notify_all()
    optimizer.register_step_post_hook(record)
    held, save = [], checkpoint_writer.atomic_torch_save

    def held_save(state_dict, path, *rest):
        if not held:  # the first write: step 2's
            began = len(after)
            with stepped:
                stepped.wait_for(lambda: len(after) >= began + 2, timeout=HOLD)
            held.append((began, len(after)))
        save(state_dict, path, *rest)
        held.append(torch.load(path, weights_only=True))
    monkeypatch.setattr(checkpoint_writer, "atomic_torch_save", held_save)
    with state.stop_signals():
        script_pass(train_single, model, loader, args, optimizer, scaler, schedule, state=state)
    (began, ended), first, last = held[0], held[1], held[-1]
    assert began == 2 and ended >= 4, "the steps after the save waited for its write"
    assert first["step"] == 2 and first["partial"]["sums"][0][COUNT] == 2 * 4
    assert all(torch.equal(first["model"][name], after[2][name]) for name in after[2])
    assert not all(torch.equal(first["model"][name], after[4][name]) for name in after[4]), "step 4 moved nothing"
    assert first["average"]["updates"] == 2
    assert last["step"] == 4 and all(torch.equal(last["model"][name], after[4][name]) for name in after[4])
    assert not state.writer.busy()


def test_an_epochs_last_pth_is_never_replaced_by_an_older_steps_write(tmp_path, monkeypatch):
    """A step checkpoint still being written when the epoch ends: the epoch's save waits for it,
    so last.pth ends as the epoch's (step 0). The step's write is held until the epoch's files are
    written or the training thread waits for the writer: a save_epoch that did not wait would
    write first and be replaced (no timeout: how fast the machine is decides nothing)."""
    args = parse_args("", ["--batch-size", "4", "--save-every-steps", "2", *outputs(tmp_path)])
    model, loader, optimizer, scaler, schedule, state = _tiny(args, 6)
    state.step = 2
    go_on, save, write_epoch = threading.Event(), checkpoint_writer.atomic_torch_save, checkpoint.write_epoch
    wait = state.writer.wait

    def held_save(state_dict, path, *rest):
        go_on.wait()
        save(state_dict, path, *rest)

    def written(*given, **named):
        try:
            return write_epoch(*given, **named)
        finally:
            go_on.set()

    def waited():
        go_on.set()  # the training thread waits for the write from here: let it go
        wait()
    monkeypatch.setattr(checkpoint_writer, "atomic_torch_save", held_save)
    monkeypatch.setattr(checkpoint, "write_epoch", written)
    state.save_step(torch.zeros(4))
    monkeypatch.setattr(state.writer, "wait", waited)  # from here on: a wait for the held write
    state.save_epoch(epoch_record(epoch=0, train_sums=torch.tensor([1.0, 1.0, 2.0, 1.0]),
                                  val_sums=torch.tensor([1.0, 1.0, 2.0, 1.0]), average_sums=None, train_seconds=1.0,
                                  val_seconds=1.0, data_wait_seconds=0.0, lr=0.001))
    state.writer.wait()
    saved = torch.load(tmp_path / "last.pth", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (1, 0)


def test_a_write_that_fails_says_so_in_the_training_thread(tmp_path, monkeypatch):
    """A full disk in the background: the next save (or the end of the block) raises the write's
    one-line error, and the writer goes on writing the saves after it."""
    writer = CheckpointWriter()

    def full(state_dict, path, *rest):
        raise UserError(f"cannot write {path} (No space left on device)")
    monkeypatch.setattr(checkpoint_writer, "atomic_torch_save", full)
    writer.save({"w": torch.ones(3)}, tmp_path / "last.pth")
    with pytest.raises(UserError, match="No space left on device"):
        writer.save({"w": torch.ones(3)}, tmp_path / "last.pth")
    monkeypatch.undo()
    writer.save({"w": torch.full((3,), 2.0)}, tmp_path / "last.pth")
    writer.wait()
    assert torch.equal(torch.load(tmp_path / "last.pth", weights_only=True)["w"], torch.full((3,), 2.0))


def test_a_kill_in_the_middle_of_a_background_write_keeps_the_previous_file(exact_data, runs, tmp_path):
    """--save-every-steps 1, the process SIGKILLed in the middle of its second step checkpoint's
    write (after step 2, in the writer's thread): last.pth is step 1's, whole; the half-written
    temporary file is beside it; --resume removes that and ends bit for bit as the straight run."""
    flags = ["--data-dir", str(exact_data), *RESUMABLE, *VAL, "--epochs", "2", "--batch-size", str(2 * B),
             *outputs(tmp_path)]
    result = python("train_single.py", *flags, "--save-every-steps", "1",
                    env={"PYTHONPATH": HOOKS, "KILL_IN_WRITE": "last.pth:2"})
    assert result.returncode == -9, result.stderr[-2000:]
    state = torch.load(tmp_path / "last.pth", weights_only=True)
    assert (state["epoch"], state["step"]) == (0, 1)
    half = [path for path in tmp_path.iterdir() if path.name.startswith(".last.pth.")]
    assert len(half) == 1 and half[0].read_bytes().startswith(b"PK\x03\x04 half")
    result = python("train_single.py", *flags, "--resume")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "after its step 1: going on" in result.stdout and not half[0].exists()
    same_end(tmp_path, resumable_run(runs, "single")[0])


def test_a_tensor_saved_again_in_another_dtype_is_written_in_its_new_dtype(tmp_path):
    """The writer reuses its host copy of a tensor from one save to the next; a tensor of the same
    shape in another dtype (a weight average kept in float64 after a float32 one, an AMP scale)
    gets a new copy, not the old one's dtype."""
    writer = CheckpointWriter()
    writer.save({"w": torch.full((3,), 0.5, dtype=torch.float32)}, tmp_path / "last.pth")
    writer.wait()
    exact = torch.tensor([1 / 3, 2 / 3, 1e-300], dtype=torch.float64)
    writer.save({"w": exact}, tmp_path / "last.pth")
    writer.wait()
    saved = torch.load(tmp_path / "last.pth", weights_only=True)["w"]
    assert saved.dtype == torch.float64 and torch.equal(saved, exact)


@pytest.mark.parametrize("rank", [0, 1])
def test_only_the_rank_that_writes_builds_last_pth(rank, tmp_path, monkeypatch):
    """A step checkpoint and an epoch's save of a whole model (DDP's), in a world of two (torch's
    fake process group, this process its rank `rank`; collectives counted, not run): rank 1 takes
    part in the one collective the saves need (the all_gather of every rank's metric sums) and
    builds nothing of last.pth: no state_dict of the model, the optimizer, the scaler or the weight
    average (an epoch's swaps the average in and copies it to the host), nothing written. The control:
    rank 0 builds each once per save and writes the files."""
    import torch.distributed as dist
    args = parse_args("", ["--batch-size", "4", "--save-every-steps", "2", "--ema-decay", "0.9", *outputs(tmp_path)])
    model, _, optimizer, scaler, _, state = _tiny(args, 6)
    built = []

    def counted(owner, name: str, label: str) -> None:
        made = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, **k: built.append(label) or made(*a, **k))
    for owner, name, label in ((model, "state_dict", "model"), (optimizer, "state_dict", "optimizer"),
                               (scaler, "state_dict", "scaler"),
                               (state.average, "state_dict", "average"), (state.average, "held", "average"),
                               (checkpoint, "last_state", "last.pth")):
        counted(owner, name, label)
    gathers, all_gather = [], dist.all_gather
    monkeypatch.setattr(dist, "all_gather", lambda *a, **k: gathers.append(1) or all_gather(*a, **k))
    dist.init_process_group("fake", store=dist.HashStore(), rank=rank, world_size=2)
    try:
        state.step = 2
        state.save_step(torch.zeros(4))
        state.save_epoch(epoch_record(epoch=0, train_sums=torch.tensor([1.0, 1.0, 2.0, 1.0]),
                                      val_sums=torch.tensor([1.0, 1.0, 2.0, 1.0]), average_sums=None,
                                      train_seconds=1.0, val_seconds=1.0, data_wait_seconds=0.0, lr=0.001))
        state.writer.wait()
    finally:
        dist.destroy_process_group()
    assert len(gathers) == 1
    if rank == 1:
        assert built == [] and sorted(p.name for p in tmp_path.iterdir()) == []
    else:
        # the average's tensors read with the model's state_dict (an epoch's: swapped in, copied to the host)
        assert built == ["model", "optimizer", "average", "model", "last.pth", "scaler"] * 2, built
        assert {"best.pth", "last.pth", "history.json"} <= {p.name for p in tmp_path.iterdir()}


def _same(saved, expected, where="last.pth") -> None:
    """`saved` holds what `expected` holds: the same keys in the same order, tensors equal in dtype,
    shape, strides and every bit, other values equal and of the same type (a dict for a dict)."""
    assert isinstance(saved, dict) if isinstance(expected, dict) else type(saved) is type(expected), \
        (where, type(saved), type(expected))
    if isinstance(expected, dict):
        assert list(saved) == list(expected), (where, list(saved), list(expected))
        for key in expected:
            _same(saved[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(saved) == len(expected), where
        for i, (a, b) in enumerate(zip(saved, expected)):
            _same(a, b, f"{where}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert (saved.dtype, saved.shape, saved.stride()) == (expected.dtype, expected.shape, expected.stride()), where
        assert torch.equal(saved.view(torch.uint8) if saved.dim() else saved, expected.view(torch.uint8)
                           if expected.dim() else expected), where
    else:
        assert saved == expected, (where, saved, expected)


def test_a_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread(tmp_path, monkeypatch):
    """On a GPU each read of a tensor by the host (.item(), .cpu(), a copy to the host) waits for
    the device, inside the step; a step checkpoint's save only queues its copies and returns, and
    the writer's thread reads them once they are done. Rank 0's save_step with --ema-decay, an
    enabled gradient scaler and the average's skipped updates counted on the device (as a fused
    optimizer's found_inf has them): no read in the training thread (before: the average swapped
    in and copied to the host, its count's .item() and the scaler state_dict's two). The file,
    written after the next step changed the scale, the weights, the average and its count (the
    write held until then), holds what the host-reading build of last.pth (scaler.state_dict(),
    the average's state_dict() and count()) gave at the save, bit for bit."""
    args = parse_args("", ["--batch-size", "4", "--save-every-steps", "2", "--ema-decay", "0.9", *outputs(tmp_path)])
    model, _, optimizer, _, _, state = _tiny(args, 6)
    state.scaler = scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(2):
        scaler.scale(model(torch.rand(4, 3, 8, 8)).logsumexp(1).mean()).backward()
        scaler.step(optimizer)  # the average's step hook: updates on the host's count
        scaler.update()
        optimizer.zero_grad()
    state.average.update(torch.zeros(()))  # a fused optimizer's update: its skipped steps counted on the device
    state.average.update(torch.ones(()))  # and one it skipped
    state.step, sums = 2, torch.arange(4.0)
    expected = io.BytesIO()  # the host-reading build's content at the save, as torch.save writes it
    torch.save(state._last_state(step=2, partial={"sums": sums[None].clone(), "train_seconds": 0.0,
                                                  "data_wait_seconds": state.data_wait}), expected)
    expected = torch.load(io.BytesIO(expected.getvalue()), weights_only=True)
    assert expected["average"]["updates"] == state.average.count() == 3  # 4 updates, 1 skipped
    assert isinstance(expected["scaler"]["scale"], float) and isinstance(expected["scaler"]["_growth_tracker"], int)
    changed, save = threading.Event(), checkpoint_writer.atomic_torch_save
    monkeypatch.setattr(checkpoint_writer, "atomic_torch_save",
                        lambda *given: changed.wait(timeout=HOLD) and save(*given))
    waits, reads = HostWaits(to_host=True), HostReads()
    with waits, reads:
        state.save_step(sums)
    scaler.update(2.0)  # the next step: another scale, moved weights and average, a skipped update counted
    with torch.no_grad():
        model[0].weight.add_(1.0)
    state.average.update(torch.zeros(()))
    state.average.update(torch.ones(()))
    changed.set()
    state.writer.wait()
    assert waits.calls == [] and reads.calls == [], (waits.calls, reads.calls)
    saved = torch.load(tmp_path / "last.pth", weights_only=True)
    assert saved["scaler"] != scaler.state_dict() and saved["average"]["updates"] != state.average.count()
    saved["partial"]["train_seconds"] = 0.0  # the clock's
    _same(saved, expected)
