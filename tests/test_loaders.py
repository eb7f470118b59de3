"""The split and the scripts' loaders: the same global batches in every mode, each validation sample
once, a resumed epoch's finished steps skipped without reading them."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, run

import train_accelerate
import train_ddp
import train_single
from src.cli import defaults
from src.config import Config
from src.errors import UserError
from src.loaders import Data, check_batches, skip_first_batches, split_indices

CPU = torch.device("cpu")


def test_split_is_seeded_disjoint_and_complete():
    train, val = split_indices(101, 0.2, seed=42)
    assert (train, val) == split_indices(101, 0.2, seed=42)
    assert len(val) == 20 and len(train) == 81
    assert sorted(train + val) == list(range(101))
    assert split_indices(101, 0.2, seed=43) != (train, val)


@pytest.mark.parametrize("fraction, n", [(0.001, 100), (0.999, 100)])
def test_split_that_would_be_empty_is_refused(fraction, n):
    with pytest.raises(UserError, match="--val-fraction"):
        split_indices(n, fraction, seed=0)


def test_a_split_of_one_validation_or_one_training_image_is_accepted_and_none_refused():
    """Both sides of each boundary of split_indices: of 100 images, 1 validation image (0.01) and
    1 training image (0.99) are splits; 0 of either (0.004, 0.996: rounded to 0 and 100) is refused
    naming the counts."""
    for fraction, sizes in ((0.01, (99, 1)), (0.99, (1, 99))):
        train, val = split_indices(100, fraction, seed=0)
        assert (len(train), len(val)) == sizes and sorted(train + val) == list(range(100))
    for fraction, counts in ((0.004, "100 train, 0 validation"), (0.996, "0 train, 100 validation")):
        with pytest.raises(UserError, match=rf"^--val-fraction {fraction} leaves an empty split of 100 images \({counts}\)$"):
            split_indices(100, fraction, seed=0)


def _args(batch_size: int, seed: int = 7, accumulate: int = 1, workers: int = 0) -> Config:
    return defaults(batch_size=batch_size, seed=seed, accumulate=accumulate, workers=workers, augment=False)


def _data(n: int, dataset=None) -> Data:
    """n training samples whose label is their index, and as many validation samples after them."""
    dataset = dataset or [(torch.zeros(1), i) for i in range(2 * n)]
    return Data(dataset, list(range(n)), list(range(n, 2 * n)), "")


def epoch_loader(mode: str, data: Data, args, epoch: int, rank: int = 0, world_size: int = 1):
    """The training loader that `mode`'s script makes, set for `epoch` as its loop sets it."""
    if mode == "ddp":
        loader = train_ddp.loaders(data.dataset, data, args, CPU, rank, world_size)[0]
    else:
        make = train_single.loaders if mode == "single" else train_accelerate.loaders
        loader = make(data.dataset, data, args, CPU, *([world_size] if mode == "accelerate" else []))[0]
    return set_epoch(mode, loader, args, epoch)


def set_epoch(mode: str, loader, args, epoch: int):
    """What the script's loop does to its training loader before an epoch's pass."""
    if mode == "ddp":
        loader.sampler.set_epoch(epoch)
    else:
        loader.sampler.generator.manual_seed(args.seed + epoch)
    loader.dataset.set_epoch(epoch)
    return loader


def _steps(mode: str, n: int, batch_size: int, world_size: int, epoch: int, accumulate: int = 1) -> list[list[int]]:
    """Per optimizer step of an epoch, the sorted dataset indices that all ranks together train on
    (the micro-batches up to the epoch's last whole step, as src.progress hands them out)."""
    data, args = _data(n), _args(batch_size, accumulate=accumulate)
    steps = n // (batch_size * world_size * accumulate)
    if mode == "accelerate":  # one loader of world_size x batch_size, cut by accelerate among the processes
        loader = epoch_loader(mode, data, args, epoch, world_size=world_size)
        micro = [labels.tolist() for _, labels, _ in loader][:steps * accumulate]
        return [sorted(sum(micro[i:i + accumulate], [])) for i in range(0, len(micro), accumulate)]
    per_rank = []
    for rank in range(world_size):
        loader = epoch_loader(mode, data, args, epoch, rank, world_size)
        micro = [labels.tolist() for _, labels, _ in loader][:steps * accumulate]
        assert len(micro) == steps * accumulate  # every rank has its micro-batches of every step
        per_rank.append([sum(micro[i:i + accumulate], []) for i in range(0, len(micro), accumulate)])
    return [sorted(sum(step, [])) for step in zip(*per_rank)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ddp_and_accelerate_global_batches_equal_the_single_process_batches(world_size):
    n, batch = 103, 5
    for epoch in range(3):
        single = _steps("single", n, batch * world_size, 1, epoch)
        assert len(single) == n // (batch * world_size) and all(len(step) == batch * world_size for step in single)
        assert _steps("ddp", n, batch, world_size, epoch) == single
        assert _steps("accelerate", n, batch, world_size, epoch) == single
    assert _steps("single", n, batch, 1, 0) != _steps("single", n, batch, 1, 1), "reshuffled each epoch"
    assert _steps("ddp", n, batch, 2, 0) != _steps("ddp", n, batch, 2, 1), "reshuffled each epoch"


@pytest.mark.parametrize("world_size, accumulate", [(1, 4), (2, 2), (4, 1)])
def test_accumulation_takes_the_steps_of_more_processes(world_size, accumulate):
    """--accumulate N with W processes of B images: the steps of N * W processes."""
    n, batch = 103, 5
    for epoch in range(2):
        steps = _steps("ddp", n, batch, world_size, epoch, accumulate=accumulate)
        assert steps == _steps("single", n, batch * 4, 1, epoch)
        assert steps == _steps("single", n, batch * world_size, 1, epoch, accumulate=accumulate)
        assert len(steps) == n // (batch * 4) and all(len(step) == batch * 4 for step in steps)


@pytest.mark.parametrize("n, world_size", [(101, 2), (101, 3), (7, 4), (5, 5)])
def test_validation_shards_cover_every_sample_once(n, world_size):
    """The validation loaders train_ddp.py gives each rank: together every validation sample, each
    once (no padding, which would count a sample twice), whatever the number of ranks."""
    data = _data(n)
    seen = []
    for rank in range(world_size):
        val_loader = train_ddp.loaders(data.dataset, data, _args(1), CPU, rank, world_size)[1]
        seen += [label for _, labels in val_loader for label in labels.tolist()]
    assert sorted(seen) == data.val_idx


def test_too_large_a_batch_or_too_many_processes():
    data = Data([(torch.zeros(1), i) for i in range(10)], list(range(10)), [0, 1], "")
    with pytest.raises(UserError, match="--batch-size 6 x 2 process"):
        check_batches(data, _args(6), 2)
    with pytest.raises(UserError, match=r"--batch-size 3 x 2 process\(es\) x 2 \(--accumulate\) = 12"):
        check_batches(data, _args(3, accumulate=2), 2)
    with pytest.raises(UserError, match="3 processes but only 2 validation images"):
        check_batches(data, _args(1), 3)


@pytest.mark.parametrize("processes", [2, 3])
def test_as_many_validation_images_as_processes_are_accepted_and_one_fewer_refused(processes):
    """Each process validates a share of at least one image: a split of exactly `processes`
    validation images is accepted (one each), one fewer is refused in one line."""
    dataset = [(torch.zeros(1), i) for i in range(20)]
    check_batches(Data(dataset, list(range(10)), list(range(10, 10 + processes)), ""), _args(1), processes)
    with pytest.raises(UserError) as refused:
        check_batches(Data(dataset, list(range(10)), list(range(10, 9 + processes)), ""), _args(1), processes)
    assert str(refused.value) == (f"{processes} processes but only {processes - 1} validation images; use fewer "
                                  "processes or more data")


def test_a_dev_shm_with_exactly_what_the_workers_need_is_accepted_and_a_byte_less_refused(tmp_path, monkeypatch):
    """check_shared_memory's boundary, the free bytes of /dev/shm faked: as many as 2 loader workers
    of each of 2 processes may hold (2 processes x 2 workers x 2 batches prefetched x 2, of 1000
    bytes: 16000) pass, one byte fewer is refused; without workers nothing is asked."""
    import shutil as shutil_module
    from collections import namedtuple

    import src.devices as devices
    usage = namedtuple("usage", "total used free")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    need = devices.shared_memory_need(2, 1000, 2)
    assert need == 16000
    for free, refused in ((need, False), (need - 1, True)):
        monkeypatch.setattr(shutil_module, "disk_usage", lambda path, free=free: usage(10**9, 10**9 - free, free))
        devices.check_shared_memory(0, 1000, tmp_path)
        if refused:
            with pytest.raises(UserError, match=f"^{tmp_path} has 0 MB free, but 2 processes x 2 loader workers need"):
                devices.check_shared_memory(2, 1000, tmp_path)
        else:
            devices.check_shared_memory(2, 1000, tmp_path)


def test_a_training_split_of_exactly_one_global_batch_is_accepted_and_one_fewer_refused():
    """--batch-size 3 x 2 processes x 2 (--accumulate) = 12: a split of 12 images is one optimizer
    step per epoch (the loaders hand all 12 out in it), 11 images are refused in one line."""
    args = _args(3, accumulate=2)
    check_batches(_data(12), args, 2)
    assert _steps("ddp", 12, 3, 2, 0, accumulate=2) == [list(range(12))]
    with pytest.raises(UserError) as refused:
        check_batches(_data(11), args, 2)
    assert str(refused.value) == ("--batch-size 3 x 2 process(es) x 2 (--accumulate) = 12 is more than the 11 "
                                  "training images; lower --batch-size")


@pytest.mark.parametrize("mode, world_size, accumulate", [("single", 1, 1), ("ddp", 2, 2), ("ddp", 3, 1)])
def test_a_resumed_epoch_skips_its_finished_steps_without_reading_their_images(mode, world_size, accumulate):
    """skip_first_batches(loader, k x --accumulate): each rank's loader hands out what an
    uninterrupted epoch hands out after its k-th optimizer step, and the data set reads none of
    the samples before; the next epoch's loader starts from its first step."""
    n, batch, k = 103, 5, 2
    reads = []

    class Counted(torch.utils.data.Dataset):
        def __len__(self):
            return 2 * n

        def __getitem__(self, index):
            reads.append(index)
            return torch.zeros(1), index

    data = _data(n, Counted())
    for rank in range(world_size):
        args = _args(batch, accumulate=accumulate)
        loader = epoch_loader(mode, data, args, 3, rank, world_size)
        whole = [labels.tolist() for _, labels, _ in loader]
        reads.clear()
        skipped = skip_first_batches(set_epoch(mode, loader, args, 3), k * accumulate)
        assert len(skipped) == len(whole) - k * accumulate
        assert [labels.tolist() for _, labels, _ in skipped] == whole[k * accumulate:]
        assert sorted(reads) == sorted(sum(whole[k * accumulate:], []))
        assert skip_first_batches(loader, 0) is loader


# The stress run, in a process of its own (a hung worker must not hang the test): the heartbeat's
# thread writing its beats, a thread taking CPython's thread-state lock as the C++ threads of
# torch.distributed and autograd do when they call into Python (PyThreadState_New without the
# GIL: it takes the interpreter's HEAD_LOCK), and the scripts' loader options starting 2 workers
# for each of PASSES passes.
STRESS = """
import ctypes, threading, sys
import torch
from torch.utils.data import DataLoader
from src.cli import defaults
from src.heartbeat import Heartbeat
from src.loaders import loader_options

lib = ctypes.CDLL(None)  # its calls release the GIL, unlike ctypes.pythonapi's
lib.PyThreadState_New.restype = ctypes.c_void_p
lib.PyThreadState_New.argtypes = lib.PyThreadState_Clear.argtypes = lib.PyThreadState_Delete.argtypes = [ctypes.c_void_p]
main = ctypes.pythonapi.PyInterpreterState_Main
main.restype = ctypes.c_void_p
interpreter, done = main(), threading.Event()

def thread_states():
    while not done.is_set():
        state = lib.PyThreadState_New(interpreter)
        lib.PyThreadState_Clear(state)
        lib.PyThreadState_Delete(state)

if __name__ == "__main__":
    dataset = [(torch.full((3, 4, 4), i, dtype=torch.uint8), i % 2) for i in range(16)]
    churn = threading.Thread(target=thread_states, daemon=True)
    with Heartbeat(torch.distributed.HashStore(), 0, 2, timeout_s=3600) as beat:
        churn.start()
        for epoch in range(int(sys.argv[1])):
            beat.at("training", epoch, 0, 0)
            options = loader_options(defaults(workers=2), torch.device("cpu"))
            loader = DataLoader(dataset, batch_size=4, timeout=120, **options)  # a hung worker: an error
            assert sum(len(labels) for _, labels in loader) == 16
        assert beat.thread.is_alive()
        done.set()
        churn.join()
    print("passes done")
"""
# Seconds the stress run may take: 30 passes took 70 to 85 s on the busy 2-core machine. A worker
# that hangs in its start fails its pass after the loader's timeout (120 s, for 4 batches of 4
# tiny images); the limit is the backstop for a hang anywhere else.
STRESS_LIMIT = 900


def test_loader_workers_started_many_times_beside_running_threads_never_hang(tmp_path):
    """The scripts' loader options (src.loaders.loader_options: workers from the fork server) start
    2 workers for each of 30 passes while the heartbeat's thread writes its beats and another
    thread takes CPython's thread-state lock as fast as it can: every pass ends. Plain forks of
    this process beside that thread hung in their own start (PyOS_AfterFork_Child, CPython
    gh-112275, fixed in 3.11.8) 46 times in 300 on this machine's Python 3.11.7; the training
    process never forks a worker, the fork server (a fresh interpreter without threads) does."""
    script = tmp_path / "stress.py"
    script.write_text(STRESS)
    environment = {**os.environ, "PYTHONPATH": str(ROOT)}
    launch = subprocess.Popen([sys.executable, str(script), "30"], cwd=ROOT, env=environment, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = launch.communicate(timeout=STRESS_LIMIT)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)  # its hung workers with it
        launch.communicate()
        pytest.fail(f"the stress run did not end within {STRESS_LIMIT} s: a loader worker hung")
    assert launch.returncode == 0 and stdout.strip() == "passes done", stderr[-3000:]


MAIN_SCRIPT = """
import json, os, sys, threading, time
import torch
from multiprocessing import forkserver
from torch.utils.data import DataLoader
import imported_once  # noqa: F401  (its import writes a line)
from src.cli import defaults
from src.loaders import loader_options

if __name__ == "__main__":
    held = open(os.environ["HELD_FILE"], "w")  # as a run holds its lock file: the fork server must not
    if sys.argv[1] == "thread":  # another thread runs when the first loader starts its server
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    dataset = [(torch.zeros(2), i) for i in range(8)]
    for _ in range(2):
        assert sum(len(b) for _, b in DataLoader(dataset, batch_size=2, **loader_options(defaults(workers=2),
                                                                                         torch.device("cpu")))) == 8
    server = forkserver._forkserver._forkserver_pid
    files = [os.readlink(f"/proc/{server}/fd/{fd}") for fd in os.listdir(f"/proc/{server}/fd")]
    print(json.dumps({"forked": open(f"/proc/{server}/cmdline").read() == open("/proc/self/cmdline").read(),
                      "parent": int(open(f"/proc/{server}/stat").read().rsplit(")", 1)[1].split()[1]),
                      "me": os.getpid(), "files": [name for name in files if name.startswith("/")]}))
"""


def _main_script(tmp_path, threads: str) -> tuple[dict, list[str]]:
    """MAIN_SCRIPT run with (`threads` "thread") or without a thread beside it: what it says of its
    fork server, and the processes that imported its module imported_once."""
    (tmp_path / "imported_once.py").write_text("import os\nwith open(os.environ['IMPORT_LOG'], 'a') as log:\n"
                                               "    log.write(f'{os.getpid()}\\n')\n")
    (tmp_path / "main_script.py").write_text(MAIN_SCRIPT)
    log = tmp_path / "imports.log"
    result = run([sys.executable, str(tmp_path / "main_script.py"), threads],
                 env={"IMPORT_LOG": str(log), "HELD_FILE": str(tmp_path / "held.lock"),
                      "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1]), log.read_text().split()


def test_a_fresh_fork_server_imports_the_main_scripts_modules_once(tmp_path):
    """A script whose imports take time (train_single.py's: matplotlib, the src modules) as the main
    module, another thread running when its first loader starts the fork server, two passes of 2
    workers: the server is a fresh interpreter (a fork of this process could catch the thread's
    locks); each worker runs the main script again (multiprocessing's preparation), but its
    imports were made once, in the fork server, so the module it imports is imported by the
    script's process and the fork server, by no worker."""
    server, imports = _main_script(tmp_path, "thread")
    assert not server["forked"] and server["parent"] == server["me"]
    assert len(imports) == 2 and str(server["me"]) in imports, imports


LABELLED = """
import sys
from multiprocessing import forkserver
from src.cli import defaults
from src.loaders import labelled_data

labelled_data(defaults(data_dir=sys.argv[1], workers=int(sys.argv[2]), image_size=32))
print(forkserver._forkserver._forkserver_pid is not None)
"""


@pytest.mark.parametrize("workers, started", [(1, "True"), (0, "False")])
def test_labelled_data_starts_the_workers_server_before_the_model_when_there_are_workers(small_data, workers, started,
                                                                                          tmp_path):
    """The scripts' first data call starts the loader workers' fork server (before the model
    is built: its imports overlap the label scan and the model), and none without --workers."""
    (tmp_path / "labelled.py").write_text(LABELLED)
    result = run([sys.executable, str(tmp_path / "labelled.py"), str(small_data), str(workers)],
                 env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == started
