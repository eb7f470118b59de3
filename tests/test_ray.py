"""train_ray.py, Ray Train around DDP's loop: it trains what torchrun's train_ddp.py trains and
writes the same files; a stop sent to its driver ends every worker at an optimizer step (exit 75)
and the run goes on in any mode; a lost worker costs only the steps since the last save (Ray
restarts the group, which goes on from the last reported checkpoint); bad input is one line.

One Ray instance serves the module (`cluster`: `ray start --head` on free ports, two CPUs, its
workers importing the test hooks), and its runs are few: a straight run, a run stopped on its
driver, and that run resumed with a worker killed on the way."""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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
    VAL,
    B,
    assert_same_best,
    assert_same_run,
    fails_in_process,
    free_port,
    history,
    in_process,
    mode_run,
    outputs,
    run_main,
    same_end,
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


@pytest.fixture(scope="module")
def cluster():
    """The address of a Ray instance of two CPUs and no GPU, started for the module and stopped
    after it (`ray start --block` ends the processes it started when it is stopped). Its session
    folder is short: Ray's sockets live there, and a socket's path has at most 107 bytes."""
    port, folder = free_port(), tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # Without token authentication (ray start turns it on; the runs' drivers have no token), and
    # without Ray's memory monitor, which kills workers when the machine's memory is 95% used: the
    # machines the suite runs on are shared, and other processes' memory is not the runs' doing.
    env = {**os.environ, "PYTHONPATH": HOOKS, "CUDA_VISIBLE_DEVICES": "", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled", "RAY_memory_monitor_refresh_ms": "0"}
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={folder}",
                             f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}"],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    address = f"127.0.0.1:{port}"
    for _ in range(600):  # its GCS answers within a minute or two on a busy machine
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert head.poll() is None, head.stderr.read()[-3000:]
        time.sleep(0.2)
    yield address
    head.send_signal(signal.SIGTERM)
    head.wait(timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


def ray_run(address: str, folder: Path, *flags: str, env: dict | None = None, pid_file: Path | None = None,
            data: Path) -> subprocess.CompletedProcess:
    """`python train_ray.py --address ADDRESS --num-workers 2 FLAGS` writing into folder; `env`:
    variables for its workers, given as `ray job submit --runtime-env-json` gives them to a driver
    (the cluster's workers have the cluster's environment, not the driver's); `pid_file`: where the
    driver's pid is written once it started."""
    command = [sys.executable, "train_ray.py", "--address", address, "--num-workers", "2", "--data-dir", str(data),
               *flags, *outputs(folder)]
    job = {"runtime_env": {"env_vars": {"WRITE_LOG": str(folder.parent / f"{folder.name}.writes"), **(env or {})}}}
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps(job)}
    driver = subprocess.Popen(command, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    if pid_file is not None:
        pid_file.write_text(str(driver.pid))
    stdout, stderr = driver.communicate(timeout=900)
    return subprocess.CompletedProcess(command, driver.returncode, stdout, stderr)


def writes(folder: Path) -> list[tuple[str, str]]:
    path = folder.parent / f"{folder.name}.writes"
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(cluster, module_tmp, exact_data):
    """Two epochs straight; (its folder, the finished driver)."""
    out = module_tmp / "straight"
    result = ray_run(cluster, out, *FLAGS, data=exact_data)
    assert result.returncode == 0, result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="module")
def stopped(cluster, module_tmp, exact_data):
    """The same run stopped by SIGTERM to its driver, sent by rank 0 in its 2nd optimizer step (then
    it waits for the request to come back to it): the ranks agree on it at the start of epoch 2 (the
    check started after step 4 would be read after step 8, in the next epoch)."""
    out = module_tmp / "stopped"
    pid_file = module_tmp / "driver.pid"
    result = ray_run(cluster, out, *FLAGS, pid_file=pid_file, data=exact_data,
                     env={"RAY_AT_STEP": "2", "RAY_ACTION": "term-driver", "RAY_LOG": str(module_tmp / "term.log"),
                          "RAY_DRIVER_PID_FILE": str(pid_file)})
    return out, result


def test_ray_trains_what_torchrun_trains_and_rank_0_alone_writes(straight, runs, far, exact_data):
    """The same history and weights as two DDP processes under torchrun (assert_same_run: within the
    modes' tolerance; measured: equal, docs/measurements.md) and so as train_single.py; rank 0 alone
    prints and writes; best.pth predicts as DDP's; Ray keeps the last checkpoint reported, which is
    the run's last.pth."""
    out, result = straight
    ddp = mode_run(runs, "ddp")[0]
    assert_same_run(out, ddp, far)
    assert_same_run(out, runs.exact("single")[0], far)
    assert {rank for rank, _ in writes(out)} == {"0"}, writes(out)
    assert {Path(path).name for _, path in writes(out)} >= {"best.pth", "best.json", "last.pth", "history.json",
                                                           "curves.png"}
    info = json.loads((out / "best.json").read_text())
    assert (info["mode"], info["processes"]) == ("ray", 2)
    for line in ("squeezenet1_1 on 2 x cpu", "epoch 1/2  train loss", "epoch 2/2  train loss", "done in "):
        assert result.stdout.count(line) == 1, (line, result.stdout[-3000:])
    assert "epoch 1/2 train:" not in result.stderr  # no progress bar: Ray forwards whole lines
    ids, files, _ = kaggle_test_files(exact_data / "test")
    p = {}
    for name, folder in (("ray", out), ("ddp", ddp)):
        model, info = load_checkpoint(folder / "best.pth")
        p[name] = predict_files(model, info, files, torch.device("cpu"))[0]
    assert torch.allclose(p["ray"], p["ddp"], atol=1e-5)
    (kept,) = list((out / "ray").glob("*/checkpoint_*/last.pth"))
    assert kept.read_bytes() == (out / "last.pth").read_bytes()


def test_a_stop_on_the_driver_ends_every_worker_at_a_step_and_goes_on_in_another_mode(stopped, straight, far,
                                                                                       tmp_path, exact_data):
    """SIGTERM to `python train_ray.py`: every worker stops after the agreed step with last.pth saved
    there, rank 0 says how to go on, the driver exits 75; train_single.py --resume (the same global
    batch in one process) ends where the straight run does, within the modes' tolerance."""
    out, result = stopped
    assert result.returncode == EXIT_STOPPED, result.stderr[-3000:]
    line = stop_line(result.stderr)
    assert f"stopped by SIGTERM after epoch 1 of 2: {out / 'last.pth'} holds it" in line, line
    assert "to go on: python train_ray.py --address " in line and line.endswith(" --resume"), line
    last = weights(out, "last.pth")
    assert (last["epoch"], last["step"]) == (1, 0)
    single = shutil.copytree(out, tmp_path / "single")
    argv = [*FLAGS, "--batch-size", str(2 * B), "--data-dir", str(exact_data), *outputs(single), "--resume"]
    resumed = run_main(train_single.main, argv)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "after epoch 1 of 2: going on" in resumed.stdout
    assert_same_run(single, straight[0], far)


def test_a_lost_worker_costs_only_the_steps_since_the_last_save(cluster, stopped, straight, module_tmp, exact_data):
    """The stopped run resumed (--resume) with rank 0 killed in its 2nd step (run step 7), after the
    step checkpoint of run step 6 was reported, and its last.pth removed with it (a node replaced
    with an empty disk): Ray Train restarts both workers (--max-failures 1), rank 0 takes the
    reported checkpoint from Ray's storage, they redo step 7 alone and end bit for bit as the
    straight run. (The kill waits for Ray Train to have taken the report in: one that rank 0 made
    just before it died may not have reached the controller, and the run would go on from the
    last.pth on disk, here removed.)"""
    out = shutil.copytree(stopped[0], module_tmp / "lost", ignore=shutil.ignore_patterns("ray"))  # the run's files
    result = ray_run(cluster, out, *FLAGS, "--resume", "--max-failures", "1", data=exact_data,
                     env={"RAY_AT_STEP": "2", "RAY_ACTION": "kill", "RAY_LOG": str(module_tmp / "kill.log"),
                          "RAY_REPORTED": str(out / "ray"), "RAY_REMOVE": str(out / "last.pth")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert (module_tmp / "kill.log").exists()
    assert "after epoch 1 of 2: going on" in result.stdout  # --resume
    assert "in epoch 2 of 2 after its step 1: going on" in result.stdout, result.stdout[-3000:]  # the restart
    assert result.stdout.count("epoch 2/2  train loss") == 1
    same_end(out, straight[0])
    assert_same_best(out, straight[0])
    assert [r["epoch"] for r in history(out)] == [1, 2]


def test_without_ray_installed_one_line_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(train_ray, "ray", None)
    fails_in_process(train_ray.main, ["--checkpoint", str(tmp_path / "m" / "best.pth")], monkeypatch, capsys,
                     "train_ray.py needs Ray Train, which is not installed in this environment: "
                     "pip install -r requirements-ray.txt")
    assert not (tmp_path / "m").exists()


def test_an_address_where_no_cluster_answers_is_one_line(monkeypatch, capsys, tmp_path):
    """A refused connection (nothing listens there) is said at once, before ray.init's own retries."""
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    fails_in_process(train_ray.main, ["--address", address, *outputs(tmp_path / "m")], monkeypatch, capsys,
                     f"--address {address}: no Ray cluster answers there (Connection refused within 10 s)")
    assert time.monotonic() - start < 60  # the bound the line states, with room for a busy machine
    assert not (tmp_path / "m").exists()
    fails_in_process(train_ray.main, ["--address", "headnode", *outputs(tmp_path / "m")], monkeypatch, capsys,
                     "--address headnode: expected HOST:PORT of a Ray cluster's head")


def test_more_workers_than_the_cluster_has_is_one_line_before_any_work(cluster, monkeypatch, capsys, tmp_path,
                                                                      exact_data):
    """Ray Train would wait for a third CPU for ever; the driver says it and ends."""
    import ray
    try:
        fails_in_process(train_ray.main, ["--address", cluster, "--num-workers", "3", "--data-dir", str(exact_data),
                                          *outputs(tmp_path / "m")], monkeypatch, capsys,
                         "--num-workers 3: the Ray cluster has 2 CPU(s), one per worker: ask for at most 2")
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
    {outcome, what reached ray.train.report} to FOLDER/CASE.RANK.json."""
    from datetime import timedelta

    import torch.distributed as dist

    from src.checkpoint_writer import CheckpointWriter
    from src.cli import defaults
    from src.errors import end_process_group
    from src.ray_worker import saved_last
    torch.set_num_threads(1)
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
