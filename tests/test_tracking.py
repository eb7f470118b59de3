"""--track mlflow / wandb (src/tracking.py): one tracked run per training run across a stop and its
resume, each epoch's and step's metrics once, every flag as a parameter, the artifacts and the
status, read back from the stores themselves (MLflow's SQLite file through a new MlflowClient, W&B's
offline files); a store that cannot be used is one line and exit 2 at start, in bounded time; a
tracker failing during the run is one warning line, never an error."""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from src.checkpoint import run_context
from src.cli import parse_args
from src.errors import UserError, exit_on_error
from src.history import RECORD_KEYS
from src.tracking import (
    ADVICE,
    CHECK_SECONDS,
    EXIT_CODES,
    PROJECT,
    Tracker,
    default_uri,
    wandb_files,
    wandb_history,
    wandb_records,
)

ARTIFACTS = ("best.pth", "best.json", "training_results.png")


pytestmark = pytest.mark.usefixtures("offline_trackers")


def _args(folder: Path, *flags: str):
    return parse_args("", ["--checkpoint", str(folder / "best.pth"), "--plot", str(folder / "training_results.png"),
                           "--arch", "squeezenet1_1", "--image-size", "64", *flags])


def _context(args, mode: str = "single") -> dict:
    return {**run_context(args), "mode": mode, "processes": 1}


def _record(epoch: int) -> dict:
    """A history record whose every field differs from epoch to epoch and from field to field."""
    return {key: (epoch if key == "epoch" else round(epoch + index / 100, 4)) for index, key in enumerate(RECORD_KEYS)}


def _write_artifacts(folder: Path) -> dict[str, bytes]:
    contents = {name: f"{name} of the run\n".encode() + os.urandom(64) for name in ARTIFACTS}
    for name, data in contents.items():
        (folder / name).write_bytes(data)
    return contents


def _stopped_and_resumed(folder: Path, track: list[str], monkeypatch) -> tuple[dict, dict, dict]:
    """A run that logs epochs 1 and 2 and the steps 10 and 20, is stopped (KILLED) and resumed from
    a last.pth of epoch 1: the resumed run logs epoch 2 and step 20 again, then epoch 3 and step 30,
    and finishes with the artifacts. Returns (the ids, the first run's flags, the artifacts' bytes)."""
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(folder, *track)
    first = Tracker(args)
    context = _context(args)
    ids = first.start(None, context)
    for epoch, step in ((1, 10), (2, 20)):
        first.log_step({"loss": step / 100, "lr": 0.001}, step)
        first.log_epoch(_record(epoch))
    first.finish("KILLED")

    resumed_args = _args(folder, *track, "--resume")
    resumed = Tracker(resumed_args)
    assert resumed.start(ids, _context(resumed_args), history=[_record(1)]) == ids
    for epoch, step in ((2, 20), (3, 30)):
        resumed.log_step({"loss": step / 100, "lr": 0.001}, step)
        resumed.log_epoch(_record(epoch))
    contents = _write_artifacts(folder)
    resumed.finish("FINISHED", [folder / name for name in ARTIFACTS])
    return ids, context, contents


def _mlflow_runs(folder: Path) -> list:
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=default_uri(folder))
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    return client, client.search_runs(experiments)


def _assert_mlflow_run(folder: Path, run_id: str, context: dict, contents: dict, epochs=(1, 2, 3), steps=(10, 20, 30)):
    client, runs = _mlflow_runs(folder)
    assert [run.info.run_id for run in runs] == [run_id]  # one run in the store, across the stop
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == PROJECT
    for key in RECORD_KEYS[1:]:
        history = client.get_metric_history(run_id, f"epoch/{key}")
        assert sorted((metric.step, metric.value) for metric in history) == [
            (epoch, _record(epoch)[key]) for epoch in epochs], key  # each epoch once, its own values
    assert sorted(metric.step for metric in client.get_metric_history(run_id, "step/loss")) == list(steps)
    # Every flag as a parameter, with the first start's values (the resume's --resume is not logged
    # over them), and the mode, processes and machine.
    expected = {**{key: str(value) for key, value in context["flags"].items()},
                "mode": context["mode"], "processes": "1", "hardware": context["hardware"]}
    assert run.data.params == expected
    assert run.data.params["resume"] == "False" and run.data.params["image_size"] == "64"
    assert sorted(artifact.path for artifact in client.list_artifacts(run_id)) == sorted(ARTIFACTS)
    for name, data in contents.items():
        assert Path(client.download_artifacts(run_id, name, str(folder / "downloaded"))).read_bytes() == data
    return run


def test_mlflow_one_run_across_a_stop_each_epoch_once(tmp_path, monkeypatch):
    ids, context, contents = _stopped_and_resumed(tmp_path, ["--track", "mlflow"], monkeypatch)
    assert set(ids) == {"mlflow"}
    run = _assert_mlflow_run(tmp_path, ids["mlflow"], context, contents)
    # The store and its artifacts beside best.pth, none in the working directory.
    assert (tmp_path / "mlflow.db").is_file()
    assert run.info.artifact_uri == (tmp_path / "mlartifacts").resolve().as_uri() + f"/{ids['mlflow']}/artifacts"
    assert not (ROOT / "mlruns").exists() and not (ROOT / "mlartifacts").exists()


def test_mlflow_stopped_run_is_killed_until_its_resume_runs(tmp_path, monkeypatch):
    from mlflow import MlflowClient
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path, "--track", "mlflow", "--track", "mlflow")
    tracker = Tracker(args)
    assert tracker.names == ["mlflow"]  # named twice, tracked once
    ids = tracker.start(None, _context(args))
    client = MlflowClient(tracking_uri=default_uri(tmp_path))
    assert client.get_run(ids["mlflow"]).info.status == "RUNNING"
    tracker.finish("KILLED")
    assert client.get_run(ids["mlflow"]).info.status == "KILLED"
    resumed = Tracker(_args(tmp_path, "--track", "mlflow", "--resume"))
    resumed.start(ids, _context(args))
    assert client.get_run(ids["mlflow"]).info.status == "RUNNING"
    resumed.finish("FAILED")
    assert client.get_run(ids["mlflow"]).info.status == "FAILED"


def test_resumed_history_fills_what_the_run_lacks(tmp_path, monkeypatch):
    """A run stopped between saving an epoch and logging it, and a run that starts tracking at its
    resume: start() logs the resumed epochs that the tracked run lacks, once."""
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path, "--track", "mlflow", "--track", "wandb")
    first = Tracker(args)
    ids = first.start(None, _context(args))
    first.log_epoch(_record(1))
    first.finish("KILLED")  # epoch 2 saved in last.pth, never logged
    resumed = Tracker(_args(tmp_path, "--track", "mlflow", "--track", "wandb", "--resume"))
    resumed.start(ids, _context(args), history=[_record(1), _record(2)])
    resumed.log_epoch(_record(3))
    resumed.finish("FINISHED")
    client, runs = _mlflow_runs(tmp_path)
    assert [run.info.run_id for run in runs] == [ids["mlflow"]]
    assert sorted(metric.step for metric in client.get_metric_history(ids["mlflow"], "epoch/val_acc")) == [1, 2, 3]
    assert [row["epoch"] for row in wandb_history(tmp_path, ids["wandb"]) if "epoch" in row] == [1, 2, 3]

    later = tmp_path / "later"  # trained without --track, resumed with it: a new run of the saved epochs
    later_args = _args(later, "--track", "mlflow", "--resume")
    tracker = Tracker(later_args)
    new = tracker.start(None, _context(later_args), history=[_record(1), _record(2)])
    tracker.finish("FINISHED")
    client, runs = _mlflow_runs(later)
    assert [run.info.run_id for run in runs] == [new["mlflow"]]
    assert sorted(metric.step for metric in client.get_metric_history(new["mlflow"], "epoch/train_loss")) == [1, 2]


def test_wandb_offline_one_run_across_a_stop_each_epoch_once(tmp_path, monkeypatch):
    ids, context, contents = _stopped_and_resumed(tmp_path, ["--track", "wandb"], monkeypatch)
    run_id = ids["wandb"]
    files = wandb_files(tmp_path, run_id)
    # Offline (no WANDB_MODE), beside best.pth: one folder per start, both of the same run.
    assert [path.parent.name.startswith("offline-run-") for path in files] == [True, True]
    records = [list(wandb_records(path)) for path in files]
    runs = [next(record.run for record in file if record.WhichOneof("record_type") == "run") for file in records]
    assert [(run.run_id, run.project, run.display_name) for run in runs] == [(run_id, PROJECT, "single x1")] * 2
    exits = [[record.exit.exit_code for record in file if record.WhichOneof("record_type") == "exit"] for file in records]
    assert exits == [[EXIT_CODES["KILLED"]], [EXIT_CODES["FINISHED"]]]
    # Every flag, the mode, processes and machine in the first start's config; the resume logs none.
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert {key: config[key] for key in context["flags"]} == context["flags"]
    assert (config["mode"], config["processes"], config["hardware"]) == ("single", 1, context["hardware"])
    assert {item.key for item in runs[1].config.update} <= {"_wandb"}
    rows = wandb_history(tmp_path, run_id)
    epochs = [row for row in rows if "epoch" in row]
    assert [row["epoch"] for row in epochs] == [1, 2, 3]  # epoch 2 not again after the resume
    for row in epochs:
        assert {key: row[f"epoch/{key}"] for key in RECORD_KEYS[1:]} == {
            key: value for key, value in _record(row["epoch"]).items() if key != "epoch"}
    assert [row["optimizer_step"] for row in rows if "optimizer_step" in row] == [10, 20, 30]
    saved = [file.path for record in records[1] if record.WhichOneof("record_type") == "files" for file in record.files.files]
    assert set(ARTIFACTS) <= set(saved)
    for name, data in contents.items():
        assert (files[1].parent / "files" / name).read_bytes() == data


def test_saved_run_missing_from_the_store_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path / "a", "--track", "mlflow")
    tracker = Tracker(args)
    ids = tracker.start(None, _context(args))
    tracker.finish("KILLED")
    other = Tracker(_args(tmp_path / "b", "--track", "mlflow", "--resume"))  # another store
    with pytest.raises(UserError, match=f"last.pth's MLflow run {ids['mlflow']} is not in sqlite:///"):
        other.start(ids, _context(args))
    other.finish("FAILED")  # as rank_0_tracker ends it: the environment as it was


@pytest.mark.parametrize("flags, message", [
    (["--tracking-uri", "http://tracking:5000"], "argument --tracking-uri: it is MLflow's store: add --track mlflow"),
    (["--track", "wandb", "--tracking-uri", "http://tracking:5000"], "it is MLflow's store: add --track mlflow"),
    (["--track", "mlflow", "--tracking-uri", "runs/mlflow.db"], "argument --tracking-uri: 'runs/mlflow.db' is not a URI"),
    (["--track", "comet"], "argument --track: invalid choice: 'comet'"),
    (["--track", "mlflow", "--evaluate"], "--evaluate trains nothing and writes nothing: drop --track"),
])
def test_tracking_flags_refused_when_parsed(flags, message, capsys):
    with pytest.raises(SystemExit) as ended:
        parse_args("", flags)
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_a_tracker_not_installed_is_refused_when_parsed(monkeypatch, capsys):
    """One line naming the file that installs the trackers: requirements.txt, which the line named,
    is the training-only install and holds neither (requirements-track.txt does, and only that)."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *rest: None if name == "wandb" else find_spec(name, *rest))
    parse_args("", ["--track", "mlflow"])
    with pytest.raises(SystemExit) as ended:
        parse_args("", ["--track", "mlflow", "--track", "wandb"])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and "argument --track: wandb is not installed in this environment: " \
        "pip install -r requirements-track.txt" in err, err
    pins = {line.split("==")[0] for line in (ROOT / "requirements-track.txt").read_text().splitlines() if "==" in line}
    assert pins == {"mlflow", "wandb"}


def _refused(uri: str, capsys) -> str:
    """Tracker(--track mlflow --tracking-uri uri) run as a script's main() is: its stderr line."""
    args = parse_args("", ["--track", "mlflow", "--tracking-uri", uri])
    with pytest.raises(SystemExit) as ended:
        exit_on_error(lambda argv: Tracker(args))
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_a_closed_port_or_an_unknown_scheme_is_one_line_and_exit_2(capsys):
    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    err = _refused(f"http://127.0.0.1:{port}", capsys)
    assert f"--tracking-uri http://127.0.0.1:{port}: MLflow cannot use it (Connection refused)" in err
    err = _refused("bogus://x", capsys)
    assert "--tracking-uri bogus://x: MLflow cannot use it" in err and "sqlite:///" in err


def test_a_server_that_never_answers_is_refused_in_bounded_time(tmp_path):
    """A socket that accepts and never answers: MLflow's own client waits 120 s per try (its default,
    set here as a user would) and retries 7 times; the check gives up after CHECK_SECONDS, once.
    The bound: that one try of 120 s, which the check must not wait for."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the connections; nothing reads or answers them
    port = silent.getsockname()[1]
    code = ("from src.cli import parse_args; from src.errors import exit_on_error; from src.tracking import Tracker; "
            f"args = parse_args('', ['--track', 'mlflow', '--tracking-uri', 'http://127.0.0.1:{port}']); "
            "exit_on_error(lambda argv: Tracker(args))")
    env = {**os.environ, "MLFLOW_HTTP_REQUEST_TIMEOUT": "120", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "7"}
    try:
        start = time.monotonic()
        result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                                text=True, timeout=120)
        seconds = time.monotonic() - start
    finally:
        silent.close()
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"error: --tracking-uri http://127.0.0.1:{port}: MLflow cannot use it (no answer "
                             f"within {CHECK_SECONDS} s): pass {ADVICE}\n")
    assert CHECK_SECONDS <= seconds < 120


def test_a_tracker_failing_during_the_run_is_one_warning(tmp_path, monkeypatch, capsys):
    """The store fails at the second epoch: one warning line, nothing raised, nothing asked of it
    again in this run; the run is still ended (the server may be back), without its artifacts."""
    from mlflow.exceptions import MlflowException
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path, "--track", "mlflow")
    tracker = Tracker(args)
    ids = tracker.start(None, _context(args))
    tracker.log_epoch(_record(1))
    backend = tracker.backends["mlflow"]
    backend.sender.wait()  # epoch 1 is in the store
    calls = []

    def down(*args, **kwargs):
        calls.append(args)
        raise MlflowException("API request to http://tracking:5000 failed: the server is down")
    monkeypatch.setattr(backend.client, "log_batch", down)
    tracker.log_epoch(_record(2))
    tracker.log_step({"loss": 0.5}, 30)
    tracker.log_epoch(_record(3))
    backend.sender.wait()  # its thread has sent them (in one call) and failed
    assert capsys.readouterr().err == ""  # said by the training thread, at its next call
    tracker.log_epoch(_record(4))
    assert len(calls) == 1
    err = capsys.readouterr().err
    assert err == "warning: MLflow tracking failed (API request to http://tracking:5000 failed: the server is down); " \
                  "training goes on without it\n"
    tracker.finish("FINISHED")
    client, runs = _mlflow_runs(tmp_path)
    assert runs[0].info.status == "FINISHED" and capsys.readouterr().err == ""
    assert [metric.step for metric in client.get_metric_history(ids["mlflow"], "epoch/val_acc")] == [1]


def test_accelerate_trackers_continue_the_saved_runs(tmp_path, monkeypatch):
    """Under accelerate, its own MLflowTracker and WandBTracker (Accelerator(log_with=...),
    init_trackers(PROJECT, init_kwargs=tracker.init_kwargs(...))): the SQLite store beside best.pth,
    the saved ids continued after a stop, each epoch once, the status; accelerate's end_training()
    after finish() changes nothing, and no MLflow URI is left set for a later run."""
    import mlflow
    from accelerate import Accelerator
    from accelerate.tracking import MLflowTracker, WandBTracker
    monkeypatch.setattr(sys, "argv", ["train_accelerate.py"])
    flags = ["--track", "mlflow", "--track", "wandb"]
    saved, contents = None, {}
    for start, (epochs, status) in enumerate((((1, 2), "KILLED"), ((2, 3), "FINISHED"))):
        args = _args(tmp_path, *flags, *(["--resume"] if start else []))
        tracker = Tracker(args)
        accelerator = Accelerator(cpu=True, log_with=tracker.names)
        context = _context(args, "accelerate")
        accelerator.init_trackers(PROJECT, init_kwargs=tracker.init_kwargs(saved, context))
        assert isinstance(accelerator.get_tracker("mlflow"), MLflowTracker)
        assert isinstance(accelerator.get_tracker("wandb"), WandBTracker)
        ids = tracker.start(saved, context, history=[_record(1)] if start else [], accelerator=accelerator)
        assert saved is None or ids == saved
        for epoch in epochs:
            tracker.log_step({"loss": epoch / 10}, epoch * 10)
            tracker.log_epoch(_record(epoch))
        if status == "FINISHED":
            contents = _write_artifacts(tmp_path)
        tracker.finish(status, [tmp_path / name for name in ARTIFACTS] if contents else [])
        accelerator.end_training()
        assert mlflow.active_run() is None and "MLFLOW_TRACKING_URI" not in os.environ
        client, runs = _mlflow_runs(tmp_path)
        assert [(run.info.run_id, run.info.status) for run in runs] == [(ids["mlflow"], status)]
        saved = ids
    run = _assert_mlflow_run(tmp_path, ids["mlflow"], {**context, "flags": {**context["flags"], "resume": False}},
                             contents, steps=(10, 20, 30))
    assert run.info.run_name == "accelerate x1"
    assert run.info.artifact_uri.startswith((tmp_path / "mlartifacts").resolve().as_uri())
    rows = wandb_history(tmp_path, ids["wandb"])
    assert [row["epoch"] for row in rows if "epoch" in row] == [1, 2, 3]
    assert len(wandb_files(tmp_path, ids["wandb"])) == 2


def test_a_wandb_file_cut_short_by_a_kill_reads_up_to_its_last_whole_record(tmp_path, monkeypatch):
    """A process killed while W&B wrote its last record leaves it cut short: a resume still reads the
    epochs before it (and does not log them again)."""
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path, "--track", "wandb")
    tracker = Tracker(args)
    ids = tracker.start(None, _context(args))
    for epoch in (1, 2):
        tracker.log_epoch(_record(epoch))
    tracker.finish("KILLED")
    [path] = wandb_files(tmp_path, ids["wandb"])
    whole = [record.WhichOneof("record_type") for record in wandb_records(path)]
    path.write_bytes(path.read_bytes()[:-3])
    assert [record.WhichOneof("record_type") for record in wandb_records(path)] == whole[:-1]
    resumed = Tracker(_args(tmp_path, "--track", "wandb", "--resume"))
    resumed.start(ids, _context(args), history=[_record(1), _record(2)])
    resumed.log_epoch(_record(3))
    resumed.finish("FINISHED")
    assert [row["epoch"] for row in wandb_history(tmp_path, ids["wandb"]) if "epoch" in row] == [1, 2, 3]


def _mlflow_store(folder: Path) -> Path:
    """A store with one run (tracked and finished here), as a user's earlier run left it."""
    args = _args(folder, "--track", "mlflow")
    tracker = Tracker(args)
    tracker.start(None, _context(args))
    tracker.finish("FINISHED")
    return folder / "mlflow.db"


@pytest.mark.parametrize("kind, said", [
    ("empty", "is an empty file, which MLflow would turn into one): name a new file or an MLflow store"),
    ("text", "is not an SQLite database, which MLflow would turn into one"),
    ("another database", "is an SQLite database without MLflow's tables, and MLflow would add its own"),
    ("truncated store", "MLflow cannot use it (database disk image is malformed)"),
    ("not a database", "MLflow cannot use it (file is not a database)"),
])
def test_a_file_that_is_not_an_mlflow_store_is_refused_and_left_as_it_was(kind, said, tmp_path, monkeypatch, capsys):
    """--tracking-uri sqlite:///.../empty.txt turned a user's empty file into a database; a corrupt,
    truncated or foreign file was refused with SQLAlchemy's "(Background on this error at: ...)"
    for its reason. Now each is one line naming what the file is, and the file is as it was."""
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    path = tmp_path / "store.db"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("notes of mine\n" * 20)
    elif kind == "another database":
        import sqlite3
        with sqlite3.connect(path) as connection:
            connection.execute("CREATE TABLE notes (text TEXT)")
        connection.close()
    else:
        store = _mlflow_store(tmp_path / "run").read_bytes()
        path.write_bytes(store[:4096] if kind == "truncated store" else store[:16] + os.urandom(4096))
    before = path.read_bytes()
    err = _refused(f"sqlite:///{path}", capsys)
    assert f"error: --tracking-uri sqlite:///{path}: MLflow cannot use it (" in err and said in err, err
    assert path.read_bytes() == before and not (tmp_path / "mlartifacts").exists()


def test_a_store_whose_writer_was_killed_in_a_transaction_is_rolled_back_and_tracked_into(tmp_path):
    """A worker killed while MLflow wrote (torchrun stops the other ranks when one dies) leaves a
    journal beside mlflow.db that the next connection must roll back. The store check read the
    file read-only, which cannot, and the restarted run was refused: "MLflow cannot use the store
    beside it (attempt to write a readonly database)". Now it starts, on the store as it was
    before the killed transaction."""
    database = _mlflow_store(tmp_path)
    import sqlite3
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE pad (x BLOB)")
        connection.executemany("INSERT INTO pad VALUES (?)", [(b"x" * 1000,)] * 500)
    connection.close()
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sqlite3, sys, time\n"
        "connection = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "connection.execute('PRAGMA cache_size = 2')  # the change spills into the file, the journal holds the old pages\n"
        "connection.execute('BEGIN IMMEDIATE')\n"
        "connection.execute(\"UPDATE pad SET x = 'y'\")\n"
        "print('written', flush=True)\n"
        "time.sleep(600)\n"), str(database)], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdout.readline() == "written\n"
    finally:
        writer.kill()
        writer.wait()
    assert (tmp_path / "mlflow.db-journal").stat().st_size > 0  # the hot journal is there
    args = _args(tmp_path, "--track", "mlflow")
    tracker = Tracker(args)
    tracker.start(None, _context(args))
    tracker.log_epoch(_record(1))
    tracker.finish("FINISHED")
    client, runs = _mlflow_runs(tmp_path)
    assert sorted(run.info.status for run in runs) == ["FINISHED", "FINISHED"]
    with sqlite3.connect(database) as connection:
        assert connection.execute("SELECT COUNT(*), MIN(x) = MAX(x), MIN(x) FROM pad").fetchone() == (500, 1, b"x" * 1000)
    connection.close()


@pytest.mark.parametrize("uri, said", [
    ("sqlite:///", "is an SQLite database in memory: the tracked run would vanish when the process ends"),
    ("sqlite:///:memory:", "is an SQLite database in memory"),
    ("sqlite://", "is an SQLite database in memory"),
    ("file:///tmp/mlruns", "is MLflow's file store, which MLflow refuses now"),
])
def test_a_store_that_cannot_keep_the_run_is_refused_when_parsed(uri, said, tmp_path, monkeypatch, capsys):
    """sqlite:/// and sqlite:///:memory: were taken: the tracked run vanished at exit and its
    artifacts landed in ./mlruns. MLFLOW_TRACKING_URI="not a uri" was refused with MLflow's "the
    filesystem backend is in maintenance mode"; it is held to --tracking-uri's rule now."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        parse_args("", ["--track", "mlflow", "--tracking-uri", uri])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument --tracking-uri: {uri!r} {said}" in err, err
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "not a uri")
    with pytest.raises(SystemExit):
        parse_args("", ["--track", "mlflow"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: MLFLOW_TRACKING_URI='not a uri' is not a URI: set it to" in err, err
    assert parse_args("", ["--track", "wandb"]).track == ["wandb"]  # MLflow's variable: not MLflow's run
    assert list(tmp_path.iterdir()) == []


def test_the_reason_of_a_store_is_the_databases_own_words():
    """SQLAlchemy's error ends with "(Background on this error at: URL)", which was taken for the
    reason; MLflow re-raises it as text too; an unknown scheme was "Model registry functionality
    is unavailable"."""
    import sqlite3

    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException
    from mlflow.tracking.registry import UnsupportedModelRegistryStoreURIException

    from src.tracking import reason
    locked = sqlalchemy.exc.OperationalError("SELECT 1", {}, sqlite3.OperationalError("database is locked"))
    assert str(locked).endswith("(Background on this error at: https://sqlalche.me/e/21/e3q8)")
    assert reason(locked) == "database is locked"
    try:
        try:
            raise locked
        except sqlalchemy.exc.OperationalError as error:
            raise MlflowException(f"{error}") from error
    except MlflowException as wrapped:
        assert reason(wrapped) == "database is locked"
    assert reason(MlflowException(str(locked))) == "database is locked"  # the text alone
    unsupported = UnsupportedModelRegistryStoreURIException("ftp://x", ["", "file", "http", "https", "sqlite"])
    assert reason(unsupported) == "no MLflow store takes its scheme; MLflow takes http, https, sqlite"


def test_an_unknown_scheme_and_a_locked_store_are_named_at_start(tmp_path, capsys):
    import sqlite3
    err = _refused("ftp://tracking/x", capsys)
    assert "--tracking-uri ftp://tracking/x: MLflow cannot use it (no MLflow store takes its scheme; MLflow " \
           "takes databricks" in err, err
    store = _mlflow_store(tmp_path)
    holder = sqlite3.connect(store, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")  # another program writing there: SQLite's lock, for CHECK_SECONDS
    try:
        err = _refused(f"sqlite:///{store}", capsys)
    finally:
        holder.close()
    assert f"--tracking-uri sqlite:///{store}: MLflow cannot use it (database is locked)" in err, err


def test_the_training_thread_never_waits_for_the_store(tmp_path, monkeypatch):
    """MLflow's log_batch ran on the training thread: against a server whose log-batch took 2 s
    each logged step took 2.09 s there (docs/measurements.md), and under a launcher every rank
    waited for rank 0 at the next collective. Now a thread of the tracker sends them: here the
    store does not answer until the test lets it, and every log call returns meanwhile. Nothing
    is lost: what is queued meanwhile goes in one call, and finish() sends what is left before it
    ends the run. MLflow's request
    settings are put in the environment once, and not changed while the sending thread reads
    them (setenv beside another thread's getenv is undefined behaviour); put back at the end."""
    import threading

    from src.tracking import RUN_REQUEST
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    for name in RUN_REQUEST:
        monkeypatch.delenv(name, raising=False)
    args = _args(tmp_path, "--track", "mlflow")
    tracker = Tracker(args)
    assert {name: os.environ.get(name) for name in RUN_REQUEST} == RUN_REQUEST
    ids = tracker.start(None, _context(args))
    backend = tracker.backends["mlflow"]
    asked, answer, threads, sent = threading.Event(), threading.Event(), [], []
    log_batch = backend.client.log_batch

    def slow(run_id, metrics=(), **kwargs):
        threads.append(threading.current_thread())
        asked.set()
        assert answer.wait(30), "the store was never let answer: something waited for it"
        sent.append(sorted((metric.key, metric.step) for metric in metrics))
        log_batch(run_id, metrics=metrics, **kwargs)

    monkeypatch.setattr(backend.client, "log_batch", slow)
    environ, writes = dict(os.environ), []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "putenv", lambda *change: writes.append(change))
        patch.setattr(os, "unsetenv", lambda *change: writes.append(change))
        tracker.log_step({"loss": 0.1}, 10)
        assert asked.wait(60)  # the store is asked, and holds the sending thread
        for step in (20, 30):
            tracker.log_step({"loss": step / 100}, step)  # returns while the store has not answered
        tracker.log_epoch(_record(1))
        answer.set()
        backend.sender.wait()
    assert writes == [] and dict(os.environ) == environ
    tracker.finish("FINISHED")
    assert threads and all(thread is not threading.main_thread() for thread in threads)
    assert [[step for key, step in batch if key == "step/loss"] for batch in sent] == [[10], [20, 30]]
    client, runs = _mlflow_runs(tmp_path)
    assert sorted(metric.step for metric in client.get_metric_history(ids["mlflow"], "step/loss")) == [10, 20, 30]
    assert [metric.step for metric in client.get_metric_history(ids["mlflow"], "epoch/val_acc")] == [1]
    assert runs[0].info.status == "FINISHED"
    assert all(name not in os.environ for name in RUN_REQUEST), "put back as it was (none set)"


def test_a_store_failing_during_the_run_is_our_one_line_and_no_library_output(tmp_path, monkeypatch, capfd):
    """An MLflow store that fails during the run (locked, or its file replaced): SQLAlchemy's
    errors with their tracebacks came on the terminal through MLflow's logger (about 250 lines)
    around our warning, whose reason was SQLAlchemy's "(Background on this error at: ...)". Now
    the one warning line, naming the database's reason, is all that is printed, by either
    stream; and no logger is left silenced after finish()."""
    import logging

    from src.tracking import LIBRARY_LOGGERS
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    args = _args(tmp_path, "--track", "mlflow")
    levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    tracker = Tracker(args)
    tracker.start(None, _context(args))
    tracker.log_step({"loss": 0.5}, 10)
    tracker.backends["mlflow"].sender.wait()
    capfd.readouterr()
    with open(tmp_path / "mlflow.db", "r+b") as store:  # another program overwrites it
        store.write(b"not a database" * 100)
    tracker.log_step({"loss": 0.4}, 20)
    tracker.backends["mlflow"].sender.wait()
    tracker.log_epoch(_record(1))  # the training thread says it
    tracker.finish("FINISHED")  # a failed store is ended quietly (it cannot be here)
    out, err = capfd.readouterr()
    assert out == "" and err == "warning: MLflow tracking failed (file is not a database); training goes on " \
                                "without it\n", err
    assert {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS} == levels


def test_the_end_of_a_run_whose_store_failed_is_given_up_after_end_seconds(tmp_path, monkeypatch, capsys):
    """A store locked through the end: the failed store's end waited on SQLite's busy timeout for
    each call, and the process exited about 60 s after "done". Now it is tried once, from the
    tracker's thread, for END_SECONDS (here the store never answers), then given up in one line."""
    import threading

    from mlflow.exceptions import MlflowException

    import src.tracking as tracking
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    monkeypatch.setattr(tracking, "END_SECONDS", 0.5)
    args = _args(tmp_path, "--track", "mlflow")
    tracker = Tracker(args)
    ids = tracker.start(None, _context(args))
    backend, held = tracker.backends["mlflow"], threading.Event()

    def locked(*args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    def never(*args, **kwargs):
        held.wait(30)

    monkeypatch.setattr(backend.client, "log_batch", locked)
    monkeypatch.setattr(backend.client, "set_terminated", never)
    monkeypatch.setattr(backend.client, "log_artifact", never)
    tracker.log_step({"loss": 0.5}, 10)
    backend.sender.wait()
    try:
        tracker.finish("FINISHED", [tmp_path / "missing.png"])
    finally:
        held.set()
    assert capsys.readouterr().err == (
        "warning: MLflow tracking failed (database is locked); training goes on without it\n"
        f"warning: MLflow did not end run {ids['mlflow']} within 0.5 s: the store shows it as running\n")


@pytest.mark.parametrize("track, link", [("mlflow", "mlartifacts"), ("wandb", "wandb")])
def test_a_trackers_folder_that_is_a_link_is_refused(track, link, tmp_path, monkeypatch, capsys):
    """wandb/ or mlartifacts/ beside --checkpoint that are links to a user's folder were followed
    and written into. Refused at start, the user's folder as it was."""
    monkeypatch.setattr(sys, "argv", ["train_single.py"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / link).symlink_to(mine)
    args = _args(tmp_path / "run", "--track", track)
    with pytest.raises(SystemExit) as ended:
        exit_on_error(lambda argv: Tracker(args))
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'run' / link} is a symbolic link to {mine}" in err and "remove the link" in err, err
    assert list(mine.iterdir()) == []
