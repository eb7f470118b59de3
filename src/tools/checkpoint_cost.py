"""What a step checkpoint of train_fsdp.py costs each rank: the memory it takes and the seconds it
holds training up, the way train_fsdp.py saved before (every shard gathered whole onto rank 0,
which wrote last.pth) against the way it saves now (each rank writes its own shards into last.dcp
with torch.distributed.checkpoint: dcp.save at an epoch's end, dcp.async_save at a step).

    python -m src.tools.checkpoint_cost [--arch vgg16] [--processes 2] [--repeats 3] [--dir DIR]

Starts --processes gloo ranks on this machine's CPU (torch.multiprocessing), each building its
shards of --arch as train_fsdp.py shards it (fully_shard per unit, then the root; the weights
made on the meta device and then only each rank's pieces allocated, drawn at random), with SGD's
momentum and a weight average (--ema-decay), after one optimizer step. Then each way of saving
a step checkpoint runs --repeats times (the median seconds are shown), each timed from its start
until every rank may go on training, and for the asynchronous one also until it is written:

- gather: whole_model, whole_optimizer and whole_average (src/fsdp.py, as train_fsdp.py called
  them before), rank 0 writing last.pth with torch.save; the other ranks go on after the gather
  but wait at their next collective for rank 0, so the save holds training up until rank 0 is done;
- dcp.save, dcp.async_save: TrainingState.save_step with that `write` (src/state.py), into last.dcp.

The memory is measured per rank in two ways: the bytes of the tensors that the save creates,
the most of them alive at once (HeldBytes: every torch operation's new tensors, in the training
thread, until they are freed), and the growth of the process's peak resident memory (Linux's
VmHWM, reset before each save through /proc/self/clear_refs; it includes what the writing
thread allocates). It prints a table and removes what it wrote (in --dir, or a temporary folder).
"""
import argparse
import dataclasses
import os
import socket
import statistics
import tempfile
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from src.cli import OneLineParser, between, open_fraction, processes_count
from src.errors import UserError, exit_on_error

WAYS = ("gather", "dcp.save", "dcp.async_save")


class HeldBytes(TorchDispatchMode):
    """While on, the bytes of the tensors that torch operations of this thread create (a new
    storage: not a view, not an in-place result, not one of the operation's inputs), and the most
    of them alive at once: `peak`; the largest one: `largest`. A tensor counts until its storage
    is freed, in whichever thread."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self.live = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.now = self.peak = self.largest = 0
        self.lock = threading.Lock()

    def _freed(self, pointer: int, size: int) -> None:
        with self.lock:
            self.live.discard(pointer)
            self.now -= size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = {tensor.untyped_storage().data_ptr() for tensor in tree_flatten((args, kwargs))[0]
                  if type(tensor) is torch.Tensor}
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor:  # a DTensor: its local tensor comes through here too
                continue
            storage = tensor.untyped_storage()
            pointer, size = storage.data_ptr(), storage.nbytes()
            with self.lock:
                if not pointer or pointer in self.live or pointer in inputs:
                    continue
                self.live.add(pointer)
                self.now += size
                self.peak, self.largest = max(self.peak, self.now), max(self.largest, size)
            weakref.finalize(storage, self._freed, pointer, size)
        return out


def resident_peak() -> int | None:
    """The process's peak resident memory (VmHWM), in bytes; None where Linux does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_resident_peak() -> bool:
    """Set VmHWM to the resident memory now; whether Linux let us."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def rank_tensors(model, optimizer, average) -> list[torch.Tensor]:
    """Every tensor this rank holds for training: its shards of the weights, their gradients, the
    optimizer state and the weight average, and the buffers."""
    from torch.distributed.tensor import DTensor

    def local(tensor):
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor
    tensors = [*model.parameters(), *model.buffers(), *average.average]
    tensors += [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    return [local(tensor) for tensor in tensors]


def sharded_model(arch: str, ema_decay: float, seed: int):
    """(model, optimizer, weight average, training state's pieces) of this rank: --arch sharded as
    train_fsdp.py shards it, its pieces alone allocated, after one SGD step with momentum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from src.cli import parse_args
    from src.ema import WeightAverage
    from src.fsdp import fsdp_units
    from src.models import build_model
    from src.recipe import make_optimizer, make_schedule
    with torch.device("meta"):
        model = build_model(arch, "none")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in fsdp_units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed + dist.get_rank())
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
            if local.is_floating_point():
                local.copy_(torch.randn(local.shape, generator=generator) * 0.01)
    args = parse_args("", ["--arch", arch, "--ema-decay", str(ema_decay)])
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    average = WeightAverage(model, optimizer, ema_decay)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, average, make_schedule(optimizer, args, 100)


def _rank(rank: int, world_size: int, port: int, arch: str, ema_decay: float, repeats: int, folder: str,
          results: str) -> None:
    """One rank: the model, then each way of saving `repeats` times; its figures into results.RANK."""
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        import torch.distributed.checkpoint as dcp

        from src import checkpoint
        from src.cli import parse_args
        from src.fsdp import whole_average, whole_model, whole_optimizer
        from src.outputs import atomic_torch_save
        from src.state import TrainingState
        model, optimizer, average, schedule = sharded_model(arch, ema_decay, seed=0)
        args = parse_args("", ["--arch", arch, "--checkpoint", str(Path(folder) / "best.pth")])
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        state = TrainingState(args, {}, model, optimizer, scaler, schedule, average, steps_per_epoch=100)
        state.step = 1
        sums = torch.zeros(4)
        figures: dict[str, dict[str, Any]] = {way: {"blocks": [], "written": [], "held": 0, "largest": 0, "resident": None} for way in WAYS}
        for _ in range(repeats):
            for way in WAYS:
                dist.barrier()
                measured = reset_resident_peak()
                before = resident_peak() if measured else None
                held = HeldBytes(rank_tensors(model, optimizer, average))
                start = time.perf_counter()
                with held:
                    if way == "gather":  # what save_step did before: whole tensors, rank 0 writes
                        last = checkpoint.last_state([], whole_model(model), whole_optimizer(model, optimizer),
                                                     whole_average(model, average), scaler, schedule, {}, 1,
                                                     {"sums": sums[None]})
                        if rank == 0:
                            atomic_torch_save(last, Path(folder) / "last.pth")
                        del last
                    else:
                        state.save_step(sums, write=dcp.save if way == "dcp.save" else dcp.async_save)
                blocks = _all_done(time.perf_counter() - start)
                state.shard_writer.wait()
                written = _all_done(time.perf_counter() - start)
                after = resident_peak() if measured else None
                mine = figures[way]
                mine["blocks"].append(blocks)
                mine["written"].append(written)
                mine["held"], mine["largest"] = max(mine["held"], held.peak), max(mine["largest"], held.largest)
                if before is not None and after is not None:
                    mine["resident"] = max(mine["resident"] or 0, after - before)
        shards = sum(tensor.numel() * tensor.element_size() for tensor in rank_tensors(model, optimizer, average)
                     if tensor is not None)
        torch.save({"figures": figures, "rank bytes": shards}, f"{results}.{rank}")
    finally:
        dist.destroy_process_group()


def _all_done(seconds: float) -> float:
    """The seconds until the last rank got there (each rank's own, then the most)."""
    mine = torch.tensor([seconds])
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(arch: str, processes: int, ema_decay: float, repeats: int, folder: Path) -> list[dict]:
    """Each rank's figures (see the module's docstring)."""
    results = folder / "results"
    # glibc's allocator then maps every tensor of 64 KB or more on its own and gives it back when it
    # is freed: a save's peak shows in the resident memory, not hidden by what earlier ones freed.
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by each rank's process as it starts
    try:
        mp.start_processes(_rank, args=(processes, _free_port(), arch, ema_decay, repeats, str(folder), str(results)),
                           nprocs=processes, start_method="spawn")
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return [torch.load(f"{results}.{rank}", weights_only=False) for rank in range(processes)]


def table(ranks: list[dict]) -> str:
    """The figures as a markdown table, one row per way, the memory of each rank."""
    def mb(value):
        return "n/a" if value is None else f"{value / 1e6:.0f}"
    head = ["way", "holds training up (s)", "written after (s)"]
    head += [f"rank {r}: tensors made (MB)" for r in range(len(ranks))]
    head += [f"rank {r}: peak RSS growth (MB)" for r in range(len(ranks))]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for way in WAYS:
        first = ranks[0]["figures"][way]
        row = [way, f"{statistics.median(first['blocks']):.2f}", f"{statistics.median(first['written']):.2f}"]
        row += [mb(rank["figures"][way]["held"]) for rank in ranks]
        row += [mb(rank["figures"][way]["resident"]) for rank in ranks]
        lines.append("| " + " | ".join(row) + " |")
    shards = ", ".join(f"rank {r} {mb(rank['rank bytes'])} MB" for r, rank in enumerate(ranks))
    return "\n".join(lines) + f"\n\nEach rank's shards of the weights, gradients' room, optimizer state and average: {shards}."


@dataclasses.dataclass(kw_only=True)
class Options:
    """checkpoint_cost's flags, as parse_args returns them."""

    arch: str
    processes: int
    ema_decay: float
    repeats: int
    dir: str | None


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--arch", default="vgg16", help="the model (any of torchvision's classifiers)")
    parser.add_argument("--processes", type=processes_count, default=2, help="gloo ranks on this machine")
    parser.add_argument("--ema-decay", type=open_fraction, default=0.999, help="the weight average's decay")
    parser.add_argument("--repeats", type=between(1, 1000), default=3, help="saves of each way (the median is shown)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary "
                                                    "folder); a new or empty folder")
    return Options(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.dir is not None and Path(args.dir).exists() and (not Path(args.dir).is_dir() or any(Path(args.dir).iterdir())):
        raise UserError(f"--dir {args.dir} is not a new or empty folder: name one (the checkpoints are written "
                        "there and removed after)")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="checkpoint-cost-") as folder:
        print(f"checkpoint cost: {args.arch}, {args.processes} gloo ranks on {os.cpu_count()} CPUs, "
              f"{args.repeats} saves of each way", flush=True)
        ranks = measure(args.arch, args.processes, args.ema_decay, args.repeats, Path(folder))
    print(table(ranks))


if __name__ == "__main__":
    exit_on_error(main)
