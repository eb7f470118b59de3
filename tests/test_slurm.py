"""docs/slurm/train.sbatch, run by bash as SLURM would run it, with fake `srun` and `scontrol` on
PATH that record how they were called (SLURM itself cannot run here): the torchrun command it
starts on every node, and the requeue after SLURM's SIGUSR1 or a stopped process's exit code, not
after a finished or failed run. That a requeued job resumes: test_stopping.py (SLURM_RESTART_COUNT);
that torchrun started as the script starts it forwards SIGUSR1 and the ranks stop and save:
test_stopping.py too."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT

SCRIPT = ROOT / "docs" / "slurm" / "train.sbatch"
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2"}

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
    """A PATH with the fake srun and scontrol first, and the log they write."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    env = {**os.environ, **SLURM, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_LOG": str(log)}
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


def test_one_torchrun_per_node_with_a_rendezvous_on_the_first_node(fake_slurm):
    env, log = fake_slurm
    batch = _batch(env)
    output, _ = batch.communicate(timeout=60)
    assert batch.returncode == 0, output
    calls = log.read_text().splitlines()
    assert calls == [
        "scontrol show hostnames gpu[07-08]",
        "srun --kill-on-bad-exit=1 torchrun --nnodes=2 --nproc-per-node=4 "
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --rdzv-backend=c10d "
        "--rdzv-endpoint=gpu07:29500 --rdzv-id=4242 --max-restarts=3 train_ddp.py --data-dir data --epochs 10"]


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
