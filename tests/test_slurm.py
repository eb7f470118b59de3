"""docs/slurm/train.sbatch, run by bash as SLURM would run it, with fake `srun` and `scontrol` on
PATH that record how they were called (SLURM itself cannot run here): the torchrun command it
starts on every node (the venv's torchrun and the code at the submission folder's paths, the GPUs
per node from Slurm's variables, a rendezvous port per job), its refusals before any srun, and the
requeue after SLURM's SIGUSR1 or a stopped process's exit code, not after a finished or failed run.
That a requeued job resumes: test_stopping.py (SLURM_RESTART_COUNT);
that torchrun started as the script starts it forwards SIGUSR1 and the ranks stop and save:
test_stopping.py too."""
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPT = ROOT / "docs" / "slurm" / "train.sbatch"
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "4",
         "SLURM_GPUS_PER_NODE": "4", "SLURM_SUBMIT_DIR": str(ROOT)}

# srun: records its arguments, then stands for the torchruns of the job: exits with FAKE_EXIT
# after FAKE_SECONDS, or with torchrun's 1 when it gets the SIGUSR1 it forwards to them; the real
# srun answers SIGTERM by SIGKILLing its tasks (no stop, no save): recorded as such.
FAKE_SRUN = """#!/bin/bash
echo "srun $*" >> "$FAKE_LOG"
sleep "${FAKE_SECONDS:-0}" &
sleeper=$!
trap 'kill $sleeper; echo "srun got SIGUSR1" >> "$FAKE_LOG"; exit 1' USR1
trap 'kill $sleeper; echo "srun got SIGTERM: its tasks SIGKILLed" >> "$FAKE_LOG"; exit 137' TERM
touch "$FAKE_LOG.started"
wait $sleeper
exit "${FAKE_EXIT:-0}"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$FAKE_LOG"
if [ "$1 $2" = "show hostnames" ]; then printf 'gpu07\\ngpu08\\n'; fi
"""


@pytest.fixture
def fake_slurm(tmp_path):
    """A PATH with the fake srun and scontrol first, and the log they write; VENV a folder whose
    bin/torchrun is there (the project's own .venv may not be: the mutation check's copy)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    for path, text in ((bin_dir / "srun", FAKE_SRUN), (bin_dir / "scontrol", FAKE_SCONTROL),
                       (tmp_path / "venv" / "bin" / "torchrun", "#!/bin/sh\nexit 1\n")):
        path.write_text(text)
        path.chmod(0o755)
    log = tmp_path / "calls.log"
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_") and key not in ("CODE", "RDZV_PORT")}
    env = {**env, **SLURM, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log),
           "VENV": str(tmp_path / "venv")}
    return env, log


def _batch(env, **fake) -> subprocess.Popen:
    """The batch script as SLURM runs it: bash, in the submission folder, with the job's variables."""
    return subprocess.Popen(["bash", str(SCRIPT), "--data-dir", "data", "--epochs", "10"], cwd=ROOT,
                            env={**env, **{f"FAKE_{k.upper()}": str(v) for k, v in fake.items()}},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _in_wait(pid: int) -> bool:
    """Whether the process waits for a child (bash in its `wait`: the kernel's do_wait): it has
    started srun and noted its pid, so SLURM's signal finds the trap and srun to pass it to."""
    try:
        return (Path("/proc") / str(pid) / "wchan").read_text() == "do_wait"
    except OSError:
        return False


def test_the_script_asks_slurm_for_the_signal_and_a_requeue():
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=B:USR1@120" in header and "#SBATCH --requeue" in header
    assert "#SBATCH --ntasks-per-node=1" in header, "one srun task, one torchrun, per node"


def _torchrun(env: dict) -> str:
    """The srun line of a job that the script starts as it should (exit 0)."""
    batch = _batch(env)
    output, _ = batch.communicate(timeout=60)
    assert batch.returncode == 0, output
    calls = Path(env["FAKE_LOG"]).read_text().splitlines()
    Path(env["FAKE_LOG"]).unlink()
    assert calls[0] == "scontrol show hostnames gpu[07-08]" and len(calls) == 2, calls
    return calls[1]


def test_one_torchrun_per_node_with_a_rendezvous_on_the_first_node(fake_slurm):
    """The venv's torchrun and train_ddp.py at the submission folder's paths (every node must see
    them there: the script named neither, and ran whatever torchrun PATH gave), one process per
    GPU that Slurm allocated, the rendezvous on the first node at the job's own port."""
    env, log = fake_slurm
    assert _torchrun(env) == (
        f"srun --kill-on-bad-exit=1 {env['VENV']}/bin/torchrun --nnodes=2 --nproc-per-node=4 "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --rdzv-backend=c10d "
        f"--rdzv-endpoint=gpu07:{10000 + 4242 % 20000} --rdzv-id=4242 --max-restarts=3 {ROOT}/train_ddp.py "
        "--data-dir data --epochs 10")


def _option(line: str, name: str) -> str:
    return next(word.split("=", 1)[1] for word in line.split() if word.startswith(name + "="))


def test_two_jobs_on_one_head_node_get_different_ports(fake_slurm):
    """Port 29500 was written into the script: a second job whose first node was the first one's
    met the first job's rendezvous, or failed to bind. Each job's port comes from its id, below
    the ephemeral ports that outgoing connections take."""
    env, _ = fake_slurm
    ports = {job: int(_option(_torchrun({**env, "SLURM_JOB_ID": job}), "--rdzv-endpoint").split(":")[1])
             for job in ("4242", "4243", "930001")}
    assert len(set(ports.values())) == 3 and all(10000 <= port < 32768 for port in ports.values()), ports
    assert _option(_torchrun({**env, "RDZV_PORT": "23456"}), "--rdzv-endpoint") == "gpu07:23456"


def test_a_port_in_use_on_the_head_node_is_refused_before_srun(fake_slurm):
    env, log = fake_slurm
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        batch = _batch({**env, "RDZV_PORT": str(port)})
        output, _ = batch.communicate(timeout=60)
    assert batch.returncode == 2 and output.strip().splitlines() == [
        f"train.sbatch: port {port} of {socket.gethostname()} is in use: submit again with "
        "RDZV_PORT set to a free one"], output
    assert "srun" not in (log.read_text() if log.exists() else "")


@pytest.mark.parametrize("slurm, processes", [
    ({"SLURM_GPUS_ON_NODE": "8", "SLURM_GPUS_PER_NODE": "8"}, "8"),
    ({"SLURM_GPUS_ON_NODE": "2"}, "2"),
    ({"SLURM_GPUS_PER_NODE": "a100:2"}, "2"),  # --gpus-per-node=[type:]N, without the batch step's count
])
def test_the_processes_per_node_are_the_gpus_slurm_allocated(slurm, processes, fake_slurm):
    """GPUS_PER_NODE had to be kept equal to #SBATCH --gpus-per-node by hand (4 by default): a job
    submitted with --gpus-per-node=8 started 4 processes a node."""
    env, _ = fake_slurm
    env = {key: value for key, value in env.items() if key not in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE")}
    assert _option(_torchrun({**env, **slurm}), "--nproc-per-node") == processes


@pytest.mark.parametrize("change, message", [
    ({"SLURM_GPUS_ON_NODE": None, "SLURM_GPUS_PER_NODE": None}, "train.sbatch: Slurm says no GPU count for this job's "
     "nodes (SLURM_GPUS_ON_NODE '', SLURM_GPUS_PER_NODE ''): submit it with --gpus-per-node=N"),
    ({"SLURM_GPUS_ON_NODE": "0", "SLURM_GPUS_PER_NODE": None}, "submit it with --gpus-per-node=N"),
    ({"VENV": "/nowhere/venv"}, f"no {ROOT}/train_ddp.py or no /nowhere/venv/bin/torchrun on "),
    ({"SLURM_SUBMIT_DIR": "/", "VENV": None}, "no //train_ddp.py or no //.venv/bin/torchrun on "),
])
def test_a_job_without_gpus_or_without_the_code_and_venv_stops_before_srun(change, message, fake_slurm):
    env, log = fake_slurm
    env = {key: value for key, value in {**env, **change}.items() if value is not None}
    batch = _batch(env)
    output, _ = batch.communicate(timeout=60)
    assert batch.returncode == 2 and len(output.strip().splitlines()) == 1 and message in output, output
    assert not log.exists() or "srun" not in log.read_text()


@pytest.mark.parametrize("exit_code, requeued", [(0, False), (1, False), (75, True)])
def test_a_requeue_follows_a_stopped_process_only(exit_code, requeued, fake_slurm):
    """Without SLURM's signal: a finished run and a failed one end the job with their code; a
    process that stopped on a signal (exit 75: `srun python train_single.py`, or SLURM's own
    SIGTERM to every process) is requeued."""
    env, log = fake_slurm
    batch = _batch(env, exit=exit_code)
    output, _ = batch.communicate(timeout=60)
    assert batch.returncode == exit_code, output
    assert ("scontrol requeue 4242" in log.read_text().splitlines()) == requeued


def test_sigusr1_before_the_time_limit_is_forwarded_and_the_job_requeued(fake_slurm):
    """SLURM's SIGUSR1 to the batch shell (--signal=B:USR1@120): the script passes SIGUSR1 to
    srun, which forwards it to torchrun on every node (here the fake srun takes it and exits 1, as
    torchrun does after forwarding it), waits for srun to end, and requeues the job."""
    env, log = fake_slurm
    batch = _batch(env, seconds=60, exit=0)
    started = log.with_name(log.name + ".started")
    deadline = time.time() + 30
    while not (started.exists() and _in_wait(batch.pid)) and time.time() < deadline:
        time.sleep(0.05)
    assert _in_wait(batch.pid), "the batch shell never reached its wait for srun"
    batch.send_signal(signal.SIGUSR1)
    output, _ = batch.communicate(timeout=30)
    assert batch.returncode == 1, output
    assert log.read_text().splitlines()[-2:] == ["srun got SIGUSR1", "scontrol requeue 4242"]
    assert "SIGUSR1: the time limit is near" in output and "requeued" in output
