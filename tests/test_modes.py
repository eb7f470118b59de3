"""The four modes train the same model: DataParallel, DDP under torchrun and accelerate against
train_single.py with the same global batch, plus exact validation counting and rank-0-only files.

AlexNet (no batch norm) with --dropout 0, float32 on the CPU: measured agreement with
train_single.py is below 1e-7 relative (DP: bit-identical); TOLERANCE allows 100x that.
"""
import socket
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torchvision

from conftest import (BIN, EXACT, LEARN, ROOT, history, max_relative_difference, outputs, python, run,
                      weights)
from src.loaders import labelled_data
from src.metrics import batch_sums, summarize
from src.predict import load_checkpoint, predict
from src.transforms import normalize

TOLERANCE = 1e-5
B = 10  # per process; the single-process reference uses 2 * B
VAL = ["--val-fraction", "0.5025", "--epochs", "1"]  # 201 images: 100 train, 101 validation


def _flags(data, out, batch):
    return ["--data-dir", str(data), *EXACT, *VAL, "--batch-size", str(batch), *outputs(out)]


COMMANDS = {
    "single": lambda: [sys.executable, "train_single.py"],
    "dp": lambda: [sys.executable, "train_dp.py"],
    "ddp": lambda: ["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py"],
    "accelerate": lambda: ["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                           "train_accelerate.py"],
}


@pytest.fixture(scope="module")
def runs(exact_data, module_tmp):
    """runs(mode) -> (output folder, finished process), each mode run once per module."""
    done = {}

    def get(mode: str):
        if mode not in done:
            out = module_tmp / mode
            out.mkdir()
            batch = B if mode in ("ddp", "accelerate") else 2 * B
            env = {"PYTHONPATH": str(ROOT / "tests" / "hooks"), "WRITE_LOG": str(out / "writes.log"),
                   "HF_HOME": str(out / "hf"),  # no accelerate config file
                   "ACCELERATE_USE_CPU": "1"}
            result = run([*COMMANDS[mode](), *_flags(exact_data, out / "out", batch)], env=env)
            assert result.returncode == 0, result.stderr[-3000:]
            done[mode] = out / "out", result
        return done[mode]
    return get


@pytest.fixture(scope="module")
def reference(runs):
    return runs("single")[0]


def _assert_same_run(out, reference):
    assert history(out)[0]["val_samples"] == 101 and history(out)[0]["train_samples"] == 100
    for key in ("train_loss", "train_acc", "val_loss", "val_acc", "val_log_loss"):
        assert history(out)[0][key] == pytest.approx(history(reference)[0][key], rel=TOLERANCE)
    assert max_relative_difference(weights(out), weights(reference)) < TOLERANCE


def test_reference_is_sensitive_to_the_batches(exact_data, reference, tmp_path):
    """Another global batch gives weights far outside TOLERANCE: the comparisons can fail."""
    result = python("train_single.py", *_flags(exact_data, tmp_path, B))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_relative_difference(weights(tmp_path), weights(reference)) > 1000 * TOLERANCE


def test_data_parallel_matches_single(runs, reference):
    out, result = runs("dp")
    assert "DataParallel runs on one device" in result.stdout
    _assert_same_run(out, reference)
    assert not any(k.startswith("module.") for k in weights(out))


def test_ddp_two_ranks_matches_single_and_only_rank_0_writes(runs, reference):
    out, result = runs("ddp")
    _assert_same_run(out, reference)
    writes = [line.split(" ", 1) for line in (out.parent / "writes.log").read_text().splitlines()]
    assert {rank for rank, _ in writes} == {"0"}, writes
    assert {Path(path).name for _, path in writes} == {
        "best.pth", "best.json", "last.pth", "history.json", "curves.png"}
    assert result.stdout.count("epoch 1/1") == 1, "one rank prints"


def test_accelerate_two_processes_matches_single_and_only_main_writes(runs, reference):
    out, result = runs("accelerate")
    assert "on 2 x cpu" in result.stdout
    _assert_same_run(out, reference)
    writes = [line.split(" ", 1) for line in (out.parent / "writes.log").read_text().splitlines()]
    assert {rank for rank, _ in writes} == {"0"}, writes


def test_every_mode_checkpoint_predicts_the_same(runs, exact_data):
    probabilities = {}
    for mode in COMMANDS:
        model, info = load_checkpoint(runs(mode)[0] / "best.pth")
        ids, probabilities[mode] = predict(model, info, exact_data / "test", workers=0)
        assert ids == list(range(1, 21))
    for mode in COMMANDS:
        assert torch.allclose(probabilities[mode], probabilities["single"], atol=1e-5)


def test_ddp_validation_accuracy_is_what_one_process_computes(exact_data, runs):
    """val_acc of a 2-rank run equals a plain evaluation of its saved weights on the split."""
    out = runs("ddp")[0]
    args = Namespace(data_dir=str(exact_data), image_size=64, val_fraction=0.5025, seed=42,
                     cache=None)
    dataset, _, val_idx = labelled_data(args, workers=0, show_progress=False)
    model = torchvision.models.alexnet(num_classes=2)
    model.load_state_dict(weights(out))
    model.eval()
    images = torch.stack([dataset[i][0] for i in val_idx])
    labels = torch.tensor([dataset[i][1] for i in val_idx])
    with torch.no_grad():
        expected = summarize(batch_sums(model(normalize(images)), labels))
    record = history(out)[0]
    assert record["val_samples"] == expected["samples"] == 101
    assert record["val_acc"] == expected["acc"]
    assert record["val_loss"] == pytest.approx(expected["loss"], rel=TOLERANCE)


def test_two_nodes_on_one_machine_match_single(exact_data, reference, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
         "--master_addr=127.0.0.1", f"--master_port={port}", "train_ddp.py",
         *_flags(exact_data, tmp_path / f"node{rank}", B)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    _assert_same_run(tmp_path / "node0", reference)
    assert not (tmp_path / "node1").exists(), "the second node's rank writes nothing"


def test_a_bad_flag_under_torchrun_is_reported_once(exact_data, tmp_path):
    result = run(["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py",
                  *_flags(exact_data, tmp_path / "out", B), "--val-fraction", "1.5"])
    assert result.returncode != 0
    assert result.stderr.count("train_ddp.py: error: argument --val-fraction: must be") == 1, result.stderr
    assert "exitcode  : 2" in result.stderr, result.stderr  # as torchrun reports it
    assert not (tmp_path / "out").exists()


def test_accelerate_refuses_processes_it_cannot_see(exact_data, tmp_path):
    """--multi_gpu without GPUs and without ACCELERATE_USE_CPU: each would train alone."""
    result = run(["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                  "train_accelerate.py", *_flags(exact_data, tmp_path / "out", B)],
                 env={"HF_HOME": str(tmp_path / "hf")})
    assert result.returncode != 0
    assert "error: launched as 2 processes but accelerate sees one" in result.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in result.stderr
    assert "exitcode  : 2" in result.stderr  # each process, as reported by the launcher
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, extra", [("train_ddp.py", ["--local-rank", "0"]),
                                           ("train_accelerate.py", [])])
def test_without_a_launcher_is_a_world_of_one(script, extra, exact_data, reference, tmp_path):
    result = python(script, *_flags(exact_data, tmp_path, 2 * B), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_run(tmp_path, reference)


def test_accelerate_one_process_bf16_learns(small_data, tmp_path):
    result = run(["accelerate", "launch", "--num_processes", "1", "--mixed_precision", "bf16",
                  "train_accelerate.py", "--data-dir", str(small_data), *LEARN, "--epochs", "2",
                  "--batch-size", "16", "--workers", "0", *outputs(tmp_path)],
                 env={"HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(bf16 precision)" in result.stdout
    assert history(tmp_path)[-1]["val_acc"] >= 0.85, history(tmp_path)
    torchvision.models.resnet18(num_classes=2).load_state_dict(weights(tmp_path))
