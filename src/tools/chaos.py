"""Stop a training run again and again, and check that it ends where an uninterrupted one does.

    python -m src.tools.chaos [--stops N] [--seed S] [--epochs E] [--batch-size B] [--save-every-steps M]
                              [--data-dir DIR] [--reference DIR] [--work-dir DIR]

Trains SqueezeNet 1.1 (64 px, dropout, a weight average, one loader worker per process) with
`torchrun --standalone --nproc_per_node=2 train_ddp.py --save-every-steps M` on a synthetic set (or
--data-dir) and stops it N times, each at a random optimizer step of a random rank, by a random
means:

- sigterm: SIGTERM to torchrun, which forwards it to its workers: every rank stops at an agreed
  step, writes last.pth there and exits (src/stopping.py, src/state.py); the next launch adds --resume;
- sigint: the same with SIGINT (Ctrl-C);
- sigkill: SIGKILL of that worker; torchrun (--max-restarts) restarts the workers, which resume
  from the last step checkpoint on their own and redo the steps after it.

The stops are made by a sitecustomize.py that this tool writes into the work folder and puts on
the workers' PYTHONPATH: after each optimizer step it looks up the plan (CHAOS_PLAN) and logs the
step (CHAOS_LOG). Then it prints the distance between the final weights (and weight average) and
those of an uninterrupted run of the same flags (trained here, or --reference: its output folder),
whether the histories match, and the steps that were done twice; the exit code is 1 unless the
distance is 0 and the histories match (on a CPU the resumed run must be bit for bit the same).
The work folder is this tool's own: it marks it (WORK/.chaos) and replaces there only what it
wrote; a folder holding what it writes without the mark is refused (src.outputs.claim_folder).
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from src.checkpoint import RESUME_KEYS
from src.errors import UserError, exit_on_error
from src.outputs import claim_folder
from src.tools.agreement import distance
from src.tools.commands import ROOT

# RESUMABLE of tests/conftest.py: what a resumed run must restore (dropout's draws, a weight
# average, a persistent loader worker), on a model small enough for a CPU.
FLAGS = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "64", "--lr", "0.001",
         "--workers", "1", "--ema-decay", "0.9", "--val-fraction", "0.5025"]
PROCESSES = 2
MEANS = ("sigterm", "sigint", "sigkill")
TIMINGS = {"train_seconds", "val_seconds", "seconds", "data_wait_seconds"}
MARK = ".chaos"  # says that this tool wrote the work folder, and may write it again
WRITES = ("data", "reference", "chaos", "hook", "steps.log", "reference.log", "launch-1.log")
INTERRUPTED = "interrupted: the launches so far are in the work folder; run the command again (it starts over)"

HOOK = '''"""Written by src/tools/chaos.py: after each optimizer step, the planned stops (CHAOS_PLAN)."""
import json
import os
import signal
import time

PLAN = json.loads(os.environ.get("CHAOS_PLAN", "[]"))
RANK, ATTEMPT = int(os.environ.get("RANK", -1)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

if RANK >= 0:  # a worker, not torchrun itself
    import src.state as state

    stop_agreed = state.TrainingState.stop_agreed

    def chaotic(self, now=False):
        agreed = stop_agreed(self, now)
        if now:  # the agreement at an epoch's start, not after a step
            return agreed
        done = self.run_step
        if RANK == 0:
            with open(os.environ["CHAOS_LOG"], "a") as log:
                log.write(f"{ATTEMPT} {done}\\n")
        for event in PLAN:
            if (event["attempt"], event["rank"], event["step"]) == (ATTEMPT, RANK, done):
                if event["means"] == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                os.kill(os.getppid(), signal.SIGTERM if event["means"] == "sigterm" else signal.SIGINT)
                for _ in range(3000):  # until torchrun has forwarded it here
                    if self.signals.requested:
                        break
                    time.sleep(0.01)
        return agreed

    state.TrainingState.stop_agreed = chaotic
'''


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--stops", type=int, default=3, help="how many times to stop the run")
    parser.add_argument("--seed", type=int, default=0, help="seeds the steps, ranks and means of the stops")
    parser.add_argument("--epochs", type=int, default=None,
                        help="epochs of the run (default: 3, or enough for 3 optimizer steps a stop)")
    parser.add_argument("--batch-size", type=int, default=5, help="images per process and step")
    parser.add_argument("--save-every-steps", type=int, default=3, help="the run's --save-every-steps")
    parser.add_argument("--data-dir", default=None,
                        help="the images (default: a synthetic set of 201, 100 of them for training)")
    parser.add_argument("--reference", default=None,
                        help="output folder of an uninterrupted run of the same flags (default: train one)")
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--launch-timeout", type=float, default=600, help="seconds one launch may take")
    args = parser.parse_args(argv)
    for name in ("stops", "epochs", "batch_size", "save_every_steps"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def plan(rng: random.Random, stops: int, total: int) -> list[list[dict]]:
    """The stops, launch by launch: each a list of events {attempt, rank, step, means} at the run's
    optimizer steps (from 1), each after the one before; a launch ends at a sigterm or sigint, its
    next attempt begins after a sigkill. Spread evenly: each gets its share of the steps left."""
    launches, launch, attempt, after = [], [], 0, 0
    for left in range(stops, 0, -1):
        room = total - 2 - after  # a signal's stop comes two steps later: the run must not be over
        if room < 1:
            raise UserError(f"{total} optimizer steps leave no room for {stops} stops: raise --epochs "
                            "or lower --batch-size")
        step = after + rng.randint(1, max(1, room // left))
        means = rng.choice(MEANS)
        launch.append({"attempt": attempt, "rank": rng.randrange(PROCESSES), "step": step, "means": means})
        after = step
        if means == "sigkill":
            attempt += 1
        else:
            launches.append(launch)
            launch, attempt = [], 0
            # The signal comes after the step's agreement: the ranks stop after step + 2 (--log-every 1).
            after = step + 2
    launches.append(launch)  # the last launch runs to the end, after its kills
    return launches


def torchrun(restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={PROCESSES}",
            f"--max-restarts={restarts}", "train_ddp.py"]


def launch(command: list[str], env: dict, log: Path, timeout: float) -> int:
    """Run a launch from the repository root; its output goes to `log`."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    with open(log, "w") as out:
        try:
            return subprocess.run(command, cwd=ROOT, env=full_env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            raise UserError(f"a launch took more than {timeout:.0f} s; its output is in {log}") from None


def position(folder: Path) -> tuple[int, int]:
    """(finished epochs, steps into the next) of folder's last.pth; (0, 0) without one."""
    path = folder / "last.pth"
    if not path.exists():
        return 0, 0
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return int(state["epoch"]), int(state.get("step", 0))


def history(folder: Path) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMINGS}
            for record in json.loads((folder / "history.json").read_text())]


def compare(out: Path, reference: Path) -> tuple[float, float, bool]:
    """The distance between the weights of two runs' last.pth, between their weight averages, and
    whether their histories match (timings left out); a reference of other flags is refused."""
    ours, theirs = (torch.load(folder / "last.pth", map_location="cpu", weights_only=True) for folder in (out, reference))
    for key in RESUME_KEYS + ("epochs",):
        if ours["info"].get(key) != theirs["info"].get(key):
            raise UserError(f"--reference {reference} is another run: its {key} is {theirs['info'].get(key)!r}, "
                            f"not {ours['info'].get(key)!r}")
    return (distance(ours["model"], theirs["model"]), distance(ours["average"]["model"], theirs["average"]["model"]),
            history(out) == history(reference))


def ended_as_straight(weights: float, average: float, same_history: bool) -> bool:
    """The verdict: the stopped and resumed run ends bit for bit where the uninterrupted one does
    (weights, weight average and history), as a resume on a CPU must."""
    return weights == 0 and average == 0 and same_history


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="chaos-"))
    claim_folder(work, MARK, WRITES, "src.tools.chaos", "the chaos check", "--work-dir ")
    data = Path(args.data_dir) if args.data_dir else work / "data"
    if not args.data_dir and not (data / "train").is_dir():
        from src.tools.synthetic import write_dataset
        write_dataset(data, n_train=201, n_test=0, size=64, seed=2)
    train_images = round(len(list((data / "train").iterdir())) * (1 - 0.5025))
    steps = train_images // (args.batch_size * PROCESSES)
    epochs = args.epochs or max(3, -(-(3 * args.stops + 2) // steps))  # a signal's stop takes up to 3 steps
    total = epochs * steps
    flags = ["--data-dir", str(data), *FLAGS, "--epochs", str(epochs), "--batch-size", str(args.batch_size)]
    events = plan(random.Random(args.seed), args.stops, total)
    print(f"chaos: {args.stops} stops of a {total}-step run (2 processes, --save-every-steps "
          f"{args.save_every_steps}), seed {args.seed}, in {work}", flush=True)
    began = time.time()

    reference = Path(args.reference) if args.reference else work / "reference"
    if not args.reference:
        shutil.rmtree(reference, ignore_errors=True)  # an earlier check's, in our own folder
        code = launch([*torchrun(0), *flags, "--checkpoint", str(reference / "best.pth"),
                       "--plot", str(reference / "curves.png")], {}, work / "reference.log", args.launch_timeout)
        if code != 0:
            raise UserError(f"the uninterrupted run failed (exit {code}); its output is in {work / 'reference.log'}")

    out = work / "chaos"
    shutil.rmtree(out, ignore_errors=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    steps_log = work / "steps.log"
    steps_log.write_text("")
    for number, events_here in enumerate(events):
        kills = sum(event["means"] == "sigkill" for event in events_here)
        env = {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "CHAOS_PLAN": json.dumps(events_here), "CHAOS_LOG": str(steps_log)}
        log = work / f"launch-{number + 1}.log"
        code = launch([*torchrun(kills), *flags, "--save-every-steps", str(args.save_every_steps),
                       "--log-every", "1", "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png"),
                       *(["--resume"] if number else [])], env, log, args.launch_timeout)
        epoch, step = position(out)
        said = ", ".join(f"{event['means']} (rank {event['rank']}) after step {event['step']}" for event in events_here)
        print(f"launch {number + 1}: {said or 'no stop'}; exit {code}, last.pth at epoch {epoch} + "
              f"{step} steps", flush=True)
        last_launch = number == len(events) - 1
        if last_launch != (code == 0):
            raise UserError(f"launch {number + 1} {'failed' if last_launch else 'did not stop'} (exit {code}); "
                            f"its output is in {log}")

    done = [int(line.split()[1]) for line in steps_log.read_text().splitlines()]
    redone = len(done) - total
    if sorted(set(done)) != list(range(1, total + 1)):
        raise UserError(f"the steps logged in {steps_log} are not each of 1 to {total}")
    weights, average, same_history = compare(out, reference)
    counts = {means: sum(e["means"] == means for launch_ in events for e in launch_) for means in MEANS}
    print(f"chaos: {args.stops} stops ({', '.join(f'{n} {m}' for m, n in counts.items())}) in {len(events)} launches, "
          f"{time.time() - began:.0f} s; {redone} of {total} steps done twice; distance to the uninterrupted run: "
          f"{weights:g} (weights), {average:g} (average); history {'the same' if same_history else 'DIFFERENT'}")
    if not ended_as_straight(weights, average, same_history):
        sys.exit(1)


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
