"""--sync-bn (src/batch_norm.py): batch norm over every process's samples. The layer (on a CPU: the
code CUDA runs, with float64 stand-ins for torch's CUDA-only kernels) on two real gloo ranks
against F.batch_norm of the whole batch, with no host read in its forward or backward and
compiled in one graph; then ResNet-18 trained by two DDP, FSDP or accelerate processes with
--sync-bn ends where train_single.py at the doubled batch ends, and without it does not.

The runs are in float64 (the FLOAT64 test hook): a batch norm model that learns fast amplifies
last-bit differences (the order of float sums, which differs between modes) from step to step
wherever a max-pool's two largest inputs are within a rounding of each other, and in float32 the
modes end up to 1e-2 of `far` apart whether batch norm is synchronised or not; in float64 a
last-bit difference is 1e-16 and cannot flip a max-pool."""
import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from conftest import LEARN, TOLERANCE, VAL, assert_same_run, distance, fails_in_process, last_model
from test_gpu_on_cpu_host_syncs import HostReads, HostWaits, _ReadsInBackward

import train_dp
from src.batch_norm import SyncedBatchNorm, sync_batch_norm, synced_batch_norm

B = 10
RESNET = [*LEARN, *VAL, "--workers", "0", "--epochs", "1"]
FLOAT64 = {"FLOAT64": "1"}


U = 2.0 ** -24  # float32's unit roundoff: one rounding of a value v is off by at most U |v|
EPS64 = torch.finfo(torch.float64).eps
C, STEPS = 3, 2
WEIGHT, BIAS = [0.5, 1.0, 2.0], [0.1, -0.2, 0.3]
# (momentum, the samples of rank 0 and of rank 1): every other sample, as the DDP sampler deals
# them; and momentum=None (a cumulative average) with ranks of 3 and 5 samples, which only each
# rank's own count weights right.
CASES = {"every other": (0.1, [[0, 2, 4, 6], [1, 3, 5, 7]]), "3 and 5, cumulative": (None, [[0, 1, 2], [3, 4, 5, 6, 7]])}


def _two_ranks(rank: int, port: int, x: torch.Tensor, grad: torch.Tensor, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    found = {}
    for case, (momentum, shares) in CASES.items():
        bn = sync_batch_norm(nn.Sequential(nn.BatchNorm2d(C, momentum=momentum)), torch.device("cpu"))[0].train()
        assert isinstance(bn, SyncedBatchNorm)
        with torch.no_grad():
            bn.weight.copy_(torch.tensor(WEIGHT))
            bn.bias.copy_(torch.tensor(BIAS))
        steps, reads, waits = [], HostReads(), HostWaits()
        for step in range(STEPS):
            mine = x[step][shares[rank]].clone().requires_grad_()
            with waits, reads:
                y = bn(mine)
                y.backward(grad[step][shares[rank]])
            for p in bn.parameters():
                dist.all_reduce(p.grad)  # as DDP sums the ranks' gradients (it then averages: the loss is per rank)
            steps.append({"y": y.detach(), "dx": mine.grad, "dw": bn.weight.grad.clone(), "db": bn.bias.grad.clone()})
            bn.zero_grad()
        found[case] = {"steps": steps, "mean": bn.running_mean, "var": bn.running_var, "reads": reads.calls + waits.calls}
    control = HostReads()
    with HostWaits(), control:
        _ReadsInBackward.apply(torch.ones(2, requires_grad=True)).sum().backward()
    torch.save({"cases": found, "control": control.calls, "compiled": _compiled(x[0][CASES["every other"][1][rank]])},
               f"{out}.{rank}")
    dist.destroy_process_group()


def _compiled(x: torch.Tensor) -> dict:
    """The layer compiled whole (fullgraph=True: a graph break is an error) against eager: its
    output and input gradient, or the error. aot_eager traces the forward and the backward as
    inductor would, without a C++ compiler."""
    bn = sync_batch_norm(nn.Sequential(nn.BatchNorm2d(C)), torch.device("cpu"))[0].train()
    ends = {}
    try:
        for name in ("eager", "compiled"):
            layer = copy.deepcopy(bn)
            run = torch.compile(layer, backend="aot_eager", fullgraph=True) if name == "compiled" else layer
            mine = x.clone().requires_grad_()
            y = run(mine)
            y.backward(torch.arange(y.numel(), dtype=y.dtype).sin().view_as(y))  # not constant: its dx is not 0
            ends[name] = (y.detach(), mine.grad, layer.running_var.clone())
    except Exception as error:  # reported by the test
        return {"error": f"{type(error).__name__}: {error}"[:2000]}
    return {"error": None, "equal": [torch.equal(a, b) for a, b in zip(ends["eager"], ends["compiled"])]}


def _whole_batch(x: torch.Tensor, grad: torch.Tensor, momentum: float | None) -> tuple[list[dict], dict]:
    """F.batch_norm of the whole batch at each step, in float64 (another implementation: torch's
    CPU batch norm): its outputs, gradients, running statistics, and each one's magnitude, the sum
    of the absolute values of the terms it is made of (for the bounds)."""
    running = {"mean": torch.zeros(C, dtype=torch.float64), "var": torch.ones(C, dtype=torch.float64)}
    scale = {"mean": torch.zeros(C, dtype=torch.float64), "var": torch.zeros(C, dtype=torch.float64)}
    steps, shape = [], [1, -1, 1, 1]
    for step in range(STEPS):
        xs, dy = x[step].double().requires_grad_(), grad[step].double()
        # The layer's float32 weight and bias (0.1 is not a float32), exactly.
        w = torch.tensor(WEIGHT).double().requires_grad_()
        b = torch.tensor(BIAS).double().requires_grad_()
        factor = momentum if momentum is not None else 1 / (step + 1)
        previous = {name: value.clone() for name, value in running.items()}
        y = F.batch_norm(xs, running["mean"], running["var"], w, b, training=True, momentum=factor, eps=1e-5)
        y.backward(dy)
        mean, var = xs.detach().mean((0, 2, 3)), xs.detach().var((0, 2, 3), unbiased=False)
        invstd = (var + 1e-5).rsqrt()
        xhat = (xs.detach() - mean.view(shape)) * invstd.view(shape)
        count = xs.numel() // C
        for name, batch in (("mean", mean), ("var", var * count / (count - 1))):
            scale[name] += previous[name].abs() + batch.abs()
        steps.append({"y": y.detach(), "dx": xs.grad, "dw": w.grad, "db": b.grad, "magnitude": {
            "y": xhat.abs() * w.detach().abs().view(shape) + b.detach().abs().view(shape),
            "dx": (dy.abs() + dy.abs().mean((0, 2, 3)).view(shape)
                   + xhat.abs() * (dy * xhat).abs().mean((0, 2, 3)).view(shape)) * (invstd * w.detach().abs()).view(shape),
            "dw": (dy * xhat).abs().sum((0, 2, 3)), "db": dy.abs().sum((0, 2, 3))}})
    return steps, {"mean": running["mean"], "var": running["var"], "magnitude": scale}


# Roundings to float32 on the way to each value, beyond float64's (at most n EPS64 of the
# magnitude for a sum of n terms): the output and the input's gradient, computed in float64,
# are rounded once; a weight's or bias's gradient once on each rank and once in the ranks'
# float32 sum; a running statistic at most 4 times a step (the float64 update rounded to the
# float32 buffer; with momentum=None that, and lerp's subtraction, product and sum in float32).
ROUNDINGS = {"y": 1, "dx": 1, "dw": 2, "db": 2, "mean": 4 * STEPS, "var": 4 * STEPS}


def _assert_within(name: str, got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, terms: int) -> None:
    bound = (ROUNDINGS[name] * U + terms * EPS64) * magnitude
    off = (got.double() - expected).abs()
    assert (off <= bound).all(), f"{name}: {(off / bound).max():.3g} of its bound off"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """_two_ranks on two gloo processes: the batches, the gradients, and what each rank found."""
    torch.manual_seed(1)
    x, grad = torch.randn(STEPS, 8, C, 5, 5) * 3 + 1, torch.randn(STEPS, 8, C, 5, 5)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path_factory.mktemp("two-ranks") / "r"
    # spawn: no fork of a process that holds torch's threads
    processes = [mp.get_context("spawn").Process(target=_two_ranks, args=(r, port, x, grad, str(out))) for r in range(2)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(300)
        assert p.exitcode == 0
    return x, grad, [torch.load(f"{out}.{rank}") for rank in range(2)]


def test_two_ranks_normalise_as_one_batch_norm_of_the_whole_batch(two_ranks):
    """Outputs, input gradients, weight and bias gradients and running statistics of two gloo
    ranks, at two steps, equal F.batch_norm of the whole batch in float64 within the float32
    roundings on the way (ROUNDINGS), with ranks of equal and of unequal sizes and with
    momentum=None."""
    x, grad, found = two_ranks
    for rank, got in enumerate(found):
        for case, (momentum, shares) in CASES.items():
            steps, running = _whole_batch(x, grad, momentum)
            mine = got["cases"][case]
            terms = x[0].numel() // C
            for step, expected in enumerate(steps):
                for name in ("y", "dx"):
                    _assert_within(name, mine["steps"][step][name], expected[name][shares[rank]],
                                   expected["magnitude"][name][shares[rank]], terms)
                for name in ("dw", "db"):
                    _assert_within(name, mine["steps"][step][name], expected[name], expected["magnitude"][name], terms)
            for name in ("mean", "var"):
                _assert_within(name, mine[name], running[name], running["magnitude"][name], terms)
    # What the synchronisation changes: a rank normalising its share alone is far outside the bounds.
    alone = F.batch_norm(x[0, 0::2], None, None, training=True)
    whole = F.batch_norm(x[0], None, None, training=True)[0::2]
    assert (alone - whole).abs().max() > 1e4 * U * whole.abs().max()


def test_nothing_in_the_layer_reads_a_tensor_on_the_host(two_ranks):
    """No host read in the forward or the backward, at either step, with momentum=None too (its
    1 / num_batches_tracked stays a tensor): HostReads sees what would make the host wait for a
    GPU (its control, reads in a backward, shows it sees them), HostWaits tensors built from
    Python values (in the forward: it cannot see a backward)."""
    for got in two_ranks[2]:
        assert got["control"] == ["aten._local_scalar_dense.default"] * 2 + ["aten.index.Tensor"]
        for case in CASES:
            assert got["cases"][case]["reads"] == [], case


def test_the_layer_compiles_in_one_graph(two_ranks):
    """torch.compile(fullgraph=True) takes the layer, its collectives and its backward whole (torch's
    SyncBatchNorm breaks the graph at its mask), and computes what eager does."""
    for got in two_ranks[2]:
        assert got["compiled"]["error"] is None, got["compiled"]["error"]
        assert got["compiled"]["equal"] == [True, True, True]


def test_an_empty_micro_batch_is_refused_before_any_collective():
    bn = sync_batch_norm(nn.Sequential(nn.BatchNorm2d(C)), torch.device("cpu"))[0].train()
    with pytest.raises(ValueError, match="--sync-bn: a rank's micro-batch is empty"):
        synced_batch_norm(bn, torch.zeros(0, C, 5, 5))


def test_the_cuda_path_calls_torchs_kernels_and_the_cpu_path_the_same_steps():
    """On CUDA the layer runs torch's own five kernels (those of nn.SyncBatchNorm); on a CPU, where
    torch has none of them, functions with their signatures (the test above runs them)."""
    from src.batch_norm import CPU_KERNELS, CUDA_KERNELS, kernels_for
    assert kernels_for(torch.device("cuda", 0)) == (
        torch.batch_norm_stats, torch.batch_norm_gather_stats_with_counts, torch.batch_norm_elemt,
        torch.batch_norm_backward_reduce, torch.batch_norm_backward_elemt)
    assert kernels_for(torch.device("cpu")) is CPU_KERNELS and CPU_KERNELS != CUDA_KERNELS


@pytest.fixture(scope="module")
def reference(runs):
    """train_single.py, ResNet-18 at the doubled batch (2 x B), float64."""
    return runs("single", *RESNET, "--batch-size", str(2 * B), env=FLOAT64, kept="file")[0]


@pytest.fixture(scope="module")
def far(runs, reference):
    """The reference against a global batch of B."""
    other = runs("single", *RESNET, "--batch-size", str(B), env=FLOAT64, kept="file")[0]
    return distance(last_model(other), last_model(reference))


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "accelerate"])
def test_resnet18_with_sync_bn_ends_where_one_process_ends(mode, runs, reference, far):
    out, result = runs(mode, *RESNET, "--batch-size", str(B), "--sync-bn", env=FLOAT64, kept="test")
    assert "on 2 x cpu" in result.stdout
    assert_same_run(out, reference, far)


def test_without_sync_bn_each_process_normalises_its_own_share(runs, reference, far):
    """The distance that --sync-bn removes."""
    out = runs("ddp", *RESNET, "--batch-size", str(B), env=FLOAT64, kept="test")[0]
    assert distance(last_model(out), last_model(reference)) / far > 20 * TOLERANCE


def test_under_accumulate_batch_norm_normalises_each_micro_batch(runs, reference, far):
    """Two processes of 5 images, 2 micro-batches a step: batch norm sees micro-batches of 10, as
    train_single.py --batch-size 10 --accumulate 2 does, not the step's 20."""
    micro = runs("single", *RESNET, "--batch-size", str(B), "--accumulate", "2", env=FLOAT64, kept="test")[0]
    out = runs("ddp", *RESNET, "--batch-size", str(B // 2), "--accumulate", "2", "--sync-bn", env=FLOAT64,
               kept="test")[0]
    assert_same_run(out, micro, far)
    assert distance(last_model(micro), last_model(reference)) / far > 20 * TOLERANCE


def test_data_parallel_refuses_sync_bn(small_data, tmp_path, monkeypatch, capsys):
    # an --arch with batch norm: VGG16's --sync-bn is refused for having none, before the mode is asked
    fails_in_process(train_dp.main, ["--data-dir", str(small_data), "--arch", "resnet18", "--weights", "none", "--sync-bn",
                                     "--checkpoint", str(tmp_path / "b.pth")],
                     monkeypatch, capsys, "--sync-bn: DataParallel runs its replicas as threads of one process")
