"""The hosts' limits and the multi-process setup, checked on the CPU with faked GPUs where needed:
more processes than GPUs, GPUs sharing ranks (SHARE_GPUS=1), bfloat16, /dev/shm per node, a
container's CPU quota, --dist-timeout for the process group and the cache wait, and caches shared
by nodes."""
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs
from conftest import (
    EXACT,
    HOOKS,
    LAUNCH,
    Asked,
    fails_in_process,
    outputs,
    run,
)

import src.process_group as process_group
import train_accelerate
import train_ddp
import train_single
from src.cli import parse_args
from src.devices import available_cpus, check_gpus, check_shared_memory, default_workers, training_device
from src.errors import UserError
from src.loaders import labelled_images
from src.tools import predict
from src.tools.synthetic import write_dataset


def test_more_processes_than_gpus_is_one_line(exact_data, tmp_path):
    result = run([*LAUNCH["ddp"](), "--data-dir", str(exact_data), *outputs(tmp_path)],
                 env={"PYTHONPATH": HOOKS, "FAKE_GPUS": "1"})
    assert result.returncode != 0
    assert result.stderr.count("error: 2 processes on this node but only 1 GPU(s): run torchrun "
                               "--nproc_per_node=1, or set CUDA_VISIBLE_DEVICES= to train on the CPU") == 1
    assert "exitcode  : 2" in result.stderr  # torchrun's summary (with a traceback of its own)


@pytest.mark.parametrize("script, flags", [(train_single, ["--amp", "bf16"]), (train_accelerate, [])])
def test_bf16_on_a_gpu_without_it_is_one_line(script, flags, exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    fake_gpus(1, bf16=False)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what accelerate launch --mixed_precision sets
    fails_in_process(script.main, ["--data-dir", str(exact_data), *flags, *outputs(tmp_path)], monkeypatch, capsys,
                     "this GPU (Fake GPU) has no bfloat16 arithmetic (Ampere and later have it)")


def test_accelerate_with_more_processes_than_gpus_is_one_line(exact_data, tmp_path, fake_gpus, monkeypatch, capsys):
    """accelerate itself would fail later with NCCL's "Duplicate GPU detected"."""
    fake_gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    fails_in_process(train_accelerate.main, ["--data-dir", str(exact_data), *outputs(tmp_path)], monkeypatch,
                     capsys, "2 processes on this node but only 1 GPU(s): run accelerate launch --num_processes 1")


def test_several_processes_may_share_a_gpu_when_asked(fake_gpus, monkeypatch, restore_numerics, tmp_path):
    """SHARE_GPUS=1 (make test-gpu on one GPU): two ranks on GPU 0 over gloo; NCCL refuses that."""
    fake_gpus(1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(UserError, match="2 processes on this node but only 1 GPU"):
        check_gpus(2)
    monkeypatch.setenv("SHARE_GPUS", "1")
    check_gpus(2)
    assert training_device(False, None, local_rank=1) == torch.device("cuda", 0)
    monkeypatch.setattr(process_group, "training_device", lambda *a: torch.device("cuda", 0))
    assert _dist_timeout_of(train_ddp, [], monkeypatch, tmp_path)["backend"] == "gloo"
    monkeypatch.delenv("SHARE_GPUS")
    assert _dist_timeout_of(train_ddp, [], monkeypatch, tmp_path)["backend"] == "nccl"


def test_a_small_dev_shm_is_one_line_before_training(tmpfs, exact_data, tmp_path, monkeypatch, capsys):
    """VGG16's batches of 50 at 224 px are 7.5 MB each: 4 workers prefetching 2 each need more
    than 64 MB (Docker's default /dev/shm); without workers nothing goes through /dev/shm."""
    small_shm = tmpfs("shm", "size=64m")
    with pytest.raises(UserError, match=f"{small_shm} has 64 MB free, but 4 loader workers need about 115 MB"):
        check_shared_memory(4, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(0, 50 * 3 * 224 * 224, small_shm)
    check_shared_memory(1, 50 * 3 * 224 * 224, small_shm)
    monkeypatch.setattr("src.devices.SHM", small_shm)
    monkeypatch.setattr("src.devices.available_cpus", lambda: 4)  # --workers 4 is not capped to this machine's CPUs
    line = fails_in_process(train_single.main, ["--data-dir", str(exact_data), *EXACT, "--image-size", "224",
                                                "--batch-size", "50", "--workers", "4", *outputs(tmp_path)],
                            monkeypatch, capsys, "--shm-size=8g")
    assert line.startswith(f"error: {small_shm} has 64 MB free, but 4 loader workers need about 115 MB")
    assert not (tmp_path / "history.json").exists()


def test_the_shared_memory_check_counts_every_process_of_the_node(monkeypatch):
    """8 processes with a loader worker each share Docker's 64 MB /dev/shm: 480 MB for batches of 15 MB."""
    monkeypatch.setattr("src.devices.shutil.disk_usage", lambda path: SimpleNamespace(free=64 * 2**20))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    with pytest.raises(UserError, match="has 64 MB free, but 8 processes x 1 loader workers need about 480 MB") as error:
        check_shared_memory(1, 15 * 2**20, Path("/"))
    assert not error.value.quiet
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(UserError) as error:
        check_shared_memory(1, 15 * 2**20, Path("/"))
    assert error.value.quiet  # rank 0 says it
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    check_shared_memory(1, 15 * 2**20, Path("/"))  # one process: 60 MB


@pytest.mark.parametrize("cpus, processes, workers", [(7, 2, 3), (8, 2, 4), (8, 1, 8), (1, 2, 1), (3, 4, 1)])
def test_each_process_of_a_node_takes_its_share_of_the_cpus_as_workers(cpus, processes, workers, monkeypatch):
    """--workers' default: the node's CPUs over its processes (torchrun's LOCAL_WORLD_SIZE),
    rounded down, at least 1: the processes of a node together start no more workers than it has
    CPUs. The training scripts' flag and predict's default."""
    monkeypatch.setattr("src.devices.available_cpus", lambda: cpus)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(processes))
    assert parse_args("", []).workers == workers
    assert default_workers() == workers


@pytest.mark.parametrize("rank, said", [("0", True), ("1", False)])
def test_the_workers_cap_is_said_by_rank_0_alone(rank, said, monkeypatch, capsys):
    """--workers above the CPUs is capped on every rank; rank 0 alone says so (one line), with
    --workers at the CPUs nothing is said."""
    monkeypatch.setattr("src.devices.available_cpus", lambda: 3)
    monkeypatch.setenv("RANK", rank)
    assert parse_args("", ["--workers", "3"]).workers == 3
    assert capsys.readouterr().err == ""
    assert parse_args("", ["--workers", "4"]).workers == 3
    assert capsys.readouterr().err == ("--workers 4 is more than the 3 CPU(s) this process may use: using 3\n"
                                       if said else "")


def test_default_workers_follow_a_containers_cpu_quota(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("100000 100000\n")  # cgroup v2: one CPU
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == cpus
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()  # cgroup v1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(tmp_path) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(tmp_path) == cpus


INIT_PROCESS_GROUP = dist.init_process_group


def _dist_timeout_of(script, argv, monkeypatch, folder) -> dict:
    """What the process group of train_ddp.py (and train_fsdp.py) and of predict under torchrun,
    and train_accelerate.py's Accelerator() get as timeouts, and how long the scripts' processes
    wait for their node's --cache (labelled_data's wait_seconds)."""
    seen = {}

    def data(args, wait_seconds=None):
        seen["cache wait"] = wait_seconds
        raise Asked()
    if script is predict:
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "2"),
                            ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "1")):
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(process_group, "torchrun_store", lambda minutes: (None, 0, 2))
        monkeypatch.setattr(process_group.dist, "init_process_group",
                            lambda backend, **kwargs: seen.update(backend=backend, group=kwargs["timeout"]))
        options = predict.parse_args(argv)
        process_group.join_process_group(options.dist_timeout, options.amp)
        return seen
    if script is train_ddp:
        def recorded(backend, **kwargs):
            seen.update(backend=backend, group=kwargs["timeout"])
            INIT_PROCESS_GROUP("gloo", store=dist.HashStore(), rank=0, world_size=1)
        monkeypatch.setattr(train_ddp.dist, "init_process_group", recorded)
    else:
        made = train_accelerate.Accelerator

        def accelerator(**kwargs):
            seen["group"] = [h.timeout for h in kwargs["kwargs_handlers"] if isinstance(h, InitProcessGroupKwargs)][0]
            return made(**kwargs)
        monkeypatch.setattr(train_accelerate, "Accelerator", accelerator)
    monkeypatch.setattr(script, "labelled_data", data)
    try:
        with pytest.raises(Asked):
            script.main([*argv, *outputs(folder)])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        from accelerate.state import AcceleratorState
        AcceleratorState._reset_state(reset_partial_state=True)
    seen["cache wait"] = timedelta(seconds=seen["cache wait"])
    return seen


@pytest.mark.parametrize("script", [train_ddp, train_accelerate, predict])
def test_dist_timeout_sets_the_process_group_and_the_cache_wait(script, monkeypatch, restore_numerics, tmp_path):
    """A node still building its --cache keeps the others waiting in their next collective: the
    timeout is --dist-timeout (60 minutes by default), and so is the node's own wait for its cache
    (predict builds none)."""
    for argv, minutes in (([], 60), (["--dist-timeout", "90"], 90), (["--dist-timeout", "0.5"], 0.5)):
        seen = _dist_timeout_of(script, argv, monkeypatch, tmp_path)
        assert set(seen.values()) - {"gloo"} == {timedelta(minutes=minutes)}
        assert ("cache wait" in seen) == (script is not predict)


def test_a_cache_wait_gives_up_after_dist_timeout(tmp_path, monkeypatch):
    import src.cache as cache
    monkeypatch.setattr(cache, "WAIT_SECONDS", 30)
    monkeypatch.setenv("LOCAL_RANK", "1")
    start = time.monotonic()
    with pytest.raises(UserError, match="waited 0 min for .*a.u8, which the first process of this node builds"):
        cache.ensure_array(tmp_path / "a.u8", tmp_path / "a.json", "key", (4,), np.uint8, None, "--cache", "x",
                           wait_seconds=0.6)
    assert time.monotonic() - start < cache.WAIT_SECONDS  # with wait_seconds ignored it would wait that long


def test_nodes_with_other_copies_of_the_images_share_a_cache_folder(tmp_path, monkeypatch):
    """Two nodes' copies of the images (cp without -p: other modification times) have other keys.
    With one file name for both, node B's build replaced node A's, and A's other processes waited
    for a key that never came; each key has files of its own now."""
    import src.cache as cache
    write_dataset(tmp_path / "a", n_train=6, n_test=0, size=32, seed=0)
    shutil.copytree(tmp_path / "a", tmp_path / "b", copy_function=shutil.copy)  # new mtimes
    nodes = [labelled_images(tmp_path / node, 32, show_progress=False) for node in "ab"]
    monkeypatch.setattr(cache, "WAIT_SECONDS", 1)
    monkeypatch.setenv("LOCAL_RANK", "0")  # each node's builder
    built = [cache.cached(dataset, 32, tmp_path / "cache", 0, show_progress=False) for dataset in nodes]
    assert built[0].key != built[1].key and built[0].path != built[1].path
    monkeypatch.setenv("LOCAL_RANK", "1")  # node A's second process finds its cache at once
    again = cache.cached(nodes[0], 32, tmp_path / "cache", 0, show_progress=False)
    assert again.path == built[0].path and torch.equal(again[5][0], nodes[0][5][0])
