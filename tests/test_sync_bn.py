"""--sync-bn (src/batch_norm.py): batch norm over every process's samples. The CPU layer against
torch's own batch norm of the whole batch, on two real gloo ranks; then ResNet-18 trained by two
DDP, FSDP or accelerate processes with --sync-bn ends where train_single.py at the doubled batch
ends, and without it does not.

The runs are in float64 (the FLOAT64 test hook): a batch norm model that learns fast amplifies
last-bit differences (the order of float sums, which differs between modes) from step to step
wherever a max-pool's two largest inputs are within a rounding of each other, and in float32 the
modes end up to 1e-2 of `far` apart whether batch norm is synchronised or not; in float64 a
last-bit difference is 1e-16 and cannot flip a max-pool."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from conftest import LEARN, TOLERANCE, VAL, assert_same_run, distance, fails_in_process, last_model

import train_dp
from src.batch_norm import CpuSyncBatchNorm, sync_batch_norm

B = 10
RESNET = [*LEARN, *VAL, "--workers", "0", "--epochs", "1"]
FLOAT64 = {"FLOAT64": "1"}


def _two_ranks(rank: int, port: int, x: torch.Tensor, grad: torch.Tensor, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    bn = sync_batch_norm(nn.Sequential(nn.BatchNorm2d(3)), torch.device("cpu"))[0].train()
    assert isinstance(bn, CpuSyncBatchNorm)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        bn.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    mine = x[rank::2].clone().requires_grad_()  # every other sample, as the DDP sampler deals them
    y = bn(mine)
    y.backward(grad[rank::2])
    for p in bn.parameters():
        dist.all_reduce(p.grad)  # as DDP sums the ranks' gradients (it then averages: the loss is per rank)
    torch.save({"y": y.detach(), "dx": mine.grad, "dw": bn.weight.grad, "db": bn.bias.grad,
                "mean": bn.running_mean, "var": bn.running_var}, f"{out}.{rank}")
    dist.destroy_process_group()


def test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch(tmp_path):
    """Outputs, input gradients, weight gradients and running statistics of two gloo ranks equal
    torch's BatchNorm2d on the whole batch (another implementation), to float32 rounding."""
    torch.manual_seed(1)
    x, grad = torch.randn(8, 3, 5, 5) * 3 + 1, torch.randn(8, 3, 5, 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.get_context("spawn").Process  # noqa: B018 (spawn: no fork of a process that holds torch's threads)
    processes = [mp.get_context("spawn").Process(target=_two_ranks, args=(r, port, x, grad, str(tmp_path / "r")))
                 for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
        assert p.exitcode == 0
    whole = nn.BatchNorm2d(3).train()
    with torch.no_grad():
        whole.weight.copy_(torch.tensor([0.5, 1.0, 2.0]))
        whole.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
    xw = x.clone().requires_grad_()
    y = whole(xw)
    y.backward(grad)
    for rank in range(2):
        got = torch.load(f"{tmp_path / 'r'}.{rank}")
        close = dict(rtol=1e-5, atol=1e-6)
        assert torch.allclose(got["y"], y[rank::2].detach(), **close)
        assert torch.allclose(got["dx"], xw.grad[rank::2], **close)
        assert torch.allclose(got["dw"], whole.weight.grad, **close)
        assert torch.allclose(got["db"], whole.bias.grad, **close)
        assert torch.allclose(got["mean"], whole.running_mean, **close)
        assert torch.allclose(got["var"], whole.running_var, **close)
    assert not torch.allclose(F.batch_norm(x[0::2], None, None, training=True), whole(x)[0::2].detach(), atol=1e-3)


@pytest.fixture(scope="module")
def reference(runs):
    """train_single.py, ResNet-18 at the doubled batch (2 x B), float64."""
    return runs("single", *RESNET, "--batch-size", str(2 * B), env=FLOAT64)[0]


@pytest.fixture(scope="module")
def far(runs, reference):
    """The reference against a global batch of B."""
    return distance(last_model(runs("single", *RESNET, "--batch-size", str(B), env=FLOAT64)[0]), last_model(reference))


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "accelerate"])
def test_resnet18_with_sync_bn_ends_where_one_process_ends(mode, runs, reference, far):
    out, result = runs(mode, *RESNET, "--batch-size", str(B), "--sync-bn", env=FLOAT64)
    assert "on 2 x cpu" in result.stdout
    assert_same_run(out, reference, far)


def test_without_sync_bn_each_process_normalises_its_own_share(runs, reference, far):
    """The distance that --sync-bn removes."""
    out = runs("ddp", *RESNET, "--batch-size", str(B), env=FLOAT64)[0]
    assert distance(last_model(out), last_model(reference)) / far > 20 * TOLERANCE


def test_under_accumulate_batch_norm_normalises_each_micro_batch(runs, reference, far):
    """Two processes of 5 images, 2 micro-batches a step: batch norm sees micro-batches of 10, as
    train_single.py --batch-size 10 --accumulate 2 does, not the step's 20."""
    micro = runs("single", *RESNET, "--batch-size", str(B), "--accumulate", "2", env=FLOAT64)[0]
    out = runs("ddp", *RESNET, "--batch-size", str(B // 2), "--accumulate", "2", "--sync-bn", env=FLOAT64)[0]
    assert_same_run(out, micro, far)
    assert distance(last_model(micro), last_model(reference)) / far > 20 * TOLERANCE


def test_data_parallel_refuses_sync_bn(small_data, tmp_path, monkeypatch, capsys):
    fails_in_process(train_dp.main, ["--data-dir", str(small_data), "--sync-bn", "--checkpoint", str(tmp_path / "b.pth")],
                     monkeypatch, capsys, "--sync-bn: DataParallel runs its replicas as threads of one process")
