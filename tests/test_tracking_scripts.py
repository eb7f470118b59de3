"""--track in the training scripts: one tracked run per training run across a stop on SIGTERM and its
resume (under torchrun a restarted worker too), read back from the stores themselves (MLflow's
SQLite file beside best.pth, W&B's offline files): each epoch's metrics once with history.json's
values, the step metrics of every --log-every once, every flag as a parameter, the artifacts, the
status; the ids in every last.pth and best.json; a new tracked run after --overwrite; FAILED on an
error; a store that cannot be used is one line and exit 2 before any work. The tracker module
alone: test_tracking.py."""
import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import EXACT, HOOKS, LAUNCH, VAL, fails_in_process, history, in_process, outputs, python, run, weights

import train_single
from src.tracking import EXIT_CODES, PROJECT, default_uri, wandb_files, wandb_history, wandb_records

ARTIFACTS = ("best.pth", "best.json", "curves.png")  # conftest.outputs names the plot curves.png


pytestmark = pytest.mark.usefixtures("offline_trackers")


def _flags(data: Path, out: Path, batch: int, every: int, *extra: str) -> list[str]:
    """Two EXACT epochs (100 training images) with --batch-size `batch` per process, step metrics
    every `every` optimizer steps, into `out`."""
    return ["--data-dir", str(data), *EXACT, *VAL, "--epochs", "2", "--batch-size", str(batch),
            "--log-every", str(every), *outputs(out), *extra]


def _report_steps(steps_per_epoch: int, every: int, epochs: int = 2) -> list[int]:
    """The optimizer steps of the run whose step metrics a run reports: every `every` steps of an
    epoch and its last (src/progress.py)."""
    return [epoch * steps_per_epoch + step for epoch in range(epochs) for step in range(1, steps_per_epoch + 1)
            if step % every == 0 or step == steps_per_epoch]


def _saved(out: Path) -> dict:
    """The run's last: last.pth, or FSDP's last.dcp read whole."""
    return weights(out, "last.pth")


def _store(out: Path):
    """MLflow's client on the store beside best.pth, and every run in it."""
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=default_uri(out))
    return client, client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])


def _steps(client, run_id: str, key: str) -> list[int]:
    return sorted(metric.step for metric in client.get_metric_history(run_id, key))


def _assert_one_finished_run(out: Path, info: dict, mode: str, steps: list[int], downloads: Path | None = None):
    """The store holds one run, the one whose id last.pth and best.json carry: FINISHED, each of
    history.json's epochs once with its values, each report step once, the first start's flags
    (`info`: the first start's last.pth info), mode, processes and machine as parameters, best.pth,
    best.json and the curves as artifacts, byte for byte (downloaded into `downloads`, by default
    beside `out`). Returns (client, run)."""
    client, runs = _store(out)
    run_id = _saved(out)["info"]["tracking"]["mlflow"]
    assert [run.info.run_id for run in runs] == [run_id]
    assert json.loads((out / "best.json").read_text())["tracking"]["mlflow"] == run_id
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == PROJECT
    assert run.info.run_name == f"{mode} x{info['processes']}"
    records = history(out)
    for key in records[0]:
        if key != "epoch":
            logged = sorted((metric.step, metric.value) for metric in client.get_metric_history(run_id, f"epoch/{key}"))
            assert [step for step, _ in logged] == [1, 2], key  # each epoch once
            assert [value for _, value in logged] == pytest.approx([record[key] for record in records], rel=1e-6), key
    assert _steps(client, run_id, "step/loss") == steps and _steps(client, run_id, "step/lr") == steps
    assert run.data.params == {**{key: str(value) for key, value in info["flags"].items()}, "mode": mode,
                               "processes": str(info["processes"]), "hardware": info["hardware"]}
    assert run.data.params["resume"] == "False"  # the first start's, not the resume's
    assert sorted(artifact.path for artifact in client.list_artifacts(run_id)) == sorted(ARTIFACTS)
    for name in ARTIFACTS:
        got = Path(client.download_artifacts(run_id, name, str((downloads or out.parent) / f"downloaded-{name}")))
        assert got.read_bytes() == (out / name).read_bytes(), name
    return client, run


def _stopped(out: Path, steps: list[int], stopped_at: int) -> dict:
    """After the stop: the KILLED run holds epoch 1 and the report steps up to the stop; last.pth
    (of the stop's step) carries its ids. Returns last.pth's info."""
    info = _saved(out)["info"]
    client, runs = _store(out)
    assert [(run.info.run_id, run.info.status) for run in runs] == [(info["tracking"]["mlflow"], "KILLED")]
    assert _steps(client, runs[0].info.run_id, "epoch/val_acc") == [1]
    assert _steps(client, runs[0].info.run_id, "step/loss") == [step for step in steps if step <= stopped_at]
    return info


def _stopped_in_epoch_1(out: Path, steps: list[int], stopped_at: int) -> dict:
    """After a stop inside epoch 1: the KILLED run holds no epoch yet and the report steps up to the
    stop; last.pth (or last.dcp) of the stop's step carries its ids. Returns its info."""
    info = _saved(out)["info"]
    client, runs = _store(out)
    assert [(run.info.run_id, run.info.status) for run in runs] == [(info["tracking"]["mlflow"], "KILLED")]
    assert _steps(client, runs[0].info.run_id, "epoch/val_acc") == []
    assert _steps(client, runs[0].info.run_id, "step/loss") == [step for step in steps if step <= stopped_at]
    return info


def _assert_one_wandb_run(out: Path, run_id: str, starts: int, steps: list[int]) -> None:
    """W&B offline: one folder per start, all of run `run_id`; epochs and steps once; the first
    start ended as stopped (exit code 75), the last as finished."""
    files = wandb_files(out, run_id)
    assert len(files) == starts and all(path.parent.name.startswith("offline-run-") for path in files)
    exits = [[record.exit.exit_code for record in wandb_records(path) if record.WhichOneof("record_type") == "exit"]
             for path in files]
    assert exits[0] == [EXIT_CODES["KILLED"]] and exits[-1] == [EXIT_CODES["FINISHED"]]
    rows = wandb_history(out, run_id)
    assert [row["epoch"] for row in rows if "epoch" in row] == [1, 2]
    assert [row["epoch/val_acc"] for row in rows if "epoch" in row] == [record["val_acc"] for record in history(out)]
    assert [row["optimizer_step"] for row in rows if "optimizer_step" in row] == steps
    for name in ARTIFACTS:
        assert (files[-1].parent / "files" / name).read_bytes() == (out / name).read_bytes()


def test_single_stopped_and_resumed_is_one_tracked_run(exact_data, tmp_path, monkeypatch, capsys):
    """train_single.py --track mlflow --track wandb, 5 steps an epoch, --log-every 2: SIGTERM at step
    8 (epoch 2 step 3, no report due there: a stop ends the step before its report) stops it with
    the run KILLED; --resume continues that run to FINISHED. Then --overwrite is a new run."""
    out = tmp_path / "out"
    flags = _flags(exact_data, out, 20, 2, "--track", "mlflow", "--track", "wandb")
    steps = _report_steps(5, 2)
    result = python("train_single.py", *flags, env={"PYTHONPATH": HOOKS, "SIGNAL_AT_STEP": "8", "SIGNAL_NAME": "SIGTERM"})
    assert result.returncode == 75, result.stderr[-3000:]
    info = _stopped(out, steps, 8)
    ids = info["tracking"]
    assert set(ids) == {"mlflow", "wandb"} and json.loads((out / "best.json").read_text())["tracking"] == ids

    code, _, err = in_process(train_single.main, [*flags, "--resume"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert _saved(out)["info"]["tracking"] == ids
    _assert_one_finished_run(out, info, "single", steps)
    _assert_one_wandb_run(out, ids["wandb"], 2, steps)

    code, _, err = in_process(train_single.main, [*flags, "--epochs", "1", "--overwrite"], monkeypatch, capsys)
    assert code == 0, err[-3000:]
    client, runs = _store(out)
    new = _saved(out)["info"]["tracking"]
    assert new["mlflow"] != ids["mlflow"] and new["wandb"] != ids["wandb"]
    assert sorted((run.info.run_id, run.info.status) for run in runs) == sorted(
        [(ids["mlflow"], "FINISHED"), (new["mlflow"], "FINISHED")])
    assert _steps(client, new["mlflow"], "epoch/val_acc") == [1] and _steps(client, ids["mlflow"], "epoch/val_acc") == [1, 2]


def test_torchrun_stopped_resumed_and_restarted_is_one_tracked_run(ddp_stops, tmp_path):
    """train_ddp.py on 2 processes of 5 images (10 steps an epoch, --log-every 4; conftest.ddp_stops):
    stopped after step 8, after epoch 1 and after step 16, each time resumed; the last resume
    loses rank 0 (SIGKILL) in step 19, and torchrun's restarted workers resume from last.pth on
    their own: one tracked run, KILLED after each stop with what it logged so far, FINISHED at the
    end, each epoch and report step once (but step 8's: a stop ends its step before its report),
    its parameters those of the first start on 2 processes."""
    steps = [step for step in _report_steps(10, 4) if step != 8]  # none at the step a run stops at
    info = _stopped_in_epoch_1(ddp_stops["at step 8"].out, steps, 8)  # the first start's
    assert info["processes"] == 2
    for stage, stopped_at in (("after epoch 1", 10), ("at step 16", 16)):
        assert _stopped(ddp_stops[stage].out, steps, stopped_at)["tracking"] == info["tracking"]
    out, result = ddp_stops["restarted"]
    assert "exitcode: -9" in result.stderr and "after its step 8: going on" in result.stdout
    _assert_one_finished_run(out, info, "ddp", steps, downloads=tmp_path)


def test_accelerate_stopped_and_resumed_is_one_tracked_run(exact_data, tmp_path):
    """train_accelerate.py on 2 processes (ACCELERATE_USE_CPU) through accelerate's own trackers,
    MLflow and W&B, with TensorBoard (--log-dir) beside them: stopped as under torchrun, resumed;
    one tracked run in each, every step metric once (accelerator.log would send TensorBoard's to
    them too); TensorBoard's events in the folder that init_trackers names, the project."""
    out = tmp_path / "out"
    flags = _flags(exact_data, out, 5, 4, "--track", "mlflow", "--track", "wandb", "--log-dir", str(tmp_path / "tb"))
    steps = _report_steps(10, 4)
    env = {"HF_HOME": str(tmp_path / "hf"), "ACCELERATE_USE_CPU": "1"}
    result = run([*LAUNCH["accelerate"](), *flags], timeout=300,
                 env={**env, "PYTHONPATH": HOOKS, "SIGNAL_AT_STEP": "11", "SIGNAL_NAME": "SIGTERM"})
    assert "exitcode  : 75" in result.stderr, result.stderr[-3000:]
    info = _stopped(out, steps, 16)

    result = run([*LAUNCH["accelerate"](), *flags, "--resume"], timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_one_finished_run(out, info, "accelerate", steps)
    _assert_one_wandb_run(out, info["tracking"]["wandb"], 2, steps)
    assert {path.parent.name for path in (tmp_path / "tb").rglob("events.out.tfevents.*")} == {PROJECT}


def test_fsdp_logs_each_epoch_after_its_sharded_save(fsdp_stops, tmp_path):
    """train_fsdp.py on 2 processes writes last.dcp (each rank its shards), not last.pth: its tracked
    run, stopped after step 8 (KILLED) and resumed with a worker killed in a save and restarted
    (conftest.fsdp_stops), still logs each epoch and report step once, FINISHED, its id in last.dcp
    and best.json."""
    steps = [step for step in _report_steps(10, 4) if step != 8]  # none at the step a run stops at
    info = _stopped_in_epoch_1(fsdp_stops["at step 8"].out, steps, 8)
    assert info["processes"] == 2
    out, result = fsdp_stops["restarted"]
    assert result.returncode == 0 and "exitcode: -9" in result.stderr, result.stderr[-3000:]
    assert (out / "last.dcp").is_dir() and not (out / "last.pth").exists()
    _assert_one_finished_run(out, info, "fsdp", steps, downloads=tmp_path)


def test_a_run_that_fails_ends_its_tracked_run_failed(exact_data, tmp_path, monkeypatch, capsys):
    """An error during the run (the validation fails here) ends the tracked run FAILED, with the
    steps it logged."""
    calls = []

    def failing(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("validation failed")
    monkeypatch.setattr(train_single, "evaluate", failing)
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    with pytest.raises(RuntimeError, match="validation failed"):
        train_single.main(_flags(exact_data, tmp_path, 20, 2, "--track", "mlflow", "--epochs", "1"))
    client, runs = _store(tmp_path)
    assert len(calls) == 1 and [run.info.status for run in runs] == ["FAILED"]
    assert _steps(client, runs[0].info.run_id, "step/loss") == [2, 4, 5]


def test_a_store_that_cannot_be_used_is_one_line_before_any_work(exact_data, tmp_path, monkeypatch, capsys):
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    flags = _flags(exact_data, tmp_path, 20, 2, "--track", "mlflow", "--tracking-uri", f"http://127.0.0.1:{port}")
    fails_in_process(train_single.main, flags, monkeypatch, capsys,
                     f"error: --tracking-uri http://127.0.0.1:{port}: MLflow cannot use it (Connection refused)")
    assert sorted(path.name for path in tmp_path.iterdir()) == [".run.lock"]  # nothing written but the run's lock
