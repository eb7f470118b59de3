"""FSDP's `last` as a torch.distributed.checkpoint (DCP) folder (src/sharded_checkpoint.py): each
rank writes its own shards, a step checkpoint while training goes on (dcp.async_save), and no rank
gathers more than its own; the folder is replaced whole or not at all (a kill in a save, a crash
between its renames); and a run's last resumes at another number of processes and in another mode
(FSDP on 2 processes stopped by SIGTERM mid-epoch, resumed by FSDP and by DDP on 1 process with
twice the --batch-size; DDP's last.pth resumed by FSDP; ResNet-18 with --sync-bn and a weight
average), ending where the straight run ends within the modes' tolerance."""
import os
import pickle
import re
import shutil
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from conftest import (
    HOOKS,
    LAUNCH,
    LEARN,
    RESUMABLE,
    TOLERANCE,
    VAL,
    HostReads,
    HostWaits,
    assert_same_run,
    distance,
    fails_in_process,
    free_port,
    in_process,
    last_model,
    outputs,
    run,
    run_main,
    same_end,
    shard_as_train_fsdp,
    stop_line,
    stops_straight,
    weights,
)

import train_ddp
import train_fsdp
from src import sharded_checkpoint
from src.errors import UserError, end_process_group

SHARDS = [".metadata", "__0_0.distcp", "__1_0.distcp", "training.pt"]
TORCHRUN = LAUNCH["fsdp"]()[:-1]  # two processes, without the script
# 100 training images in global batches of 10 (5 per process): 10 steps an epoch, so that a stop
# under torchrun, agreed every CHECK_EVERY = 4 steps, falls inside an epoch.
FLAGS = [*RESUMABLE, *VAL, "--epochs", "2"]


# Two real gloo ranks (torch.multiprocessing's spawn), saving a step checkpoint of a small sharded
# model through the training state, as train_fsdp.py does.

def _model() -> nn.Module:
    """Linear layers whose rows do not split evenly in two (45 and 3: 23 + 22, 2 + 1), batch norm."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 45), nn.BatchNorm1d(45), nn.Linear(45, 3))


def _state(folder: Path, model: nn.Module):
    """The training state train_fsdp.py makes around the sharded model: SGD with momentum, a weight
    average, after a step on this rank's own batch."""
    from src.cli import parse_args
    from src.ema import WeightAverage
    from src.recipe import make_optimizer, make_schedule
    from src.state import TrainingState
    args = parse_args("", ["--checkpoint", str(folder / "best.pth"), "--ema-decay", "0.9"])
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    average = WeightAverage(model, optimizer, 0.9)
    state = TrainingState(args, {"run": "ours"}, model, optimizer, torch.amp.GradScaler("cpu", enabled=False),
                          make_schedule(optimizer, args, 10), average, steps_per_epoch=10)
    return state


def _step(state, rank: int) -> None:
    generator = torch.Generator().manual_seed(rank + 10 * state.step)
    inputs, labels = torch.randn(8, 64, generator=generator), torch.randint(0, 3, (8,), generator=generator)
    F.cross_entropy(state.model(inputs), labels).backward()
    state.optimizer.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1


def _whole(state) -> dict:
    """The whole weights, optimizer state and average as train_fsdp.py gathered them before (rank 0)."""
    from src.fsdp import whole_average, whole_model, whole_optimizer
    return {"model": whole_model(state.model), "optimizer": whole_optimizer(state.model, state.optimizer),
            "average": whole_average(state.model, state.average)}


def _two_ranks_save(rank: int, folder: Path) -> dict:
    """A step checkpoint with dcp.async_save whose writing is held until the next training step is
    done (a writer that waits for it); the memory each rank's save takes (HeldBytes) against the
    gather of before; what every rank sees of a folder only rank 0 has."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import _check_shared
    from src.fsdp import whole_average, whole_model, whole_optimizer
    from src.tools.checkpoint_cost import HeldBytes, rank_tensors
    model = _model()
    shard_as_train_fsdp(model)
    state = _state(folder, model)
    for _ in range(3):
        _step(state, rank)
    local = [tensor for tensor in rank_tensors(model, state.optimizer, state.average)]
    found = {"local": sum(t.numel() * t.element_size() for t in local),
             "largest local": max(t.numel() * t.element_size() for t in local)}
    with HeldBytes(local) as held:  # the gather of before: whole tensors on rank 0
        saved_whole = _whole(state)
    found["gather"] = (held.peak, held.largest)

    released, waited = threading.Event(), []
    write_data = sharded_checkpoint._Writer.write_data

    def held_back(self, *args, **kwargs):  # the writing thread waits for the training's next step
        waited.append(released.wait(timeout=20))
        return write_data(self, *args, **kwargs)
    sharded_checkpoint._Writer.write_data = held_back
    try:
        held = HeldBytes(local)  # on while the save runs in this thread, not while the step runs
        with held:
            state.save_step(torch.tensor([1.0, 2.0, 3.0, 4.0 + rank]), write=dcp.async_save)
        found["returned before writing"] = not waited
        _step(state, rank)  # training goes on while the shards are written
        released.set()
        with held:
            state.shard_writer.wait()
        found["async"] = (held.peak, held.largest)
        found["waited"] = waited
    finally:
        sharded_checkpoint._Writer.write_data = write_data
    dist.barrier()
    last = folder / "last.dcp"
    if rank == 0:
        found["files"] = sorted(os.listdir(last))
        found["beside"] = sorted(os.listdir(folder))
        found["saved"] = sharded_checkpoint.read_whole(last)  # no process group needed
        found["whole"] = saved_whole
    found["after"] = {"model": whole_model(model), "optimizer": whole_optimizer(model, state.optimizer),
                      "average": whole_average(model, state.average)}
    try:
        _check_shared(last if rank == 0 else folder / "elsewhere" / "last.dcp", "the folder")
    except UserError as error:
        found["shared"] = str(error)
    found["failed"] = _full_on_rank_1(state, rank, dcp.async_save)
    dist.barrier()
    if rank == 0:
        found["after failure"] = (sorted(os.listdir(folder)), sharded_checkpoint.read_whole(last)["step"])
    return found


class _FullDisk:
    """A file that takes its first write and fails every later one, as a disk that fills does."""

    def __init__(self, file):
        self.file, self.writes = file, 0

    def write(self, data) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(28, "No space left on device")
        return self.file.write(data)

    def __getattr__(self, name: str):
        return getattr(self.file, name)


def _full_on_rank_1(state, rank: int, write) -> tuple[str, bool] | None:
    """A step checkpoint (`write`: dcp.async_save) in which rank 1's disk fills as it writes a tensor
    of its shard file (torch.save then raises its own "unexpected pos ...", with the OSError only as
    its context, which a rank's error sent to rank 0 loses): the one-line error each rank raises,
    and whether it is quiet (None: none raised)."""
    save = torch.save

    def full(obj, file, *args, **kwargs):
        return save(obj, _FullDisk(file), *args, **kwargs)
    if rank == 1:
        torch.save = full
    try:
        _step(state, rank)
        state.save_step(torch.zeros(4), write=write)
        state.shard_writer.wait()
    except UserError as error:
        return str(error), error.quiet
    finally:
        torch.save = save
    return None


def _rank(rank: int, port: int, folder: str, results: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    try:
        result = {"value": _two_ranks_save(rank, Path(folder))}
    except BaseException as error:
        result = {"error": "".join(traceback.format_exception(error))}
    finally:
        end_process_group()
    torch.save(result, f"{results}.{rank}")


@pytest.fixture(scope="module")
def two_ranks(module_tmp):
    folder = module_tmp / "two"
    folder.mkdir()
    mp.start_processes(_rank, args=(free_port(), str(folder), str(module_tmp / "result")), nprocs=2,
                       start_method="spawn")
    found = []
    for rank in (0, 1):
        saved = torch.load(module_tmp / f"result.{rank}", weights_only=False)
        assert "error" not in saved, saved["error"][-3000:]
        found.append(saved["value"])
    return folder, found


def test_each_rank_writes_its_own_shard_and_none_holds_the_whole_state(two_ranks):
    """The folder holds one shard file per rank, DCP's metadata and training.pt, and nothing is
    left beside it. The save makes no tensor larger than the rank's largest shard, and at most a
    copy of the rank's own shards (the staging of dcp.async_save, which its thread writes from)
    and one shard more (bounds from each rank's tensors, not measured), where the gather of before
    made whole tensors and held the whole weights, optimizer state and average on rank 0 (the
    control: HeldBytes sees them)."""
    folder, ranks = two_ranks
    assert ranks[0]["files"] == SHARDS
    assert ranks[0]["beside"] == ["last.dcp"], "no temporary folder, no previous one, no last.pth"
    model_bytes = sum(t.numel() * t.element_size() for key, t in ranks[0]["whole"]["model"].items()
                      if key in dict(_model().named_parameters()))
    for rank in ranks:
        peak, largest = rank["async"]
        assert largest <= rank["largest local"], (largest, rank["largest local"])
        assert peak <= rank["local"] + rank["largest local"], (peak, rank["local"])
    gather_peak, gather_largest = ranks[0]["gather"]
    assert gather_peak >= 3 * model_bytes > ranks[0]["local"] + ranks[0]["largest local"]  # weights, momentum, average
    assert gather_largest > max(rank["largest local"] for rank in ranks)


def test_a_save_that_fails_on_one_rank_is_one_line_and_the_last_checkpoint_stays(two_ranks):
    """A step checkpoint (dcp.async_save) whose shard cannot be written on rank 1 (a full disk:
    torch.save's "unexpected pos"): both ranks end it with the same one-line error, which rank 0
    says (rank 1 quiet) with the disk's own reason; the save's new folder is removed, and last.dcp
    is still the step checkpoint before it, whole."""
    folder, ranks = two_ranks
    line = (f"cannot write {folder / 'last.dcp'} (No space left on device; ", "): make room or write elsewhere; "
            "the previous last.dcp is intact")
    for rank, quiet in zip(ranks, (False, True)):
        error, said_quiet = rank["failed"]
        assert error.startswith(line[0]) and error.endswith(line[1]) and "\n" not in error, error
        assert said_quiet == quiet
    assert ranks[0]["after failure"] == (["last.dcp"], 3)


def test_held_bytes_counts_the_tensors_made_inside_not_older_ones_written_in_place():
    """HeldBytes, which the test above measures the saves with: an in-place operation (add_,
    copy_, an out= tensor) on tensors made before it was on, listed as existing or not, makes no
    new storage and counts nothing; the control: a new tensor made inside counts its bytes."""
    from src.tools.checkpoint_cost import HeldBytes
    listed, older, buf, source, out = torch.zeros(100), torch.zeros(1000), torch.empty(500), torch.ones(500), torch.empty(200)
    with HeldBytes([listed]) as held:
        listed.add_(1)
        older.add_(1)
        buf.copy_(source)
        torch.mul(source[:200], 2, out=out)
    assert (held.peak, held.largest) == (0, 0)
    assert older.sum() == 1000 and torch.equal(buf, source) and out.sum() == 400, "the operations ran"
    with HeldBytes([older]) as held:
        new = older + 1
    assert (held.peak, held.largest) == (new.numel() * new.element_size(),) * 2 == (4000, 4000)


def test_held_bytes_forgets_a_tensor_once_it_is_freed():
    """HeldBytes' peak is the most bytes alive at once, not their sum: a tensor of N bytes made
    and freed, then another made, peaks at N (each counted while alive: 2N only if the freed one's
    bytes stayed counted); the control: both alive at once is 2N."""
    from src.tools.checkpoint_cost import HeldBytes
    source = torch.ones(1000)
    size = source.numel() * source.element_size()
    with HeldBytes([source]) as held:
        first = source * 2
        assert held.now == size
        del first  # its storage's last reference: freed here
        assert held.now == 0
        second = source * 3
    assert (held.peak, held.largest, held.now) == (size, size, size) == (4000, 4000, 4000)
    assert second.sum() == 3000, "the operations ran"
    with HeldBytes([source]) as held:
        both = source * 2, source * 3
    assert held.peak == 2 * size and sum(t.numel() * t.element_size() for t in both) == 2 * size


def test_a_step_checkpoint_is_written_while_training_goes_on_and_holds_its_step(two_ranks):
    """save_step with dcp.async_save returns before any shard is written (the writing thread
    waited for the next training step, which changed every weight); what it wrote is the state at
    the save, read whole without a process group: the weights, momentum, average and its count
    of the gather, bit for bit."""
    _, ranks = two_ranks
    for rank in ranks:
        assert rank["returned before writing"] and rank["waited"] == [True]
    saved, whole, after = ranks[0]["saved"], ranks[0]["whole"], ranks[0]["after"]
    assert (saved["epoch"], saved["step"], saved["info"]) == (0, 3, {"run": "ours"})
    assert saved["partial"]["sums"].tolist() == [[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 5.0]]  # each rank's row
    for part in ("model",):
        assert saved[part].keys() == whole[part].keys()
        assert all(torch.equal(saved[part][key], whole[part][key]) for key in whole[part])
    assert saved["optimizer"]["param_groups"] == whole["optimizer"]["param_groups"]
    assert sorted(saved["optimizer"]["state"]) == sorted(whole["optimizer"]["state"]) == list(range(8))
    for number, state in whole["optimizer"]["state"].items():
        assert torch.equal(saved["optimizer"]["state"][number]["momentum_buffer"], state["momentum_buffer"])
    assert saved["average"]["updates"] == whole["average"]["updates"] == 3
    assert all(torch.equal(saved["average"]["model"][key], value) for key, value in whole["average"]["model"].items())
    moved = [key for key in whole["model"] if not torch.equal(after["model"][key], whole["model"][key])]
    assert "0.weight" in moved and "4.bias" in moved, "the next step changed the weights during the write"


# dcp.async_save's staging: on the host, in buffers kept between saves.

def _on_a_gpus_mesh(local: torch.Tensor):
    """A DTensor whose mesh is a GPU's ("cuda", made without a GPU: no backend), whose local shard
    is `local` (a CPU tensor): what the staging sees of an FSDP shard on a GPU, but for its local
    tensor's device."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    mesh = DeviceMesh("cuda", torch.arange(1), _init_backend=False)
    return DTensor(local, DTensorSpec(mesh, (Shard(0),), TensorMeta(local.shape, local.stride(), local.dtype)),
                   requires_grad=False)


def test_a_step_checkpoint_is_staged_on_the_host_in_buffers_kept_between_saves(tmp_path, world_of_one_group):
    """_Writer.stage (dcp.async_save's copy before its thread writes) of a shard of a GPU's mesh:
    a DTensor of the same mesh and placements whose local tensor is a host copy, left in host
    memory (torch's DTensor.from_local would move it back to the mesh's GPU: here it raises, no
    GPU); plain values as they are. The next save's staging copies into the same buffers (the
    same storage), which then hold its values."""
    from src.checkpoint_writer import HostCopies
    local = torch.arange(12.0).reshape(3, 4)
    shard = _on_a_gpus_mesh(local)
    copies = HostCopies()

    def staged() -> dict:
        writer = sharded_checkpoint._Writer(tmp_path / "new", tmp_path / "last.dcp", "id", None, None, copies)
        return writer.stage({"model": {"w": shard}, "lr": 0.5})
    first = staged()
    copy = first["model"]["w"]
    assert copy.device == torch.device("cpu") and copy.to_local().device == torch.device("cpu")
    assert copy.device_mesh.device_type == "cuda" and copy.placements == shard.placements and first["lr"] == 0.5
    assert torch.equal(copy.to_local(), local) and copy.to_local().data_ptr() != local.data_ptr()
    local.add_(100)  # the next step's update
    again = staged()["model"]["w"].to_local()
    assert again.data_ptr() == copy.to_local().data_ptr() and torch.equal(again, local)
    # The training state's step checkpoints keep theirs from one dcp.async_save to the next.
    import torch.distributed.checkpoint as dcp
    state, buffers = _saved(tmp_path / "run"), []
    for _ in range(2):
        _step(state, 0)
        state.save_step(torch.zeros(4), write=dcp.async_save)
        state.shard_writer.wait()
        buffers.append({place: buffer.data_ptr() for place, buffer in state.shard_writer.copies.buffers.items()})
    assert buffers[0] and buffers[1] == buffers[0]


def test_an_fsdp_step_checkpoint_reads_nothing_from_the_device_in_the_training_thread(tmp_path, world_of_one_group,
                                                                                       monkeypatch):
    """FSDP's step checkpoint (dcp.async_save) reads nothing from the device in the training thread:
    rank 0's training.pt takes the ranks' metric sums, the fp16 scaler's scale and growth tracker
    and the average's count (its skipped updates on the device) as the staging copies them with
    the shards, and DCP's thread writes it once those copies are done (on a GPU each read here
    waited for the device inside the step: before, the sums' .cpu() and three .item()). Written
    after the next step changed the scale and the count (DCP's writing held until then),
    training.pt holds their values at the save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    state = _saved(tmp_path / "run")  # a first save: the saves' process group made
    state.scaler = scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(torch.ones(()))  # its scale made, on the device
    _step(state, 0)
    state.average.update(torch.zeros(()))  # a fused optimizer's update: its skipped steps counted on the device
    state.average.update(torch.ones(()))  # and one it skipped
    at_save, sums = (scaler.state_dict(), state.average.count()), torch.tensor([1.0, 2.0, 3.0, 4.0])
    changed, write_data = threading.Event(), FileSystemWriter.write_data
    monkeypatch.setattr(FileSystemWriter, "write_data",
                        lambda self, *given: changed.wait(timeout=60) and write_data(self, *given))
    waits, reads = HostWaits(to_host=True), HostReads()
    with waits, reads:
        state.save_step(sums, write=dcp.async_save)
    scaler.update(2.0)  # the next steps: another scale, an update taken and one skipped
    state.average.update(torch.zeros(()))
    state.average.update(torch.ones(()))
    changed.set()
    state.shard_writer.wait()
    assert waits.calls == [] and reads.calls == [], (waits.calls, reads.calls)
    training = sharded_checkpoint.read_training(tmp_path / "run" / "last.dcp")
    assert training["step"] == 2 and torch.equal(training["partial"]["sums"], sums[None])
    assert training["scaler"] == at_save[0] != scaler.state_dict()
    assert isinstance(training["scaler"]["_growth_tracker"], int)
    assert training["average"] == {"updates": at_save[1]} != {"updates": state.average.count()}
    assert isinstance(training["scaler"]["scale"], float) and isinstance(training["average"]["updates"], int)


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU: the staging takes its GPU path (pinned copies, an event)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a property of torch.Tensor's, faked
        return True


def test_a_shard_on_a_gpu_is_staged_in_pinned_memory_and_written_after_its_copies(tmp_path, world_of_one_group,
                                                                                   cuda_calls, monkeypatch):
    """Shards on GPU 1 (faked on the CPU: tensors that say they are on a GPU, torch.cuda's calls
    recorded per thread by conftest's cuda_calls, pinning noted): each host buffer is asked for in
    pinned memory, and the copies are queued behind one CUDA event that the training thread records
    and does not wait for; DCP's writing thread makes GPU 1 its own, then waits for that event,
    then writes."""
    from torch.distributed.checkpoint import FileSystemWriter
    pinned, written, empty_strided = [], [], torch.empty_strided

    def no_pinning(*args, pin_memory=False, **kwargs):  # the CPU cannot pin: noted, and a plain buffer
        pinned.append(pin_memory)
        return empty_strided(*args, **kwargs)
    monkeypatch.setattr(torch, "empty_strided", no_pinning)
    monkeypatch.setattr(FileSystemWriter, "write_data",
                        lambda self, plan, planner: written.append(cuda_calls.of("AsyncCheckpointExecutor")))
    cuda_calls.set_device(torch.device("cuda", 1))  # the script's, in the training thread
    from src.checkpoint_writer import HostCopies
    writer = sharded_checkpoint._Writer(tmp_path / "new", tmp_path / "last.dcp", "id", None, None, HostCopies())
    writer.stage({"model": {"w": _on_a_gpus_mesh(torch.ones(3, 4).as_subclass(_OnGpu)),
                            "b": torch.ones(3).as_subclass(_OnGpu)}})
    assert pinned == [True, True]
    assert [what for what, _ in cuda_calls.of("MainThread")] == ["set_device", "Event", "record"]
    thread = threading.Thread(target=writer.write_data, args=(None, None), name="AsyncCheckpointExecutor")
    thread.start()
    thread.join()
    assert written == [[("set_device", 1), ("synchronize", 1)]]


def test_every_rank_must_see_the_folder(two_ranks):
    _, ranks = two_ranks
    assert ranks[0]["shared"] == ("cannot resume from the folder: rank(s) 1 do not see it; FSDP's last.dcp must be "
                                  "in a folder that every node shares (--checkpoint)")


def test_two_ranks_shards_load_into_one_rank(two_ranks, world_of_one_group):
    """The two ranks' last.dcp loaded into the shards of a world of one (DCP cuts each tensor from
    the two saved pieces): the weights, momentum and average that were saved, bit for bit."""
    folder, ranks = two_ranks
    from src.fsdp import whole_average, whole_model, whole_optimizer
    model = _model()
    shard_as_train_fsdp(model)
    state = _state(folder, model)
    saved = ranks[0]["saved"]
    sharded_checkpoint.load_shards(folder / "last.dcp", model, state.optimizer, state.average,
                                   saved["average"]["updates"])
    loaded = {"model": whole_model(model), "optimizer": whole_optimizer(model, state.optimizer),
              "average": whole_average(model, state.average)}
    assert all(torch.equal(loaded["model"][key], value) for key, value in saved["model"].items())
    for number, value in saved["optimizer"]["state"].items():
        assert torch.equal(loaded["optimizer"]["state"][number]["momentum_buffer"], value["momentum_buffer"])
    assert loaded["average"]["updates"] == 3
    assert all(torch.equal(loaded["average"]["model"][key], value) for key, value in saved["average"]["model"].items())


@pytest.fixture
def world_of_one_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    end_process_group()


def test_loading_a_last_dcp_leaves_each_parameter_frozen_or_trained_as_it_was(tmp_path, world_of_one_group):
    """A last.dcp written with one layer frozen loaded into a model with another frozen (--freeze
    changed on --resume): the loading makes the parameters with a state in the file require a
    gradient for torch's calls, and afterwards every parameter requires one as it did before."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import run_info
    model = _model()
    model[4].requires_grad_(False)  # no momentum in the file for the last layer
    shard_as_train_fsdp(model)
    state = _state(tmp_path, model)
    _step(state, 0)
    state.info = run_info(state.args, 8, "digest")
    state.save_step(torch.zeros(4), write=dcp.save)
    again = _model()
    again[0].requires_grad_(False)  # momentum in the file for the first layer
    shard_as_train_fsdp(again)
    resumed = _state(tmp_path, again)
    before = {name: param.requires_grad for name, param in again.named_parameters()}
    assert not all(before.values()) and any(before.values())
    sharded_checkpoint.load_shards(tmp_path / "last.dcp", again, resumed.optimizer, resumed.average, 1)
    assert {name: param.requires_grad for name, param in again.named_parameters()} == before


def test_a_last_dcp_that_diverged_is_refused(tmp_path, world_of_one_group):
    """A step checkpoint whose weights are not finite (a run that diverged inside an epoch): --resume
    refuses it in one line naming the folder and a tensor, as it refuses such a last.pth."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import run_info
    model = _model()
    shard_as_train_fsdp(model)
    state = _state(tmp_path, model)
    _step(state, 0)
    with torch.no_grad():
        model[2].weight.to_local()[0, 0] = float("nan")
    state.info = info = run_info(state.args, 8, "digest")
    state.save_step(torch.zeros(4), write=dcp.save)
    again = _model()
    shard_as_train_fsdp(again)
    resumed = _state(tmp_path, again)
    resumed.args.resume, resumed.info = True, info
    with pytest.raises(UserError, match=f"^{tmp_path / 'last.dcp'} holds weights that are not finite .NaN or infinity. "
                                        "in 1 tensor.s., first 2.weight: it comes from a run that diverged"):
        resumed.resume()


# Nothing read runs code, and every part of a folder is of one save.

class _Marker:
    """Unpickled with pickle (or torch.load without weights_only), it creates the file at `path`:
    what a crafted pickle would run."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return os.mknod, (str(self.path),)


def _saved(folder: Path, seed: int = 0, steps: int = 1, writer=None):
    """A step checkpoint of the small sharded model (world of one) after `steps` steps, written into
    folder/last.dcp with dcp.save through the training state; the state."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import run_info
    torch.manual_seed(seed)
    model = _model()
    shard_as_train_fsdp(model)
    state = _state(folder, model)
    if writer is not None:
        state.shard_writer = writer
    for _ in range(steps):
        _step(state, seed)
    state.info = run_info(state.args, 8, "digest")
    state.save_step(torch.zeros(4), write=dcp.save)
    return state


def _readers(folder: Path, marker: Path, info: dict):
    """Each way a last.dcp is read: whole, as --resume of every mode but FSDP and the report read it
    (src.checkpoint.read_last), the report's final weights, and FSDP's --resume into its shards
    (src.state.TrainingState.resume, the run's `info`); the one-line error each raises, the marker
    never made."""
    from src.checkpoint import read_last
    from src.tools.report import Run, final_weights

    def fsdp_resume():
        model = _model()
        shard_as_train_fsdp(model)
        state = _state(folder, model)
        state.args.resume, state.info = True, info
        state.resume()
    errors = []
    for read in (lambda: read_last(folder), lambda: final_weights(Run(folder, "1 fsdp", {}, [])), fsdp_resume):
        with pytest.raises(UserError) as caught:
            read()
        errors.append(str(caught.value))
        assert not marker.exists(), "the crafted pickle ran"
    assert all("\n" not in error for error in errors), errors
    return errors


def test_a_crafted_metadata_runs_nothing_in_any_reader(tmp_path, world_of_one_group):
    """A last.dcp whose .metadata is a pickle that would create a marker file when unpickled (as
    torch's reader unpickles it, with pickle.load): every reader refuses it in one line naming the
    file, and the marker never appears. The control: a pickle of DCP's own metadata classes is read."""
    info = _saved(tmp_path).info
    marker = tmp_path / "marker"
    metadata = tmp_path / "last.dcp" / ".metadata"
    kept = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(_Marker(marker)))
    for error in _readers(tmp_path, marker, info):
        assert f"{metadata} is not DCP's metadata (it names posix.mknod, which DCP's metadata never holds); " \
               "nothing in it was run" in error, error
    metadata.write_bytes(kept)
    assert sharded_checkpoint.read_metadata(tmp_path / "last.dcp").storage_meta.save_id
    from src.checkpoint import read_last
    assert read_last(tmp_path)["step"] == 1


def test_a_value_in_a_shard_is_loaded_without_running_code(tmp_path, world_of_one_group, monkeypatch):
    """A save whose one value that is not a tensor (the optimizer's learning rate) is an object
    whose pickle would create a marker file: torch's planners load such values with
    weights_only=False; here every reader refuses it in one line, and the marker never appears."""
    marker, shards_of = tmp_path / "marker", sharded_checkpoint.shards_of

    def crafted(*args):
        shards = shards_of(*args)
        shards["optimizer"]["param_groups"][0]["lr"] = _Marker(marker)
        return shards
    monkeypatch.setattr(sharded_checkpoint, "shards_of", crafted)
    info = _saved(tmp_path).info
    assert not marker.exists()
    for error in _readers(tmp_path, marker, info):
        assert "its value optimizer.param_groups.0.lr is not plain data (" in error and "GLOBAL posix.mknod" in error \
               and "nothing in it was run" in error, error


def test_a_part_of_another_save_is_refused_naming_it(tmp_path, world_of_one_group):
    """A shard file copied from another run's last.dcp (of the same model: it would load), or
    from an earlier save of the same run, and another save's .metadata: refused in one line
    naming the file, by every reader, before anything is loaded. The control: each folder whole
    reads."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import read_last
    one, other = tmp_path / "one", tmp_path / "other"
    runs = [_saved(one, seed=0, steps=2), _saved(other, seed=7, steps=2)]
    shutil.copytree(one / "last.dcp", tmp_path / "earlier")  # step 2's save, before step 3's
    for state in runs:  # each run's second save, at the same step
        _step(state, 0)
        state.save_step(torch.zeros(4), write=dcp.save)
    run = runs[0]
    for folder in (one, other):
        assert read_last(folder)["step"] == 3
    for source, name in ((other / "last.dcp", "__0_0.distcp"), (tmp_path / "earlier", "__0_0.distcp"),
                         (other / "last.dcp", ".metadata")):
        mixed = tmp_path / "mixed"
        shutil.rmtree(mixed, ignore_errors=True)
        shutil.copytree(one, mixed)
        shutil.copy(source / name, mixed / "last.dcp" / name)
        part = mixed / "last.dcp" / name
        for error in _readers(mixed, tmp_path / "no marker", run.info):
            assert (f"{part} is not part of the save that {mixed / 'last.dcp' / 'training.pt'} names" in error
                    if name != ".metadata" else f"{part} is of another save than" in error), error


def test_a_last_dcp_without_metadata_is_one_line_and_no_library_traceback(tmp_path, world_of_one_group, capsys):
    """Without .metadata (a copy that lost it): each reader's one line says it is missing, and
    nothing else reaches the terminal (torch's reader logs two tracebacks, "Global metadata is not
    found", before it gives up); the report's error gives that reason, not an exception's name."""
    info = _saved(tmp_path).info
    (tmp_path / "last.dcp" / ".metadata").unlink()
    errors = _readers(tmp_path, tmp_path / "no marker", info)
    assert all(f"{tmp_path / 'last.dcp' / '.metadata'} is missing" in error for error in errors), errors
    assert errors[1] == f"cannot read the weights of {tmp_path}: cannot read {tmp_path / 'last.dcp'} " \
                        f"({tmp_path / 'last.dcp' / '.metadata'} is missing)"
    assert capsys.readouterr() == ("", "")


def test_a_folder_holding_a_last_dcp_holds_an_earlier_run(fsdp_stopped, tmp_path, monkeypatch, capsys, world_of_one):
    """Without --resume a new run there is refused, as over a last.pth; --overwrite removes it (and
    what a save left beside it) before any training."""
    from src.cli import defaults
    from src.outputs import _check_overwrite, output_paths
    shutil.copytree(fsdp_stopped[0], tmp_path / "out")
    fails_in_process(train_fsdp.main, ["--data-dir", str(tmp_path / "nowhere"), *outputs(tmp_path / "out")],
                     monkeypatch, capsys, f"{tmp_path / 'out'} holds the files of an earlier run (last.dcp): pass --resume")
    _folder(tmp_path / "out" / ".last.dcp.12-4.tmp", "half")
    args = defaults(checkpoint=str(tmp_path / "out" / "best.pth"), plot=str(tmp_path / "p.png"),
                    overwrite=True, resume=False)
    _check_overwrite(args, output_paths(args))
    # The lock file stays, meaning nothing; so does the run's MLflow store (--track mlflow), which
    # keeps the earlier runs (docs/watching.md).
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".run.lock", "mlflow.db"]


# A failed save: one line, the new folder removed, the last checkpoint intact.

def _fill(disk: Path) -> Path:
    """A file taking every byte left on the disk."""
    filler = disk / "filler"
    with open(filler, "wb") as file:
        try:
            while True:
                file.write(bytes(1 << 16))
                file.flush()
        except OSError:
            pass
    return filler


@pytest.mark.parametrize("way", ["save", "async_save"])
def test_a_full_disk_in_a_save_is_one_line_and_keeps_the_last_checkpoint(way, tmpfs, world_of_one_group):
    """A real full disk under dcp.save (an epoch's end) and dcp.async_save (a step checkpoint, its
    error raised by the next wait): one line naming last.dcp with the disk's reason, the save's new
    folder removed, last.dcp the step before it byte for byte; once there is room the next save
    goes through."""
    import torch.distributed.checkpoint as dcp

    from src.checkpoint import read_last
    disk = tmpfs("disk", "size=2m")
    state = _saved(disk)
    before = {p.name: p.read_bytes() for p in (disk / "last.dcp").iterdir()}
    filler = _fill(disk)
    _step(state, 0)
    with pytest.raises(UserError) as caught:
        state.save_step(torch.zeros(4), write=getattr(dcp, way))
        state.shard_writer.wait()
    message = str(caught.value)
    assert message.startswith(f"cannot write {disk / 'last.dcp'} (No space left on device; ") and message.endswith(
        " MB free there): make room or write elsewhere; the previous last.dcp is intact"), message
    assert sorted(os.listdir(disk)) == ["filler", "last.dcp"]
    assert {p.name: p.read_bytes() for p in (disk / "last.dcp").iterdir()} == before
    filler.unlink()
    state.save_step(torch.zeros(4), write=getattr(dcp, way))
    state.shard_writer.wait()
    assert read_last(disk)["step"] == 2 and sorted(os.listdir(disk)) == ["last.dcp"]


def test_fsdp_on_a_full_disk_ends_in_one_line_without_a_temporary(tmpfs, tiny_data, world_of_one, monkeypatch,
                                                                   capsys):
    """train_fsdp.py with --save-every-steps 1 on a disk too small for its step checkpoint: exit 2,
    one line (the disk's reason, naming last.dcp), no save's folder left behind."""
    from conftest import TINY
    disk = tmpfs("disk", "size=3m")
    fails_in_process(train_fsdp.main, ["--data-dir", str(tiny_data), *TINY, "--epochs", "1", "--save-every-steps", "1",
                                       *outputs(disk)], monkeypatch, capsys,
                     f"error: cannot write {disk / 'last.dcp'} (No space left on device; ")
    assert sorted(os.listdir(disk)) == [".run.lock"]


# A run replaces, renames or removes only the folders a save wrote.

@pytest.mark.parametrize("name, flag", [("last.dcp", "--overwrite"), (".last.dcp.previous", "--resume"),
                                        (".last.dcp.previous", "--overwrite"), (".last.dcp.3-1.tmp", "--resume")])
def test_a_users_folder_at_a_saves_name_is_refused_and_left_as_it_is(name, flag, tmp_path, monkeypatch, capsys):
    """A folder of the user's named last.dcp (--overwrite removed it whole), .last.dcp.previous
    (taken for an earlier run's files, and renamed to last.dcp under --resume) or a save's
    temporary name, holding a file no save writes: the run stops at its start in one line naming
    it, and the folder is as it was. (train_single.py: every mode checks its outputs alike.)"""
    import train_single
    folder = tmp_path / "out" / name
    folder.mkdir(parents=True)
    (folder / "mythesis.txt").write_text("years of work")
    fails_in_process(train_single.main, ["--data-dir", str(tmp_path / "nowhere"), *outputs(tmp_path / "out"), flag],
                     monkeypatch, capsys, f"--checkpoint {tmp_path / 'out'}: {name} there is a folder holding "
                                          "mythesis.txt, not the folder of FSDP's checkpoint")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [name]
    assert (folder / "mythesis.txt").read_text() == "years of work"


@pytest.mark.parametrize("name, flag", [("last.dcp", "--overwrite"), (".last.dcp.previous", "--resume")])
@pytest.mark.parametrize("held", ["nothing", "a text training.pt", "a torch file of other content"])
def test_a_users_folder_holding_only_a_saves_names_is_not_taken_for_a_save(name, flag, held, tmp_path, monkeypatch,
                                                                            capsys):
    """A user's empty folder named last.dcp was removed by --overwrite, and one named
    .last.dcp.previous holding a text file named training.pt was renamed to last.dcp under --resume
    (then "delete it"): the names are not enough; a whole save's folder holds a training.pt that
    loads as a save's. Refused at the start in one line, the folder as it was."""
    import train_single
    folder = tmp_path / "out" / name
    folder.mkdir(parents=True)
    if held == "a text training.pt":
        (folder / "training.pt").write_text("my notes")
    elif held != "nothing":  # loads without running code, but is not a save's
        torch.save({"weights": torch.ones(2)}, folder / "training.pt")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    fails_in_process(train_single.main, ["--data-dir", str(tmp_path / "nowhere"), *outputs(tmp_path / "out"), flag],
                     monkeypatch, capsys, f"--checkpoint {tmp_path / 'out'}: {name} there is a folder without a "
                                          "save's training.pt, not the folder of FSDP's checkpoint")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [name]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_only_the_folders_a_save_wrote_are_removed_or_renamed(tmp_path):
    """remove (--overwrite, and a last.pth that replaced an FSDP run's), repair (a run's start)
    and the readers' whole_folder act on a folder only if a save wrote it (only the files a save
    writes, no link): a user's folder at each name, or a link to one, is left as it is and not
    read as a save. The control: the same names holding a save's files are removed and put back."""
    last, previous, temporary = tmp_path / "last.dcp", tmp_path / ".last.dcp.previous", tmp_path / ".last.dcp.4-2.tmp"
    users = tmp_path / "users"
    users.mkdir()
    (users / "training.pt").write_text("a file of the user's")
    for path in (previous, temporary):
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    last.symlink_to(users)
    sharded_checkpoint.repair(last)
    sharded_checkpoint.remove(last)
    assert sharded_checkpoint.whole_folder(last) is None and sharded_checkpoint.temporaries(last) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [".last.dcp.4-2.tmp", ".last.dcp.previous", "last.dcp", "users"]
    assert all((path / "notes.txt").exists() for path in (previous, temporary)) and (users / "training.pt").exists()
    last.unlink()  # no last.dcp: a previous one of a save's would be put back in its place
    sharded_checkpoint.repair(last)
    assert not os.path.lexists(last) and (previous / "notes.txt").exists()
    for path in (previous, temporary):
        shutil.rmtree(path)
    _folder(previous, "saved")
    (_folder(temporary, "half") / "__0_0.distcp").write_text("half")
    assert sharded_checkpoint.whole_folder(last) == previous
    sharded_checkpoint.repair(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp", "users"] and _content(last) == "saved"
    sharded_checkpoint.remove(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["users"]


# Replaced whole or not at all.

def _folder(path: Path, content: str) -> Path:
    """A save's folder as is_ours reads one: its training.pt a dict with the epoch (and `content`)."""
    path.mkdir(parents=True)
    torch.save({"epoch": 1, "content": content}, path / "training.pt")
    return path


def _content(path: Path) -> str:
    """The `content` of a folder _folder made."""
    return torch.load(path / "training.pt", weights_only=True)["content"]


def test_a_crash_between_the_renames_leaves_the_previous_folder_which_the_next_start_puts_back(tmp_path, monkeypatch):
    last = _folder(tmp_path / "last.dcp", "old")
    new = _folder(tmp_path / ".last.dcp.6-2.tmp", "new")
    replace, calls = os.replace, []

    def crash_after_the_first(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the process ends here
        replace(src, dst)
    monkeypatch.setattr(os, "replace", crash_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        sharded_checkpoint.commit(new, last)
    monkeypatch.setattr(os, "replace", replace)
    assert not last.exists() and sharded_checkpoint.whole_folder(last) == tmp_path / ".last.dcp.previous"
    assert _content(sharded_checkpoint.whole_folder(last)) == "old"
    sharded_checkpoint.repair(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"] and _content(last) == "old"
    # A crash after both renames: the new one is in place, the previous one goes at the next start.
    _folder(tmp_path / ".last.dcp.previous", "older")
    sharded_checkpoint.repair(last)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"] and _content(last) == "old"
    new = _folder(tmp_path / ".last.dcp.9-3.tmp", "newer")
    sharded_checkpoint.commit(new, last, replaces=tmp_path / "last.pth")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.dcp"] and _content(last) == "newer"


def test_resume_takes_the_newer_of_last_pth_and_last_dcp(tmp_path):
    from src.checkpoint import _newer_here
    torch.save({"epoch": 1, "step": 0}, tmp_path / "last.pth")
    (tmp_path / "last.dcp").mkdir()
    torch.save({"epoch": 1, "step": 3}, tmp_path / "last.dcp" / "training.pt")
    assert _newer_here(tmp_path / "last.pth", sharded=False) == ((1, 3), 0, str(tmp_path / "last.dcp"))
    torch.save({"epoch": 2, "step": 0}, tmp_path / "last.pth")
    assert _newer_here(tmp_path / "last.pth", sharded=True) == ((2, 0), 0, str(tmp_path / "last.pth"))
    torch.save({"epoch": 1, "step": 3}, tmp_path / "last.pth")  # the same place: the one this mode writes
    assert _newer_here(tmp_path / "last.pth", sharded=True)[2] == str(tmp_path / "last.dcp")
    assert _newer_here(tmp_path / "last.pth", sharded=False)[2] == str(tmp_path / "last.pth")


# Stopped on two processes, resumed elsewhere (the real scripts).

# SIGTERM to rank 0 in step 1 (as SLURM sends it to each task; torchrun, which would forward it,
# gives its workers 30 s before it kills them, less than ResNet-18's steps take here): the ranks
# agree after step 4 and stop after step 8 of epoch 1, exit code 75.
SIGTERM_AT_STEP_1 = {"PYTHONPATH": HOOKS, "SIGNAL_AT_STEP": "1", "SIGNAL_NAME": "SIGTERM"}


def _stopped(mode: str, exact_data, folder: Path, *flags: str, env: dict | None = None):
    """A two-process run of `mode` (5 images a process) with --save-every-steps 3, stopped by SIGTERM."""
    script = "train_fsdp.py" if mode == "fsdp" else "train_ddp.py"
    result = run([*TORCHRUN, script, "--data-dir", str(exact_data), *(flags or FLAGS), "--batch-size", "5",
                  "--save-every-steps", "3", "--log-every", "1", *outputs(folder)],
                 env={**SIGTERM_AT_STEP_1, **(env or {})}, timeout=900)
    assert result.returncode == 1 and "exitcode: 75" in result.stderr, result.stderr[-3000:]
    where = folder / ("last.dcp" if mode == "fsdp" else "last.pth")
    assert stop_line(result.stderr).startswith(f"stopped by SIGTERM at epoch 1 step 8 of 10: {where} saved there;")
    return result


def _resume(main, data, folder: Path, monkeypatch, capsys, *extra: str) -> str:
    code, out, err = in_process(main, ["--data-dir", str(data), *FLAGS, "--workers", "0", "--batch-size", "10",
                                       "--resume", *extra, *outputs(folder)], monkeypatch, capsys)
    end_process_group()
    assert code == 0, err[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp_stopped(fsdp_stops):
    """The two-process FSDP run stopped by SIGTERM after step 8 (conftest.fsdp_stops): (its
    folder, torchrun's result)."""
    return fsdp_stops["at step 8"]


def test_an_fsdp_run_stopped_on_two_processes_leaves_one_shard_per_rank(fsdp_stopped):
    folder, result = fsdp_stopped
    # Each rank ends 75 after the save; the one that ends second may get torchrun's SIGTERM first
    # (torchrun ends the others once one has exited not 0), while rank 0 ends its tracker: -15.
    codes = sorted(re.findall(r"exitcode  : (-?\d+)", result.stderr))
    assert result.returncode == 1 and codes in (["75", "75"], ["-15", "75"]), result.stderr[-3000:]
    where = folder.parent / "out" / "last.dcp"
    assert stop_line(result.stderr).startswith(f"stopped by SIGTERM at epoch 1 step 8 of 10: {where} saved there;")
    assert sorted(os.listdir(folder / "last.dcp")) == SHARDS
    assert not (folder / "last.pth").exists() and sharded_checkpoint.position(folder / "last.dcp") == (0, 8)


@pytest.mark.parametrize("main", [train_fsdp.main, train_ddp.main], ids=["fsdp", "ddp"])
def test_resumed_on_one_process_with_twice_the_batch_it_ends_where_the_straight_run_does(
        main, fsdp_stopped, runs, far, tmp_path, world_of_one, monkeypatch, capsys):
    """The stopped FSDP run's last.dcp, resumed by one process of FSDP (DCP reshards the two
    ranks' pieces into one) or of DDP (read whole) with --batch-size 10: the finished steps
    skipped, both ranks' partial sums taken by the one, it ends where the straight two-process FSDP
    run ends (weights, average, history) within the modes' tolerance."""
    folder, _ = fsdp_stopped
    shutil.copytree(folder, tmp_path / "out")
    printed = _resume(main, runs.exact_data, tmp_path / "out", monkeypatch, capsys)
    assert f"resumed from {tmp_path / 'out' / 'last.dcp'} in epoch 1 of 2 after its step 8: going on" in printed
    straight = stops_straight(runs, "fsdp")
    assert_same_run(tmp_path / "out", straight, far)
    assert (tmp_path / "out" / "last.dcp").exists() == (main is train_fsdp.main)
    assert (tmp_path / "out" / "last.pth").exists() == (main is train_ddp.main), "one last, the newest"


def test_a_ddp_last_pth_resumes_under_fsdp_on_one_process(ddp_stops, runs, far, tmp_path, world_of_one, monkeypatch,
                                                           capsys):
    """DDP's step checkpoint of two processes (whole tensors, each rank's sums; conftest.ddp_stops'
    stop after step 8) into FSDP's shards of one process, weight average and all: the same end as
    the straight DDP run."""
    shutil.copytree(ddp_stops["at step 8"].out, tmp_path / "out")
    assert weights(tmp_path / "out", "last.pth")["step"] == 8
    assert weights(tmp_path / "out", "last.pth")["partial"]["sums"].shape[0] == 2, "each rank's row"
    printed = _resume(train_fsdp.main, runs.exact_data, tmp_path / "out", monkeypatch, capsys)
    assert f"resumed from {tmp_path / 'out' / 'last.pth'} in epoch 1 of 2 after its step 8" in printed
    assert_same_run(tmp_path / "out", stops_straight(runs, "ddp"), far)
    assert not (tmp_path / "out" / "last.pth").exists(), "last.dcp replaced it"


def test_another_global_batch_is_refused_before_any_work(fsdp_stopped, runs, tmp_path, world_of_one, monkeypatch,
                                                         capsys):
    shutil.copytree(fsdp_stopped[0], tmp_path / "out")
    fails_in_process(train_fsdp.main, ["--data-dir", str(runs.exact_data), *FLAGS, "--workers", "0", "--batch-size",
                                       "5", "--resume", *outputs(tmp_path / "out")], monkeypatch, capsys,
                     f"{tmp_path / 'out' / 'last.dcp'} was trained with --batch-size (x processes x --accumulate) 10, "
                     "not 5")
    assert sharded_checkpoint.position(tmp_path / "out" / "last.dcp") == (0, 8)


def test_a_kill_in_a_save_leaves_the_previous_last_dcp_and_the_restart_goes_on_from_it(fsdp_stops, runs):
    """The stopped run resumed under --max-restarts=1, rank 1 killed as it starts writing its
    shard of the step checkpoint after step 12 (its third save: after step 9, at epoch 1's end,
    then this one; conftest.fsdp_stops): torchrun restarts both workers, which find epoch 1's
    last.dcp whole (the half-written new folder removed) and end bit for bit where the straight
    run does."""
    out, result = fsdp_stops["restarted"]
    where = out.parent / "out" / "last.dcp"
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exitcode: -9" in result.stderr
    first, restart = result.stdout.split("resumed from")[1:]
    assert first.startswith(f" {where} in epoch 1 of 2 after its step 8: going on")
    assert restart.startswith(f" {where} after epoch 1 of 2: going on")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith((".last", "last"))) == ["last.dcp"]
    same_end(out, stops_straight(runs, "fsdp"))


# ResNet-18 with batch norm synchronised and a weight average, in float64 (test_sync_bn.py says
# why; ShuffleNet V2 x0.5, whose two-process run takes half as long in float32, took longer than
# ResNet-18 in float64: its depthwise convolutions have no fast float64 kernel on a CPU).
BATCH_NORM = [*LEARN, *VAL, "--workers", "0", "--epochs", "2", "--sync-bn", "--ema-decay", "0.9"]
FLOAT64 = {"FLOAT64": "1"}


@pytest.fixture(scope="module")
def batch_norm_stopped(exact_data, module_tmp):
    """FSDP on two processes (BATCH_NORM) stopped by SIGTERM after step 8."""
    folder = module_tmp / "batch-norm-stopped"
    _stopped("fsdp", exact_data, folder, *BATCH_NORM, env=FLOAT64)
    return folder


@pytest.mark.parametrize("main", [train_fsdp.main, train_ddp.main], ids=["fsdp", "ddp"])
def test_resnet18_with_sync_bn_and_ema_stopped_on_two_resumes_on_one(main, batch_norm_stopped, runs, tmp_path,
                                                                        world_of_one):
    """FSDP on two processes (--sync-bn, --ema-decay) stopped mid-epoch, resumed by one process of
    FSDP or DDP with twice the batch (a world of one in this process): the weights, their average
    and batch norm's statistics end where the straight two-process run's do; the yardstick is the
    same job with another global batch."""
    shutil.copytree(batch_norm_stopped, tmp_path / "out")
    result = run_main(main, ["--data-dir", str(runs.exact_data), *BATCH_NORM, "--batch-size", "10", "--resume",
                             *outputs(tmp_path / "out")], env=FLOAT64)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "in epoch 1 of 2 after its step 8: going on" in result.stdout
    straight = runs("fsdp", *BATCH_NORM, "--batch-size", "5", env=FLOAT64, kept="file")[0]
    # one process normalises its whole batch: train_single.py refuses --sync-bn, which cannot act there
    other = runs("single", *[flag for flag in BATCH_NORM if flag != "--sync-bn"], "--batch-size", "20", env=FLOAT64,
                 kept="file")[0]
    far = distance(last_model(other), last_model(straight))
    assert_same_run(tmp_path / "out", straight, far)
    statistics = [key for key in last_model(straight) if "running" in key]
    assert statistics and distance({k: last_model(tmp_path / "out")[k] for k in statistics},
                                   {k: last_model(straight)[k] for k in statistics}) < TOLERANCE * far
