"""Shared fixtures: small synthetic datasets, a runner for the real scripts and launchers, and the
training runs that several test modules compare against, each made once per session, whichever of
the test runner's workers needs it first."""
import contextlib
import csv
import fcntl
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import typing
import weakref
from pathlib import Path

# These tests define the CPU behaviour: on a machine with GPUs they must not use them (a CPU run
# compared with a GPU run, two ranks on one GPU). Set before anything initialises CUDA.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
# `make test` runs two test workers, and most tests start processes of two threads each: OpenMP
# threads that spin while they wait for each other take the cores the other processes need (the
# suite measured 524 s spinning, 380 s passive, on 2 cores). How a thread waits changes no result.
# Read when torch loads OpenMP: set before it is imported, here and in every process started.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A test run started as a background job of a non-interactive shell (`pytest ... &`) inherits
# Ctrl-C ignored, and so would every run it starts: the Ctrl-C tests' runs would not stop. Python
# installs its Ctrl-C handler only where the signal is not ignored when it starts.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import pytest  # noqa: E402
import torch  # noqa: E402
from hooks.sitecustomize import InProcess, in_process_variables, install  # noqa: E402
from PIL import Image  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from src.errors import end_process_group  # noqa: E402
from src.history import AVERAGE  # noqa: E402
from src.tools.agreement import TOLERANCE, distance  # noqa: E402
from src.tools.synthetic import TEST_LABELS, write_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
HOOKS = str(ROOT / "tests" / "hooks")

# Small and fast, and the property under test does not need VGG16. ResNet-18 learns the
# synthetic set in two epochs at 32 px. SqueezeNet 1.1 has no batch norm, so a batch split across
# processes computes exactly what the whole batch does in one process (up to the order of float
# sums), and its dropout (torchvision's 0.5) draws per sample, whichever process holds it; at
# lr 0.001 it keeps learning (at 0.01 its last ReLU dies and nothing moves any more).
LEARN = ["--arch", "resnet18", "--weights", "none", "--image-size", "32", "--lr", "0.003"]
EXACT = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "64", "--lr", "0.001", "--workers", "0"]
VAL = ["--val-fraction", "0.5025"]  # the exact set's 201 images: 100 train, 101 validation
# What a resumed or restarted run must restore, on every rank: dropout's draws, a weight average
# (--ema-decay) and one persistent loader worker.
RESUMABLE = [flag for flag in EXACT if flag not in ("--workers", "0")] + ["--workers", "1", "--ema-decay", "0.9"]
B = 10  # per process in the two-process runs; one process takes 2 * B


LAUNCH = {
    "single": lambda: [sys.executable, "train_single.py"],
    "dp": lambda: [sys.executable, "train_dp.py"],
    "ddp": lambda: ["torchrun", "--standalone", "--nproc_per_node=2", "train_ddp.py"],
    "fsdp": lambda: ["torchrun", "--standalone", "--nproc_per_node=2", "train_fsdp.py"],
    # Port 0: a free one (the test runner's two workers may run two of these at once).
    "accelerate": lambda: ["accelerate", "launch", "--multi_gpu", "--num_processes", "2",
                           "--main_process_port", "0", "train_accelerate.py"],
    "accelerate-bf16": lambda: ["accelerate", "launch", "--num_processes", "1", "--mixed_precision",
                                "bf16", "train_accelerate.py"],
}
MODES = ["single", "dp", "ddp", "accelerate"]
PROCESSES = {"single": 1, "dp": 1, "ddp": 2, "fsdp": 2, "accelerate": 2, "accelerate-bf16": 1}


def shared_folder(config: pytest.Config) -> Path:
    """The folder that the test runner's workers (`make test` runs two) share for one session:
    the synthetic datasets and the training runs are made there once, by whichever worker needs
    them first."""
    base = config._tmp_path_factory.getbasetemp()  # a worker's is <the session's>/popen-gwN
    return (base.parent if hasattr(config, "workerinput") else base) / "shared"


@contextlib.contextmanager
def made_once(folder: Path):
    """with made_once(folder) as missing: if missing, make folder's contents. One process at a
    time gets past the lock; a folder counts as made once the block ended without error, and one
    whose block failed fails every later test that needs it at once, with the same message (a
    process that died in the block leaves no verdict: the next one tries again)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done, failed = (folder.parent / f"{folder.name}.{verdict}" for verdict in ("done", "failed"))
        if failed.exists():
            pytest.fail(f"{folder.name} failed earlier in this session:\n{failed.read_text()}")
        if done.exists():
            yield False
            return
        shutil.rmtree(folder, ignore_errors=True)  # what a process that died in the block left
        folder.mkdir()
        try:
            yield True
        except BaseException as error:
            failed.write_text(str(error)[-3000:])
            raise
        done.touch()


# The files that take longest (measured with --durations, 2026-12-05; the GPU proof's dry run in
# test_gpu_on_cpu_selftest.py, 2026-12-06), first: with -n 2 each worker takes whole files (--dist
# loadfile) in collection order, and a long file taken last would leave the other worker idle at
# the end. The rest keep their order.
LONGEST_FIRST = ["test_gpu_on_cpu_selftest.py", "test_ray.py", "test_sync_bn.py", "test_fsdp.py", "test_modes.py",
                 "test_reliability.py", "test_stopping.py", "test_performance.py", "test_freeze.py",
                 "test_arch_walk.py", "test_recipe.py", "test_benchmark.py", "test_chaos.py", "test_hung_rank.py",
                 "test_dropout.py", "test_report.py", "test_two_ranks.py"]


# make test-fast (-m "not slow") leaves out, whoever wrote them, the tests that train or start
# processes: those whose code, or a fixture's they use (through any other), reads the session's
# training runs, starts a process (a command line, a launcher, a spawned worker) or runs a training
# script's main. The rest are marked where they are (pytest.mark.slow).
SLOW_FIXTURES = {"runs", "ddp_stops", "fsdp_stops", "launch", "bench", "compared"}  # the last three: two
# ranks, the benchmark's and compare_recipes' runs, each made once per file
# The tests that took 2.5 s or more each with -n 2, and the four above 1.9 s after that (pytest
# --durations, 2026-12-05, on the 2-core AMD EPYC at a load of 4 to 9): slow, by file. A test's id
# with its parameters marks that one alone.
SLOW_TESTS = {
    "test_arch_walk.py": {
        "test_sizes_a_model_cannot_take_are_refused_naming_the_size_it_needs[maxvit_t]",
        "test_every_listed_model_trains_a_step[alexnet]",
        "test_every_listed_model_trains_a_step[convnext_base]",
        "test_every_listed_model_trains_a_step[convnext_large]",
        "test_every_listed_model_trains_a_step[convnext_small]",
        "test_every_listed_model_trains_a_step[densenet161]",
        "test_every_listed_model_trains_a_step[efficientnet_b5]",
        "test_every_listed_model_trains_a_step[efficientnet_b7]",
        "test_every_listed_model_trains_a_step[efficientnet_v2_l]",
        "test_every_listed_model_trains_a_step[efficientnet_v2_m]",
        "test_every_listed_model_trains_a_step[maxvit_t]",
        "test_every_listed_model_trains_a_step[regnet_x_16gf]",
        "test_every_listed_model_trains_a_step[regnet_x_32gf]",
        "test_every_listed_model_trains_a_step[regnet_x_8gf]",
        "test_every_listed_model_trains_a_step[regnet_y_128gf]",
        "test_every_listed_model_trains_a_step[regnet_y_16gf]",
        "test_every_listed_model_trains_a_step[regnet_y_32gf]",
        "test_every_listed_model_trains_a_step[regnet_y_3_2gf]",
        "test_every_listed_model_trains_a_step[regnet_y_8gf]",
        "test_every_listed_model_trains_a_step[resnet101]",
        "test_every_listed_model_trains_a_step[resnet152]",
        "test_every_listed_model_trains_a_step[resnext101_32x8d]",
        "test_every_listed_model_trains_a_step[resnext101_64x4d]",
        "test_every_listed_model_trains_a_step[swin_b]",
        "test_every_listed_model_trains_a_step[swin_s]",
        "test_every_listed_model_trains_a_step[swin_t]",
        "test_every_listed_model_trains_a_step[swin_v2_b]",
        "test_every_listed_model_trains_a_step[swin_v2_s]",
        "test_every_listed_model_trains_a_step[swin_v2_t]",
        "test_every_listed_model_trains_a_step[vgg11]",
        "test_every_listed_model_trains_a_step[vgg11_bn]",
        "test_every_listed_model_trains_a_step[vgg13]",
        "test_every_listed_model_trains_a_step[vgg13_bn]",
        "test_every_listed_model_trains_a_step[vgg16]",
        "test_every_listed_model_trains_a_step[vgg16_bn]",
        "test_every_listed_model_trains_a_step[vgg19]",
        "test_every_listed_model_trains_a_step[vgg19_bn]",
        "test_every_listed_model_trains_a_step[vit_b_16]",
        "test_every_listed_model_trains_a_step[vit_b_32]",
        "test_every_listed_model_trains_a_step[vit_h_14]",
        "test_every_listed_model_trains_a_step[wide_resnet101_2]",
        "test_every_listed_model_trains_a_step[wide_resnet50_2]",
        "test_imagenet_weights_lose_the_auxiliary_classifiers_and_best_pth_reloads[googlenet]",
        "test_imagenet_weights_lose_the_auxiliary_classifiers_and_best_pth_reloads[inception_v3]",
    },
    "test_augment.py": {
        "test_lambda_follows_beta_alpha_alpha[cutmix_alpha-1.0]",
        "test_lambda_follows_beta_alpha_alpha[mixup_alpha-0.2]",
        "test_mixup_and_cutmix_each_mix_half_of_the_samples_with_both_alphas",
        "test_random_erasing_erases_with_probability_p_a_box_of_the_documented_area",
        "test_the_partner_is_drawn_uniformly_from_the_others_of_the_split_and_loaded_by_the_dataset",
        "test_trivial_augment_draws_each_operation_and_magnitude_equally_often",
    },
    "test_benchmark.py": {
        "test_loader_alone_measures_a_loader_of_known_speed",
        "test_the_dropout_cost_table_shows_its_timings_and_counts",
    },
    "test_diverged.py": {
        "test_predict_export_and_resume_refuse_weights_that_are_not_finite",
    },
    "test_dropout.py": {
        "test_built_models_draw_per_sample_and_keep_torchvision_state_dicts[vgg11]",
        "test_the_triton_kernel_compiles_for_an_h100",
        "test_vgg_gradients_of_a_batch_split_between_two_processes_are_the_whole_batchs",
    },
    "test_ema.py": {
        "test_best_pth_holds_the_average_when_it_validates_better",
    },
    "test_freeze.py": {
        "test_the_feature_cache_is_rebuilt_when_the_backbone_or_size_changes",
    },
    "test_fsdp.py": {
        "test_fsdp_reduces_once_per_step_and_validates_with_rank_0s_buffers",
        "test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp[resnet18]",
        "test_compile_runs_every_convolution_and_linear_compiled_under_fsdp_as_under_ddp[vgg11]",
        "test_each_vgg16_rank_holds_half_of_what_a_ddp_rank_holds",
    },
    "test_gpu_on_cpu_fused_optimizers.py": {
        "test_the_schedule_advances_at_every_optimizer_step_also_a_skipped_one[train_accelerate]",
        "test_fp16_with_the_gpus_fused_adamw_ends_where_plain_adamw_does",
        "test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does[train_accelerate]",
        "test_fp16_with_the_gpus_fused_sgd_ends_where_plain_sgd_does[train_single]",
        "test_the_weight_average_leaves_out_the_steps_the_scaler_skips_under_fused_sgd",
    },
    "test_inputs.py": {
        "test_workers_above_the_cpus_are_capped_in_one_line",
    },
    "test_models.py": {
        "test_imagenet_file_keeps_every_backbone_tensor_and_gets_a_new_head[googlenet]",
        "test_imagenet_file_keeps_every_backbone_tensor_and_gets_a_new_head[convnext_tiny]",
        "test_random_init_model_loads_into_torchvision_two_class_model[vgg16]",
    },
    "test_mutations.py": {
        "test_the_runner_reads_which_tests_failed_from_pytest",
    },
    "test_performance.py": {
        "test_cache_is_reused_and_rebuilt_when_its_inputs_change",
    },
    "test_recipe.py": {
        "test_each_recipe_flag_changes_the_training[augment-True]",
        "test_save_epoch_writes_best_pth_only_for_a_better_epoch_by_best_by[val_log_loss]",
    },
    "test_synthetic.py": {
        "test_hard_set_is_harder_but_fair",
    },
    "test_tracking.py": {
        "test_a_closed_port_or_an_unknown_scheme_is_one_line_and_exit_2",
        "test_wandb_offline_one_run_across_a_stop_each_epoch_once",
        "test_a_tracker_failing_during_the_run_is_one_warning",
        "test_accelerate_trackers_continue_the_saved_runs",
        "test_mlflow_one_run_across_a_stop_each_epoch_once",
        "test_mlflow_stopped_run_is_killed_until_its_resume_runs",
        "test_resumed_history_fills_what_the_run_lacks",
        "test_saved_run_missing_from_the_store_is_one_line",
    },
}

SLOW_CODE = re.compile(r"(?<![\w.])(python|run|run_main)\(|subprocess\.|torchrun|\.Process\(|start_processes|mp\.spawn|"
                       r"(?<![\w.])(in_process|printed_by)\(\s*train_")


def _slow_code(function, seen: dict) -> bool:
    """Whether function, or a function of the tests' own that it calls (through any other), starts
    a process or reads the training runs."""
    if function not in seen:
        seen[function] = False  # a function that calls itself, through others or not
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return False
        called = (getattr(function, "__globals__", {}).get(name) for name in set(CALLED.findall(source)))
        seen[function] = bool(SLOW_CODE.search(source)) or any(
            inspect.isfunction(other) and _in_tests(other) and _slow_code(other, seen)
            for other in called)
    return seen[function]


CALLED = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\(")


def _in_tests(function) -> bool:
    return Path(inspect.getfile(function)).resolve().is_relative_to(ROOT / "tests")


def _is_slow(item, seen: dict) -> bool:
    if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("slow"):
        return True
    if {item.name, item.name.split("[")[0]} & SLOW_TESTS.get(item.path.name, set()):
        return True
    info = getattr(item, "_fixtureinfo", None)
    functions = [getattr(item, "function", None)]
    for name in getattr(item, "fixturenames", ()):
        functions += [definition.func for definition in (info.name2fixturedefs.get(name, ()) if info else ())]
    return any(function is not None and _slow_code(function, seen) for function in functions)


@pytest.hookimpl(trylast=True)  # after pytest's own, which makes the session's folder
def pytest_configure(config: pytest.Config) -> None:
    # torch.compile's kernels (inductor's cache: hundreds of MB) in the session's shared folder, so
    # that they go with it rather than pile up in the system's temporary folder run after run. Set in
    # the controller before its workers start, so all of them and their processes share one cache.
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(shared_folder(config) / "inductor")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    place = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.path.name, len(place)))  # stable: a file's tests keep their order
    seen: dict = {}
    for item in items:
        if _is_slow(item, seen):
            item.add_marker(pytest.mark.slow)


# TEST_COST_LOG=path: each test appends a JSON line to path: its id, its seconds, the CPU seconds
# (user + system) of the test process and of the processes it waited for, setup and teardown
# included (a shared run counts to the first test that needs it), and the commands it started
# (a launcher, a script, a spawned rank, a fork server of loader workers).
# `python checks/suite_cost.py path` sums them by file.
_STARTED: list[str] = []


def started_command(args) -> str:
    """What a started process is, in a few words: "torchrun", "accelerate launch", "python SCRIPT",
    "python -m MODULE", "python -c", "spawned rank", "fork server", or its program's name."""
    args = [str(arg) for arg in ([args] if isinstance(args, (str, bytes, os.PathLike)) else args)]
    names = [Path(arg).name for arg in args]
    if "torchrun" in names[:3]:
        return "torchrun"
    if "accelerate" in names[:3] and "launch" in args:
        return "accelerate launch"
    if names and names[0].startswith("python"):
        rest = [arg for arg in args[1:] if arg not in ("-u", "-B", "-X", "importtime", "-s", "-E")]
        if any("forkserver" in arg for arg in rest):
            return "fork server"
        if any("spawn_main" in arg or "resource_tracker" in arg for arg in rest):
            return "spawned rank" if any("spawn_main" in arg for arg in rest) else "resource tracker"
        if rest[:1] == ["-m"]:
            return f"python -m {rest[1]}" if len(rest) > 1 else "python -m"
        if rest[:1] == ["-c"]:
            return "python -c"
        return f"python {Path(rest[0]).name}" if rest else "python"
    return names[0] if names else "?"


def subreaper() -> bool:
    """Make this process the one that orphaned descendants are handed to (Linux's
    PR_SET_CHILD_SUBREAPER), so that their CPU time is counted here once reaped; False elsewhere."""
    import ctypes
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def reap_orphans() -> None:
    """Reap the ended processes handed to this one, which nobody here waits for: its ended
    children that it did not start itself (those stay for their Popen or Process to wait for)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid() and not _started_here(int(entry.name)):
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry.name), 0)


_STARTED_PIDS: set[int] = set()


def _started_here(pid: int) -> bool:
    """Whether pid is a process this one started itself (its Popen or spawn waits for it)."""
    return pid in _STARTED_PIDS


if os.environ.get("TEST_COST_LOG"):
    import multiprocessing.util
    import resource

    _popen_init = subprocess.Popen.__init__
    _spawnv_passfds = multiprocessing.util.spawnv_passfds

    def _recorded_popen(self, args, *more, **options):
        _STARTED.append(started_command(args))
        _popen_init(self, args, *more, **options)
        _STARTED_PIDS.add(self.pid)

    def _recorded_spawn(path, args, passfds):
        _STARTED.append(started_command(args))
        pid = _spawnv_passfds(path, args, passfds)
        _STARTED_PIDS.add(pid)
        return pid

    _fork = os.fork

    def _recorded_fork():
        pid = _fork()
        if pid:
            _STARTED_PIDS.add(pid)
        return pid

    os.fork = _recorded_fork
    subprocess.Popen.__init__ = _recorded_popen
    multiprocessing.util.spawnv_passfds = _recorded_spawn
    # The processes that outlive their parent (a loader workers' fork server, once its training
    # process has ended) are handed to this one and reaped here: their CPU seconds count too.
    reaper = subreaper()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        def cpu(who):
            usage = resource.getrusage(who)
            return usage.ru_utime + usage.ru_stime
        _STARTED.clear()
        _REMOTE_CPU.clear()
        start = (time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN))
        yield
        if reaper:
            reap_orphans()
        end = (time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN))
        record = {"test": item.nodeid, "seconds": end[0] - start[0], "cpu": end[1] - start[1],
                  "children_cpu": end[2] - start[2] + sum(_REMOTE_CPU), "started": list(_STARTED),
                  "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
        with open(os.environ["TEST_COST_LOG"], "a") as log:
            log.write(json.dumps(record) + "\n")


# A loader's iterator that a test leaves in a reference cycle (a stop raised through a generator
# that wraps the loader, an exception kept by pytest.raises) is ended by the cycle collector at
# some later test: the collector runs the weak-reference callbacks first, which close the
# iterator's index queues, and its __del__ then sends its workers a stop they never get and waits
# 5 s for each (a later test took 40 s of such waits). Each test's loader iterators with workers
# are ended when it ends, while their queues still work.
_LOADER_ITERATORS: "weakref.WeakSet" = weakref.WeakSet()
_start_loader_iterator = torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__


def _recorded_start(self, *args, **kwargs):
    _LOADER_ITERATORS.add(self)
    _start_loader_iterator(self, *args, **kwargs)


torch.utils.data.dataloader._MultiProcessingDataLoaderIter.__init__ = _recorded_start


@pytest.fixture(autouse=True)
def _end_loader_workers():
    yield
    for iterator in list(_LOADER_ITERATORS):
        iterator._shutdown_workers()
    _LOADER_ITERATORS.clear()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In the controller (or the only process), once every worker has ended: remove the shared
    runs unless a test failed (then they stay for a look, as pytest keeps failed tests' tmp_path)."""
    factory = session.config._tmp_path_factory
    if not hasattr(session.config, "workerinput") and factory._basetemp is not None and exitstatus == 0:
        shutil.rmtree(shared_folder(session.config), ignore_errors=True)


def shared_dataset(request, name: str, **sizes) -> Path:
    """A synthetic dataset (src.tools.synthetic.write_dataset) made once per session in the shared folder."""
    path = shared_folder(request.config) / name
    with made_once(path) as missing:
        if missing:
            write_dataset(path, **sizes)
    return path


@pytest.fixture(scope="session")
def small_data(request) -> Path:
    """240 training and 30 test images of about 64 px."""
    return shared_dataset(request, "synthetic", n_train=240, n_test=30, size=64, seed=1)


@pytest.fixture(scope="session")
def exact_data(request) -> Path:
    """201 labelled images (with --val-fraction 0.5025: 100 train, 101 validation), 20 test."""
    return shared_dataset(request, "exact", n_train=201, n_test=20, size=64, seed=2)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory) -> Path:
    """A folder for the runs one test module shares, removed when the module is done."""
    path = tmp_path_factory.mktemp("module")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def free_port() -> int:
    """A TCP port of this machine that nothing listens on now (a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def world_of_one(monkeypatch):
    """The environment torchrun gives a world of one, on a free port; the process group that
    a script's main() makes here is destroyed after the test."""
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(name, value)
    yield
    end_process_group()


def on_threads(world_size: int, work) -> list:
    """work(rank) on every rank of a world of `world_size`, each rank a thread of this process in
    torch's threaded process group (torch.testing's, as torch's own tests use it: each thread has
    its own default group, and the collectives run between the threads, each reduction by its op);
    the results in rank order; a rank's error is raised here. For a rank's code whose launcher is
    not under test: what is per process stays shared (os.environ, signal handlers: the main
    thread's only, so a test calls a handler itself)."""
    import threading

    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )
    results, errors = [None] * world_size, [None] * world_size
    store = dist.HashStore()

    def rank(number: int) -> None:
        try:
            dist.init_process_group("threaded", rank=number, world_size=world_size, store=store)
            results[number] = work(number)
        except BaseException as error:
            errors[number] = error
            ProcessLocalGroup.exception_handle(error)  # the other ranks' collectives end
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=rank, args=(number,)) for number in range(world_size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    for error in errors:
        if error is not None and not isinstance(error, SystemExit):  # SystemExit: ended by another's error
            raise error
    return results


def run(command: list[str], env: dict | None = None, timeout: int = 600, cwd: Path = ROOT):
    """Run a command as a user would (from the repo root), as processes of its own, capturing its
    output. For what needs them: a launcher (torchrun, accelerate launch), a signal, a kill, a crash,
    the command line itself; one process's run is run_main's. A variable of env set to None is
    left out of the command's environment."""
    full_env = {key: value for key, value in {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}.items()
                if value is not None}  # None: a variable left out
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    return subprocess.run(command, cwd=cwd, env=full_env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=timeout)


def python(*args: str, env: dict | None = None, timeout: int = 600):
    """`python ARGS` as a process of its own (run): a new interpreter, about 4 s of imports."""
    return run([sys.executable, *args], env=env, timeout=timeout)


def run_main(main, argv: list[str], env: dict | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """main(argv) of a script or tool in this process, as `python COMMAND ARGV` runs it alone: its
    exit code (src.errors.run_command: 0, 2 with one line, 75 stopped, 130 on Ctrl-C), and what it
    printed on stdout and stderr, as run() returns them. env: variables set for the run, the test
    hooks' among them (tests/hooks/sitecustomize.py, installed with monkeypatch, all undone when it
    ends; PYTHONPATH is ignored: the hooks need no path here). A hook that signals or kills its
    process is refused: that test needs run()."""
    from src.errors import INTERRUPTED, run_command
    env = {key: value for key, value in (env or {}).items() if key != "PYTHONPATH"}
    interrupted = getattr(sys.modules[main.__module__], "INTERRUPTED", INTERRUPTED)  # a tool's own advice
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        for key, value in env.items():
            patch.setenv(key, value)
        hooks = InProcess(patch)
        install({**os.environ, **env}, hooks)
        patch.setattr(sys, "argv", command_line(main, argv))
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = run_command(main, argv, interrupted)
                except SystemExit as exit:  # argparse's usage error (2), a tool's sys.exit(1): as Python ends
                    code = exit.code if isinstance(exit.code, int) else int(exit.code is not None)
                    if not isinstance(exit.code, int) and exit.code is not None:
                        print(exit.code, file=sys.stderr)
            hooks.finish()
        finally:
            forget_accelerator()
    return subprocess.CompletedProcess([sys.executable, *command_line(main, argv)], code, out.getvalue(),
                                       err.getvalue())


def forget_accelerator() -> None:
    """accelerate's singletons (AcceleratorState, GradientState) reset, as a new process has them: the
    next Accelerator() starts from its arguments and the environment, not from the last one's."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def outputs(folder: Path, *extra: str) -> list[str]:
    """Flags that send every output file of a run into folder."""
    return ["--checkpoint", str(folder / "best.pth"), "--plot", str(folder / "curves.png"), *extra]


def history(folder: Path) -> list[dict]:
    return json.loads((folder / "history.json").read_text())


def weights(folder: Path, name: str = "best.pth") -> dict:
    """A file of a run's folder; "last.pth": the run's last, FSDP's last.dcp read whole as last.pth
    holds it (src.checkpoint.read_last: the newer of the two)."""
    if name == "last.pth":
        from src.checkpoint import read_last
        return read_last(folder)
    return torch.load(folder / name, map_location="cpu", weights_only=True)


def read_last_copy(path: Path) -> dict:
    """A copy of a last (COPY_LAST): a last.K.pth file, or a last.K.dcp folder read whole."""
    if path.is_dir():
        from src.sharded_checkpoint import read_whole
        return read_whole(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def last_model(folder: Path) -> dict:
    return weights(folder, "last.pth")["model"]


def cache_files(folder: Path) -> list[str]:
    """The file names in a --cache folder without the key each holds (train_32px.KEY.u8: train_32px.u8)."""
    return sorted(re.sub(r"\.[0-9a-f]{16}\.", ".", path.name) for path in folder.iterdir())


def last_line(result) -> str:
    """The last line of stderr, without what progress bars drew on it (after a carriage return)."""
    return (result.stderr.strip().splitlines() or [""])[-1].split("\r")[-1].strip()


def fails(result, message: str) -> str:
    """Assert a run ended with exit 2 and one line naming the problem, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert message in last_line(result), result.stderr[-3000:]
    return last_line(result)


# The modes whose run is one process: the shared runs train them in the test worker (run_main);
# those of two processes under a launcher: in TwoRanks' two processes.
SCRIPTS = {"single": "train_single", "dp": "train_dp"}
TWO_RANK_SCRIPTS = {"ddp": "train_ddp", "fsdp": "train_fsdp", "accelerate": "train_accelerate"}
TWO_RANKS_LIMIT = 900  # seconds a run in TwoRanks may take: past it, the run failed (a collective that waits for ever)
_REMOTE_CPU: list[float] = []  # CPU seconds that TwoRanks' processes spent on the current test's runs


def _two_rank_server(rank: int, connection) -> None:
    """One process of TwoRanks, rank `rank` of a world of two: for each request (the script's
    module, its argv, its environment, the port of rank 0's store), the script's main(argv) with
    the variables torchrun gives a rank and the test hooks installed (run_main); replies (exit
    code, stdout, stderr, CPU seconds spent)."""
    import resource
    import traceback

    def cpu() -> float:
        return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
                   for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    torch.set_num_threads(1)  # as torchrun and accelerate launch give each of several processes
    began = 0.0  # the first run's CPU seconds count this process's start
    while (request := connection.recv()) is not None:
        module, argv, env, port = request
        with pytest.MonkeyPatch.context() as patch:
            for name, value in dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
                patch.setenv(name, value)
            try:
                result = run_main(importlib.import_module(module).main, argv, env=env)
                reply = [result.returncode, result.stdout, result.stderr]
            except BaseException:  # the harness's own failure: said as a failed run
                reply = [1, "", traceback.format_exc()]
            finally:
                end_process_group()
        spent, began = cpu() - began, cpu()
        connection.send([*reply, spent])


class TwoRanks:
    """Two processes (torch.multiprocessing's spawn) that run the shared runs of the two-process
    modes (train_ddp.py, train_fsdp.py, train_accelerate.py), one run after another, each with its
    own process group: a run costs its training, not a launcher's and two Pythons' start (some 10
    CPU seconds). Where the launcher itself is under test (its signals, restarts, reports), the
    tests start it. A run that fails or takes past TWO_RANKS_LIMIT ends both processes; the next
    run starts two new ones."""

    def __init__(self):
        self.processes: list = []
        self.connections: list = []
        self.counted = 0.0  # CPU seconds of these processes reported to TEST_COST_LOG's tests

    def run(self, script: str, argv: list[str], env: dict) -> subprocess.CompletedProcess:
        """main(argv) of `script` (train_ddp, ...) on both ranks: exit code 0 if both ended 0 (else
        the first other), rank 0's output then rank 1's, as a launcher passes both on."""
        if not self.processes or not all(process.is_alive() for process in self.processes):
            self.start()
        port = free_port()
        for connection in self.connections:
            connection.send([script, argv, env, port])
        replies = []
        for connection in self.connections:
            if not connection.poll(TWO_RANKS_LIMIT):
                self.stop()
                return subprocess.CompletedProcess([script, *argv], 1, "", f"no answer in {TWO_RANKS_LIMIT} s")
            replies.append(connection.recv())
        _REMOTE_CPU.append(sum(reply[3] for reply in replies))
        self.counted += _REMOTE_CPU[-1]
        codes = [reply[0] for reply in replies]
        if any(codes):
            self.stop()  # a rank may still wait in a collective, or for its launcher
        return subprocess.CompletedProcess([script, *argv], next((code for code in codes if code), 0),
                                           "".join(reply[1] for reply in replies),
                                           "".join(reply[2] for reply in replies))

    def start(self) -> None:
        import multiprocessing
        self.stop()
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(2)]
        self.connections = [ours for ours, _ in pipes]
        self.processes = [context.Process(target=_two_rank_server, args=(rank, theirs), name=f"rank {rank}")
                          for rank, (_, theirs) in enumerate(pipes)]  # not daemons: their loaders start workers
        for process in self.processes:
            process.start()

    def stop(self) -> None:
        for connection in self.connections:
            with contextlib.suppress(OSError):
                connection.send(None)
        for process in self.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
        if self.processes:  # reaped here: the seconds their runs reported must not count twice
            _REMOTE_CPU.append(-self.counted)
        self.processes, self.connections, self.counted = [], [], 0.0


class Runs:
    """Training runs shared by the whole session (every worker of it): run(mode, *flags) trains
    once per distinct (mode, flags, env, data) and returns (output folder, finished process). A
    one-process mode trains in the worker's own process (run_main), a two-process mode in TwoRanks,
    unless own_process says to run its command line (under its launcher), the run compiles
    (torch.compile's caches are the process's) or a hook of env needs a process of its own."""

    def __init__(self, root: Path, exact_data: Path):
        self.root, self.exact_data = root, exact_data
        self.two_ranks = TwoRanks()

    def __call__(self, mode: str, *flags: str, env: dict | None = None, data: Path | None = None,
                 own_process: bool = False, kept: str = "session"):
        """kept: "file" for a run of the asking test file alone, "test" for one of the asking test
        alone: removed once that file's (or test's) tests have passed. ResNet-18's checkpoints, some
        in float64, are 90 to 340 MB a run: kept for the whole session they would add up to GBs of a
        machine's disk (a later request makes the run again)."""
        key = json.dumps([mode, flags, sorted((env or {}).items()), str(data)])
        out = self.root / f"run-{mode}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
        if kept != "session" and out not in _RELEASED[kept]:
            _RELEASED[kept].append(out)
        with made_once(out) as missing:
            if missing:
                # "{run}" in a flag or an environment value: a path in the run's own folder.
                flags = [flag.replace("{run}", str(out)) for flag in flags]
                full_env = {"PYTHONPATH": HOOKS, "WRITE_LOG": str(out / "writes.log"),
                            "HF_HOME": str(out / "hf"),  # no accelerate config file
                            "ACCELERATE_USE_CPU": "1",
                            **{k: v.replace("{run}", str(out)) for k, v in (env or {}).items()}}
                argv = ["--data-dir", str(data or self.exact_data), *flags, *outputs(out / "out")]
                here = not own_process and "--compile" not in flags and set(env or {}) <= in_process_variables()
                if here and mode in SCRIPTS:
                    full_env.pop("PYTHONPATH")
                    result = run_main(importlib.import_module(SCRIPTS[mode]).main, argv, env=full_env)
                elif here and mode in TWO_RANK_SCRIPTS:
                    full_env.pop("PYTHONPATH")
                    result = self.two_ranks.run(TWO_RANK_SCRIPTS[mode], argv, full_env)
                else:
                    result = run([*LAUNCH[mode](), *argv], env=full_env)
                assert result.returncode == 0, result.stderr[-3000:]
                (out / "result.json").write_text(json.dumps([result.args, result.stdout, result.stderr]))
        args, stdout, stderr = json.loads((out / "result.json").read_text())
        return out / "out", subprocess.CompletedProcess(args, 0, stdout, stderr)

    def exact(self, mode: str, *flags: str, epochs: int = 2, env: dict | None = None, own_process: bool = False):
        """An EXACT run of `mode` with the global batch 2 * B (B per process for two processes)."""
        batch = 2 * B // PROCESSES[mode]
        return self(mode, *EXACT, *VAL, "--epochs", str(epochs), "--batch-size", str(batch), *flags, env=env,
                    own_process=own_process)


# The runs of the test file and of the test running now in this process (Runs(..., kept=...)).
_RELEASED: dict[str, list[Path]] = {"file": [], "test": []}


def _release(kept: str, session: pytest.Session, failed_before: int) -> None:
    """Remove the runs kept for the file or test that just ended, unless one of its tests failed
    (then they stay for a look, as the session's other runs do)."""
    if session.testsfailed == failed_before:
        for out in _RELEASED[kept]:
            with open(out.parent / f"{out.name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                (out.parent / f"{out.name}.done").unlink(missing_ok=True)
                shutil.rmtree(out, ignore_errors=True)
    _RELEASED[kept].clear()


@pytest.fixture(scope="module", autouse=True)
def _release_the_files_runs(request):
    failed = request.session.testsfailed
    yield
    _release("file", request.session, failed)


@pytest.fixture(autouse=True)
def _release_the_tests_runs(request):
    failed = request.session.testsfailed
    yield  # after the test's call phase, whose failure is counted by now
    _release("test", request.session, failed)


@pytest.fixture(scope="session")
def runs(request, exact_data) -> Runs:
    made = Runs(shared_folder(request.config) / "runs", exact_data)
    yield made
    made.two_ranks.stop()


@pytest.fixture(scope="session")
def far(runs) -> float:
    """The distance between the reference (train_single.py, global batch 2 * B, 2 epochs) and the
    same run with batch B: what a mode that took other batches would be off by."""
    reference = last_model(runs.exact("single")[0])
    other = last_model(runs("single", *EXACT, *VAL, "--epochs", "2", "--batch-size", str(B))[0])
    return distance(reference, other)


def assert_same_run(out: Path, reference: Path, far: float, tolerance: float = TOLERANCE) -> float:
    """Same sample counts, same metrics and last.pth weights within tolerance x far; returns the
    measured share of far."""
    got, want = history(out), history(reference)
    assert [r["epoch"] for r in got] == [r["epoch"] for r in want]
    for a, b in zip(got, want):
        assert (a["train_samples"], a["val_samples"]) == (b["train_samples"], b["val_samples"])
        for key in ("train_loss", "train_acc", "val_loss", "val_acc", "val_log_loss", "lr"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), (key, a, b)
        for key in AVERAGE.values():  # the weight average's validation, where the runs keep one
            assert (key in a) == (key in b), (key, a, b)
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-9), (key, a, b)
    share = distance(last_model(out), last_model(reference)) / far
    assert share < tolerance, share
    averages = last_average(out), last_average(reference)
    assert (averages[0] is None) == (averages[1] is None)
    if averages[0] is not None:
        assert distance(*averages) / far < tolerance, distance(*averages) / far
    return share


def last_average(folder: Path) -> dict | None:
    """The weight average (--ema-decay) in last.pth, None without one."""
    average = weights(folder, "last.pth")["average"]
    return None if average is None else average["model"]


# No user setting of the machine reaches the tracked runs: W&B offline, MLflow's default store
# (the offline_trackers fixture; the same for the runs made once per session).
TRACKER_SETTINGS = ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID",
                    "MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")
OFFLINE_TRACKERS = {**dict.fromkeys(TRACKER_SETTINGS), "WANDB_DISABLE_GIT": "true"}
TORCHRUN = ["torchrun", "--standalone", "--nproc_per_node=2"]
# torchrun's signals in docs/slurm/train.sbatch: its default list and SIGUSR1, which srun forwards
SLURM_SIGNALS = re.search(r"--signals-to-handle=(\S+)", (ROOT / "docs" / "slurm" / "train.sbatch").read_text())[1]
# The runs that stop and go on (ddp_stops, fsdp_stops): 2 processes of 5 images (10 optimizer steps
# an epoch), 2 epochs, a step checkpoint every 3 steps of the run, step metrics every 4, tracked in
# MLflow.
STOPS = [*RESUMABLE, *VAL, "--epochs", "2", "--batch-size", "5", "--save-every-steps", "3", "--log-every", "4",
         "--track", "mlflow"]


class Stage(typing.NamedTuple):
    """One launch of a chain of runs: a copy of the output folder as the launch left it, and its
    finished launcher (args, exit code, stdout, stderr)."""
    out: Path
    result: subprocess.CompletedProcess


def chain(request, name: str, script: str, stages: list[tuple[str, list[str], list[str], dict]]) -> dict[str, Stage]:
    """Launches of `script` with STOPS that go on one after another in one output folder (each
    stage: its name, the launcher, the script's extra flags, the hooks' variables), made once per
    session, each stage's folder copied as it left it; by stage name. A launch names the folder
    it wrote as Stage.out.parent / "out"."""
    folder = shared_folder(request.config) / name
    out = folder / "out"
    flags = [script, "--data-dir", str(shared_folder(request.config) / "exact"), *STOPS, *outputs(out)]
    with made_once(folder) as missing:
        if missing:
            for number, (_, launcher, extra, env) in enumerate(stages):
                result = run([*launcher, *flags, *extra], env={"PYTHONPATH": HOOKS, **OFFLINE_TRACKERS, **env},
                             timeout=600)
                shutil.copytree(out, folder / str(number), symlinks=True)
                (folder / f"{number}.json").write_text(json.dumps([result.args, result.returncode, result.stdout,
                                                                   result.stderr]))
    return {stage: Stage(folder / str(number), subprocess.CompletedProcess(
        *json.loads((folder / f"{number}.json").read_text()))) for number, (stage, _, _, _) in enumerate(stages)}


@pytest.fixture(scope="session")
def ddp_stops(request, exact_data) -> dict[str, Stage]:
    """train_ddp.py under torchrun (STOPS) stopped three times and gone on each time with --resume,
    then a worker killed and restarted by torchrun, to the end (conftest.chain):

    - "at step 8": SIGUSR1 to rank 1 alone (kill -USR1 to one worker) as its step 1 starts: the
      agreement check after step 4 carries it, the one after step 8 reads it, both ranks stop
      there; rank 0, never signalled, gets a SIGUSR1 as the stop's save renames last.pth (the
      third rename: after steps 3 and 6 first), which changes nothing;
    - "after epoch 1": --resume; SIGUSR1 to rank 1 alone in the run's step 9: the blocking
      agreement at epoch 2's start stops both, epoch 1's files saved; MLflow's end of the tracked
      run held 3 s (SLOW_TRACKER_END), so rank 1 has ended its stop long before rank 0;
    - "at step 16": --resume under torchrun started as docs/slurm/train.sbatch starts it
      (--signals-to-handle with SIGUSR1); SIGUSR1 to torchrun in the run's step 11, which it
      forwards to both ranks: they stop after step 16 (epoch 2 step 6);
    - "restarted": --resume under --max-restarts=1; rank 0 killed (SIGKILL) as its 3rd step (the
      run's 19th) starts, once the step checkpoint after step 18 is written: torchrun restarts both
      workers, which resume from it on their own and go on to the end.

    test_stopping (the stops and the end bit for bit), test_reliability (the restart),
    test_tracking_scripts (one tracked run across all four) and test_sharded_checkpoint (the
    first stage's two-rank step checkpoint) read it; the uninterrupted run to compare with is
    stops_straight(runs, "ddp")."""
    one = {"SIGNAL_AT_STEP": "1", "SIGNAL_RANK": "1", "SIGNAL_NAME": "SIGUSR1"}
    return chain(request, "ddp-stops", "train_ddp.py", [
        ("at step 8", TORCHRUN, [], {**one, "SIGNAL_AT_REPLACE": "last.pth:3"}),
        ("after epoch 1", TORCHRUN, ["--resume"], {**one, "SLOW_TRACKER_END": "3"}),
        ("at step 16", [*TORCHRUN, f"--signals-to-handle={SLURM_SIGNALS}"], ["--resume"],
         {"SIGNAL_AT_STEP": "1", "SIGNAL_TO": "parent", "SIGNAL_NAME": "SIGUSR1"}),
        ("restarted", [*TORCHRUN, "--max-restarts=1"], ["--resume"], {"KILL_AT_STEP": "3", "KILL_RANK": "0"}),
    ])


@pytest.fixture(scope="session")
def fsdp_stops(request, exact_data) -> dict[str, Stage]:
    """train_fsdp.py under torchrun (STOPS) stopped once, then gone on with a worker killed in the
    middle of a save and restarted by torchrun, to the end (conftest.chain):

    - "at step 8": SIGTERM to rank 0 as its step 1 starts (as SLURM sends it to each task): the
      ranks agree after step 4 and stop after step 8 of epoch 1, each rank's shards in last.dcp;
    - "restarted": --resume under --max-restarts=1; rank 1 killed (SIGKILL) as it starts writing
      its shard of its third save (after step 9, at epoch 1's end, then after step 12: a step
      checkpoint written by dcp.async_save while training goes on): torchrun restarts both
      workers, which find epoch 1's last.dcp whole (the half-written one removed) and go on to the
      end.

    test_sharded_checkpoint (the shards, the resumes in other modes and numbers of processes, the
    kill in a save) and test_tracking_scripts (one tracked run across both) read it; the
    uninterrupted run to compare with is stops_straight(runs, "fsdp")."""
    return chain(request, "fsdp-stops", "train_fsdp.py", [
        ("at step 8", TORCHRUN, [], {"SIGNAL_AT_STEP": "1", "SIGNAL_NAME": "SIGTERM"}),
        ("restarted", [*TORCHRUN, "--max-restarts=1"], ["--resume"], {"KILL_AT_SHARD": "3", "KILL_RANK": "1"}),
    ])


def stops_straight(runs: Runs, mode: str) -> Path:
    """The uninterrupted run of ddp_stops or fsdp_stops (a stop, a resume or a restart must change
    nothing of it: the step checkpoints, the step metrics and the tracker are left out)."""
    return runs(mode, *RESUMABLE, *VAL, "--epochs", "2", "--batch-size", "5")[0]


def resumable_run(runs: Runs, mode: str):
    """Two straight epochs of RESUMABLE with the global batch 2 * B."""
    return runs(mode, *RESUMABLE, *VAL, "--epochs", "2", "--batch-size", str(2 * B // PROCESSES[mode]))


def stepped_run(runs: Runs) -> Path:
    """train_single.py's two EXACT epochs with --save-every-steps 3, each last.pth kept (COPY_LAST):
    copies/last.1.pth after step 3, .2 at epoch 1's end, .3 after step 6 (epoch 2's first), .4 after
    step 9, .5 at epoch 2's end (the mid-epoch checkpoints the other modes resume)."""
    return runs.exact("single", "--save-every-steps", "3", env={"COPY_LAST": "{run}/copies"})[0]


def same_end(out: Path, reference: Path) -> None:
    """The same weights and weight average, bit for bit (the same processes, threads and data),
    and history."""
    assert torch.equal(torch.cat([t.flatten() for t in last_model(out).values()]),
                       torch.cat([t.flatten() for t in last_model(reference).values()]))
    averages = last_average(out), last_average(reference)
    assert (averages[0] is None) == (averages[1] is None)
    if averages[0] is not None:
        assert torch.equal(torch.cat([t.flatten() for t in averages[0].values()]),
                           torch.cat([t.flatten() for t in averages[1].values()]))
    timings = {"train_seconds", "val_seconds", "seconds", "data_wait_seconds"}
    assert [{k: v for k, v in r.items() if k not in timings} for r in history(out)] == \
        [{k: v for k, v in r.items() if k not in timings} for r in history(reference)]


def assert_same_best(out: Path, reference: Path) -> None:
    """The same best.pth, bit for bit, and best.json's epoch and choice of weights."""
    ours, theirs = weights(out), weights(reference)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[key], theirs[key]) for key in ours)
    infos = [json.loads((folder / "best.json").read_text()) for folder in (out, reference)]
    assert [(info["epoch"], info["weights"]) for info in infos][0] == [(info["epoch"], info["weights"]) for info in infos][1]


def mode_run(runs: Runs, mode: str):
    """The two-epoch EXACT run of a mode that test_modes compares and test_watch reads: with
    TensorBoard logs (OUT/../tensorboard), --profile, a log of which ranks scanned train/ (there is
    no train.csv; OUT/../scans.log) and of the settings train_accelerate.py gives accelerate
    (OUT/../accelerator.log), where OUT is the run's output folder. train_dp.py's from its command
    line (`python train_dp.py`: that script's run end to end; train_single.py's are elsewhere)."""
    return runs.exact(mode, "--log-dir", "{run}/tensorboard", "--log-every", "2", "--profile",
                      env={"SCAN_LOG": "{run}/scans.log", "ACCELERATOR_LOG": "{run}/accelerator.log"},
                      own_process=mode == "dp")


# The modern augmentation recipe (src/augment.py): a policy, erasing, MixUp and CutMix, with the
# values of issue 49's check.
MODERN = ["--auto-augment", "ta_wide", "--random-erase", "0.25", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]
# The full recipe (test_recipe, test_fsdp): every recipe flag on, a weight average among them.
RECIPE = ["--augment", *MODERN, "--lr-schedule", "cosine", "--warmup-epochs", "0.5", "--weight-decay", "0.01",
          "--label-smoothing", "0.1", "--clip-grad-norm", "1.0", "--best-by", "val_log_loss", "--ema-decay", "0.9"]
MICRO = {"single": (B, 4), "dp": (2 * B, 2), "ddp": (B, 2), "fsdp": (B, 2), "accelerate": (B, 2)}  # batch, --accumulate


def recipe_run(runs, mode, *extra, env=None, batch=None, accumulate=None):
    """A mode's two epochs of EXACT with every RECIPE flag, at the reference's global batch."""
    b, n = MICRO[mode]
    return runs(mode, *EXACT, *VAL, *RECIPE, "--epochs", "2", "--batch-size", str(batch or b),
                "--accumulate", str(accumulate or n), *extra, env=env)


@pytest.fixture(scope="module")
def reference(runs):
    """train_single.py with --accumulate 4: one process takes the steps of 2 processes x 2."""
    return recipe_run(runs, "single")[0]


@pytest.fixture(scope="module")
def recipe_far(runs, reference):
    """The reference against the same recipe with half the global batch."""
    other = recipe_run(runs, "single", accumulate=2)[0]
    return distance(last_model(other), last_model(reference))


# --evaluate (test_evaluate, test_fsdp): a shared run's output folder validated again.
U = 2.0 ** -24  # float32's unit roundoff


def evaluate_flags(mode: str, out, *extra: str) -> list[str]:
    """The flags of the shared run of `mode` (conftest.mode_run, less what writes: --log-dir,
    --profile), validating a file of its output folder `out`; the plot at its default place."""
    return [*EXACT, *VAL, "--epochs", "2", "--batch-size", str(2 * B // PROCESSES[mode]),
            "--checkpoint", str(out / "best.pth"), "--evaluate", *extra]


def evaluated_record(stdout: str) -> dict:
    """The record --evaluate prints (a JSON line after its summary line), printed once."""
    records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    assert len(records) == 1 and stdout.count("validated ") == 1, stdout
    return records[0]


def assert_reproduces(record: dict, out, epoch: int) -> None:
    """The validation figures of history.json's epoch: the same samples and correct answers; the
    same per-image losses, summed in float32 in the same order, give the same mean (a tolerance
    of 101 x u covers another order of the 101 positive terms)."""
    want = history(out)[epoch - 1]
    assert want["epoch"] == epoch and record["val_samples"] == want["val_samples"] == 101
    assert record["val_acc"] == want["val_acc"]
    for key in ("val_loss", "val_log_loss"):
        assert record[key] == pytest.approx(want[key], rel=101 * U, abs=0), (key, record, want)


def files_and_times(folder) -> dict:
    """The folder's files and its own time of change."""
    return {".": folder.stat().st_mtime_ns,
            **{p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}}


def copy_run(mode: str, runs, out):
    """A copy of the shared run's output folder, with the temporary file of a save in progress
    (a training run writing there now): validating must leave it alone."""
    shutil.copytree(mode_run(runs, mode)[0], out)
    (out / ".last.pth.in-progress.tmp").write_bytes(b"half a checkpoint")
    return out


# predict and export (test_predict, test_export): a folder of mixed files, a trained best.pth.
FORMATTED = 5e-7  # the CSV's p_dog has 6 significant digits: off by at most half a unit of the 6th

# The images of the mixed folder in the order predict lists them (natural order of their path in
# the folder), and the other files: two that are not images, two broken images.
MIXED_IMAGES = ["a/b/deep.jpeg", "a/cat.2.jpg", "a/cat.10.jpg", "Cat 7, \"quoted\" é.JPG", "cmyk.jpg", "gray.jpg",
                "lossless.png", "nested/dog.1.jpg", "nested/dog.3.JPEG", "nested/dog.20.jpg", "palette.png",
                "rgba.png", "x.bmp"]
MIXED_OTHERS = ["notes.txt", "nested/README"]
MIXED_BROKEN = {"broken.jpg": "truncated", "empty.png": "cannot identify image file"}


def read_predictions(path):
    """predict's CSV as a DataFrame, every path a string."""
    import pandas as pd
    return pd.read_csv(path, dtype={"path": str}, keep_default_na=False)


def validation_pass(checkpoint, files, flip=False):
    """p(dog) for the files as the training scripts' validation computes it, from its own pieces:
    DogCatDataset (open_rgb's draft decode, image_transform), a loader, model_inputs, the model;
    and the float32 bound (src.tools.rounding) of another computation of each."""
    import pandas as pd
    from torch.utils.data import DataLoader

    from src.datasets import DogCatDataset
    from src.inference import load_checkpoint
    from src.tools.rounding import rounding_bound
    from src.transforms import image_transform, model_inputs, normalize
    model, info = load_checkpoint(checkpoint)
    table = pd.DataFrame({"filename": [str(f) for f in files], "label": 0})
    dataset = DogCatDataset(table, "/", image_transform(info["image_size"]), draft_size=info["image_size"])
    images = torch.cat([batch for batch, _ in DataLoader(dataset, batch_size=5)])
    if flip:
        images = images.flip(dims=[3])
    with torch.no_grad():
        p = torch.cat([model(model_inputs(batch, torch.device("cpu"))).softmax(dim=1)
                       for batch in images.split(5)])
    _, bound = rounding_bound(model, normalize(images))
    return p[:, 1].numpy(), bound[:, 1].numpy()


def make_mixed(folder, source):
    """The mixed folder, from the labelled JPEGs of the `exact` set (source/train)."""
    train = source / "train"
    copies = {"Cat 7, \"quoted\" é.JPG": "cat.7.jpg", "a/b/deep.jpeg": "dog.4.jpg", "a/cat.2.jpg": "cat.2.jpg",
              "a/cat.10.jpg": "cat.10.jpg", "nested/dog.1.jpg": "dog.1.jpg", "nested/dog.3.JPEG": "dog.3.jpg",
              "nested/dog.20.jpg": "dog.20.jpg"}
    for name, original in copies.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(train / original, folder / name)
    with Image.open(train / "dog.5.jpg") as image:
        rgb = image.convert("RGB")
    rgb.convert("CMYK").save(folder / "cmyk.jpg")
    rgb.convert("L").save(folder / "gray.jpg")
    rgb.save(folder / "lossless.png")
    rgb.convert("P").save(folder / "palette.png")
    rgb.convert("RGBA").save(folder / "rgba.png")
    rgb.resize((rgb.width * 3, rgb.height * 3)).save(folder / "x.bmp")
    (folder / "notes.txt").write_text("not an image\n")
    (folder / "nested" / "README").write_text("not an image either\n")
    jpeg = (train / "cat.5.jpg").read_bytes()
    (folder / "broken.jpg").write_bytes(jpeg[: len(jpeg) // 3])
    (folder / "empty.png").write_bytes(b"")
    return folder


@pytest.fixture(scope="module")
def mixed(module_tmp, exact_data):
    return make_mixed(module_tmp / "mixed", exact_data)


@pytest.fixture(scope="module")
def checkpoint(runs):
    """best.pth of the shared one-device run (SqueezeNet at 64 px)."""
    return mode_run(runs, "single")[0] / "best.pth"


def command_line(main, argv: list[str]) -> list[str]:
    """sys.argv as `python COMMAND ARGV` sets it for main() of COMMAND (its file name first)."""
    return [f"{main.__module__.rsplit('.', 1)[-1]}.py", *argv]


def in_process(main, argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """main() of a command in this process, as `python COMMAND ARGV` runs it, for the checks that
    end before any training (a subprocess would spend 4 s importing torch); returns
    (exit code, stdout, stderr)."""
    from src.errors import exit_on_error
    monkeypatch.setattr(sys, "argv", command_line(main, argv))
    try:
        exit_on_error(main)
        code = 0
    except SystemExit as exit:
        code = exit.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def printed_by(main, argv: list[str]) -> str:
    """What main() of a command prints, run in this process, for module fixtures (in_process needs
    a test's monkeypatch and capsys)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as stdout:
        patch.setattr(sys, "argv", command_line(main, argv))
        main()
    return stdout.getvalue()


def fails_in_process(main, argv: list[str], monkeypatch, capsys, message: str) -> str:
    """in_process ending with exit 2 and one line on stderr holding message; returns that line."""
    code, _, err = in_process(main, argv, monkeypatch, capsys)
    line = err.strip().split("\r")[-1].strip()  # progress bars erase themselves with carriage returns
    assert code == 2 and err.count("\n") == 1 and message in line, (code, err)
    return line


@pytest.fixture
def offline_trackers(monkeypatch):
    """No user setting of the machine reaches the tracking tests' runs: W&B offline, MLflow's default store."""
    for name in TRACKER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")


@pytest.fixture
def tmpfs(tmp_path):
    """tmpfs(name, options): a tmpfs mounted at tmp_path / name (e.g. "size=64m", "ro,size=1m"),
    unmounted after the test; remount(folder, options) changes it. Needs root with mount rights,
    as on CI; skips elsewhere."""
    mounted = []

    def mount(name: str, options: str) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (not root, or no mount rights)")
        mounted.append(folder)
        return folder
    yield mount
    for folder in mounted:
        subprocess.run(["umount", str(folder)], check=True)


def remount(folder: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True)


# Faked GPUs and torch's numerics settings (the tests of the GPU's paths on the CPU).
@pytest.fixture
def fake_gpus(monkeypatch):
    """fake_gpus(n, bf16): torch reports n CUDA GPUs, for the checks made before any is used."""
    def fake(n: int, bf16: bool = True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0) if bf16 else (7, 0))
    return fake


class CudaCalls:
    """A stand-in for CUDA's current device, which is per thread (a new thread's is 0, as CUDA's
    runtime has it), and for torch.cuda's calls on it: set_device, current_device, and Event's
    record, query and synchronize. Each call is recorded as (the thread's name, the call, the
    device current in that thread then)."""

    def __init__(self):
        self.local = threading.local()
        self.calls: list[tuple[str, str, int]] = []

    def current_device(self) -> int:
        return getattr(self.local, "device", 0)

    def set_device(self, device) -> None:
        self.local.device = device.index if isinstance(device, torch.device) else int(device)
        self.called("set_device")

    def called(self, what: str) -> None:
        self.calls.append((threading.current_thread().name, what, self.current_device()))

    def of(self, thread: str) -> list[tuple[str, int]]:
        """(call, device) of each call made in the thread named `thread`, in order."""
        return [(what, device) for name, what, device in self.calls if name == thread]


@pytest.fixture
def cuda_calls(monkeypatch) -> CudaCalls:
    """torch.cuda's set_device, current_device and Event replaced by a CudaCalls that records,
    per thread, on which device each call was made (CUDA runs a thread's calls on its current
    device, GPU 0 unless the thread set another)."""
    calls = CudaCalls()

    class Event:
        def __init__(self, *args, **kwargs):
            calls.called("Event")

        def record(self, stream=None) -> None:
            calls.called("record")

        def query(self) -> bool:
            calls.called("query")
            return True

        def synchronize(self) -> None:
            calls.called("synchronize")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", calls.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", calls.current_device)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    return calls


# What would make the host wait for a GPU inside a training step, seen on the CPU.

def _to_the_host(args: tuple, kwargs: dict) -> bool:
    """Whether Tensor.to(*args, **kwargs) asks for the CPU."""
    target = kwargs.get("device", args[0] if args else None)
    target = target.device if isinstance(target, torch.Tensor) else target
    if target is None or isinstance(target, torch.dtype):
        return False
    try:
        return torch.device(target).type == "cpu"
    except (TypeError, RuntimeError):
        return False


class HostWaits(TorchFunctionMode):
    """Records, outside the data loader's own code, what would make the host wait for a GPU or copy
    Python values to it: tensors built from Python values, and reads of a tensor on the host."""
    WATCHED = {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.Tensor.new_tensor,
               torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy,
               torch.Tensor.__bool__}

    def __init__(self, to_host: bool = False):
        super().__init__()
        self.calls = []
        self.to_host = to_host  # and Tensor.to the CPU (on the CPU, where no batch is moved to it: a save)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.WATCHED or (self.to_host and func is torch.Tensor.to and _to_the_host(args[1:], kwargs or {})):
            stack = traceback.extract_stack(limit=12)
            if not any("torch/utils/data" in frame.filename for frame in stack):
                self.calls.append((func.__name__, stack[-2].filename.rsplit("/", 1)[-1], stack[-2].lineno))
        return func(*args, **(kwargs or {}))


class HostReads(TorchDispatchMode):
    """Records the operations that make the host wait for a GPU's result: a tensor read as a
    Python number (item, float, int, bool: aten._local_scalar_dense), nonzero and a boolean mask
    (the size of the result depends on the values: torch's SyncBatchNorm drops empty ranks so).
    A dispatch mode sees the backward pass too, which a torch function mode (HostWaits) does not:
    autograd runs the backward without the Python function modes."""
    READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
             torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
             torch.ops.aten._unique2.default}
    INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func in self.INDEXING and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func in self.READS or masked:
            self.calls.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def restore_numerics(monkeypatch):
    """Put torch's global numerics settings back after a test changes them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    backends = torch.backends
    saved = (torch.are_deterministic_algorithms_enabled(), backends.cudnn.allow_tf32,
             backends.cuda.matmul.allow_tf32, backends.cudnn.benchmark, backends.cudnn.deterministic)
    yield
    torch.use_deterministic_algorithms(saved[0])
    backends.cudnn.allow_tf32, backends.cuda.matmul.allow_tf32 = saved[1:3]
    backends.cudnn.benchmark, backends.cudnn.deterministic = saved[3:]


@pytest.fixture
def stop_signals():
    """Puts back the handlers of SIGTERM, SIGUSR1 and SIGINT after a test whose src.stopping.Stops
    replaced them in this process (exit_on_error does it for a script's main())."""
    saved = {number: signal.getsignal(number) for number in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    yield
    for number, handler in saved.items():
        signal.signal(number, handler)


def stop_line(text: str) -> str:
    """The one line that rank 0 prints when a run stops on a signal (src/stopping.py), from a
    process's stderr (progress bars erased with carriage returns before it)."""
    lines = [line.split("\r")[-1].strip() for line in text.splitlines() if "stopped by " in line]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


class Asked(Exception):
    """Raised by a stand-in that stops a script where a test has seen what it asked for."""


# The refusals of bad input (test_outputs, test_inputs, test_diverged): a model to predict and
# export with that needs no training run, and a small dataset to copy and spoil.
TINY = ["--arch", "squeezenet1_1", "--weights", "none", "--image-size", "32", "--workers", "0", "--batch-size", "8"]


def write_checkpoint(folder: Path, state: dict, **fields) -> Path:
    """best.pth holding `state` and its best.json as training writes them (squeezenet1_1 at 32 px,
    ImageNet's normalisation), with `fields` changed (a field set to None is left out)."""
    from src.inference import sha256_of
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / "best.pth")
    info = {"arch": "squeezenet1_1", "image_size": 32, "num_classes": 2, "classes": ["cat", "dog"],
            "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225], "epoch": 1,
            "sha256": sha256_of(folder / "best.pth"), **fields}
    (folder / "best.json").write_text(json.dumps({k: v for k, v in info.items() if v is not None}))
    return folder / "best.pth"


@pytest.fixture(scope="session")
def untrained(tmp_path_factory) -> Path:
    """best.pth of an untrained 2-class SqueezeNet 1.1 (seeded) with its best.json: what predict and
    export need, without a training run."""
    import torchvision
    torch.manual_seed(0)
    model = torchvision.models.squeezenet1_1(num_classes=2)
    return write_checkpoint(tmp_path_factory.mktemp("untrained"), model.state_dict())


# Where tiny_data's labelled test images go in the validation folder: two depths under each class.
VAL_PLACES = ("cats/2023", "Dogs/trip/day 2")


def val_folder(tiny_data: Path, folder: Path) -> tuple[Path, dict[Path, int]]:
    """tiny_data's 6 labelled test images laid out as class folders, at depths 2 and 3; each
    file with its label (0 cat, 1 dog)."""
    with open(tiny_data / TEST_LABELS) as file:
        labels = {int(row["id"]): int(row["label"]) for row in csv.DictReader(file)}
    files = {}
    for image_id, label in labels.items():
        target = folder / VAL_PLACES[label] / f"{image_id}.jpg"
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_data / "test" / f"{image_id}.jpg", target)
        files[target] = label
    (folder / "cats" / "2023" / ".notes.txt").write_text("a hidden file, not an image\n")
    return folder, files


@pytest.fixture(scope="session")
def tiny_data(request) -> Path:
    """40 labelled images and 6 test images of about 40 px (copy it before changing it)."""
    return shared_dataset(request, "tiny40", n_train=40, n_test=6, size=40, seed=5)


def script_pass(script, net, loader, args, optimizer, scaler, schedule, model=None, frozen: bool = False,
                accelerator=None, steps: int | None = None, epoch: int = 0, average=None, state=None):
    """One epoch of a script's own train_epoch over `loader` (its training loader, set for the epoch),
    with the TrainingState and Progress that the script makes around it; returns the sums. `model`:
    the plain model under `net` (`net` itself by default); `steps`: the optimizer steps of the
    epoch (all the loader's whole steps by default); `accelerator`: train_accelerate.py's."""
    from src.ema import WeightAverage
    from src.progress import Progress
    from src.state import TrainingState
    model = net if model is None else model
    steps = len(loader) // args.accumulate if steps is None else steps
    if state is None:
        average = WeightAverage(model, optimizer, None) if average is None else average
        state = TrainingState(args, {}, model, optimizer, scaler, schedule, average, steps)
    progress = Progress(args, state, args.batch_size, torch.device("cpu"))
    extra = (accelerator,) if accelerator is not None else ()
    return script.train_epoch(*extra, net, loader, epoch, progress, state, args, torch.device("cpu"), frozen)


def script_loader(script, dataset, args, epoch: int = 0, rank: int = 0, world_size: int = 1, val_idx=(0,)):
    """`script`'s training loader over all of `dataset` (a list of (image, label)), set for `epoch`
    as its loop sets it."""
    from src.loaders import Data
    data = Data(dataset, list(range(len(dataset))), list(val_idx), "")
    name = script.__name__
    extra = (rank, world_size) if name in ("train_ddp", "train_fsdp") else (world_size,) if name == "train_accelerate" else ()
    loader = script.loaders(dataset, data, args, torch.device("cpu"), *extra)[0]
    if name in ("train_ddp", "train_fsdp"):
        loader.sampler.set_epoch(epoch)
    else:
        loader.sampler.generator.manual_seed(args.seed + epoch)
    loader.dataset.set_epoch(epoch)
    return loader


def shard_as_train_fsdp(model, device=None, compiled: bool = False) -> None:
    """fully_shard as train_fsdp.py's train() does it (each unit, then the root), in the process
    group this process is in."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from src.fsdp import check_shardable, compile_units, fsdp_units
    device = device or torch.device("cpu")
    check_shardable(model)
    units = fsdp_units(model)
    if compiled:
        compile_units(model, units)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
