"""train_ray.py, Ray Train around DDP's loop: it trains what torchrun's train_ddp.py trains and
writes the same files, after a lost worker too, which costs only the steps since the last save
(Ray restarts the group, which goes on from the last reported checkpoint); the heartbeat watches
Ray's process group, and a worker that stops answering ends the run with its line; a stop sent to
its driver ends every worker at an optimizer step (exit 75); it resumes another mode's last.pth and
another mode resumes its; bad input is one line.

One Ray instance serves the module (`cluster`: `ray start --head` on free ports, its workers
importing the test hooks), and three runs, at once, serve its tests (`fits`): one from the start
with a worker killed on the way, one that resumes train_single.py's last.pth and is stopped, and
one with a worker that stops answering."""
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    BIN,
    EXACT,
    HOOKS,
    ROOT,
    TOLERANCE,
    VAL,
    B,
    assert_same_best,
    assert_same_run,
    distance,
    fails_in_process,
    free_port,
    history,
    in_process,
    last_model,
    mode_run,
    outputs,
    run,
    run_main,
    same_end,
    stepped_run,
    stop_line,
    weights,
)

import train_ray
import train_single
from src.errors import EXIT_STOPPED, Stopped, UserError
from src.inference import kaggle_test_files, load_checkpoint, predict_files
from src.ray_driver import check_workers, end_as_told
from src.ray_worker import worker_outcome

# Two epochs of 5 optimizer steps (100 training images, 2 workers of B); a step checkpoint every 3.
FLAGS = [*EXACT, *VAL, "--epochs", "2", "--batch-size", str(B), "--save-every-steps", "3"]
CPUS = 6  # the cluster's: the module's three runs at once, two workers each
DIST_TIMEOUT = 7  # minutes, the lost run's --dist-timeout: not the default, which the heartbeat must not take instead
# Ray's settings for the cluster, each leaving out what the tests do not use (the file's cost:
# docs/measurements.md, Ray Train). Without token authentication (ray start turns it on; the runs' drivers
# have no token), and without Ray's memory monitor, which kills workers when the machine's memory
# is 95% used: the machines the suite runs on are shared, and other processes' memory is not the
# runs' doing.
CLUSTER_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0",
    # Stopped at once: on SIGTERM `ray start --block` waits up to 30 s for its node to drain.
    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
    # The workers at the suite's niceness: Ray's default adds 15, and on a busy machine they starved.
    "RAY_worker_niceness": "0",
    # No idle workers started for the first driver: each actor of a run starts a worker of its own.
    "RAY_prestart_worker_first_driver": "0",
    "RAY_enable_metrics_collection": "0",
    # Ray Train's controller watches no node for preemption (one actor less per run).
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


class Cluster:
    """`ray start --head --block` started (its process), reachable at `address` once ready() said so."""

    def __init__(self, head: subprocess.Popen, port: int):
        self.head, self.port, self.address = head, port, f"127.0.0.1:{port}"

    def ready(self) -> str:
        """The address, once the head's GCS answers (within a minute or two on a busy machine)."""
        for _ in range(600):
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self.address
            assert self.head.poll() is None, self.head.stderr.read()[-3000:]
            time.sleep(0.2)
        raise AssertionError("the Ray cluster's head did not answer within 120 s")


@pytest.fixture(scope="module")
def cluster():
    """A Ray instance of CPUS CPUs and no GPU, started for the module (its start goes on while the
    first test's other fixtures work) and stopped after it (`ray start --block` ends the processes
    it started when it is stopped). Its session folder is short: Ray's sockets live there, and a
    socket's path has at most 107 bytes. Its ports are free ones, the client server's and the
    dashboard's too (their defaults are one per machine, for every session on it)."""
    port, folder = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    env = {**os.environ, "PYTHONPATH": HOOKS, "CUDA_VISIBLE_DEVICES": "", **CLUSTER_ENV}
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", f"--num-cpus={CPUS}",
                             "--num-gpus=0", "--include-dashboard=false", "--no-monitor",
                             f"--object-store-memory={100 * 2 ** 20}", f"--temp-dir={folder}",
                             f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}",
                             f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    yield Cluster(head, port)
    head.send_signal(signal.SIGTERM)
    head.wait(timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


def ray_command(address: str, folder: Path, data: Path, *flags: str) -> list[str]:
    """`train_ray.py --address ADDRESS --num-workers 2 FLAGS` writing into folder (the driver's argv)."""
    return ["--address", address, "--num-workers", "2", "--data-dir", str(data), *flags, *outputs(folder)]


def job_env(folder: Path, **env: str) -> dict:
    """The driver's variables that give its workers `env` (the test hooks' settings), as `ray job
    submit --runtime-env-json` gives them (the cluster's workers have the cluster's environment, not
    the driver's), with WRITE_LOG: FOLDER.writes."""
    job = {"runtime_env": {"env_vars": {"WRITE_LOG": str(folder.parent / f"{folder.name}.writes"), **env}}}
    return {"RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}


def writes(folder: Path) -> list[tuple[str, str]]:
    path = folder.parent / f"{folder.name}.writes"
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]


class Driver:
    """`python train_ray.py ARGV` started with the test hooks' settings `env` for its workers
    (job_env), its output in NAME.out and NAME.err beside its folder."""

    def __init__(self, folder: Path, argv: list[str], **env: str):
        self.folder, self.command = folder, [sys.executable, "train_ray.py", *argv]
        with open(f"{folder}.out", "w") as out, open(f"{folder}.err", "w") as err:
            self.process = subprocess.Popen(self.command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1", **job_env(folder, **env)})

    def result(self) -> subprocess.CompletedProcess:
        self.process.wait(timeout=900)
        return subprocess.CompletedProcess(self.command, self.process.returncode, Path(f"{self.folder}.out").read_text(),
                                           Path(f"{self.folder}.err").read_text())


@pytest.fixture(scope="module")
def fits(cluster, module_tmp, exact_data, runs):
    """The module's three Ray Train runs, at once; {name: (its output folder, the finished driver)}.

    `lost`: FLAGS from the start with --max-failures 1; rank 0 is killed in its 4th step, once Ray
    Train has taken in the step checkpoint after step 3, and its last.pth removed with it (a node
    replaced with an empty disk); each rank logs the beats its heartbeat reads at its 2nd step
    (OUT/../beats.log). Its driver runs in this process (run_main).
    `stopped`: train_single.py's last.pth after step 3 (stepped_run) resumed (--resume); rank 0 sends
    SIGTERM to the driver in its 1st step (the run's 4th) and waits for the request to come back to
    it: the ranks agree on it at the start of epoch 2 (the check started after step 4 would be read
    after step 8, in the next epoch). Its driver is a process of its own, which gets the signal.
    `hung`: one epoch, --dist-timeout 0.5 (30 s) and --max-failures 0; rank 1 stops itself with
    SIGSTOP at its 2nd step (OUT/../hung.log: its pid), once its heartbeat has written that place."""
    stepped = stepped_run(runs)  # while the cluster starts
    address = cluster.ready()
    lost, stopped, hung = module_tmp / "lost", module_tmp / "stopped", module_tmp / "hung"
    stopped.mkdir()
    shutil.copy(stepped.parent / "copies" / "last.1.pth", stopped / "last.pth")
    pid_file = module_tmp / "driver.pid"
    stopping = Driver(stopped, ray_command(address, stopped, exact_data, *FLAGS, "--resume"), RAY_AT_STEP="1",
                      RAY_ACTION="term-driver", RAY_LOG=str(module_tmp / "term.log"), RAY_DRIVER_PID_FILE=str(pid_file))
    pid_file.write_text(str(stopping.process.pid))
    hanging = Driver(hung, ray_command(address, hung, exact_data, *EXACT, *VAL, "--epochs", "1", "--batch-size", str(B),
                                       "--dist-timeout", "0.5", "--max-failures", "0"),
                     RAY_AT_STEP="2", RAY_ACTION="stop", RAY_RANK="1", RAY_LOG=str(module_tmp / "hung.log"))
    sigint = signal.getsignal(signal.SIGINT)
    try:
        argv = ray_command(address, lost, exact_data, *FLAGS, "--max-failures", "1", "--dist-timeout", str(DIST_TIMEOUT))
        lost_run = run_main(train_ray.main, argv, env=job_env(
            lost, RAY_AT_STEP="4", RAY_ACTION="kill", RAY_LOG=str(module_tmp / "kill.log"),
            RAY_REPORTED=str(lost / "ray"), RAY_REMOVE=str(lost / "last.pth"), BEAT_LOG=str(module_tmp / "beats.log"),
            BEAT_AT_STEP="2"))
    finally:
        signal.signal(signal.SIGINT, sigint)  # Ray Train's driver leaves its own for Ctrl-C
        stopped_run, hung_run = stopping.result(), hanging.result()
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # Ray ends it with its group
            os.kill(int((module_tmp / "hung.log").read_text().split()[0]), signal.SIGKILL)
    return {"lost": (lost, lost_run), "stopped": (stopped, stopped_run), "hung": (hung, hung_run)}


def test_ray_trains_what_torchrun_trains_and_rank_0_alone_writes(fits, runs, far, exact_data):
    """The same history, weights and best.pth as two DDP processes under torchrun, bit for bit
    (the same processes, threads and data; a lost worker on the way changes nothing: the next
    test), and so train_single.py's within the modes' tolerance; rank 0 alone prints and writes;
    best.pth predicts as DDP's; Ray keeps the last checkpoint reported, which is the run's
    last.pth."""
    out, result = fits["lost"]
    assert result.returncode == 0, result.stderr[-3000:]
    ddp = mode_run(runs, "ddp")[0]
    same_end(out, ddp)
    assert_same_best(out, ddp)
    assert_same_run(out, runs.exact("single")[0], far)
    assert {rank for rank, _ in writes(out)} == {"0"}, writes(out)
    assert {Path(path).name for _, path in writes(out)} >= {"best.pth", "best.json", "last.pth", "history.json",
                                                           "curves.png"}
    info = json.loads((out / "best.json").read_text())
    assert (info["mode"], info["processes"]) == ("ray", 2)
    assert "squeezenet1_1 on 2 x cpu" in result.stdout
    for line in ("epoch 1/2  train loss", "epoch 2/2  train loss", "done in "):
        assert result.stdout.count(line) == 1, (line, result.stdout[-3000:])
    assert "epoch 1/2 train:" not in result.stderr  # no progress bar: Ray forwards whole lines
    ids, files, _ = kaggle_test_files(exact_data / "test")
    p = {}
    for name, folder in (("ray", out), ("ddp", ddp)):
        model, info = load_checkpoint(folder / "best.pth")
        p[name] = predict_files(model, info, files, torch.device("cpu"))[0]
    assert torch.equal(p["ray"], p["ddp"])
    (kept,) = list((out / "ray").glob("*/checkpoint_*/last.pth"))
    assert kept.read_bytes() == (out / "last.pth").read_bytes()


def test_a_lost_worker_costs_only_the_steps_since_the_last_save(fits, runs, module_tmp):
    """Rank 0 killed in step 4 after the step checkpoint of step 3 was reported, its last.pth removed
    with it: Ray Train restarts both workers (--max-failures 1), rank 0 takes the reported checkpoint
    from Ray's storage, they redo step 4 alone and end bit for bit as torchrun's straight run. (The
    kill waits for Ray Train to have taken the report in: one that rank 0 made just before it died
    may not have reached the controller, and the run would go on from the last.pth on disk, here
    removed.)"""
    out, result = fits["lost"]
    assert result.returncode == 0, result.stderr[-3000:]
    assert (module_tmp / "kill.log").exists()
    assert f"resumed from {out / 'last.pth'} in epoch 1 of 2 after its step 3: going on" in result.stdout, \
        result.stdout[-3000:]  # the restart
    assert result.stdout.count("epoch 1/2  train loss") == 1
    assert [r["epoch"] for r in history(out)] == [1, 2]
    same_end(out, mode_run(runs, "ddp")[0])


def test_the_heartbeat_watches_ray_s_process_group_through_its_store(fits, module_tmp):
    """Each Ray Train worker watches the others (src/heartbeat.py, which names a rank that stops
    answering: tests/test_hung_rank.py) with the --dist-timeout of the run, which is the process
    group's timeout too, through the store of the process group Ray Train made: every rank reads
    every rank's beat there, in both worker groups."""
    lines = [json.loads(line) for line in (module_tmp / "beats.log").read_text().splitlines()]
    assert sorted(line["rank"] for line in lines) == [0, 0, 1, 1], lines  # at step 2 of both groups
    for line in lines:
        assert (line["world_size"], line["timeout_s"], line["group_timeout_s"]) == (2, DIST_TIMEOUT * 60, DIST_TIMEOUT * 60), line
        assert line["beats"] is not None and all(beat is not None for beat in line["beats"]), line
        assert all(beat["where"].startswith(("epoch 1 ", "its start")) for beat in line["beats"]), line


def test_a_stop_on_the_driver_ends_every_worker_at_a_step(fits):
    """SIGTERM to `python train_ray.py`: every worker stops after the agreed step with last.pth saved
    there, rank 0 says how to go on, the driver exits 75."""
    out, result = fits["stopped"]
    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]
    line = stop_line(result.stderr)
    assert f"stopped by SIGTERM after epoch 1 of 2: {out / 'last.pth'} holds it" in line, line
    assert shlex.split(line.split("; to go on: python ", 1)[1]) == result.args[1:], line  # --resume in it already
    last = weights(out, "last.pth")
    assert (last["epoch"], last["step"]) == (1, 0)
    assert [r["epoch"] for r in history(out)] == [1]


def test_a_hung_worker_is_named_and_ends_the_run_in_one_line(fits):
    """A worker that stops answering (SIGSTOP: alive, not stepping) is named by the other's
    heartbeat within --dist-timeout, which ends that worker; Ray Train, with no failure left to
    retry, gives up on the group, and the driver ends with the heartbeat's line as its last and
    exit 1, as torchrun's runs end (tests/test_hung_rank.py), not with Ray's traceback of a dead
    actor, and not waiting for ever."""
    out, result = fits["hung"]
    assert result.returncode == 1, result.stderr[-3000:]
    # The driver's own lines: Ray prefixes those it forwards from its actors with "(Name pid=N)".
    own = [line for line in result.stderr.splitlines() if line.strip() and not re.match(r"(\x1b\[\d+m)?\(", line)]
    assert not any("Traceback" in line for line in own), result.stderr[-3000:]
    assert re.fullmatch(r"timeout: rank 1 stopped answering at epoch 1 step 2 \(training\); last heard \d+ s ago "
                        r"\(the others wait at epoch 1 step 3 \(training\); --dist-timeout 0.5 min\)", own[-1]), own[-3:]
    assert not (out / "last.pth").exists()  # no epoch ended


def test_ray_resumes_another_modes_last_pth_and_another_mode_resumes_ray_s(fits, runs, far, tmp_path, exact_data):
    """train_ray.py --resume goes on from train_single.py's last.pth after step 3 (the same global
    batch in two workers), to epoch 1's end within the modes' tolerance of train_single.py's; its
    own last.pth, where its driver stopped it, goes on in train_single.py --resume, which ends where
    train_single.py's straight run does, within the modes' tolerance."""
    out, result = fits["stopped"]
    stepped = stepped_run(runs)
    assert f"resumed from {out / 'last.pth'} in epoch 1 of 2 after its step 3: going on" in result.stdout, \
        result.stdout[-3000:]
    epoch_1 = weights(stepped.parent / "copies", "last.2.pth")["model"]
    assert distance(last_model(out), epoch_1) < TOLERANCE * far
    single = shutil.copytree(out, tmp_path / "single", ignore=shutil.ignore_patterns("ray"))
    argv = [*FLAGS, "--batch-size", str(2 * B), "--data-dir", str(exact_data), *outputs(single), "--resume"]
    resumed = run_main(train_single.main, argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after epoch 1 of 2: going on" in resumed.stdout
    assert_same_run(single, stepped, far)


def test_without_ray_installed_one_line_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(train_ray, "ray", None)
    fails_in_process(train_ray.main, ["--checkpoint", str(tmp_path / "m" / "best.pth")], monkeypatch, capsys,
                     "train_ray.py needs Ray Train, which is not installed in this environment: "
                     "pip install -r requirements-ray.txt")
    assert not (tmp_path / "m").exists()


def test_a_ray_that_fails_as_it_imports_is_one_line(tmp_path):
    """A Ray installed but failing as it imports with another error than ImportError (versions that
    do not fit: here an AttributeError) was the import's traceback; it is one line naming the
    error and the install, exit 2, before anything is written."""
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "__init__.py").write_text("raise AttributeError(\"module 'pydantic' has no attribute 'v1'\")\n")
    result = run([sys.executable, "train_ray.py", "--checkpoint", str(tmp_path / "m" / "best.pth")],
                 env={"PYTHONPATH": str(tmp_path)}, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-3000:]
    assert result.stderr == ("error: train_ray.py cannot import Ray Train (AttributeError: module 'pydantic' has no "
                             "attribute 'v1'): reinstall it in this environment: pip install -r requirements-ray.txt\n")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("answer", [b"HTTP/1.1 400 Bad Request\r\n\r\n", bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])],
                         ids=["http", "grpc"])
def test_an_address_where_another_server_listens_is_one_line_at_once(answer):
    """A port where something other than a gRPC server answers (here HTTP/1.1), where ray.init would
    retry for ever, is one line; one that answers HTTP/2's preface with a SETTINGS frame, as Ray's
    GCS does, is taken (the module's cluster is reached through the same check)."""
    from src.ray_driver import reachable
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def serve():
            connection, _ = server.accept()
            with connection:
                connection.recv(100)
                connection.sendall(answer)

        threading.Thread(target=serve, daemon=True).start()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        if answer.startswith(b"HTTP"):
            with pytest.raises(UserError) as error:
                reachable(address)
            assert str(error.value) == (f"--address {address}: something listens there but not a Ray cluster's head "
                                        "(it answered b'HTTP/1.1 '): give the port that `ray start --head` printed "
                                        "(the GCS's, 6379 by default; ray:// its client server's, 10001)")
        else:
            assert reachable(address) == address


def test_an_address_where_no_cluster_answers_is_one_line(monkeypatch, capsys, tmp_path):
    """A refused connection (nothing listens there) is said at once, before ray.init's own retries."""
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    fails_in_process(train_ray.main, ["--address", address, *outputs(tmp_path / "m")], monkeypatch, capsys,
                     f"--address {address}: no Ray cluster answers there (Connection refused within 10 s)")
    assert time.monotonic() - start < 60  # the bound the line states, with room for a busy machine
    assert not (tmp_path / "m").exists()
    # no port; out of range; "²" (a digit to str.isdigit); labels the host name lookup cannot encode
    for address in ["headnode", "headnode:99999", "headnode:0", "headnode:\u00b2", "head..example:6379",
                    f"{'a' * 64}.example:6379"]:
        fails_in_process(train_ray.main, ["--address", address, *outputs(tmp_path / "m")], monkeypatch, capsys,
                         f"--address {address}: expected HOST:PORT of a Ray cluster's head")


def test_more_workers_than_the_cluster_has_is_one_line_before_any_work(cluster, monkeypatch, capsys, tmp_path,
                                                                      exact_data):
    """Ray Train would wait for a CPU more for ever; the driver says it and ends."""
    import ray
    try:
        fails_in_process(train_ray.main, ["--address", cluster.ready(), "--num-workers", str(CPUS + 1), "--data-dir",
                                          str(exact_data), *outputs(tmp_path / "m")], monkeypatch, capsys,
                         f"--num-workers {CPUS + 1}: the Ray cluster has {CPUS} CPU(s), one per worker: ask for at most {CPUS}")
    finally:
        ray.shutdown()
    assert not (tmp_path / "m").exists()
    assert check_workers(2, {"CPU": 16.0, "GPU": 2.0}) is True
    with pytest.raises(UserError, match="--num-workers 3: the Ray cluster has 2 GPU"):
        check_workers(3, {"CPU": 16.0, "GPU": 2.0})


def test_evaluate_is_left_to_the_scripts_without_a_cluster(monkeypatch, capsys):
    code, _, err = in_process(train_ray.main, ["--evaluate"], monkeypatch, capsys)
    assert code == 2 and "--evaluate validates without a cluster: run it with train_ddp.py" in err


def test_a_worker_ends_on_bad_input_or_a_stop_without_failing_so_ray_does_not_restart_it():
    """What train_loop_per_worker returns, and how the driver ends on it: an exception would be a
    failed worker, which Ray Train restarts (--max-failures) to fail the same way again."""
    for raised, outcome in ((UserError("--data-dir x: no train/ folder"), {"exit": 2, "error": "--data-dir x: no train/ folder"}),
                            (UserError("said by rank 0", quiet=True), {"exit": 2}),
                            (Stopped(), {"exit": EXIT_STOPPED})):
        with worker_outcome() as got:
            raise raised
        assert got == outcome
    with pytest.raises(RuntimeError, match="a real failure"), worker_outcome():
        raise RuntimeError("a real failure")
    end_as_told({})
    with pytest.raises(Stopped):
        end_as_told({"exit": EXIT_STOPPED})
    with pytest.raises(UserError, match="no train/ folder") as error:
        end_as_told({"exit": 2, "error": "--data-dir x: no train/ folder"})
    assert not error.value.quiet
    with pytest.raises(UserError) as error:
        end_as_told({"exit": 2})
    assert error.value.quiet



REPORT_CASES = ["save", "write", "none"]


def _reports_after_a_save(rank: int, ports: list[int], folder: str) -> None:
    """One of two gloo ranks at a report of train_ray.py's loop, as train_loop_per_worker runs it
    (worker_outcome around it), in each of REPORT_CASES in turn (a process group each): rank 0's
    save failed before ("save": its save_step raised the background write's error, which ends its
    loop), or its write fails now ("write", found by saved_last), or nothing fails ("none"). Writes
    {outcome, what reached ray.train.report} to FOLDER/CASE.RANK.json. Rank 1 looks for rank 0's
    note 2 s late: the group's store lives in rank 0's process (as under Ray Train), and rank 0
    ending its group ended the store with it before rank 1 could read the note."""
    from datetime import timedelta

    import torch.distributed as dist

    import src.errors
    import src.ray_worker
    from src.checkpoint_writer import CheckpointWriter
    from src.cli import defaults
    from src.errors import another_rank_said_why, end_process_group
    from src.ray_worker import saved_last
    torch.set_num_threads(1)

    def late() -> bool:
        time.sleep(2)
        return another_rank_said_why()
    if rank == 1:
        src.ray_worker.another_rank_said_why = late
    src.errors.NOTE_READ_WAIT = 3600  # rank 0 ends when rank 1 has marked that it read the note, not by the clock
    for case, port in zip(REPORT_CASES, ports):
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=timedelta(seconds=60))
        writer = CheckpointWriter()
        args = defaults(checkpoint=str(Path(folder) / case / f"node{rank}" / "best.pth"))
        Path(args.checkpoint).parent.mkdir(parents=True)
        if rank == 0:
            writer.save({"step": torch.tensor(3)}, Path(args.checkpoint).parent / "last.pth")
            if case == "write":
                writer.error = UserError("cannot write last.pth (No space left on device)")  # as its thread sets it
        reported = []
        with worker_outcome() as outcome:
            if rank == 0 and case == "save":
                raise UserError("cannot write last.pth (No space left on device)")
            with saved_last(SimpleNamespace(args=args, writer=writer)) as where:
                # ray.train.report(..., checkpoint=...) here: a barrier that every rank must reach
                reported.append(where and sorted(os.listdir(where)))
        end_process_group()
        Path(folder, f"{case}.{rank}.json").write_text(json.dumps({"outcome": outcome, "reported": reported}))


@pytest.fixture(scope="module")
def reports(module_tmp):
    """The folder of _reports_after_a_save's records, from one spawn of its two ranks."""
    import torch.multiprocessing as mp
    folder = module_tmp / "reports"
    folder.mkdir()
    context = mp.start_processes(_reports_after_a_save, args=([free_port() for _ in REPORT_CASES], str(folder)),
                                 nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 240  # seconds, on a busy machine; a rank left in a barrier waits for ever
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())) and time.monotonic() < deadline:
            pass
    finally:
        for process in context.processes:
            process.kill()
    return folder


@pytest.mark.parametrize("case", REPORT_CASES)
def test_a_save_that_failed_on_rank_0_ends_every_worker_before_rays_report(case, reports):
    """ray.train.report is a barrier of Ray's own, with no timeout (Ray 2.60), which the end of
    the process group does not reach: a rank 0 whose step checkpoint failed (a full disk: its
    save_step, or the write that saved_last waits for) left the other workers there until the
    heartbeat named rank 0 after --dist-timeout (an hour by default), a failed worker that Ray then
    restarted. Every worker now hears from rank 0 through the process group first: none reaches
    the report, rank 0 says the line (exit 2) and rank 1 ends quietly (exit 2). The control: rank 0
    reports a folder holding last.pth (removed after the report), rank 1 no checkpoint."""
    ends = [json.loads(path.read_text()) if (path := reports / f"{case}.{rank}.json").exists() else None
            for rank in (0, 1)]
    if case == "none":
        assert ends == [{"outcome": {}, "reported": [["last.pth"]]}, {"outcome": {}, "reported": [None]}], ends
        assert list((reports / case / "node0").glob(".ray-report-*")) == []
    else:
        said = "cannot write last.pth (No space left on device)"
        assert ends == [{"outcome": {"exit": 2, "error": said}, "reported": []},
                        {"outcome": {"exit": 2}, "reported": []}], ends
