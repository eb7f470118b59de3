"""Stop a training run again and again, and check that it ends where an uninterrupted one does.

    python -m src.tools.chaos [--stops N] [--seed S] [--epochs E] [--batch-size B] [--save-every-steps M]
                              [--data-dir DIR] [--reference DIR] [--work-dir DIR]
    python -m src.tools.chaos --change-world [--far DIR] [the same options]

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

--change-world: every stop ends its launch (SIGTERM or SIGINT as above, or SIGKILL of a worker,
which torchrun does not restart, or of the one process), and each launch resumes the run in a
world drawn anew, another one than the launch before: train_single.py, or train_ddp.py or
train_fsdp.py on 1 or 2 processes (WORLDS), each with the same global batch (--batch-size x 2),
so that it goes on from the last of any mode (last.pth, or FSDP's last.dcp resharded). Each stop
is planned after the steps done so far, among the steps left (a signal needs up to 2 x
CHECK_EVERY steps to be agreed on by two processes, src/stopping.py). Processes of another count
sum floats in another order, so the end is not bit for bit. The distances are shares of the
control distance (the yardstick of the tests: between the uninterrupted run and the same job with
another global batch, trained here or --far), and the float floor is the share between the
uninterrupted run on two processes and on one (train_single.py, trained here or --alone): the
order of the sums alone, grown over the run's steps. The verdict: the run ends within the floor,
or within the modes' tolerance (src/tools/agreement.py TOLERANCE) where that is larger, of one of
the two uninterrupted runs (weights and average), and its history's figures differ from theirs by
no more relatively than theirs from each other, or 1e-4; the exit code is 1 otherwise.
"""
import argparse
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from src import sharded_checkpoint
from src.checkpoint import RESUME_KEYS, last_position, read_last
from src.cli import BATCH_SIZES, EPOCHS, SEEDS, STEPS, OneLineParser, between, ranged
from src.errors import UserError, exit_on_error
from src.outputs import claim_folder
from src.stopping import CHECK_EVERY
from src.tools.agreement import TOLERANCE, distance
from src.tools.commands import ROOT

# RESUMABLE of tests/conftest.py: what a resumed run must restore (dropout's draws, a weight
# average, a persistent loader worker), on a model small enough for a CPU.
FLAGS = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "64", "--lr", "0.001",
         "--workers", "1", "--ema-decay", "0.9", "--val-fraction", "0.5025"]
PROCESSES = 2
MEANS = ("sigterm", "sigint", "sigkill")
TIMINGS = {"train_seconds", "val_seconds", "seconds", "data_wait_seconds"}
MARK = ".chaos"  # says that this tool wrote the work folder, and may write it again
WRITES = ("data", "reference", "far", "alone", "chaos", "hook", "steps.log", "reference.log", "far.log", "alone.log",
          "launch-1.log")
# The worlds that --change-world draws from: (script, processes).
WORLDS = (("train_single.py", 1), ("train_ddp.py", 1), ("train_ddp.py", 2), ("train_fsdp.py", 1), ("train_fsdp.py", 2))
CLOSE = 1e-4  # how close the histories' figures must be when the processes change (as the tests hold the modes)
INTERRUPTED = "interrupted: the launches so far are in the work folder; run the command again (it starts over)"

HOOK = '''"""Written by src/tools/chaos.py: after each optimizer step, the planned stops (CHAOS_PLAN)."""
import json
import math
import os
import signal
import time

PLAN = json.loads(os.environ.get("CHAOS_PLAN", "[]"))
RANK, ATTEMPT = int(os.environ.get("RANK", -1)), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
UNDER_TORCHRUN = "TORCHELASTIC_RUN_ID" in os.environ
if not UNDER_TORCHRUN and os.environ.get("CHAOS_ALONE"):  # train_single.py: the one process
    RANK = 0

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
                target = os.getppid() if UNDER_TORCHRUN else os.getpid()  # torchrun forwards it to every worker
                os.kill(target, signal.SIGTERM if event["means"] == "sigterm" else signal.SIGINT)
                for _ in range(3000):  # until torchrun has forwarded it here
                    if self.signals.requested:
                        break
                    time.sleep(0.01)
        return agreed

    state.TrainingState.stop_agreed = chaotic
'''


@dataclasses.dataclass(kw_only=True)
class Options:
    """chaos's flags, as parse_args returns them."""

    stops: int
    seed: int
    epochs: int | None
    batch_size: int
    save_every_steps: int
    data_dir: str | None
    reference: str | None
    work_dir: str | None
    launch_timeout: float
    change_world: bool
    far: str | None
    alone: str | None


def parse_args(argv: list[str] | None = None) -> Options:
    parser = OneLineParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    # Each stop is a launch or a restart of the run (seconds each): a hundred is an afternoon.
    parser.add_argument("--stops", type=between(1, 100), default=3, help="how many times to stop the run")
    parser.add_argument("--seed", type=between(*SEEDS), default=0, help="seeds the steps, ranks and means of the stops")
    parser.add_argument("--epochs", type=between(*EPOCHS), default=None,
                        help="epochs of the run (default: 3, or enough for 3 optimizer steps a stop)")
    parser.add_argument("--batch-size", type=between(*BATCH_SIZES), default=5, help="images per process and step")
    parser.add_argument("--save-every-steps", type=between(*STEPS), default=3, help="the run's --save-every-steps")
    parser.add_argument("--data-dir", default=None,
                        help="the images (default: a synthetic set of 201, 100 of them for training)")
    parser.add_argument("--reference", default=None,
                        help="output folder of an uninterrupted run of the same flags (default: train one)")
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a temporary folder)")
    # subprocess's waits poll in milliseconds held in a C int: at most 24.8 days.
    parser.add_argument("--launch-timeout", type=ranged(0, 24 * 86400, True, False), default=600,
                        help="seconds one launch may take")
    parser.add_argument("--change-world", action="store_true",
                        help="resume each launch in another mode and number of processes (the same global batch)")
    parser.add_argument("--far", default=None,
                        help="--change-world: output folder of an uninterrupted run of the same flags but twice "
                             "the --batch-size, the control distance (default: train one)")
    parser.add_argument("--alone", default=None,
                        help="--change-world: output folder of an uninterrupted train_single.py run of the same "
                             "flags and global batch, the float floor (default: train one)")
    args = parser.parse_args(argv)
    for flag in ("far", "alone"):
        parser.refuse_unless(parser.given(argv), flag, args.change_world, "it is a run of --change-world: add it")
    return Options(**vars(args))


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


def torchrun(restarts: int, script: str = "train_ddp.py", processes: int = PROCESSES) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            f"--max-restarts={restarts}", script]


def world_command(script: str, processes: int) -> list[str]:
    """How a launch of that world starts: train_single.py alone, the others under torchrun."""
    return [sys.executable, script] if script == "train_single.py" else torchrun(0, script, processes)


def next_stop(rng: random.Random, done: int, left: int, total: int, previous: tuple[str, int] | None) -> dict:
    """--change-world's next launch: a world other than `previous`, and its stop (None for the last
    launch): after step `done` (the furthest the run got), at its share of the steps left, with room
    for two processes to agree on a signal before the run's end (else a kill)."""
    world = rng.choice([world for world in WORLDS if world != previous])
    if not left:
        return {"world": world, "event": None}
    means = rng.choice(MEANS)
    if total - done - 2 * CHECK_EVERY < 1:  # too late for two processes to agree on a signal: a kill
        means = "sigkill"
    room = total - done - (2 * CHECK_EVERY if means != "sigkill" else 0)
    if room < 1:
        raise UserError(f"{total} optimizer steps leave no room for {left} more stop(s) after step {done}: "
                        "raise --epochs or lower --batch-size")
    step = done + rng.randint(1, max(1, room // left))
    return {"world": world, "event": {"attempt": 0, "rank": rng.randrange(world[1]), "step": step, "means": means}}


def history_apart(ours: list[dict], theirs: list[dict]) -> float:
    """The largest relative difference between two histories' figures (timings left out); infinite
    where their epochs, fields or sample counts differ."""
    if len(ours) != len(theirs) or any(a.keys() != b.keys() for a, b in zip(ours, theirs)):
        return math.inf
    apart = 0.0
    for a, b in zip(ours, theirs):
        for key in a:
            if isinstance(a[key], float) or isinstance(b[key], float):
                apart = max(apart, abs(a[key] - b[key]) / max(abs(a[key]), abs(b[key]), 1e-12))
            elif a[key] != b[key]:
                return math.inf
    return apart


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
    """(finished epochs, steps into the next) of folder's last (last.pth, or FSDP's last.dcp: the
    newer); (0, 0) without one."""
    return last_position(folder) or (0, 0)


def history(folder: Path) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMINGS}
            for record in json.loads((folder / "history.json").read_text())]


def _last_of(what: str, folder: Path) -> dict:
    """The last (last.pth or last.dcp) of a run's output folder, or one line saying it has none."""
    last = read_last(folder)
    if last is None:
        raise UserError(f"{what} {folder} holds no last.pth or last.dcp: pass the output folder of a finished run")
    return last


def compare(out: Path, reference: Path) -> tuple[float, float, bool]:
    """The distance between the weights of two runs' last.pth, between their weight averages, and
    whether their histories match (timings left out); a reference of other flags is refused."""
    ours, theirs = _last_of("the stopped run's folder", out), _last_of("--reference", reference)
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
    # A signal's stop takes up to 3 steps; with world changes, up to 2 x CHECK_EVERY, and each
    # stop gets room for its own.
    per_stop = 2 * CHECK_EVERY + 2 if args.change_world else 3
    epochs = args.epochs or max(3, -(-(per_stop * args.stops + 2) // steps))
    total = epochs * steps
    flags = ["--data-dir", str(data), *FLAGS, "--epochs", str(epochs)]
    began = time.time()
    if args.change_world:
        print(f"chaos: {args.stops} stops of a {total}-step run, each launch in a world drawn anew (global batch "
              f"{args.batch_size * PROCESSES}, --save-every-steps {args.save_every_steps}), seed {args.seed}, in {work}",
              flush=True)
    else:
        print(f"chaos: {args.stops} stops of a {total}-step run (2 processes, --save-every-steps "
              f"{args.save_every_steps}), seed {args.seed}, in {work}", flush=True)
    reference = _straight(args.reference, work / "reference", flags, args.batch_size, work / "reference.log",
                          args.launch_timeout)
    out = work / "chaos"
    shutil.rmtree(out, ignore_errors=True)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    steps_log = work / "steps.log"
    steps_log.write_text("")
    common = [*flags, "--save-every-steps", str(args.save_every_steps), "--log-every", "1",
              "--checkpoint", str(out / "best.pth"), "--plot", str(out / "curves.png")]
    env = {"PYTHONPATH": os.pathsep.join([str(hook), str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CHAOS_LOG": str(steps_log)}
    if args.change_world:
        far = _straight(args.far, work / "far", flags, 2 * args.batch_size, work / "far.log", args.launch_timeout)
        alone = _straight(args.alone, work / "alone", flags, PROCESSES * args.batch_size, work / "alone.log",
                          args.launch_timeout, alone=True)
        _changing_worlds(args, work, out, common, env, total, steps_log, (reference, alone, far), began)
    else:
        _one_world(args, work, out, common, env, total, steps_log, reference, began)


def _straight(given: str | None, folder: Path, flags: list[str], batch_size: int, log: Path, timeout: float,
              alone: bool = False) -> Path:
    """An uninterrupted run of two DDP processes, or of train_single.py (`alone`): `given` (--reference,
    --far, --alone), else trained here."""
    if given:
        return Path(given)
    shutil.rmtree(folder, ignore_errors=True)  # an earlier check's, in our own folder
    command = [sys.executable, "train_single.py"] if alone else torchrun(0)
    code = launch([*command, *flags, "--batch-size", str(batch_size), "--checkpoint", str(folder / "best.pth"),
                   "--plot", str(folder / "curves.png")], {}, log, timeout)
    if code != 0:
        raise UserError(f"the uninterrupted run failed (exit {code}); its output is in {log}")
    return folder


def _launched(work: Path, number: int, command: list[str], env: dict, out: Path, said: str, last_launch: bool,
              timeout: float) -> None:
    """Run one launch; say where it left the run; refuse a launch that did not stop, or a last one
    that failed."""
    log = work / f"launch-{number + 1}.log"
    code = launch([*command, *(["--resume"] if number else [])], env, log, timeout)
    epoch, step = position(out)
    kind = "last.dcp" if sharded_checkpoint.whole_folder(out / sharded_checkpoint.NAME) and \
        sharded_checkpoint.position(out / sharded_checkpoint.NAME) == (epoch, step) else "last.pth"
    print(f"launch {number + 1}: {said}; exit {code}, {kind} at epoch {epoch} + {step} steps", flush=True)
    if last_launch != (code == 0):
        raise UserError(f"launch {number + 1} {'failed' if last_launch else 'did not stop'} (exit {code}); "
                        f"its output is in {log}")


def _steps_done(steps_log: Path, total: int) -> list[int]:
    done = [int(line.split()[1]) for line in steps_log.read_text().splitlines()]
    if sorted(set(done)) != list(range(1, total + 1)):
        raise UserError(f"the steps logged in {steps_log} are not each of 1 to {total}")
    return done


def _one_world(args: Options, work: Path, out: Path, common: list[str], env: dict, total: int, steps_log: Path,
               reference: Path, began: float) -> None:
    """Two DDP processes in every launch, resumed by torchrun after a kill: bit for bit."""
    events = plan(random.Random(args.seed), args.stops, total)
    for number, events_here in enumerate(events):
        kills = sum(event["means"] == "sigkill" for event in events_here)
        said = ", ".join(f"{event['means']} (rank {event['rank']}) after step {event['step']}" for event in events_here)
        _launched(work, number, [*torchrun(kills), *common, "--batch-size", str(args.batch_size)],
                  {**env, "CHAOS_PLAN": json.dumps(events_here)}, out, said or "no stop", number == len(events) - 1,
                  args.launch_timeout)
    redone = len(_steps_done(steps_log, total)) - total
    weights, average, same_history = compare(out, reference)
    counts = {means: sum(e["means"] == means for launch_ in events for e in launch_) for means in MEANS}
    print(f"chaos: {args.stops} stops ({', '.join(f'{n} {m}' for m, n in counts.items())}) in {len(events)} launches, "
          f"{time.time() - began:.0f} s; {redone} of {total} steps done twice; distance to the uninterrupted run: "
          f"{weights:g} (weights), {average:g} (average); history {'the same' if same_history else 'DIFFERENT'}")
    if not ended_as_straight(weights, average, same_history):
        sys.exit(1)


def _changing_worlds(args: Options, work: Path, out: Path, common: list[str], env: dict, total: int, steps_log: Path,
                     straight: tuple[Path, Path, Path], began: float) -> None:
    """Each launch in a world drawn anew, each stop ending its launch; the verdict against the float floor."""
    rng, counts = random.Random(args.seed), dict.fromkeys(MEANS, 0)
    worlds: list[tuple[str, int]] = []
    for number in range(args.stops + 1):
        done = max([0] + [int(line.split()[1]) for line in steps_log.read_text().splitlines()])
        left = args.stops - number
        chosen = next_stop(rng, done, left, total, worlds[-1] if worlds else None)
        (script, processes), event = chosen["world"], chosen["event"]
        worlds.append((script, processes))
        batch = args.batch_size * PROCESSES // processes  # the same global batch
        said = f"{script} x {processes}: " + (f"{event['means']} (rank {event['rank']}) after step {event['step']}"
                                               if event else "no stop")
        if event:
            counts[event["means"]] += 1
        _launched(work, number, [*world_command(script, processes), *common, "--batch-size", str(batch)],
                  {**env, "CHAOS_PLAN": json.dumps([event] if event else []), "CHAOS_ALONE": "1"}, out, said,
                  left == 0, args.launch_timeout)
    redone = len(_steps_done(steps_log, total)) - total
    found = verdict(out, *straight)
    to_two, to_one, floor, far = found["to two"], found["to one"], found["floor"], found["far"]
    print(f"chaos: {args.stops} stops ({', '.join(f'{n} {m}' for m, n in counts.items())}) in {args.stops + 1} launches "
          f"in {len(set(worlds))} worlds, {time.time() - began:.0f} s; {redone} of {total} steps done twice")
    print(f"chaos: distance to the uninterrupted run on 2 processes {to_two[0]:.2g} (weights), {to_two[1]:.2g} "
          f"(average), on 1 process {to_one[0]:.2g}, {to_one[1]:.2g}, as shares of the control distance {far:.3g} "
          f"(another global batch); the float floor (1 against 2 processes) {floor[0]:.2g}, {floor[1]:.2g}, the modes' "
          f"tolerance {TOLERANCE:g}: {'within' if found['ends'] else 'OUTSIDE'}; history {found['apart']:.2g} apart "
          f"(the floor {found['history floor']:.2g}): {'within' if found['history'] else 'OUTSIDE'}")
    if not (found["ends"] and found["history"]):
        sys.exit(1)


def verdict(out: Path, reference: Path, alone: Path, far_run: Path) -> dict:
    """--change-world's verdict on the run in `out` (see the module's docstring): its distances (weights,
    average) to the uninterrupted runs on 2 processes (`reference`) and on 1 (`alone`), and theirs to
    each other (the float floor), as shares of `far` (reference against far_run, another global
    batch); whether it ends within the floor (or TOLERANCE) of one of them; the history's largest
    relative difference from theirs, and whether it is within theirs from each other (or CLOSE)."""
    ours, theirs = _last_of("the stopped run's folder", out), _last_of("--reference", reference)
    single, other = _last_of("--alone", alone), _last_of("--far", far_run)
    for name, folder, state in (("--reference", reference, theirs), ("--alone", alone, single)):
        for key in RESUME_KEYS + ("epochs",):
            if ours["info"].get(key) != state["info"].get(key):
                raise UserError(f"{name} {folder} is another run: its {key} is {state['info'].get(key)!r}, "
                                f"not {ours['info'].get(key)!r}")
    if other["info"].get("batch_size") == theirs["info"]["batch_size"]:
        raise UserError(f"--far {far_run} has the global batch of the run ({other['info'].get('batch_size')}): "
                        "the control is the same job with another one")
    far = distance(theirs["model"], other["model"])

    def share(a: dict, b: dict) -> tuple[float, float]:  # weights, average
        return distance(a["model"], b["model"]) / far, distance(a["average"]["model"], b["average"]["model"]) / far
    to_two, to_one, floor = share(ours, theirs), share(ours, single), share(single, theirs)
    bound = max(floor[0], TOLERANCE), max(floor[1], TOLERANCE)
    apart = min(history_apart(history(out), history(folder)) for folder in (reference, alone))
    history_floor = max(history_apart(history(alone), history(reference)), CLOSE)
    return {"far": far, "to two": to_two, "to one": to_one, "floor": floor,
            "ends": all(min(a, b) <= limit for a, b, limit in zip(to_two, to_one, bound)),
            "apart": apart, "history floor": history_floor, "history": apart <= history_floor}


if __name__ == "__main__":
    exit_on_error(main, INTERRUPTED)
