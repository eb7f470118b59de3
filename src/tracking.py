"""Experiment tracking (--track mlflow, --track wandb): one tracked run per training run, across
every stop, from rank 0 / the main process only.

    tracker = Tracker(args)                                  # checks the store: UserError if it cannot be used
    ids = tracker.start(saved_ids, context, history)         # a new run, or the saved one continued
    tracker.log_epoch(record)                                # each epoch once, whoever logs it
    tracker.log_step(values, step)                           # step metrics, each step once
    tracker.finish("FINISHED" | "KILLED" | "FAILED", [best.pth, best.json, curves])

In the scripts: main() makes it on rank 0 right after the outputs are checked, and ends it with the
run's status (`with lock_outputs(args), rank_0_tracker(args) as tracker:`); train() hands it to the
training state after the resume (src/state.py `state.track(tracker)`: start() with last.pth's ids,
the ids into every last.pth and best.json, log_epoch() after each epoch's save); src/progress.py
sends the step metrics (log_step()).

MLflow: without --tracking-uri (or MLFLOW_TRACKING_URI), a SQLite store beside --checkpoint
(`mlflow.db`, its artifacts in `mlartifacts/`), which `mlflow ui --backend-store-uri
sqlite:///model/mlflow.db` opens. The client is MlflowClient with explicit run ids: no global
active run, so that a script's main() can run several times in one process. W&B: offline unless
WANDB_MODE says otherwise, its files in `wandb/` beside --checkpoint, never a login prompt.

The ids (`{"mlflow": run id, "wandb": run id}`) go into last.pth and best.json; a resumed run, a
torchrun restart or a requeued job hands them back to start(), which continues those runs. Each
epoch's and step's metrics are logged once: start() reads back what the run already holds (MLflow's
metric history; the W&B run's own .wandb files beside it), log_epoch() and log_step() skip what
is there, and the epochs of the resumed history that the run lacks (a run stopped between saving
an epoch and logging it, or one that starts tracking at a resume) are logged at start.

A store that cannot be reached at start is a UserError (one line, exit 2, before any work); a
tracker that fails later is one warning line and the run goes on without it: tracking never costs
a checkpoint. Under train_accelerate.py the runs go through accelerate's own trackers
(accelerate.tracking.MLflowTracker, WandBTracker), on the main process:

    accelerator = Accelerator(log_with=requested(args) + [...], ...)
    if accelerator.is_main_process:   # WandBTracker starts on every process that calls init_trackers
        tracker = Tracker(args)
        accelerator.init_trackers(PROJECT, init_kwargs=tracker.init_kwargs(saved_ids, context))
        ids = tracker.start(saved_ids, context, history, accelerator=accelerator)
    ...
    tracker.finish(status, artifacts)  # before accelerator.end_training(), which ends runs as finished

MLflowTracker takes no URI: init_kwargs() sets MLflow's process-wide one (mlflow.set_tracking_uri,
which also sets MLFLOW_TRACKING_URI in os.environ) and finish() puts the earlier one back. The
saved MLflow id reaches it as `run_id` (mlflow.start_run(run_id=...) sets it RUNNING again), the
artifact folder as `logging_dir` (a new experiment's artifact_location); the W&B id as `id` with
`resume="allow"`, the folder as `dir`, the mode as `mode`.
"""
import collections
import contextlib
import dataclasses
import logging
import os
import re
import secrets
import shutil
import sqlite3
import string
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from src.config import Config
from src.errors import EXIT_STOPPED, UserError, one_line

BACKENDS = ("mlflow", "wandb")
# MLflow's experiment and W&B's project, the same for the five modes, so that their runs sit in one
# table (MLFLOW_EXPERIMENT_NAME names another experiment, as it does for accelerate's MLflowTracker).
PROJECT = "dogs-vs-cats"
STATUSES = ("FINISHED", "KILLED", "FAILED")  # MLflow's RunStatus names
# W&B marks a run by its exit code: 0 finished, any other failed (a stopped run is resumed later).
EXIT_CODES = {"FINISHED": 0, "KILLED": EXIT_STOPPED, "FAILED": 1}
# MLflow's HTTP client retries 7 times with a backoff of minutes by default; at start a store is
# asked once and given this long (a closed port answers at once, a dropped packet never does).
CHECK_SECONDS = 5
# During the run, per request unless the user set MLflow's own variables: a server gone down costs
# the run seconds once, then tracking stops.
RUN_REQUEST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
CHECK_REQUEST = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(CHECK_SECONDS)}
ADVICE = ("a server's http(s)://HOST:PORT, a database such as sqlite:///PATH/mlflow.db, or no "
          "--tracking-uri for the store beside --checkpoint")
# A URI starts with its scheme (RFC 3986): a plain path would be MLflow's file store, which it refuses.
URI_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
SQLITE_HEADER = b"SQLite format 3\0"  # the first 16 bytes of every SQLite database file
MLFLOW_TABLES = ("experiments", "runs")  # in every MLflow store
# MLflow's loggers and those of the libraries it calls: while a tracker lives their records
# (SQLAlchemy's errors with their tracebacks, urllib3's retries, alembic's migrations) stay off
# the terminal; the tracker says what failed, in one line.
LIBRARY_LOGGERS = ("mlflow", "alembic", "sqlalchemy", "urllib3")
# How long finish() waits to end a run whose store failed during the run (it is still ended: the
# server may be back). A working store's last records and artifacts are waited for: each request
# is bounded by RUN_REQUEST, and a SQLite store by MLflow's 20 s busy timeout.
END_SECONDS = 5


def requested(args: Config) -> list[str]:
    """The backends that --track names, each once, in the order given."""
    return list(dict.fromkeys(args.track or []))


def default_uri(folder: Path) -> str:
    """The SQLite store beside the checkpoint: sqlite:////absolute/folder/mlflow.db."""
    return "sqlite:///" + str(Path(folder).resolve() / "mlflow.db")


def parameters(context: dict) -> dict:
    """What a run logs as its parameters: every flag (context["flags"]), the mode, the processes and
    the machine (context: src.checkpoint.run_context's keys)."""
    return {**context.get("flags", {}), **{key: context[key] for key in ("mode", "processes", "hardware")
                                          if key in context}}


def run_name(context: dict) -> str:
    """The tracked run's name: the mode and its processes ("ddp x2")."""
    return f"{context.get('mode', 'run')} x{context.get('processes', 1)}"


def numbers(values: dict) -> dict[str, float]:
    """The numeric entries of `values` (a history record has no other kind), as floats."""
    return {key: float(value) for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def reason(error: BaseException) -> str:
    """A short reason for a tracker's error. A database's own words, found in SQLAlchemy's error
    (its `orig`) or in the text MLflow made of it ("database is locked", "file is not a
    database"; SQLAlchemy's text ends with "(Background on this error at: URL)"); a URI scheme
    that no MLflow store takes, named; MLflow's HTTP errors carry the whole chain of urllib3's (a
    URL, "Max retries exceeded", "Caused by ..."): the socket's own words are taken from it
    ("Connection refused"), a read timeout or an HTTP status said plainly; any other error, its
    first sentence."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:  # the chain, innermost last
        seen.add(id(cause))
        orig = getattr(cause, "orig", None)
        if orig is not None:  # sqlalchemy.exc.DBAPIError: the driver's error
            return one_line(orig)
        if hasattr(cause, "supported_uri_schemes"):  # MLflow's UnsupportedModelRegistryStoreURIException
            schemes = [scheme for scheme in cause.supported_uri_schemes if scheme not in ("", "file")]
            return f"no MLflow store takes its scheme; MLflow takes {', '.join(schemes)}"
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, OSError) and error.strerror:
        return error.strerror + (f": {error.filename}" if error.filename else "")
    text = str(error)
    found = re.search(r"\((?:sqlite3|psycopg2?|pymysql|MySQLdb|pyodbc)[\w.]*\) ([^\n\[]+)", text)
    if found:  # SQLAlchemy's error as MLflow re-raised it: "(sqlite3.OperationalError) database is locked"
        return found.group(1).strip()
    found = re.search(r"\[Errno -?\d+\] ([^'\"()]+)", text)
    if found:
        return found.group(1).strip().rstrip(":")
    found = re.search(r"read timeout=([\d.]+)", text)
    if found:
        return f"no answer within {found.group(1)} s"
    found = re.search(r"error code (\d+) != 200", text)
    if found:
        return f"it answered HTTP {found.group(1)}"
    return re.split(r"(?<=[.!?])\s", one_line(error), maxsplit=1)[0][:300]


def _set_environment(values: dict, override: bool) -> dict:
    """Set MLflow's request settings (it reads them from os.environ at each request); returns what
    to put back (_put_back). `override` replaces the user's own, else they are kept. Called on the
    main thread while no thread of ours makes a request: setenv while another thread calls getenv
    is undefined behaviour (POSIX), and glibc frees the old environment array it extends."""
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if override or saved[name] is None:
            os.environ[name] = value
    return saved


def _put_back(saved: dict) -> None:
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def _environment(values: dict, override: bool):
    """_set_environment for the calls inside, put back after."""
    saved = _set_environment(values, override)
    try:
        yield
    finally:
        _put_back(saved)


def _quiet_libraries() -> dict[str, int]:
    """LIBRARY_LOGGERS silenced; returns their levels, for _loud_again."""
    levels = {name: logging.getLogger(name).level for name in LIBRARY_LOGGERS}
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    return levels


def _loud_again(levels: dict[str, int]) -> None:
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)


def mlflow_uri(args: Config, folder: Path) -> tuple[str, str]:
    """(the MLflow store's URI, what gave it: "--tracking-uri", "MLFLOW_TRACKING_URI" or
    "--checkpoint" for the SQLite store beside it in `folder`)."""
    uri = args.tracking_uri
    if uri:
        return uri, "--tracking-uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    return default_uri(folder), "--checkpoint"


def uri_problem(uri: str) -> str | None:
    """What the form of an MLflow URI says is wrong with it ("is not a URI", ...), or None: a plain
    path (MLflow's file store, which MLflow refuses now: file: too), an SQLite database in memory
    (sqlite://, sqlite:///, sqlite:///:memory:: the run vanishes when the process ends, and its
    artifacts land in ./mlruns)."""
    if not URI_SCHEME.match(uri):
        return "is not a URI"
    scheme = uri.split(":", 1)[0].lower()
    if scheme == "file":
        return "is MLflow's file store, which MLflow refuses now"
    if scheme.split("+")[0] == "sqlite" and sqlite_file(uri) is None:
        return "is an SQLite database in memory: the tracked run would vanish when the process ends"
    return None


def _store_file_problem(database: Path) -> str | None:
    """What is wrong with the file of a sqlite:/// store, or None: nothing there yet (MLflow makes
    it), or an SQLite database holding MLflow's tables. Anything else is not MLflow's to write
    into: a user's empty file, another file, another program's database."""
    if not os.path.lexists(database):
        return None
    if not os.path.isfile(database):
        what = ("a symbolic link to " + os.readlink(database) if os.path.islink(database)
                else "a folder" if os.path.isdir(database) else "not a regular file")
        return f"{database} is {what}, not a database file"
    try:
        with open(database, "rb") as file:
            head = file.read(len(SQLITE_HEADER))
    except OSError as error:
        return f"{database} cannot be read ({error.strerror})"
    if head != SQLITE_HEADER:
        return f"{database} is {'an empty file' if not head else 'not an SQLite database'}, which MLflow would turn into one"
    # Read-write, though only read: a writer killed inside a transaction (a worker torchrun stopped)
    # leaves a journal that the next connection must roll back, which a read-only one cannot do
    # ("attempt to write a readonly database"). mode=rw never creates the file.
    connection = sqlite3.connect(f"{Path(database).resolve().as_uri()}?mode=rw", uri=True, timeout=CHECK_SECONDS)
    try:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    finally:
        connection.close()
    if not set(MLFLOW_TABLES) <= tables:
        return f"{database} is an SQLite database without MLflow's tables, and MLflow would add its own"
    return None


def store_outputs(args: Config) -> list[tuple[str, Path]]:
    """What --track mlflow writes on this machine, named as its source names it: the database file
    of a sqlite:/// store and its artifacts folder (mlartifacts/ beside it); for src.outputs, which
    keeps every output of a run out of the data folder."""
    if "mlflow" not in requested(args):
        return []
    uri, source = mlflow_uri(args, Path(args.checkpoint).parent)
    database = sqlite_file(uri)
    if database is None:
        return []
    named = "the store beside --checkpoint" if source == "--checkpoint" else f"{source}'s database"
    return [(named, database), (f"{named}'s mlartifacts/", database.resolve().parent / "mlartifacts")]


def _not_a_link(folder: Path, writer: str, flag: str) -> None:
    """Refuse a folder that a tracker writes into which is a symbolic link: a user's folder it
    points to would be written into."""
    if os.path.islink(folder):
        raise UserError(f"{flag}: {folder} is a symbolic link to {os.readlink(folder)}, and {writer} would write "
                        "into the folder it points to: remove the link, or track from another folder")


class _MLflow:
    key, name = "mlflow", "MLflow"

    def __init__(self, uri: str, source: str):
        """Checks the URI and what is there (uri_problem, _store_file_problem, the artifacts folder),
        connects to the store and asks it for one experiment: a UserError naming `source` (what
        gave the URI: --tracking-uri, MLFLOW_TRACKING_URI or --checkpoint) if that fails."""
        from mlflow import MlflowClient
        self.uri, self.source = uri, source
        self.run_id = ""  # start() sets it
        self.epochs: set[int] = set()
        self.last_step, self.started = 0, False
        self.accelerated: Any = None  # accelerate's MLflowTracker (unannotated), under accelerate
        self.sender: _Sender | None = None
        problem = uri_problem(uri)
        if problem is not None:
            raise UserError(_unusable(source, uri, f"it {problem}"))
        self.artifacts = _artifact_root(uri)
        database = sqlite_file(uri)
        try:
            if database is not None:
                problem = _store_file_problem(database)
                if problem is not None:
                    raise UserError(_unusable(source, uri, problem, "name a new file or an MLflow store"))
                _not_a_link(database.resolve().parent / "mlartifacts", "MLflow (its artifacts)", source)
                database.parent.mkdir(parents=True, exist_ok=True)  # SQLite makes the file, not its folder
            with _environment(CHECK_REQUEST, override=True):
                self.client = MlflowClient(tracking_uri=uri)
                self.client.search_experiments(max_results=1)
        except UserError:
            raise
        except Exception as error:  # any failure of the store: a bad scheme, a refused connection, a 403
            raise UserError(_unusable(source, uri, reason(error))) from None

    def init_kwargs(self, saved_id: str | None, context: dict) -> dict:
        """accelerate's MLflowTracker(experiment_name, logging_dir, run_id, run_name, tags): it takes
        no URI, so MLflow's process-wide one is set here (and put back by finish())."""
        import mlflow
        if saved_id is not None:
            self._saved(saved_id)  # here: MLflowTracker.start() would fail inside init_trackers()
        self.previous_uri = os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.uri)
        kwargs = {"run_id": saved_id, "run_name": run_name(context)}
        if self.artifacts is not None:  # where a new experiment keeps its artifacts
            kwargs["logging_dir"] = self.artifacts
        return kwargs

    def start(self, saved_id: str | None, context: dict, history: Sequence[dict], accelerator: Any) -> str:
        from mlflow.entities import Param
        if accelerator is not None:  # MLflowTracker.start() created or resumed the run
            self.accelerated = accelerator.get_tracker("mlflow")
            self.run_id = self.accelerated.tracker.info.run_id
        elif saved_id is not None:
            run = self._saved(saved_id)
            self.run_id = run.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(
                experiment, artifact_location=self.artifacts)
            self.run_id = self.client.create_run(experiment_id, run_name=run_name(context)).info.run_id
        if saved_id is None:  # a new run: its parameters (a resumed run has them, and --resume differs)
            values = {key: str(value) for key, value in parameters(context).items()}
            if self.accelerated is not None:
                self.accelerated.store_init_configuration(values)
            else:
                items = [Param(key, value[:6000]) for key, value in values.items()]
                for first in range(0, len(items), 100):  # MLflow's most per request
                    self.client.log_batch(self.run_id, params=items[first:first + 100])
        else:
            self.epochs, self.last_step = self._logged()
        self.sender = _Sender(self._send, f"{self.name} logging")
        self.started = True
        return self.run_id

    def _saved(self, saved_id: str):
        from mlflow.exceptions import MlflowException
        try:
            run = self.client.get_run(saved_id)
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            raise UserError(f"last.pth's MLflow run {saved_id} is not in {self.uri} ({self.source}): pass "
                            "the --tracking-uri the run was started with, or --overwrite for a new run")
        return run

    def _logged(self) -> tuple[set[int], int]:
        """The epochs whose metrics the run holds, and its last step of step metrics."""
        keys = self.client.get_run(self.run_id).data.metrics
        epochs = next((key for key in keys if key.startswith("epoch/")), None)
        logged = {metric.step for metric in self.client.get_metric_history(self.run_id, epochs)} if epochs else set()
        last = max((metric.step for key in keys if key.startswith("step/")
                    for metric in self.client.get_metric_history(self.run_id, key)), default=0)
        return logged, last

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        """`values` at `step` (`axis` names the step for W&B; MLflow has one per metric), queued for
        the sending thread (_Sender), stamped now. Under accelerate too, on the run's id: its
        MLflowTracker.log calls mlflow.log_metrics, whose active run is the calling thread's."""
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        if self.sender is None:
            raise RuntimeError("MLflow's log() before its start()")
        self.sender.metrics([Metric(key, value, now, step) for key, value in values.items()])

    def _send(self, metrics: list) -> None:
        self.client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str, artifacts: list[Path]) -> None:
        try:
            for path in artifacts:
                if self.accelerated is not None:
                    self.accelerated.log_artifact(str(path))
                else:
                    self.client.log_artifact(self.run_id, str(path))
        finally:  # the run ends with its status whatever became of its artifacts
            if self.accelerated is not None:
                import mlflow
                active = mlflow.active_run()
                try:
                    if active is not None and active.info.run_id == self.run_id:
                        mlflow.end_run(status)  # accelerate's end_training() then finds no run to end
                finally:
                    # set by init_kwargs: no later run inherits it (None, the environment's unset, unsets it)
                    mlflow.set_tracking_uri(self.previous_uri)  # type: ignore[arg-type]  # annotated str | Path
                    self.accelerated = None
            self.client.set_terminated(self.run_id, status)


def _unusable(source: str, uri: str, why: str, advice: str | None = None) -> str:
    """The line for a store that MLflow cannot use, with what to do about it (`advice`, else how to
    name another store)."""
    if source == "--checkpoint":
        return f"--checkpoint: MLflow cannot use the store beside it, {uri} ({why})" + (f": {advice}" if advice else "")
    if source == "MLFLOW_TRACKING_URI":
        return (f"MLFLOW_TRACKING_URI={uri}: MLflow cannot use it ({why}): " + (advice or (
            "set it to a server's http(s)://HOST:PORT or a database such as sqlite:///PATH/mlflow.db, or unset it "
            "for the store beside --checkpoint")))
    return f"--tracking-uri {uri}: MLflow cannot use it ({why}): " + (advice or f"pass {ADVICE}")


def sqlite_file(uri: str) -> Path | None:
    """The database file of a sqlite:/// URI (sqlite:///relative/path, sqlite:////absolute/path);
    None for another store or SQLite in memory."""
    if not uri.startswith("sqlite:///"):
        return None
    name = uri.removeprefix("sqlite:///").split("?")[0]
    return Path(name) if name and name != ":memory:" else None


def _artifact_root(uri: str) -> str | None:
    """Where a new experiment of a SQLite store keeps its artifacts: `mlartifacts/` beside the
    database file (MLflow's default would be ./mlruns in the working directory). A server or
    another database: its own default."""
    database = sqlite_file(uri)
    return None if database is None else database.resolve().parent.joinpath("mlartifacts").as_uri()


class _WandB:
    key, name = "wandb", "W&B"

    def __init__(self, folder: Path):
        """Offline unless WANDB_MODE asks for more; online, it needs credentials already there (no
        prompt): a UserError if there are none."""
        _not_a_link(Path(folder) / "wandb", "W&B", "--checkpoint")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb
        self.wandb, self.folder = wandb, Path(folder)
        self.mode = os.environ.get("WANDB_MODE") or "offline"
        self.run: Any = None  # start()'s: wandb.init's Run, or accelerate's tracker of it (unannotated)
        self.run_id = ""  # init_kwargs() sets it
        self.epochs: set[int] = set()
        self.last_step = 0
        self.accelerated: Any = None
        self.started = False
        if self.mode not in ("offline", "dryrun", "disabled"):
            try:
                logged_in = wandb.login(prompt=False, verify=False)
            except Exception as error:
                raise UserError(f"WANDB_MODE={self.mode}: W&B cannot log in ({reason(error)}): "
                                "set WANDB_API_KEY or run `wandb login`, or unset WANDB_MODE to track offline") from None
            if not logged_in:
                raise UserError(f"WANDB_MODE={self.mode} but W&B has no API key: set WANDB_API_KEY or run "
                                "`wandb login`, or unset WANDB_MODE to track offline")

    def init_kwargs(self, saved_id: str | None, context: dict) -> dict:
        """wandb.init's arguments but the project (accelerate's WandBTracker passes its own)."""
        self.run_id = saved_id or new_wandb_id()
        self.folder.mkdir(parents=True, exist_ok=True)
        return {"id": self.run_id, "resume": "allow", "dir": str(self.folder), "mode": self.mode,
                "name": run_name(context), "config": parameters(context) if saved_id is None else None,
                "settings": self.wandb.Settings(silent=True, console="off")}

    def start(self, saved_id: str | None, context: dict, history: Sequence[dict], accelerator: Any) -> str:
        if accelerator is not None:
            self.run = accelerator.get_tracker("wandb", unwrap=True)
            self.accelerated = accelerator.get_tracker("wandb")
        else:
            self.run = self.wandb.init(project=PROJECT, **self.init_kwargs(saved_id, context))
            self.accelerated = None
        # Epoch and step metrics on their own x axes (W&B's own step only grows).
        self.run.define_metric("epoch")
        self.run.define_metric("epoch/*", step_metric="epoch")
        self.run.define_metric("optimizer_step")
        self.run.define_metric("step/*", step_metric="optimizer_step")
        if saved_id is not None:
            try:
                self.epochs, self.last_step = wandb_logged(self.folder, self.run_id)
            except Exception as error:  # files of another wandb's format: the saved epochs were logged
                print(f"warning: W&B cannot read run {self.run_id}'s files in {self.folder / 'wandb'} "
                      f"({reason(error)}): the resumed epochs count as logged", file=sys.stderr)
                self.epochs = {record["epoch"] for record in history}
        self.started = True
        return self.run_id

    def log(self, values: dict[str, float], step: int, axis: str) -> None:
        """`values` with their x axis, `axis` = `step` (W&B's own step counts the rows)."""
        if self.accelerated is not None:
            self.accelerated.log({**values, axis: step})
        else:
            self.run.log({**values, axis: step})

    def finish(self, status: str, artifacts: list[Path]) -> None:
        """The artifacts go into the run's files/ folder, which W&B uploads (offline: at `wandb sync`)."""
        try:
            files = Path(self.run.dir)
            for path in artifacts if self.mode != "disabled" else ():  # a disabled run has no folder
                copy = files / path.name
                with contextlib.suppress(FileNotFoundError):
                    copy.unlink()
                try:  # best.pth is replaced by a rename, never rewritten: a link keeps this one
                    os.link(path, copy)
                except OSError:
                    shutil.copy2(path, copy)
                self.run.save(str(copy), base_path=str(files), policy="now")
            self.run.summary["status"] = status
        finally:
            try:
                self.run.finish(exit_code=EXIT_CODES[status])  # accelerate's end_training() then finds it finished
            finally:
                # finish() returns before W&B's service has written the run's last records (measured:
                # 4 of 8 files complete right after it); a resume in this process reads them.
                self.wandb.teardown()


def new_wandb_id() -> str:
    """A new W&B run id, as W&B draws them: 8 characters of [a-z0-9]."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


def wandb_files(folder: Path, run_id: str) -> list[Path]:
    """The .wandb files of run `run_id` under folder/wandb/, one per start (resumes included), oldest
    first. W&B names each start's folder [offline-]run-YYYYMMDD_HHMMSS-ID, with -N added for a
    second start within the same second."""
    named = re.compile(rf"(?:offline-)?run-(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for path in (Path(folder) / "wandb").glob(f"*/run-{run_id}.wandb"):
        match = named.fullmatch(path.parent.name)
        if match:
            found.append(((match.group(1), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def wandb_records(path: Path):
    """The records of a .wandb file (wandb.proto's Record): a header (":W&B", magic, version), then
    LevelDB's log format in 32 KiB blocks, each record a header (CRC-32C, length, type: full, or
    first, middle and last pieces) and its bytes; a block's last bytes under a header are zeros."""
    from wandb.proto import wandb_internal_pb2
    data, block = path.read_bytes(), 32768
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a .wandb file")
    position, pieces = 7, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0:  # padding to the end of the block
            position += left
            continue
        if position + 7 + length > len(data):  # the last record of a process killed while writing it
            return
        pieces += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or a record's last piece
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # protobuf makes its classes at import
            record.ParseFromString(pieces)
            pieces = b""
            yield record


def wandb_history(folder: Path, run_id: str) -> list[dict]:
    """The rows that run `run_id` logged, every start's, in order: {key: value}."""
    import json
    rows = []
    for path in wandb_files(folder, run_id):
        for record in wandb_records(path):
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def wandb_logged(folder: Path, run_id: str) -> tuple[set[int], int]:
    """The epochs whose metrics W&B run `run_id` holds, and its last optimizer step, read from its
    files beside the checkpoint (offline or not, W&B writes them)."""
    rows = wandb_history(folder, run_id)
    epochs = {int(row["epoch"]) for row in rows if "epoch" in row}
    return epochs, max((int(row["optimizer_step"]) for row in rows if "optimizer_step" in row), default=0)


class _Sender:
    """A thread that makes one store's calls, in order, while training goes on: MLflow's log_batch
    waits for its store (a slow server, a locked SQLite file), and rank 0 waiting there held every
    rank at the next collective. The metrics queued meanwhile go in one call (up to MLflow's 1000
    a request). The first call of metrics that fails ends them: `error` keeps it for the main
    thread to say, and the metrics queued or sent later are dropped (the store is not asked again
    in this run). call() queues another call (the end of the run) and returns its Future. A daemon
    thread: one stuck in a store does not keep the process from exiting."""

    BATCH = 1000

    def __init__(self, send: Callable[[list], None], name: str):
        self.send = send
        self.jobs: collections.deque = collections.deque()
        self.condition = threading.Condition()
        self.busy = False
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def metrics(self, items: list) -> None:
        with self.condition:
            if self.error is None:
                self.jobs.append((items, None))
                self.condition.notify_all()

    def call(self, function: Callable[[], None]) -> Future:
        done: Future = Future()
        with self.condition:
            self.jobs.append((function, done))
            self.condition.notify_all()
        return done

    def wait(self) -> None:
        """Until every queued call is made (or dropped)."""
        with self.condition:
            self.condition.wait_for(lambda: not self.jobs and not self.busy)

    def close(self) -> None:
        """The thread ends after what is queued."""
        with self.condition:
            self.jobs.append((None, None))
            self.condition.notify_all()

    def _run(self) -> None:
        while True:
            with self.condition:
                self.condition.wait_for(lambda: self.jobs)
                job, done = self.jobs.popleft()
                if job is None:
                    return
                while done is None and self.jobs and self.jobs[0][1] is None and self.jobs[0][0] is not None \
                        and len(job) + len(self.jobs[0][0]) <= self.BATCH:
                    job = job + self.jobs.popleft()[0]
                self.busy = True
            try:
                if done is None:
                    self.send(job)
                elif done.set_running_or_notify_cancel():
                    job()
                    done.set_result(None)
            except BaseException as error:
                if done is not None:
                    done.set_exception(error)
                else:
                    with self.condition:
                        self.error = error
                        self.jobs = collections.deque(item for item in self.jobs if item[1] is not None)
            finally:
                with self.condition:
                    self.busy = False
                    self.condition.notify_all()


class Tracker:
    """The run's trackers (--track), on rank 0 / the main process; without --track it does nothing.
    From its making to finish() MLflow's request settings (RUN_REQUEST) are in the environment,
    and the libraries' loggers are silent (LIBRARY_LOGGERS)."""

    def __init__(self, args: Config, folder: Path | None = None):
        """Checks each store now, before any work: a UserError (one line, exit 2) if one cannot be
        used. `folder`: where the default stores go (by default --checkpoint's folder)."""
        self.folder = Path(folder if folder is not None else Path(args.checkpoint).parent)
        self.backends: dict[str, _MLflow | _WandB] = {}
        self.ids: dict[str, str] = {}
        self.failed: set[str] = set()
        self.environment: dict[str, str | None] = {}
        self.levels: dict[str, int] = {}
        names = requested(args)
        if "mlflow" in names:
            import mlflow  # noqa: F401  # its import sets its loggers' levels: quieted after it
            self.levels = _quiet_libraries()
        try:
            for name in names:
                if name == "mlflow":
                    self.backends[name] = _MLflow(*mlflow_uri(args, self.folder))
                else:
                    self.backends[name] = _WandB(self.folder)
        except BaseException:
            _loud_again(self.levels)
            raise
        if "mlflow" in names:  # once, here: no thread of the run is making requests yet
            self.environment = _set_environment(RUN_REQUEST, override=False)

    @property
    def names(self) -> list[str]:
        """The backends, as accelerate's log_with names them."""
        return list(self.backends)

    def init_kwargs(self, saved_ids: dict | None, context: dict) -> dict:
        """accelerate's init_trackers(PROJECT, init_kwargs=...) for Accelerator(log_with=names), on
        the main process only (WandBTracker's start() runs on every process that calls it): the
        saved ids continue their runs (MLflowTracker's run_id, WandBTracker's id with
        resume="allow"), MLflow's URI is set process-wide for MLflowTracker, W&B's folder and mode
        as in start(). Call start(..., accelerator=) after init_trackers."""
        saved = saved_ids or {}
        return {name: backend.init_kwargs(saved.get(name), context) for name, backend in self.backends.items()}

    def start(self, saved_ids: dict | None, context: dict, history: Sequence[dict] = (), accelerator: Any = None) -> dict:
        """Starts each run, or continues the saved one (`saved_ids`: last.pth's, None for a new
        run), and logs the epochs of `history` (the resumed records) that it lacks. `context`:
        src.checkpoint.run_context(args) (or run_info, which holds it): a new run logs its flags,
        mode, processes and machine as parameters, and is named by its mode and processes. Returns
        the ids to save in last.pth and best.json (with any saved id of a backend not tracked now).
        `accelerator`: under accelerate, after init_trackers(PROJECT, init_kwargs=init_kwargs(...))."""
        saved = dict(saved_ids or {})
        for name, backend in self.backends.items():
            try:
                self.ids[name] = backend.start(saved.get(name), context, history, accelerator)
            except UserError:
                raise
            except Exception as error:
                where = f"run {saved[name]}" if saved.get(name) else "a new run"
                raise UserError(f"{backend.name} could not start {where} ({reason(error)})") from None
        for record in history:
            self.log_epoch(record)
        return {**saved, **self.ids}

    def log_epoch(self, record: dict) -> None:
        """A history record's fields as metrics `epoch/<field>` at its epoch; an epoch the run
        holds already is skipped. (MLflow's are sent by its thread: a failure is said at the next
        call or at finish().)"""
        epoch = record["epoch"]
        values = {f"epoch/{key}": value for key, value in numbers(record).items() if key != "epoch"}
        for name, backend in self._working():
            if epoch in backend.epochs:
                continue
            if self._guarded(backend, lambda: backend.log(values, epoch, "epoch")):
                backend.epochs.add(epoch)

    def log_step(self, values: dict, step: int) -> None:
        """Step metrics `step/<name>` at an optimizer step; a step not after the run's last is skipped."""
        named = {(key if key.startswith("step/") else f"step/{key}"): value for key, value in numbers(values).items()}
        for name, backend in self._working():
            if step <= backend.last_step or not named:
                continue
            if self._guarded(backend, lambda: backend.log(named, step, "optimizer_step")):
                backend.last_step = step

    def finish(self, status: str, artifacts: Sequence[Path] = ()) -> None:
        """Ends each run with `status` ("FINISHED", "KILLED": stopped on a signal, "FAILED": an
        error), after logging the files of `artifacts` that exist (best.pth, best.json, the curves).
        Call it before accelerate's end_training(), which would end the runs as finished."""
        if status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        files = [Path(path) for path in artifacts if Path(path).is_file()]
        try:
            for name, backend in self.backends.items():
                if backend.started:  # a failed one is still ended: the server may be back
                    self._end(name, backend, status, files)
        finally:
            self.backends = {}
            _put_back(self.environment)
            _loud_again(self.levels)
            self.environment, self.levels = {}, {}

    def _end(self, name: str, backend, status: str, files: list[Path]) -> None:
        """One backend's end: its queued records sent first; then its artifacts (none for a store
        that failed during the run) and status, from its sending thread where it has one, waited
        for at most END_SECONDS when it failed (the run then shows as running there)."""
        sender = getattr(backend, "sender", None)
        if sender is not None:
            sender.wait()
            self._said(name, backend)
        failed = name in self.failed
        files = [] if failed else files
        if sender is None or backend.accelerated is not None:  # MLflow's fluent API: this thread's run
            self._guarded(backend, lambda: backend.finish(status, files), quiet=failed)
        else:
            done = sender.call(lambda: backend.finish(status, files))
            try:
                error = done.exception(timeout=END_SECONDS if failed else None)
            except TimeoutError:
                print(f"warning: {backend.name} did not end run {backend.run_id} within {END_SECONDS} s: the store "
                      "shows it as running", file=sys.stderr)
                error = None
            if error is not None and not failed:
                self._warn(backend, error)
        if sender is not None:
            sender.close()

    def _working(self):
        for name, backend in self.backends.items():
            self._said(name, backend)
        return [(name, backend) for name, backend in self.backends.items()
                if name not in self.failed and backend.started]

    def _said(self, name: str, backend) -> None:
        """A failure of the backend's sending thread, said once (its warning)."""
        error = getattr(getattr(backend, "sender", None), "error", None)
        if error is not None and name not in self.failed:
            self._warn(backend, error)

    def _warn(self, backend, error: BaseException) -> None:
        print(f"warning: {backend.name} tracking failed ({reason(error)}); training goes on without it",
              file=sys.stderr)
        self.failed.add(backend.key)

    def _guarded(self, backend, call, quiet: bool = False) -> bool:
        """call(); a failure is one warning line, and this backend is not asked again in this run."""
        try:
            call()
            return True
        except Exception as error:
            if quiet or backend.key in self.failed:
                self.failed.add(backend.key)
            else:
                self._warn(backend, error)
            return False


@contextlib.contextmanager
def rank_0_tracker(args: Config) -> Iterator[Tracker]:
    """with rank_0_tracker(args) as tracker: the run's Tracker on rank 0 / the main process, its
    stores checked now (a UserError on every rank: rank 0's), one that tracks nothing elsewhere.
    When the block ends the tracked runs end with it: FINISHED with best.pth, best.json and the
    curves; KILLED on a stop on a signal (src.errors.Stopped) or Ctrl-C; FAILED on an error. Under
    accelerate, the block ends before accelerator.end_training(), which would end them FINISHED."""
    from src.errors import Stopped
    from src.outputs import output_paths
    from src.ranks import from_rank_0  # here: it loads torch.distributed
    made = []
    from_rank_0(lambda: made.append(Tracker(args)))  # nothing is sent: every rank learns of an error
    tracker = made[0] if made else Tracker(dataclasses.replace(args, track=None))  # no --track
    try:
        yield tracker
    except (Stopped, KeyboardInterrupt):
        tracker.finish("KILLED")
        raise
    except BaseException:
        tracker.finish("FAILED")
        raise
    paths = output_paths(args)
    tracker.finish("FINISHED", [paths["best"], paths["info"], paths["plot"]])
