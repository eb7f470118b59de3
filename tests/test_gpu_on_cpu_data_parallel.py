"""DataParallel's GPU-only defects, checked on the CPU where their mechanism runs there: each
replica's autocast dtype (threads), channels-last weights after the broadcast, every GPU's own
dropout masks, and the refusals made before training (--compile on 2+ GPUs, a GPU without bfloat16)."""
import copy
import importlib
import threading

import torch
import torch.nn as nn
from conftest import (
    fails_in_process,
    outputs,
)

import src.data_parallel as data_parallel
import train_dp
from src.dropout import sample_key, set_samples
from src.models import build_model
from src.seeds import seed_epoch


def test_data_parallel_replicas_autocast_to_the_dtype_asked_for():
    """DataParallel runs each replica in a thread that re-enters autocast without a dtype
    (parallel_apply); the dtype is per thread. Here the thread's default is set to float16, as on
    CUDA, and --amp bf16 asked for bfloat16 in the main thread."""
    model = nn.Linear(4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        replica = data_parallel.AutocastReplica(copy.deepcopy(model), "cpu")  # made where DataParallel makes it
    seen = {}

    def replica_thread():  # what torch/nn/parallel/parallel_apply.py's _worker does
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.amp.autocast("cpu", enabled=True):
            seen["plain"] = model(torch.ones(2, 4)).dtype
            seen["ours"] = replica(torch.ones(2, 4)).dtype
    thread = threading.Thread(target=replica_thread)
    thread.start()
    thread.join()
    assert seen == {"plain": torch.float16, "ours": torch.bfloat16}


def test_data_parallel_replicas_without_amp_run_in_float32():
    """Without --amp the caller does not autocast, and parallel_apply enters autocast disabled in
    each replica's thread (whose default dtype is float16, as on CUDA): the replica stays float32."""
    model = nn.Linear(4, 4)
    replica = data_parallel.AutocastReplica(copy.deepcopy(model), "cpu")  # made outside autocast
    seen = {}

    def replica_thread():
        torch.set_autocast_dtype("cpu", torch.float16)
        with torch.amp.autocast("cpu", enabled=False):  # parallel_apply: enabled as in the caller
            seen["ours"] = replica(torch.ones(2, 4)).dtype
    thread = threading.Thread(target=replica_thread)
    thread.start()
    thread.join()
    assert seen == {"ours": torch.float32}


def test_data_parallel_wraps_every_replica(monkeypatch):
    monkeypatch.setattr(nn.DataParallel, "replicate",
                        lambda self, module, device_ids: [copy.deepcopy(module) for _ in device_ids])
    dp = data_parallel.AutocastDataParallel(nn.Linear(2, 2))
    dp.src_device_obj = torch.device("cpu")  # what DataParallel sets when it has GPUs
    replicas = dp.replicate(dp.module, [0, 1])
    assert [type(r) for r in replicas] == [data_parallel.AutocastReplica] * 2


def test_data_parallel_replicas_keep_channels_last_weights(monkeypatch):
    """Broadcast hands GPUs 1..N their weights as views of one flat buffer, NCHW. torch's own
    replicate() runs here, with the broadcast done by the same flatten and unflatten on the CPU."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def broadcast(tensors, devices, detach=False):  # comm.broadcast_coalesced's layout
        if not tensors:
            return []
        flat = _flatten_dense_tensors([t.detach() if detach else t for t in tensors])
        return [list(tensors)] + [list(_unflatten_dense_tensors(flat, tensors)) for _ in devices[1:]]
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.replicate"), "_broadcast_coalesced_reshape", broadcast)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3)).to(memory_format=torch.channels_last)
    dp = data_parallel.AutocastDataParallel(model)
    dp.src_device_obj = torch.device("cpu")  # what DataParallel sets when it has GPUs
    replicas = dp.replicate(model, [0, 1, 2])
    assert [r.replica[i].weight.is_contiguous(memory_format=torch.channels_last)
            for r in replicas for i in (0, 2)] == [True] * 6
    replicas[2](torch.ones(1, 3, 8, 8)).sum().backward()  # the gradients reach the module's weights
    assert model[0].weight.grad is not None and model[2].weight.grad.abs().sum() > 0


def test_each_replica_draws_the_masks_of_its_own_samples(monkeypatch):
    """The scatter gives replica i its share of the batch; it must draw those samples' masks, the
    ones the whole model draws for them in one process. torch's own replicate() runs here, with
    the broadcast and the scatter done on the CPU."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    def broadcast(tensors, devices, detach=False):
        if not tensors:
            return []
        flat = _flatten_dense_tensors([t.detach() if detach else t for t in tensors])
        return [list(tensors)] + [list(_unflatten_dense_tensors(flat, tensors)) for _ in devices[1:]]
    monkeypatch.setattr(importlib.import_module("torch.nn.parallel.replicate"), "_broadcast_coalesced_reshape", broadcast)
    monkeypatch.setattr(nn.DataParallel, "scatter",
                        lambda self, inputs, kwargs, device_ids: (((inputs[0][:2],), (inputs[0][2:],)), ({}, {})))
    model = build_model("squeezenet1_1", "none").train()
    images = torch.randn(5, 3, 64, 64)
    keys = torch.tensor([sample_key(42, 1, i) for i in range(5)])
    set_samples(model, keys)
    whole = model(images)
    dp = data_parallel.AutocastDataParallel(model)
    dp.src_device_obj = torch.device("cpu")  # what DataParallel sets when it has GPUs
    inputs, _ = dp.scatter((images,), {}, [0, 1])
    replicas = dp.replicate(model, [0, 1])
    assert dp.shares == [2, 3]
    assert [r.replica.classifier[0].samples.tolist() for r in replicas] == [keys[:2].tolist(), keys[2:].tolist()]
    assert torch.allclose(torch.cat([r(*args) for r, args in zip(replicas, inputs)]), whole, atol=1e-6)
    # Validation after it: a last batch of 3 while the keys are still the training batch's 5 (the
    # replicas of an eval forward draw nothing, and must not split those keys over its shares).
    model.eval()
    inputs, _ = dp.scatter((images[:3],), {}, [0, 1])
    replicas = dp.replicate(model, [0, 1])
    assert dp.shares == [2, 1]
    assert torch.allclose(torch.cat([r(*args) for r, args in zip(replicas, inputs)]), model(images[:3]), atol=1e-6)


def test_each_gpu_draws_its_own_dropout_masks(monkeypatch):
    """DataParallel's replicas draw dropout from their own GPU's generator; torch.manual_seed gives
    every GPU the same seed, so every replica drew the same mask. Two CPU generators stand in."""
    generators = (torch.Generator(), torch.Generator())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    with torch.random.fork_rng(devices=[]):
        masks = []
        for epoch in (0, 0, 1):
            seed_epoch(42, epoch, rank=1)
            masks.append([torch.bernoulli(torch.full((64,), 0.5), generator=g) for g in generators])
    assert not torch.equal(*masks[0])  # the two GPUs
    assert torch.equal(masks[0][1], masks[1][1])  # a function of (seed, epoch, rank, GPU)
    assert not torch.equal(masks[0][1], masks[2][1])


def test_compile_with_data_parallel_on_two_gpus_is_refused(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    fake_gpus(2)
    line = fails_in_process(train_dp.main, ["--data-dir", str(exact_data), "--compile", *outputs(tmp_path)],
                            monkeypatch, capsys, "--compile with DataParallel on 2 GPUs would compile nothing")
    assert "torchrun --nproc_per_node=2 train_ddp.py --compile" in line
    assert not tmp_path.joinpath("best.pth").exists()


def test_data_parallel_checks_bf16_on_every_gpu(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    """Each GPU runs a replica: one without bfloat16 among them is refused, not only the first."""
    fake_gpus(2)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if device in (0, None) else (7, 0))
    fails_in_process(train_dp.main, ["--data-dir", str(exact_data), "--amp", "bf16", *outputs(tmp_path)],
                     monkeypatch, capsys, "this GPU (Fake GPU) has no bfloat16 arithmetic")
