"""Two real gloo ranks, in this module's one launch (torch.multiprocessing's spawn: two processes
that run the SCENARIOS below in turn, each in a process group of its own, each rank's prints kept
apart and its renames logged): train_ddp.py (then --resume and --evaluate), train_fsdp.py,
train_accelerate.py and predict say what only rank 0 should say, once, and write from rank 0
alone, each file in its order and with the usual mode; the reductions and rank-dependent indices
with uneven shares (each epoch's sample counts, FSDP's validation forwards and sums, the shards'
whole state, predict's rows, the newest last.pth of two nodes); a torchrun restart whose store
still holds the dead attempt's keys.

A fake process group cannot show these: its collectives do nothing, and one process cannot print
twice."""
import contextlib
import json
import math
import os
import re
import stat
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision
from conftest import HOOKS, TINY, free_port, outputs, read_predictions, val_folder, weights, write_checkpoint

from src.errors import end_process_group
from src.metrics import batch_sums

VAL_FRACTION = "0.225"  # tiny_data's 40 images: 31 train, 9 validation (4 on rank 0, 5 on rank 1)
FLAGS = [*TINY, "--batch-size", "4", "--val-fraction", VAL_FRACTION, "--epochs", "2"]
# Most messages a run can print, in one run: --resume with no last.pth yet, a frozen first epoch
# (SqueezeNet's last layer is not its output layer), --profile's table; and --cache's.
CHATTY = ["--resume", "--freeze-epochs", "1", "--profile"]
PREDICTED = 7  # predict's folder: 7 images (the 4th broken: rank 1's first), and a text file
BROKEN = 3
# Seconds a scenario may take (it takes seconds): after this a rank stops the whole launch. Under a
# breakage a rank may wait in a collective that the other never joins.
SCENARIO_LIMIT = 120


def _script(name: str, argv: list[str]) -> None:
    """main() of train_NAME.py (or src.tools.NAME) as `python NAME.py ARGV` runs it under a launcher."""
    import importlib

    from src.errors import exit_on_error
    module = importlib.import_module(name)
    sys.argv = [f"{name.rsplit('.', 1)[-1]}.py", *argv]
    exit_on_error(module.main)


# The scenarios: each runs on both ranks with the environment torchrun gives a rank (its own
# port), and returns what the test reads (on each rank).

def _ddp_flags(folder: Path, data: Path) -> list[str]:
    return ["--data-dir", str(data), *FLAGS, "--cache", str(folder / "cache"), *CHATTY, *outputs(folder / "ddp")]


def ddp(rank: int, folder: Path, data: Path):
    _script("train_ddp", [*_ddp_flags(folder, data), "--log-dir", str(folder / "tensorboard")])


def ddp_resume(rank: int, folder: Path, data: Path):
    """train_ddp.py --resume of the run above, with nothing left to train."""
    _script("train_ddp", _ddp_flags(folder, data))


def ddp_evaluate(rank: int, folder: Path, data: Path):
    _script("train_ddp", ["--data-dir", str(data), *FLAGS, "--checkpoint", str(folder / "ddp" / "best.pth"),
                          "--plot", str(folder / "ddp" / "curves.png"), "--evaluate"])


def fsdp(rank: int, folder: Path, data: Path):
    """train_fsdp.py with --amp fp16 (its gradient scaler's state ends in last.pth)."""
    _script("train_fsdp", ["--data-dir", str(data), *FLAGS, "--cache", str(folder / "cache"), *CHATTY,
                           "--amp", "fp16", *outputs(folder / "fsdp")])


def accelerate(rank: int, folder: Path, data: Path):
    os.environ.update(ACCELERATE_USE_CPU="1", HF_HOME=str(folder / "hf"))
    try:
        _script("train_accelerate", ["--data-dir", str(data), *FLAGS, "--cache", str(folder / "cache"), *CHATTY,
                                     *outputs(folder / "accelerate")])
    finally:
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def predict(rank: int, folder: Path, data: Path):
    """predict over PREDICTED images, in batches of 2: rank 0 takes 3, rank 1 the 4 from BROKEN on."""
    _script("src.tools.predict", [str(folder / "images"), "--checkpoint", str(folder / "model" / "best.pth"),
                                  "--output", str(folder / "two.csv"), "--workers", "0", "--batch-size", "2"])


def _plain_group(rank: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=60))


def newest_last(rank: int, folder: Path, data: Path):
    """Two nodes (each rank the first of its own, with a folder of its own) holding last.pth files
    of the epochs (or (epoch, steps into the next)) in NEWEST_CASES: which one every rank resumes from."""
    from src.checkpoint import _newest_last
    _plain_group(rank)
    os.environ["LOCAL_RANK"] = "0"
    found = []
    for case, epochs in enumerate(NEWEST_CASES):
        path = folder / f"node{rank}" / str(case) / "last.pth"
        path.parent.mkdir(parents=True)
        if epochs[rank] is not None:
            epoch, step = epochs[rank] if isinstance(epochs[rank], tuple) else (epochs[rank], 0)
            torch.save({"epoch": epoch, "step": step, "written_by": rank}, path)
        source, state = _newest_last(path)
        found.append((source, None if state is None else (state["epoch"], state["written_by"])))
    return found


NEWEST_CASES = [(1, 2), (2, 1), (2, 2), (None, 1), (None, None), ((1, 0), (1, 3)), ((1, 3), 1)]


def fsdp_validation(rank: int, folder: Path, data: Path):
    """A sharded model of odd sizes (its shards uneven: 3 rows on rank 0, 2 on rank 1) validates
    9 samples in batches of 2 (4 on rank 0: 2 batches, 5 on rank 1: 3), then its whole state is
    gathered onto rank 0."""
    from conftest import shard_as_train_fsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import train_fsdp
    from src.cli import parse_args
    from src.ema import WeightAverage
    from src.loaders import Data
    from src.progress import Progress
    from src.recipe import make_optimizer
    from src.state import TrainingState
    _plain_group(rank)
    model, inputs, labels = _odd_model_and_samples()
    forwards = []
    model.register_forward_hook(lambda module, args, output: forwards.append(len(args[0])))
    shard_as_train_fsdp(model)
    args = parse_args("", ["--workers", "0", "--log-every", "1000", "--batch-size", "2"])
    dataset = [(inputs[i], int(labels[i])) for i in range(len(inputs))]
    data = Data(dataset, list(range(len(inputs))), list(range(len(inputs))), "")
    val_loader = train_fsdp.loaders(dataset, data, args, torch.device("cpu"), rank, 2)[1]
    optimizer = make_optimizer(model, args, torch.device("cpu"))
    state = TrainingState(args, {}, model, optimizer, None, None, WeightAverage(model, optimizer, None), 1)
    sums = train_fsdp.evaluate(model, val_loader, "val", Progress(args, state, 2, torch.device("cpu")), args,
                               torch.device("cpu"))
    shapes = {name: tuple(p.to_local().shape) for name, p in model.named_parameters()}
    # what train_fsdp.py gathers for best.pth
    whole = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"forwards": forwards, "sums": sums, "shapes": shapes, "state": whole if rank == 0 else None}


def _odd_model_and_samples() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A model whose first dimensions are odd (5 rows and 1) and 9 samples, the same in every process."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 1), nn.Linear(1, 2))
    inputs = torch.randint(0, 256, (9, 1, 2, 2), dtype=torch.uint8).repeat(1, 3, 1, 1)
    return model, inputs, torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1])


def restart(rank: int, folder: Path, data: Path):
    """torchrun --max-restarts keeps its store (the agent's) across attempts, and starts each
    attempt's workers as new processes: attempt 0 joins, reduces and ends; in attempt 1 rank 0 joins
    the same store at once and rank 1 RESTART_DELAY s after it, as a restarted worker may (with the
    dead attempt's keys in reach, rank 0 would take rank 1's old address and fail to connect), and
    they reduce again. Each attempt is a process of its own: a process that joined a group before
    names its next group otherwise (torch counts them), which would hide the old keys."""
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store at MASTER_PORT is the agent's (the test's)
    os.environ["MASTER_PORT"] = os.environ["AGENT_PORT"]
    done = []
    for attempt in (0, 1):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
        worker = mp.get_context("spawn").Process(target=_restart_attempt, args=(rank, attempt, str(folder)),
                                                 daemon=True)
        worker.start()
        worker.join(SCENARIO_LIMIT / 2)
        if worker.is_alive():
            worker.kill()
        total = folder / f"restart{attempt}.{rank}"
        assert worker.exitcode == 0 and total.exists(), f"attempt {attempt} of rank {rank}: exit {worker.exitcode}"
        done.append(tuple(json.loads(total.read_text())))
    return done


def _restart_attempt(rank: int, attempt: int, folder: str) -> None:
    """One attempt's worker of `restart`, a new process: it joins as train_ddp.py does and writes its
    all-reduced total to FOLDER/restartATTEMPT.RANK."""
    from src.process_group import torchrun_store
    torch.set_num_threads(1)
    joining = Path(folder) / "attempt1.rank0"
    if attempt == 1 and rank == 0:
        joining.touch()
    if attempt == 1 and rank == 1:
        while not joining.exists():
            time.sleep(0.05)
        time.sleep(RESTART_DELAY)
    store, rank_, world_size = torchrun_store(1)  # as train_ddp.py joins
    # Whether this attempt's store shows a key of the dead attempt (gloo may not read the stale
    # addresses: which rank of a pair connects depends on their ports).
    stale = store.check([f"written in attempt 0 by rank {rank}"])
    store.set(f"written in attempt {attempt} by rank {rank}", "1")
    dist.init_process_group("gloo", store=store, rank=rank_, world_size=world_size)
    total = torch.tensor([rank + 1.0])
    dist.all_reduce(total)
    end_process_group()
    (Path(folder) / f"restart{attempt}.{rank}").write_text(json.dumps([total.item(), stale]))


RESTART_DELAY = 3


def val_dir(rank: int, folder: Path, data: Path):
    """labelled_data with --val-dir (rank 0 scans both folders and sends the tables), then
    train_ddp.py's loaders: the names of the validation images in this rank's shard, in order."""
    import train_ddp
    from src.cli import defaults
    from src.loaders import labelled_data
    _plain_group(rank)
    args = defaults(["--data-dir", str(data), "--val-dir", str(folder / "val"), "--image-size", "32"])
    loaded = labelled_data(args)
    val_loader = train_ddp.loaders(loaded.dataset, loaded, args, torch.device("cpu"), rank, 2)[1]
    return [loaded.dataset.frame["filename"][loaded.val_idx[i]] for i in val_loader.sampler]


SCENARIOS = [ddp, ddp_resume, ddp_evaluate, fsdp, accelerate, predict, newest_last, fsdp_validation, restart, val_dir]


def _rank(rank: int, ports: dict, folder: str, data: str) -> None:
    """One rank: each scenario of `ports` in turn, its prints and its result (or traceback) in files."""
    torch.set_num_threads(1)
    folder, data = Path(folder), Path(data)
    saved = dict(os.environ)
    for scenario in (scenario for scenario in SCENARIOS if scenario.__name__ in ports):
        name = scenario.__name__
        os.environ.clear()
        os.environ.update(saved)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[name]), AGENT_PORT=str(ports["agent"]))
        stem = folder / f"{name}.{rank}"

        def hung(stem=stem, name=name):  # a collective that waits for a rank that never comes
            torch.save({"error": f"{name} did not end within {SCENARIO_LIMIT} s"}, f"{stem}.pt")
            os._exit(3)
        watchdog = threading.Timer(SCENARIO_LIMIT, hung)
        watchdog.start()
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err, \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                result = {"value": scenario(rank, folder, data)}
            except BaseException as error:  # a script's exit too
                result = {"error": "".join(traceback.format_exception(error))}
            finally:
                end_process_group()
        watchdog.cancel()
        torch.save(result, f"{stem}.pt")


@pytest.fixture(scope="module")
def launch(tiny_data, module_tmp):
    """The two ranks' run of every scenario; the folder of their files."""
    folder = module_tmp / "two"
    (folder / "images").mkdir(parents=True)
    for i in range(PREDICTED):
        source = tiny_data / "test" / f"{i % 6 + 1}.jpg"
        (folder / "images" / f"{i}.jpg").write_bytes(source.read_bytes()[:100] if i == BROKEN else source.read_bytes())
    (folder / "images" / "notes.txt").write_text("not an image")
    val_folder(tiny_data, folder / "val")
    torch.manual_seed(0)  # an untrained ResNet-18 with a head of larger weights: each image its own p(dog)
    model = torchvision.models.resnet18(num_classes=2)
    nn.init.normal_(model.fc.weight, std=0.2)
    write_checkpoint(folder / "model", model.state_dict(), arch="resnet18")
    ports = {scenario.__name__: free_port() for scenario in SCENARIOS}
    agent = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    ports["agent"] = agent.port
    with pytest.MonkeyPatch.context() as patch:  # the test hooks log each rank's renames onto an output
        patch.setenv("PYTHONPATH", os.pathsep.join([HOOKS, os.environ.get("PYTHONPATH", "")]))
        patch.setenv("WRITE_LOG", str(folder / "writes.log"))
        context = mp.start_processes(_rank, args=(ports, str(folder), str(tiny_data)), nprocs=2, join=False,
                                     start_method="spawn")
    try:
        while not context.join(timeout=30):
            pass
    except mp.ProcessExitedException:  # a rank's watchdog ended it: the other may be waiting for it
        for process in context.processes:
            process.kill()
    return folder


def result(folder: Path, scenario: str, rank: int):
    """What the scenario returned on that rank; a failed test with its traceback if it raised."""
    path = folder / f"{scenario}.{rank}.pt"
    assert path.exists(), f"{scenario} did not end on rank {rank}: {(folder / f'{scenario}.{rank}.err').read_text()[-3000:]}"
    saved = torch.load(path, weights_only=False)
    assert "error" not in saved, f"rank {rank}: {saved['error'][-3000:]}\n{(folder / f'{scenario}.{rank}.err').read_text()[-2000:]}"
    return saved["value"]


def printed(folder: Path, scenario: str, rank: int) -> tuple[str, str]:
    return (folder / f"{scenario}.{rank}.out").read_text(), (folder / f"{scenario}.{rank}.err").read_text()



# What each rank printed: rank 0 each of its lines once, rank 1 nothing of ours (library warnings,
# which every process prints, aside).

def ours(text: str) -> list[str]:
    """The lines of a rank's stderr that are not Python's warnings (the file:line: ...Warning: line
    and the source line below it); a progress bar's redraws each count."""
    lines, kept = text.replace("\r", "\n").splitlines(), []
    skip = False
    for line in lines:
        if re.match(r"^\S+:\d+: \w*Warning: ", line) or re.search(r"\w*Warning: ", line.split("]")[-1]) and ".py:" in line:
            skip = True
            continue
        if skip and line.startswith("  "):
            skip = False
            continue
        skip = False
        if line.strip():
            kept.append(line)
    return kept


# The lines rank 0 must print exactly once in each scenario.
SAID = {
    "ddp": ["--resume: no ", "squeezenet1_1 on 2 x cpu: 31 train / 9 val images, batch 4 x 2",
            "the last layer of squeezenet1_1 is not its output layer", "--profile: 1 training step on rank 0 of 2",
            "| where the time went |", "epoch 1/2  train loss", "epoch 2/2  train loss", "done in "],
    "ddp_resume": ["reading images from the cache ", "after epoch 2 of 2: nothing left to train",
                   "squeezenet1_1 on 2 x cpu", "done in "],
    "ddp_evaluate": ["squeezenet1_1 on 2 x cpu", "validated ", '{"val_loss": '],
    "fsdp": ["--resume: no ", "squeezenet1_1 on 2 x cpu", "--freeze under FSDP runs the frozen backbone",
             "| where the time went |", "epoch 1/2  train loss", "epoch 2/2  train loss", "done in ", "rank 0 held "],
    "accelerate": ["--resume: no ", "squeezenet1_1 on 2 x cpu", "(accelerate MULTI_CPU",
                   "the last layer of squeezenet1_1 is not its output layer", "| where the time went |",
                   "epoch 1/2  train loss", "epoch 2/2  train loss", "done in "],
    "predict": ["cannot decode it", "/images/0.jpg  ", f"predicted {PREDICTED - 1} images", "skipped 1 file(s)"],
}


@pytest.mark.parametrize("scenario", SAID)
def test_rank_0_alone_speaks_and_says_each_thing_once(scenario, launch):
    """Each script and predict under a launcher of two: rank 1 prints nothing of ours (no line, no
    progress bar); rank 0 prints each line once, each of the scenario's messages among them, and
    draws each progress bar once."""
    result(launch, scenario, 0), result(launch, scenario, 1)
    out0, err0 = printed(launch, scenario, 0)
    out1, err1 = printed(launch, scenario, 1)
    assert out1 == "" and ours(err1) == [], (out1, err1)
    lines = [line for line in out0.splitlines() if line.strip()]
    assert len(lines) == len(set(lines)), out0
    for message in SAID[scenario]:
        assert sum(message in line for line in lines) == 1, (message, out0)
    bars = [line for line in ours(err0) if re.search(r":\s+0%\|", line)]
    assert bars and len(bars) == len(set(bars)), err0


def test_a_broken_image_on_rank_1_leaves_its_own_row_out(launch, tmp_path, monkeypatch, capsys):
    """predict's shares: rank 0 the first 3 images, rank 1 the 4 from the broken one on (its first,
    at global index 3): the CSV has every other image's row, in order, each p(dog) that of the
    one-process validation pass; the broken one is named."""
    from conftest import FORMATTED, validation_pass
    result(launch, "predict", 0)
    files = [launch / "images" / f"{i}.jpg" for i in range(PREDICTED)]
    rows = read_predictions(launch / "two.csv")
    kept = [file for i, file in enumerate(files) if i != BROKEN]
    assert list(rows["path"]) == [str(file) for file in kept]
    p, bound = validation_pass(launch / "model" / "best.pth", kept)
    assert np.all(np.abs(rows["p_dog"].to_numpy() - p) <= bound + FORMATTED)
    assert np.ptp(p) > 0.1, "the images' p(dog) differ: a row in another's place shows"
    assert f"left out {files[BROKEN]}: cannot decode it" in printed(launch, "predict", 0)[0]


@pytest.mark.parametrize("script", ["ddp", "fsdp", "accelerate"])
def test_each_epoch_counts_the_samples_of_both_ranks(script, launch):
    """31 training images in global batches of 8: 3 steps of 4 images per rank, 24 an epoch; the 9
    validation images in shares of 4 and 5 (accelerate pads the shorter share and drops the
    padding again): the reduced sums count every sample once, and their loss is the mean over them."""
    result(launch, script, 0)
    records = json.loads((launch / script / "history.json").read_text())
    assert [(r["train_samples"], r["val_samples"]) for r in records] == [(24, 9), (24, 9)]
    assert all(0 < r["val_loss"] < 5 and 0 <= r["val_acc"] <= 1 for r in records)


def test_fsdp_fp16_scales_the_loss_on_both_ranks(launch):
    """train_fsdp.py --amp fp16: the gradient scaler's state in last.dcp (a disabled scaler keeps
    none): a power of two at most its initial 2^16 (halved for each overflow), steps counted."""
    result(launch, "fsdp", 0)
    scaler = weights(launch / "fsdp", "last.pth")["scaler"]  # last.dcp's training.pt
    assert scaler, "no gradient scaler under fp16"
    assert scaler["scale"] <= 2.0 ** 16 and math.log2(scaler["scale"]).is_integer(), scaler
    assert 1 <= scaler["_growth_tracker"] <= 6, scaler  # 2 epochs of 3 steps


def test_fsdp_validation_forwards_and_sums_with_uneven_shards(launch):
    """Every forward of the sharded model gathers from both ranks, so each runs as many: 3 (rank 0:
    its 2 batches and one more of its last inputs; rank 1: its 3 batches); the sums reduced over
    the two ranks are those of the whole model over the 9 samples, each once."""
    ranks = [result(launch, "fsdp_validation", rank) for rank in (0, 1)]
    assert [r["forwards"] for r in ranks] == [[2, 2, 2], [2, 2, 1]]
    model, inputs, labels = _odd_model_and_samples()
    with torch.no_grad():
        from src.transforms import model_inputs
        want = batch_sums(model.eval()(model_inputs(inputs, torch.device("cpu"))), labels)
    for r in ranks:
        torch.testing.assert_close(r["sums"], want, rtol=1e-6, atol=1e-6)
        assert r["sums"][2] == 9


def test_fsdp_gathers_uneven_shards_into_the_whole_state(launch):
    """Rows cut ceil(rows / 2) on rank 0 and the rest on rank 1 (5 rows: 3 and 2; 1 row: 1 and an
    empty shard); rank 0's gathered state is the model's, tensor for tensor."""
    ranks = [result(launch, "fsdp_validation", rank) for rank in (0, 1)]
    assert ranks[0]["shapes"] == {"1.weight": (3, 12), "1.bias": (3,), "3.weight": (1, 5), "3.bias": (1,),
                                  "4.weight": (1, 1), "4.bias": (1,)}
    assert ranks[1]["shapes"] == {"1.weight": (2, 12), "1.bias": (2,), "3.weight": (0, 5), "3.bias": (0,),
                                  "4.weight": (1, 1), "4.bias": (1,)}
    model, _, _ = _odd_model_and_samples()
    state = ranks[0]["state"]
    assert state.keys() == model.state_dict().keys()
    for key, tensor in model.state_dict().items():
        assert torch.equal(state[key], tensor), key
    assert ranks[1]["state"] is None


@pytest.mark.parametrize("case, want", [
    ((1, 2), (1, (2, 1))),  # the newer on rank 1's node
    ((2, 1), (0, (2, 0))),
    ((2, 2), (0, (2, 0))),  # a tie: rank 0's own, nothing to copy
    ((None, 1), (1, (1, 1))),  # rank 0's node has none
    ((None, None), (0, None)),
    (((1, 0), (1, 3)), (1, (1, 1))),  # epoch 1's end on rank 0's node, 3 steps into epoch 2 on rank 1's
    (((1, 3), 1), (0, (1, 0))),
])
def test_every_rank_resumes_from_the_newest_last_pth_of_any_node(case, want, launch):
    found = [result(launch, "newest_last", rank)[NEWEST_CASES.index(case)] for rank in (0, 1)]
    assert found == [want, want]


def test_each_rank_validates_its_share_of_the_val_dir_and_together_the_whole_once(launch, tiny_data):
    """--val-dir under two ranks: rank 1 holds rank 0's tables (it scans nothing), so the shares of
    train_ddp.py's validation loader are the folder's 6 images, 3 a rank, each once, in the order
    one process validates them (labelled_data in this process)."""
    from src.cli import defaults
    from src.loaders import labelled_data
    shares = [result(launch, "val_dir", rank) for rank in (0, 1)]
    one = labelled_data(defaults(["--data-dir", str(tiny_data), "--val-dir", str(launch / "val"), "--image-size", "32"]))
    whole = [one.dataset.frame["filename"][i] for i in one.val_idx]
    assert [len(share) for share in shares] == [3, 3] and shares[0] + shares[1] == whole
    assert sorted(whole) == sorted(str(path) for path in (launch / "val").rglob("*.jpg"))


def test_a_restarted_attempt_joins_a_store_holding_the_dead_attempts_keys(launch):
    """Each attempt reduces, and neither sees a key the dead attempt wrote to the agent's store."""
    assert result(launch, "restart", 0) == result(launch, "restart", 1) == [(3.0, False), (3.0, False)]


# What each rank wrote: rank 0 alone, each file in its order, with the mode a new file gets.

def _written(folder: Path) -> list[tuple[str, str]]:
    """(rank, path relative to the launch's folder) of every rename onto an output, in order."""
    lines = (folder / "writes.log").read_text().splitlines()
    return [(rank, str(Path(path).relative_to(folder))) for rank, path in (line.split(" ", 1) for line in lines)]


def test_rank_0_alone_writes_each_file_in_its_order_with_the_usual_mode(launch):
    """Each epoch of each script: best.pth before the best.json that holds its sha256 (in the
    epochs that printed "best so far"), then last.pth, history.json and the plot; the cache's
    pixels before the key that says they are complete; predict's CSV once. Every rename is rank
    0's, no temporary file is left, and every file has the mode of a new file under the umask."""
    for scenario in ("ddp", "fsdp", "accelerate", "predict"):
        result(launch, scenario, 0)
    written = _written(launch)
    assert {rank for rank, _ in written} == {"0"}, written
    for script in ("ddp", "fsdp", "accelerate"):
        best = ["best so far" in line for line in printed(launch, script, 0)[0].splitlines() if line.startswith("epoch ")]
        # FSDP's last is a folder of each rank's shards: the one before moved aside, the new one renamed into place.
        last = {"fsdp": lambda epoch: [".last.dcp.previous"] * (epoch > 0) + ["last.dcp"]}.get(script, lambda _: ["last.pth"])
        want = [f"{script}/{name}" for epoch, is_best in enumerate(best)
                for name in (["best.pth", "best.json"] if is_best else []) + last(epoch) + ["history.json", "curves.png"]]
        assert [path for _, path in written if path.startswith(f"{script}/")] == want, script
    cache = [path for _, path in written if path.startswith("cache/")]
    assert len(cache) == 2 and cache[0].endswith(".u8") and cache[1] == cache[0][:-len(".u8")] + ".json"
    assert [path for _, path in written if path.endswith(".csv")] == ["two.csv"]
    umask = os.umask(0)
    os.umask(umask)
    files = [path for path in launch.rglob("*") if path.is_file() and path.parent.name in ("ddp", "fsdp", "accelerate", "cache")]
    files.append(launch / "two.csv")
    assert not [path for path in files if path.name.endswith(".tmp")]
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in files} == {path.name: 0o666 & ~umask for path in files}
