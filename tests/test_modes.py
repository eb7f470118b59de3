"""The four modes train the same model: DataParallel, DDP under torchrun and accelerate against
train_single.py with the same global batch over two epochs (each reshuffled), exact validation
counting, and rank-0-only output."""
import json
import os
import re
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from conftest import (
    BIN,
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
    history,
    last_model,
    mode_run,
    outputs,
    run,
    run_main,
    weights,
)

import train_accelerate
import train_ddp
from src.cli import defaults
from src.inference import check_complete, kaggle_test_files, load_checkpoint, predict_files
from src.loaders import labelled_data
from src.transforms import normalize


@pytest.fixture(scope="module")
def single_run(runs):
    """The output folder of train_single.py's shared run (conftest's `reference` is the full recipe's)."""
    return mode_run(runs, "single")[0]


def test_the_tolerance_catches_the_seed_faults(runs, single_run, far):
    """Another global batch is `far` by definition; the seed's DDP script never reshuffled
    (no set_epoch): measured 0.065 of far after its one unshuffled epoch, 65 x the tolerance."""
    assert far > 0
    same_order = runs.exact("single", env={"NO_RESHUFFLE": "1"})[0]
    assert distance(last_model(same_order), last_model(single_run)) / far > 20 * TOLERANCE


def test_distance_is_the_euclidean_norm_of_every_weight_difference():
    """src.tools.agreement.distance, which every agreement test measures with, against numpy's
    norm of the two state_dicts' differences laid end to end (an integer buffer among them), a 3-4-5
    triangle, and its refusal of state_dicts that hold other tensors."""
    generator = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(5, generator=generator),
         "count": torch.tensor(7)}
    b = {"w": torch.randn(4, 3, generator=generator), "b": torch.randn(5, generator=generator),
         "count": torch.tensor(4)}
    by_hand = np.linalg.norm(np.concatenate([(a[k].numpy().astype(np.float64) - b[k].numpy()).ravel() for k in a]))
    assert distance(a, b) == pytest.approx(by_hand, rel=1e-12) and by_hand > 3  # the buffer's 3 counts
    assert distance({"x": torch.tensor([3.0]), "y": torch.tensor([[4.0]])},
                    {"x": torch.tensor([0.0]), "y": torch.tensor([[0.0]])}) == 5.0
    assert distance(a, a) == 0.0
    with pytest.raises(ValueError, match="the state_dicts hold other tensors"):
        distance(a, {**b, "extra": torch.zeros(1)})


def test_data_parallel_matches_single(runs, single_run, far):
    out, result = mode_run(runs, "dp")
    assert "DataParallel runs on one device" in result.stdout
    assert assert_same_run(out, single_run, far) == 0  # the same code path on a CPU
    assert not any(k.startswith("module.") for k in weights(out))


def _writes(out: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(" ", 1)) for line in (out.parent / "writes.log").read_text().splitlines()]


@pytest.mark.parametrize("mode", ["ddp", "accelerate"])
def test_two_processes_match_single_and_only_rank_0_writes_prints_and_scans(mode, runs, single_run, far):
    out, result = mode_run(runs, mode)
    assert_same_run(out, single_run, far)
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
        ids, files, _ = kaggle_test_files(exact_data / "test")
        p, broken = predict_files(model, info, files, torch.device("cpu"))
        check_complete(files, broken)
        probabilities[mode] = p[:, info["classes"].index("dog")]
        assert ids == list(range(1, 21))
    for mode in MODES:
        assert torch.allclose(probabilities[mode], probabilities["single"], atol=1e-5)


def test_val_log_loss_is_kaggles_metric_clipped():
    """batch_sums against the metric written out: p(dog) clipped to [0.005, 0.995] (docs/outputs.md), so a
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
    args = defaults(data_dir=str(exact_data), image_size=64, val_fraction=0.5025, seed=42, cache=None, workers=0)
    data = labelled_data(args)
    dataset, val_idx = data.dataset, data.val_idx
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
    p_dog = np.clip(p[:, 1], 0.005, 0.995)  # Kaggle's metric, clipped as docs/outputs.md says
    log_loss = -np.mean(labels * np.log(p_dog) + (1 - labels) * np.log(1 - p_dog))
    assert record["val_log_loss"] == pytest.approx(log_loss, rel=1e-5)


def _two_machines(launcher: list[str], script: str, folders: list[Path], *flags: str,
                  env: dict | None = None) -> list[str]:
    """Two "machines" on one host, machine R started as `launcher`, with R in place of "{R}" and
    a free port in place of "{PORT}", writing into folders[R] (no shared disk); their outputs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    machines = [subprocess.Popen(
        [*(part.format(R=rank, PORT=port) for part in launcher), script, *flags, *outputs(folders[rank])],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": HOOKS,
             "PYTHONUNBUFFERED": "1", **(env or {})})
        for rank in (0, 1)]
    logs = [machine.communicate(timeout=600)[0] for machine in machines]
    assert [machine.returncode for machine in machines] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    return logs


ACCELERATE_MACHINES = ["accelerate", "launch", "--multi_gpu", "--num_machines", "2", "--machine_rank", "{R}",
                       "--num_processes", "2", "--main_process_ip", "127.0.0.1", "--main_process_port", "{PORT}"]
# Static rendezvous: --node_rank is the machine's place, so node 0's process is global rank 0.
TORCHRUN_MACHINES = ["torchrun", "--nnodes=2", "--node_rank={R}", "--nproc_per_node=1",
                     "--master_addr=127.0.0.1", "--master_port={PORT}"]
RESULTS = ("on 2 x cpu", "epoch 1/", "epoch 2/", "done in ", "resumed from", "copied")


def test_rank_0_on_another_machine_resumes_the_run_and_gets_its_files(exact_data, runs, far, tmp_path):
    """Two machines without a shared disk, each with its own checkpoint folder. Epoch 1 with
    accelerate, rank 0 on machine A; then `--resume` to epoch 2 under torchrun with the roles
    swapped, as torchrun's c10d rendezvous may place them: rank 0 is on B, which holds nothing.
    A's first process reports its last.pth, which is sent from there; B gets the run's files and
    the job ends where two straight epochs of train_single.py do (to the float rounding: the
    launchers give each process one thread). Only global rank 0 prints results, in both."""
    a, b = tmp_path / "a", tmp_path / "b"
    flags = ["--data-dir", str(exact_data), *EXACT, *VAL, "--batch-size", str(B)]
    logs = _two_machines(ACCELERATE_MACHINES, "train_accelerate.py", [a, b], *flags, "--epochs", "1",
                         env={"ACCELERATE_USE_CPU": "1", "HF_HOME": str(tmp_path / "hf")})
    assert all(line in logs[0] for line in ("on 2 x cpu", "epoch 1/1 train:", "epoch 1/1  train loss", "done in "))
    assert not any(line in logs[1] for line in RESULTS), logs[1]
    assert not b.exists(), "machine 1 writes nothing"
    epoch_1 = (a / "last.pth").read_bytes()

    writes = tmp_path / "writes.log"
    logs = _two_machines(TORCHRUN_MACHINES, "train_ddp.py", [b, a], *flags, "--epochs", "2", "--resume",
                         env={"WRITE_LOG": str(writes)})
    reference = runs.exact("single")[0]
    assert_same_run(b, reference, far)
    assert distance(weights(b), weights(reference)) / far < TOLERANCE
    assert json.loads((b / "best.json").read_text())["epoch"] == json.loads((reference / "best.json").read_text())["epoch"]
    assert (a / "last.pth").read_bytes() == epoch_1 and len(history(a)) == 1, "rank 1 writes nothing"
    written = [line.split(" ", 1) for line in writes.read_text().splitlines()]
    assert {rank for rank, _ in written} == {"0"}
    # last.pth twice: copied before training (with best.pth, whichever epoch is best), then epoch 2's.
    assert [path for _, path in written].count(str(b / "last.pth")) == 2, written
    assert f"rank 0 is on another node than {socket.gethostname()}:{a / 'last.pth'}: copied" in logs[0]
    assert "after epoch 1 of 2: going on" in logs[0] and "done in " in logs[0]
    assert not any(line in logs[1] for line in RESULTS), logs[1]


def test_a_bad_flag_under_torchrun_is_reported_once(exact_data, tmp_path):
    """docs/reliability.md: rank 0 prints the line and exits 2; the other rank waits, silent, until
    torchrun stops it (SIGTERM), so rank 0's line always comes out; torchrun reports both exit
    codes and exits 1."""
    result = run([*LAUNCH["ddp"](), "--data-dir", str(exact_data), *EXACT,
                  *outputs(tmp_path / "out"), "--val-fraction", "1.5"])
    assert result.returncode == 1, result.stderr[-3000:]
    assert result.stderr.count("train_ddp.py: error: argument --val-fraction: must be") == 1, result.stderr
    codes = dict(re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+)", result.stderr))
    assert codes == {"0": "2", "1": "-15"}, result.stderr[-3000:]
    root_cause = result.stderr.split("Root Cause")[1]
    assert re.search(r"rank\s+: 0 ", root_cause), result.stderr[-3000:]
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


@pytest.mark.parametrize("script, extra", [(train_ddp, ["--local-rank", "0"]), (train_accelerate, [])])
def test_without_a_launcher_is_a_world_of_one(script, extra, exact_data, single_run, far, tmp_path):
    result = run_main(script.main, ["--data-dir", str(exact_data), *EXACT, *VAL, "--epochs", "2",
                                    "--batch-size", str(2 * B), *outputs(tmp_path), *extra],
                      env={"HF_HOME": str(tmp_path / "hf")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path, single_run, far)
