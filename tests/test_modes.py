"""The four modes train the same model: DataParallel, DDP under torchrun and accelerate against
train_single.py with the same global batch over two epochs (each reshuffled), exact validation
counting, and rank-0-only output."""
import os
import shutil
import socket
import subprocess
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import (
    BIN,
    DROPOUT,
    EXACT,
    HOOKS,
    LAUNCH,
    MODES,
    ROOT,
    TOLERANCE,
    VAL,
    B,
    assert_same_run,
    distance,
    dropout_run,
    history,
    last_model,
    mode_run,
    outputs,
    python,
    run,
    weights,
)

from src.loaders import labelled_data
from src.tools.predict import load_checkpoint, predict
from src.transforms import normalize


@pytest.fixture(scope="module")
def reference(runs):
    return mode_run(runs, "single")[0]


def test_the_tolerance_catches_the_seed_faults(runs, reference, far):
    """Another global batch is `far` by definition; the seed's DDP script never reshuffled
    (no set_epoch): measured 0.065 of far after its one unshuffled epoch, 65 x the tolerance."""
    assert far > 0
    same_order = runs.exact("single", env={"NO_RESHUFFLE": "1"})[0]
    assert distance(last_model(same_order), last_model(reference)) / far > 20 * TOLERANCE


def test_data_parallel_matches_single(runs, reference, far):
    out, result = mode_run(runs, "dp")
    assert "DataParallel runs on one device" in result.stdout
    assert assert_same_run(out, reference, far) == 0  # the same code path on a CPU
    assert not any(k.startswith("module.") for k in weights(out))


def _writes(out: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ", 1)) for line in (out.parent / "writes.log").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["ddp", "accelerate"])
def test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans(mode, runs, reference, far):
    out, result = mode_run(runs, mode)
    assert_same_run(out, reference, far)
    writes = _writes(out)
    assert {rank for rank, _ in writes} == {"0"}, writes
    assert {Path(path).name for _, path in writes} >= {
        "best.pth", "best.json", "last.pth", "history.json", "curves.png"}
    for line in ("on 2 x cpu", "epoch 1/2  train loss", "done in "):
        assert result.stdout.count(line) == 1, f"one rank prints {line!r}"
    assert result.stderr.count("epoch 1/2 train:   0%") == 1, "one rank draws progress bars"
    # No train.csv: rank 0 scans train/ (opening every image) and sends the table to rank 1.
    assert (out.parent / "scans.log").read_text().split() == ["0"]


def test_every_mode_checkpoint_predicts_the_same(runs, exact_data):
    probabilities = {}
    for mode in MODES:
        model, info = load_checkpoint(mode_run(runs, mode)[0] / "best.pth")
        ids, probabilities[mode] = predict(model, info, exact_data / "test", workers=0)
        assert ids == list(range(1, 21))
    for mode in MODES:
        assert torch.allclose(probabilities[mode], probabilities["single"], atol=1e-5)


def test_val_log_loss_is_kaggles_metric_clipped():
    """batch_sums against the metric written out: p(dog) clipped to [0.005, 0.995] (README), so a
    confident mistake costs -log(0.005) and not -log(1e-13); the loss itself is not clipped.
    (The runs' probabilities stay inside the clip: this batch has confident answers, right and wrong.)"""
    from src.metrics import CORRECT, COUNT, LOG_LOSS, LOSS, batch_sums
    logits = torch.tensor([[0.0, 30.0], [30.0, 0.0], [0.0, 0.0], [1.0, 2.0], [0.0, 30.0]])
    labels = torch.tensor([0, 0, 1, 1, 1])  # a confident mistake, two confident right answers
    p = logits.double().softmax(dim=1).numpy()
    y = labels.numpy()
    p_dog = np.clip(p[:, 1], 0.005, 0.995)
    sums = batch_sums(logits, labels).double()
    assert sums[LOG_LOSS].item() == pytest.approx(-np.sum(y * np.log(p_dog) + (1 - y) * np.log(1 - p_dog)), rel=1e-6)
    assert sums[LOSS].item() == pytest.approx(-np.sum(np.log(p[np.arange(5), y])), rel=1e-6)
    assert (sums[CORRECT].item(), sums[COUNT].item()) == (3, 5)  # the tie (0, 0) goes to class 0


def test_ddp_validation_metrics_are_what_one_process_computes(exact_data, runs):
    """val_acc, val_loss and val_log_loss of a 2-rank run equal a plain evaluation of its
    last.pth on the split, computed here without the project's metric code."""
    out = mode_run(runs, "ddp")[0]
    args = Namespace(data_dir=str(exact_data), image_size=64, val_fraction=0.5025, seed=42, cache=None, workers=0)
    dataset, _, val_idx, _ = labelled_data(args)
    model = torchvision.models.squeezenet1_1(num_classes=2)
    model.load_state_dict(last_model(out))
    model.eval()
    images = torch.stack([dataset[i][0] for i in val_idx])
    labels = np.array([dataset[i][1] for i in val_idx])
    with torch.no_grad():
        p = model(normalize(images)).double().softmax(dim=1).numpy()
    record = history(out)[-1]
    assert record["val_samples"] == len(val_idx) == 101
    assert record["val_acc"] == np.mean(p.argmax(axis=1) == labels)
    assert record["val_loss"] == pytest.approx(-np.mean(np.log(p[np.arange(101), labels])), rel=1e-5)
    p_dog = np.clip(p[:, 1], 0.005, 0.995)  # Kaggle's metric, clipped as README says
    log_loss = -np.mean(labels * np.log(p_dog) + (1 - labels) * np.log(1 - p_dog))
    assert record["val_log_loss"] == pytest.approx(log_loss, rel=1e-5)


def _two_nodes(exact_data, folders, *flags):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(
        [str(BIN / "torchrun"), "--nnodes=2", f"--node_rank={rank}", "--nproc_per_node=1",
         "--master_addr=127.0.0.1", f"--master_port={port}", "train_ddp.py", "--data-dir",
         str(exact_data), *flags, *outputs(folders[rank])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": HOOKS})
        for rank in (0, 1)]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    return logs


def test_two_nodes_without_a_shared_disk_resume_to_the_straight_run(exact_data, runs, far, tmp_path):
    """Two torchrun nodes on one machine, each with its own checkpoint folder, dropout on: --resume
    to epoch 2 from one epoch of DDP (one node, two processes; copied to node 0's folder only).
    Only node 0 has last.pth; its rank reads it and sends it to the other, and the job ends where
    two straight epochs of 2 processes do (to the float rounding: torchrun gives one process per
    node two threads, and two per node one each)."""
    folders = [tmp_path / "node0", tmp_path / "node1"]
    flags = [*DROPOUT, *VAL, "--batch-size", str(B)]
    shutil.copytree(runs("ddp", *flags, "--epochs", "1")[0], folders[0])
    logs = _two_nodes(exact_data, folders, *flags, "--epochs", "2", "--resume")
    assert "resumed from" in logs[0] and "after epoch 1" in logs[0]
    assert_same_run(folders[0], dropout_run(runs, "ddp")[0], far)
    assert not folders[1].exists(), "the second node's rank writes nothing"


def test_a_bad_flag_under_torchrun_is_reported_once(exact_data, tmp_path):
    result = run([*LAUNCH["ddp"](), "--data-dir", str(exact_data), *EXACT,
                  *outputs(tmp_path / "out"), "--val-fraction", "1.5"])
    assert result.returncode != 0
    assert result.stderr.count("train_ddp.py: error: argument --val-fraction: must be") == 1, result.stderr
    assert "exitcode  : 2" in result.stderr, result.stderr  # as torchrun reports it
    assert not (tmp_path / "out").exists()


def test_accelerate_refuses_processes_it_cannot_see(exact_data, tmp_path):
    """--multi_gpu without GPUs and without ACCELERATE_USE_CPU: each would train alone."""
    result = run([*LAUNCH["accelerate"](), "--data-dir", str(exact_data), *EXACT,
                  *outputs(tmp_path / "out")], env={"HF_HOME": str(tmp_path / "hf")})
    assert result.returncode != 0
    assert "error: launched as 2 processes but accelerate sees one" in result.stderr
    assert "ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2" in result.stderr
    assert "exitcode  : 2" in result.stderr  # each process, as reported by the launcher
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script, extra", [("train_ddp.py", ["--local-rank", "0"]),
                                           ("train_accelerate.py", [])])
def test_without_a_launcher_is_a_world_of_one(script, extra, exact_data, reference, far, tmp_path):
    result = python(script, "--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "2",
                    "--batch-size", str(2 * B), *outputs(tmp_path), *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, reference, far)
