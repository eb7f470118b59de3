"""The threads of ours that make CUDA calls make their rank's GPU theirs first (torch.cuda.set_device,
as torch's pin-memory thread does): a new thread's CUDA calls run on GPU 0, where each rank of a
node would open a CUDA context of its own (hundreds of MB each). On the CPU, with torch.cuda's
current device, set_device and events faked per thread (conftest's cuda_calls): the heartbeat's
thread (src/heartbeat.py), which asks the events of the places it tells, and the step checkpoint's
writer thread (src/checkpoint_writer.py), which waits for the copies' event. `make test-gpu`'s
`gpu0` check looks at each process's contexts on a machine with 2+ GPUs."""
import time

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
