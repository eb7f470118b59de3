"""The CUDA-only branches of src/, run on the CPU with the device faked at the boundary (conftest's
cuda_calls: torch.cuda's per-thread current device, set_device and events, each call recorded with
the thread and device it was made on; tensors that say they are on a GPU; pinned allocations made
plain). `make test-gpu` runs them on a GPU.

- The threads of ours that make CUDA calls make their rank's GPU theirs first (torch.cuda.set_device,
  as torch's pin-memory thread does): a new thread's CUDA calls run on GPU 0, where each rank of a
  node would open a CUDA context of its own (hundreds of MB each): the heartbeat's thread
  (src/heartbeat.py), which asks the events of the places it tells, and the step checkpoint's
  writer thread (src/checkpoint_writer.py), which waits for the copies' event. `make test-gpu`'s
  `gpu0` check looks at each process's contexts on a machine with 2+ GPUs.
- The stop agreement under NCCL (src/stopping.py): each flag copied to pinned host memory behind
  the collective, an event recorded after the copy and asked, not waited for, at the next check.
- The feature cache's host copies (src/freeze.py): an event behind each copy, waited for before
  the copy is stored."""
import signal
import time

import numpy as np
import torch
import torch.distributed as dist

from src.checkpoint_writer import CheckpointWriter
from src.heartbeat import Heartbeat

GPU = torch.device("cuda", 1)  # a rank that is not on GPU 0


def test_the_heartbeat_thread_sets_its_ranks_gpu_before_it_asks_an_event(cuda_calls):
    """Rank 1 of 2 on GPU 1: the main thread records an event at each place (at()), the thread asks
    them (query) on GPU 1, having set it first."""
    cuda_calls.set_device(GPU)  # the script's torch.cuda.set_device(device), in the main thread
    with Heartbeat(dist.HashStore(), rank=1, world_size=2, timeout_s=600.0, device=GPU) as beat:
        for step in range(3):
            beat.at("training", 0, step, step)
        deadline = time.monotonic() + 30
        while not any(what == "query" for what, _ in cuda_calls.of("heartbeat")) and time.monotonic() < deadline:
            time.sleep(0.05)
    calls = cuda_calls.of("heartbeat")
    assert calls[0] == ("set_device", 1), calls
    assert ("query", 1) in calls and {device for _, device in calls} == {1}, calls
    assert {device for _, device in cuda_calls.of("MainThread")} == {1}


def test_a_heartbeat_given_cuda_without_an_index_uses_the_main_threads_gpu(cuda_calls):
    cuda_calls.set_device(GPU)
    with Heartbeat(dist.HashStore(), rank=1, world_size=2, timeout_s=600.0, device=torch.device("cuda")) as beat:
        beat.at("training", 0, 0, 0)
        deadline = time.monotonic() + 30
        while not cuda_calls.of("heartbeat") and time.monotonic() < deadline:
            time.sleep(0.05)
    assert cuda_calls.of("heartbeat")[0] == ("set_device", 1)


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on a GPU: the writer takes its GPU path (pinned copies, an event)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]  # a property of torch.Tensor's, faked
        return True


def test_the_checkpoint_writer_thread_sets_the_gpu_of_its_copies_before_it_waits_for_them(cuda_calls, monkeypatch,
                                                                                        tmp_path):
    """A step checkpoint of tensors on GPU 1: the copies go to pinned buffers with an event
    recorded behind them in the training thread; the writer thread sets GPU 1, then waits for that
    event, then writes the copies."""
    pinned = []
    empty_strided = torch.empty_strided

    def no_pinning(*args, pin_memory=False, **kwargs):  # the CPU cannot pin: noted, and a plain buffer
        pinned.append(pin_memory)
        return empty_strided(*args, **kwargs)
    monkeypatch.setattr(torch, "empty_strided", no_pinning)
    cuda_calls.set_device(GPU)
    weights = torch.arange(6.0).view(2, 3).as_subclass(_OnGpu)
    writer = CheckpointWriter()
    writer.save({"model": {"w": weights}, "step": 3}, tmp_path / "last.pth")
    writer.wait()
    assert pinned == [True]
    assert cuda_calls.of("checkpoint writer") == [("set_device", 1), ("synchronize", 1)]
    assert [what for what, _ in cuda_calls.of("MainThread")] == ["set_device", "Event", "record"]
    saved = torch.load(tmp_path / "last.pth")
    assert saved["step"] == 3 and torch.equal(saved["model"]["w"], torch.arange(6.0).view(2, 3))


class _GpuTorch:
    """torch as a module sees it on a GPU, on the CPU: pinned host memory and tensors made on "cuda"
    are plain CPU tensors, each request noted (what it asked for); the rest is torch's (torch.cuda:
    cuda_calls's stand-in)."""

    def __init__(self):
        self.asked: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        return getattr(torch, name)

    def zeros(self, *args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        self.asked.append(("zeros", "pinned" if pin_memory else "pageable"))
        return torch.zeros(*args, **kwargs)

    def full(self, *args, device=None, **kwargs) -> torch.Tensor:
        self.asked.append(("full", str(device)))
        return torch.full(*args, **kwargs)


class _Work:
    def wait(self) -> None:
        pass


def test_the_stop_agreement_under_nccl_reads_each_flag_from_pinned_memory_behind_an_event(cuda_calls, monkeypatch,
                                                                                         stop_signals):
    """Two ranks over NCCL (the collective faked: rank 1 got SIGTERM): the two pinned host buffers
    made once, at the start; each check every 4 steps puts this rank's flag on the GPU, starts the
    all-reduce, copies its result to a pinned buffer and records an event behind the copy; the
    check 4 steps later asks that event (query, no wait) and reads the buffer: every rank stops
    after step 8 on rank 1's flag, without a wait."""
    import src.stopping as stopping
    fake = _GpuTorch()
    monkeypatch.setattr(stopping, "torch", fake)
    monkeypatch.setattr(stopping.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(stopping.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(stopping.dist, "get_backend", lambda group=None: "nccl")

    def all_reduce(tensor, op=None, async_op=False):
        tensor.fill_(float(signal.SIGTERM))  # MAX with rank 1's flag
        return _Work()
    monkeypatch.setattr(stopping.dist, "all_reduce", all_reduce)
    with stopping.StopSignals() as signals:
        assert signals.on_gpu and fake.asked == [("zeros", "pinned")] * 2
        agreed = [signals.agreed_at(step) for step in range(1, 9)]
    assert agreed == [False] * 7 + [True] and signals.agreed == signal.SIGTERM and signals.waits == 0
    assert fake.asked[2:] == [("full", "cuda")] * 2
    assert [what for what, _ in cuda_calls.of("MainThread")] == ["Event", "record", "query", "Event", "record"]


def test_the_feature_caches_copy_is_stored_after_its_event(cuda_calls):
    """A batch of backbone outputs on a GPU: copied to the host without waiting, an event recorded
    behind the copy; the store waits for that event before it reads the copy."""
    from src.freeze import _store, _to_host
    outputs = torch.arange(6.0).view(2, 3).as_subclass(_OnGpu)
    copy = _to_host(outputs)
    array = np.zeros((4, 3), dtype=np.float32)
    _store(array, copy, 1)
    assert [what for what, _ in cuda_calls.of("MainThread")] == ["Event", "record", "synchronize"]
    assert array.tolist() == [[0, 0, 0], [0, 1, 2], [3, 4, 5], [0, 0, 0]]
