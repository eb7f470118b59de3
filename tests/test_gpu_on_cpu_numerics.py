"""--deterministic's numerics, checked on the CPU: TF32 and nondeterministic kernels off, every
script passes the flag on (also against accelerate's TF32 for dynamo), and the benchmark's
ceilings set up the numerics as a run does."""
import multiprocessing
import os

import pytest
import torch
from conftest import Asked

import train_accelerate
import train_ddp
import train_dp
import train_single
from src.recipe import make_optimizer


def _numerics():
    backends = torch.backends
    return [torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
            backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic,
            os.environ.get("CUBLAS_WORKSPACE_CONFIG")]


def test_deterministic_switches_off_tf32_and_nondeterministic_kernels(restore_numerics):
    from src.devices import configure_numerics
    configure_numerics(False)
    assert _numerics() == [False, True, False, True, False, None]  # torch's defaults, and benchmark
    configure_numerics(True)
    assert _numerics() == [True, False, False, False, True, ":4096:8"]


@pytest.mark.parametrize("script", [train_single, train_dp, train_ddp, train_accelerate])
def test_the_scripts_pass_deterministic_on(script, monkeypatch):
    """Each script hands --deterministic to configure_numerics before it trains (accelerate: just
    after Accelerator(), which turns TF32 on for a dynamo backend)."""
    def configure(deterministic):
        raise Asked(deterministic)
    monkeypatch.setattr("src.devices.configure_numerics", configure)
    monkeypatch.setattr(train_accelerate, "configure_numerics", configure)
    for flags, expected in ((["--deterministic"], True), ([], False)):
        with pytest.raises(Asked) as asked:
            script.main(flags)
        assert asked.value.args == (expected,)


def test_deterministic_survives_accelerates_tf32_for_dynamo(monkeypatch, restore_numerics):
    """accelerate turns TF32 matmuls on in Accelerator() when a dynamo backend is set (CUDA only):
    a fake does it here, and --deterministic must still end with it off."""
    from accelerate.state import AcceleratorState

    class DynamoAccelerator(train_accelerate.Accelerator):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            torch.backends.cuda.matmul.allow_tf32 = True  # accelerate/state.py with a dynamo backend on CUDA

    def stop(args):
        raise Asked(torch.backends.cuda.matmul.allow_tf32)
    monkeypatch.setattr(train_accelerate, "Accelerator", DynamoAccelerator)
    monkeypatch.setattr(train_accelerate, "lock_outputs", stop)
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        with pytest.raises(Asked) as asked:
            train_accelerate.main(["--deterministic"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert asked.value.args == (False,)


def test_the_benchmarks_ceilings_run_as_the_runs_do(monkeypatch, restore_numerics):
    """The bare step bounds train_single.py: the same (fused, on a GPU) optimizer, and the spawned
    process sets cudnn.benchmark as a script does. AS_ON_GPU=1 takes the GPU's branch."""
    from src.tools import benchmark
    made = []
    monkeypatch.setattr(benchmark, "make_optimizer", lambda *a: made.append(make_optimizer(*a)) or made[-1])
    monkeypatch.setenv("AS_ON_GPU", "1")
    args = benchmark.parse_args(["--arch", "squeezenet1_1", "--image-size", "32", "--steps", "1"])
    assert benchmark.bare_step(args, torch.device("cpu"), 2, True) > 0
    assert [opt.defaults["fused"] for opt in made] == [True] and made[0].defaults["momentum"] == 0.9
    torch.backends.cudnn.benchmark = False
    benchmark._start_as_a_run()
    multiprocessing.set_start_method(None, force=True)
    assert torch.backends.cudnn.benchmark
