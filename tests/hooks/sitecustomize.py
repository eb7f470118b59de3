"""Test hooks: each one changes a piece of the product for a test, and is off unless its variable
is set. Two ways in:

- a process started by a test (a launcher's workers, a script run as a command): PYTHONPATH
  holds this folder, Python imports this file at its start, and the variables of its environment
  install their hooks (each into its module as that is imported);
- a test's own process (a script's main(argv) run in-process, conftest.run_main): install(settings,
  InProcess(monkeypatch)) installs the same hooks with monkeypatch, into every module of the
  project that holds the piece, and monkeypatch undoes them when the run ends. The hooks that
  signal or kill their process (IN_PROCESS lists the others) are refused there: those tests need
  a process of their own.

WRITE_LOG=path: log "RANK file" for each os.replace. All our outputs are written to a temporary
name and renamed into place, so this lists every output file write and the rank that made it.

KILL_AT_STEP=n (with KILL_RANK=r, KILL_LOG=path): the process of rank r writes the time to
KILL_LOG and SIGKILLs itself at its n-th optimizer step, in the first attempt only
(TORCHELASTIC_RESTART_COUNT 0): a worker dying mid-epoch. A step checkpoint that this process is
writing in the background is written first: which last.pth a restart finds does not depend on
how fast the disk was; the trackers' queued reports are sent first too (a kill in the moment
after a step checkpoint loses the reports still queued, which the restart does not make again).

INTERRUPT_AT_STEP=n: rank 0 sends itself SIGINT (Ctrl-C) at its n-th optimizer step.
INTERRUPT_AT_REPLACE=name:k: Ctrl-C arrives as the k-th rename onto a file called `name` starts
(KeyboardInterrupt raised there, as before the stop signals were caught).

SIGNAL_AT_STEP=n (with SIGNAL_NAME=SIGTERM|SIGINT|SIGUSR1, SIGNAL_RANK=r, SIGNAL_TO=self|parent):
the process of rank r (default 0) sends that signal at its n-th optimizer step, in the first
attempt only, to itself or to its parent (torchrun), and then waits until the signal has come
back to it (torchrun forwards it; at most 30 s): the stop then begins in that step.
SIGNAL_AT_REPLACE=name:k: the process sends itself SIGNAL_NAME as the k-th rename onto `name`
starts (a second signal during the stop's save).
KILL_AT_SHARD=k (with KILL_RANK=r): the process of rank r SIGKILLs itself as it starts writing its
k-th shard file of FSDP's last.dcp (torch.distributed.checkpoint's FileSystemWriter.write_data, in
dcp.async_save's writing thread), in the first attempt only: a worker dying in the middle of a save.
KILL_IN_WRITE=name:k: the process SIGKILLs itself in the middle of its k-th write of a file called
`name` (src.outputs.atomic_write): part of the content is in the temporary file, flushed, and the
rename never comes (a kill while a step checkpoint is written in the background).
STOP_AT_STEP=n (with STOP_RANK=r, STOP_LOG=path): at its n-th optimizer step, once its heartbeat
has written that place, the process of rank r writes "PID TIME" to STOP_LOG and stops itself with
SIGSTOP (a rank that stops answering without dying; whoever reads STOP_LOG kills it).

RAY_AT_STEP=n (with RAY_ACTION=kill|term-driver|stop, RAY_RANK=r, RAY_LOG=path): in a Ray Train worker
(train_ray.py) of rank r (default 0), read when the step comes (Ray Train sets RANK after its
workers start), at its n-th optimizer step, once in the run (RAY_LOG, written first, marks it
done: a worker that Ray restarted finds it and does nothing): `kill`, the process SIGKILLs itself,
once Ray Train has taken in a checkpoint reported if RAY_REPORTED (a storage_path) is given (at
most 120 s: the controller collects a report a second or two after it is made), after removing the
file RAY_REMOVE if given (a node replaced with an empty disk); `term-driver`,
it sends SIGTERM to the driver whose pid the file RAY_DRIVER_PID_FILE holds, then waits (at most
120 s) until the stop has come back to it (its StopSignals' flag, which the driver's request
raises): the stop then begins in that step; `stop`, once its heartbeat has written that place, the
process stops itself with SIGSTOP (a worker that stops answering without dying; RAY_LOG holds
"PID TIME", for whoever must kill it).

BEAT_LOG=path (with BEAT_AT_STEP=n): at its n-th optimizer step each process appends one JSON line to
path: the rank, world size and timeout (seconds) of the heartbeat it entered (src/heartbeat.py), the
timeout of its (gloo) process group, and every rank's last beat as read from that heartbeat's store
(null without a store): where the ranks of a process group read each other's beats.

FAKE_GPUS=n: torch reports n CUDA GPUs, for the checks that run before anything touches a GPU
(in the processes that torchrun starts; in-process tests use conftest's fake_gpus).

ACCELERATOR_LOG=path: write the DataLoaderConfiguration that train_accelerate.py gives accelerate.

SLOW_ITEM=seconds: every training or validation image takes that long to load.
SLOW_TRACKER_END=seconds: MLflow's end of a tracked run (its artifacts and status) starts that much
later, as with a slow server: rank 0 ends its stop after the other ranks.
SCAN_LOG=path: log "RANK" each time a process scans train/ for its images.
APPEAR_AFTER_LISTING=new:source: a file appears among predict's images while its ranks start (a
copy into the folder: rsync, a camera): rank 0 copies source to new (whole, by a rename) right
after it lists the files to predict (src.image_files.find_images, or Kaggle's test/:
src.inference.kaggle_test_files), and any other rank that lists them waits for it first (at most
60 s).
AUGMENT_SEED_SHIFT=k: augmentation draws as if the seed were seed + k (a control).
NO_RESHUFFLE=1: every epoch takes the first epoch's order, as the seed's DDP script did (a control).
BATCH_MIXING=1: MixUp and CutMix as torchvision's reference script does them (a control): the
training split mixes nothing, and each training micro-batch that a process's loop takes is mixed
by src.augment.mixer's transform, which pairs each image with its neighbour in the process's own
micro-batch (a roll by one) and draws lambda, the box and the choice from the process's generator.
COMPILE_LOG=path: at the end (of the process, or of the in-process run), write how many frames
torch.compile compiled.
COPY_LAST=dir: copy last.pth to dir/last.K.pth each time the process writes it (K = 1, 2, ...),
and FSDP's last.dcp folder to dir/last.K.dcp: the checkpoints that the next one replaces.
SYNC_CHECK_STEPS=a:b (with SYNC_LOG=path): on a GPU, training micro-batches a to b of every epoch
run under torch.cuda.set_sync_debug_mode("warn"), and each host synchronisation there that this
process's Python code makes is recorded with where it was called from (in the main thread, or in
a backward, whose warnings autograd hands to the thread that called it; gloo's own threads, which
copy CUDA tensors through the host for ranks sharing a GPU, only print theirs). At the first
micro-batch of each window the hook reads a tensor back itself: the control, which the record
must show. Each process writes its record to SYNC_LOG.RANK (JSON) at exit, with the training
passes it wrapped (src.progress.Progress._pass; on a CPU it only counts them).
DTYPE_LOG=path: each process appends "RANK DTYPE" for each dtype of the logits that
F.cross_entropy gets (the training loss): float16 under --amp fp16, float32 without autocast.
COMPILE_OPS_LOG=path: each process writes to path.RANK (JSON) at exit the conv2d and linear calls
that ran inside graphs compiled by torch.compile (its backend wrapped to count them), the forwards
of the model given to torch.compile first (the scripts' root), and that model's Conv2d and Linear
modules: every forward run compiled calls each of them once.
COMPILE_BACKEND=name: with COMPILE_OPS_LOG, the counting backend compiles with this backend instead
of the scripts' own (inductor): "eager" traces the graphs and runs them as they are (make test-gpu
--device cpu, where inductor's C++ compilation would cost minutes).
TF32_LOG=path: torch.backends.cuda.matmul.allow_tf32 ("RANK WHEN VALUE"), right after accelerate's
Accelerator() is made (WHEN accelerator) and at the first optimizer step (step).
TARGETS_LOG=path: each process appends "RANK KIND" once for each kind of target F.cross_entropy
gets: "soft" (a probability per class: MixUp's and CutMix's) or "hard" (class indices).
MEMORY_LOG=path: each process writes to path.RANK (JSON) at exit: its GPU; on a GPU the peak of
CUDA memory allocated before its first step checkpoint (TrainingState.save_step), the memory
allocated when that begins, and the peak through its first epoch's training (at its first
save_epoch); the GPUs on which it holds a CUDA context (CUDA's primary context of each visible
device); and, where nvidia-smi lists processes by their pids, its memory on GPU 0.

PER_PROCESS_DROPOUT=1: the model's dropout layers draw as torch's do, from the process's generator
(a control: the per-sample masks are what makes the modes agree).

FLOAT64=1: the model's weights and inputs are float64: the agreement tests of batch norm models
compare the modes there, where the order of float sums cannot flip a max-pool's choice (in float32
a near tie flipped by a last-bit difference sends a gradient elsewhere, and a fast-learning ResNet
amplifies that from step to step).

OVERFLOW_AT=1,3: those optimizer steps (counted per gradient scaler, from 1) are skipped as for
an fp16 overflow, whatever the gradients, on every rank alike: an fp16 GradScaler finds an inf
(it halves its scale; fused optimizers get found_inf and must leave their state as it was); a
disabled one (float32, bf16), or accelerate's optimizer without a scaler, does not step. So runs
in any precision and mode skip the same steps.
NAN_AT_STEP=n (with NAN_RANK=r: that rank only): after its n-th optimizer step, the process's
weights are all NaN, as in a run that diverged.
AS_ON_GPU=1: src.devices.gpu_choices makes the CPU take the GPU's branch (fused optimizers); here
accelerate does too: with fp16 on the CPU it autocasts and makes its GradScaler as on CUDA
(accelerate/accelerator.py makes neither off a GPU, so fp16 would train in float32).
"""
import atexit
import glob
import importlib
import importlib.abc
import importlib.util
import os
import signal
import sys
import threading
import time

# Where the hooks go.

def _owner(module, attribute: str):
    """(the object holding the last part of a dotted attribute of module, that part's name)."""
    *path, name = attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _after_import(name, patch):
    """Call patch(module) once `name` has been imported (the scripts import src after this runs)."""
    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            sys.meta_path.insert(0, self)
            original = spec.loader.exec_module

            def exec_module(module):
                original(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Finder())


class AtImport:
    """A new process's hooks, for its whole life: a piece of the project (src, accelerate) is
    replaced in its module as that is imported, before the scripts import it by name; torch's and
    the standard library's at once."""

    def wrap(self, module: str, attribute: str, make) -> None:
        """module.attribute (a dotted path: Class.method) replaced by make(the original)."""
        def patch(loaded):
            owner, name = _owner(loaded, attribute)
            setattr(owner, name, make(getattr(owner, name)))
        if module in sys.modules or module.split(".")[0] not in ("src", "accelerate"):
            patch(importlib.import_module(module))
        else:
            _after_import(module, patch)

    def at_end(self, function) -> None:
        atexit.register(function)


def _ours(module) -> bool:
    name = getattr(module, "__name__", "")
    return name == "src" or name.startswith(("src.", "train_"))


class InProcess:
    """A test's own process: each replacement made with `monkeypatch` (undone when it ends), in its
    module and in every module of the project that imported the original by name; the functions
    given to at_end run at finish(), when the in-process run has ended."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.ends = monkeypatch, []

    def wrap(self, module: str, attribute: str, make) -> None:
        loaded = importlib.import_module(module)
        owner, name = _owner(loaded, attribute)
        original = getattr(owner, name)
        replacement = make(original)
        self.monkeypatch.setattr(owner, name, replacement)
        if owner is loaded:
            for other in list(sys.modules.values()):
                if other is not loaded and _ours(other) and getattr(other, name, None) is original:
                    self.monkeypatch.setattr(other, name, replacement)

    def at_end(self, function) -> None:
        self.ends.append(function)

    def finish(self) -> None:
        for function in self.ends:
            function()


HOOKS = []  # (the variables that turn a hook on, its install(settings, patcher), whether a test's process may take it)


def hook(*variables: str, in_process: bool = True):
    """Register install(settings, patcher) as the hook that any of `variables` turns on;
    in_process=False: one that signals, stops or kills its process, or reads what only a new
    process starts with."""
    def register(function):
        HOOKS.append((variables, function, in_process))
        return function
    return register


def install(settings, patcher) -> None:
    """Install the hook of each variable set (non-empty) in settings (an environment)."""
    for variables, function, in_process in HOOKS:
        on = [variable for variable in variables if settings.get(variable)]
        if on and isinstance(patcher, InProcess) and not in_process:
            raise ValueError(f"the test hook {on[0]} signals or ends its process, or changes how it starts: "
                             "run the command as a process of its own")
        if on:
            function(settings, patcher)


def in_process_variables() -> set:
    """The variables whose hooks a test's own process may take."""
    return {variable for variables, _, in_process in HOOKS if in_process for variable in variables}


def _rank(settings) -> str:
    return settings.get("RANK", "0")


_TRAINING = {"watched": False, "ran": False}


def _watch_training(patcher) -> None:
    """Note when this process starts a training run (makes its src.progress.Progress), for
    _trained(); once per process."""
    if _TRAINING["watched"]:
        return
    _TRAINING["watched"] = True

    def make(init):
        def noted(self, *args, **kwargs):
            _TRAINING["ran"] = True
            return init(self, *args, **kwargs)
        return noted
    patcher.wrap("src.progress", "Progress.__init__", make)


def _trained() -> bool:
    """Whether this process trained (it made a Progress: _watch_training). Other processes start
    with the same environment and write their records at exit too, under the rank of their
    environment: a launcher (torchrun, accelerate launch: no RANK, rank 0's name) ends after the
    workers, and so does each rank's loader fork server (its own RANK), which imports the script's
    modules but trains nothing: an empty record of theirs would replace the rank's."""
    return _TRAINING["ran"]


# The hooks.

@hook("WRITE_LOG", "INTERRUPT_AT_REPLACE")
def _logged_replaces(settings, patcher):
    renames = {}

    def make(replace):
        def logged_replace(src, dst, *args, **kwargs):
            if settings.get("INTERRUPT_AT_REPLACE"):
                name, k = settings["INTERRUPT_AT_REPLACE"].split(":")
                if os.path.basename(os.fspath(dst)) == name:
                    renames["interrupt"] = renames.get("interrupt", 0) + 1
                    if renames["interrupt"] == int(k):
                        raise KeyboardInterrupt
            if settings.get("WRITE_LOG"):
                with open(settings["WRITE_LOG"], "a") as log:
                    log.write(f"{settings.get('RANK', '-')} {os.fspath(dst)}\n")
            return replace(src, dst, *args, **kwargs)
        return logged_replace
    patcher.wrap("os", "replace", make)


@hook("SIGNAL_AT_REPLACE", in_process=False)
def _signal_at_replace(settings, patcher):
    name, k = settings["SIGNAL_AT_REPLACE"].split(":")
    renames = [0]

    def make(replace):
        def signalling_replace(src, dst, *args, **kwargs):
            if os.path.basename(os.fspath(dst)) == name:
                renames[0] += 1
                if renames[0] == int(k):
                    os.kill(os.getpid(), getattr(signal, settings.get("SIGNAL_NAME", "SIGTERM")))
            return replace(src, dst, *args, **kwargs)
        return signalling_replace
    patcher.wrap("os", "replace", make)


def _stop_requested() -> int:
    """The stop signal the run's StopSignals (src/stopping.py) has noted, read from its handler."""
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, "__self__", None), "requested", 0)


def _on_step(patcher, n, action):
    """Run action() at the n-th optimizer step of this process (SGD's or AdamW's)."""
    for optimizer in ("SGD", "AdamW"):
        count = [0]

        def make(step, count=count):
            def counted(self, *args, **kwargs):
                count[0] += 1
                if count[0] == n:
                    action()
                return step(self, *args, **kwargs)
            return counted
        patcher.wrap("torch.optim", f"{optimizer}.step", make)


def _first_attempt(settings) -> bool:
    return settings.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


@hook("KILL_AT_STEP", in_process=False)
def _kill_at_step(settings, patcher):
    if _rank(settings) != settings.get("KILL_RANK", "1") or not _first_attempt(settings):
        return

    senders: list = []  # the trackers' sending threads (src.tracking._Sender) of this process

    def register(original):
        def init(self, *args, **kwargs):
            original(self, *args, **kwargs)
            senders.append(self)
        return init
    patcher.wrap("src.tracking", "_Sender.__init__", register)

    def die():
        for thread in threading.enumerate():  # a step checkpoint still being written lands first:
            if thread.name == "checkpoint writer":  # the kill comes between two saves, always the same
                thread.join()
        for sender in senders:  # and the step reports queued so far are sent: which reports the
            sender.wait()  # tracked run holds does not depend on how fast the store answered
        if settings.get("KILL_LOG"):
            with open(settings["KILL_LOG"], "w") as log:
                log.write(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    _on_step(patcher, int(settings["KILL_AT_STEP"]), die)


@hook("KILL_AT_SHARD", in_process=False)
def _kill_at_shard(settings, patcher):
    if _rank(settings) != settings.get("KILL_RANK", "1") or not _first_attempt(settings):
        return
    shards = [0]

    def make(write):
        def write_data(self, *args, **kwargs):
            shards[0] += 1
            if shards[0] == int(settings["KILL_AT_SHARD"]):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, *args, **kwargs)
        return write_data
    patcher.wrap("src.sharded_checkpoint", "_Writer.write_data", make)


@hook("INTERRUPT_AT_STEP", in_process=False)
def _interrupt_at_step(settings, patcher):
    if _rank(settings) == "0":
        _on_step(patcher, int(settings["INTERRUPT_AT_STEP"]), lambda: os.kill(os.getpid(), signal.SIGINT))


@hook("SIGNAL_AT_STEP", in_process=False)
def _signal_at_step(settings, patcher):
    if _rank(settings) != settings.get("SIGNAL_RANK", "0") or not _first_attempt(settings):
        return

    def send():
        to_parent = settings.get("SIGNAL_TO", "self") == "parent"
        os.kill(os.getppid() if to_parent else os.getpid(), getattr(signal, settings.get("SIGNAL_NAME", "SIGTERM")))
        waited = 0.0
        while to_parent and not _stop_requested() and waited < 30:
            time.sleep(0.01)
            waited += 0.01
    _on_step(patcher, int(settings["SIGNAL_AT_STEP"]), send)


def _beaten() -> None:
    """Wait until this rank's heartbeat thread (src/heartbeat.py, which looks every 0.25 s) has
    written the place its main thread is at now into the launcher's store: the place the others
    then name is this one, however busy the machine."""
    import json
    thread = next((thread for thread in threading.enumerate() if thread.name == "heartbeat"), None)
    if thread is None:
        return
    heartbeat = thread._target.__self__  # the Heartbeat whose _run the thread runs
    from src.heartbeat import described
    want = described(heartbeat.place)["where"]
    key = f"beat/{heartbeat.rank}"
    while not (heartbeat.store.check([key]) and json.loads(heartbeat.store.get(key))["where"] == want):
        time.sleep(0.05)


@hook("STOP_AT_STEP", in_process=False)
def _stop_at_step(settings, patcher):
    if _rank(settings) != settings.get("STOP_RANK", "1"):
        return

    def stop():
        _beaten()
        with open(settings["STOP_LOG"], "w") as log:
            log.write(f"{os.getpid()} {time.time()}\n")
        os.kill(os.getpid(), signal.SIGSTOP)
    _on_step(patcher, int(settings["STOP_AT_STEP"]), stop)


@hook("RAY_AT_STEP", in_process=False)
def _ray_at_step(settings, patcher):
    signals = []  # the StopSignals of this process (train_ray.py's run makes one)

    def make(init):
        def recorded(self, *args, **kwargs):
            init(self, *args, **kwargs)
            signals.append(self)
        return recorded
    patcher.wrap("src.stopping", "StopSignals.__init__", make)

    def act():
        log = settings["RAY_LOG"]
        if os.environ.get("RANK", "0") != settings.get("RAY_RANK", "0") or os.path.exists(log):
            return
        with open(log, "w") as file:
            file.write(f"{os.getpid()} {time.time()}\n")
        if settings.get("RAY_ACTION") == "stop":  # a worker that stops answering without dying
            _beaten()
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        if settings.get("RAY_ACTION", "kill") == "kill":
            waited = 0.0  # until Ray Train has taken in a checkpoint reported (RAY_REPORTED, a storage_path)
            while (settings.get("RAY_REPORTED") and not glob.glob(f"{settings['RAY_REPORTED']}/*/checkpoint_manager_snapshot.json")
                   and waited < 120):
                time.sleep(0.01)
                waited += 0.01
            if settings.get("RAY_REMOVE"):
                os.remove(settings["RAY_REMOVE"])
            os.kill(os.getpid(), signal.SIGKILL)
        with open(settings["RAY_DRIVER_PID_FILE"]) as file:
            os.kill(int(file.read()), signal.SIGTERM)
        waited = 0.0
        while not any(stops.requested for stops in signals) and waited < 120:
            time.sleep(0.01)
            waited += 0.01
    _on_step(patcher, int(settings["RAY_AT_STEP"]), act)


@hook("BEAT_LOG")
def _log_beats(settings, patcher):
    entered = []  # the heartbeats this process entered

    def make(enter):
        def recorded(self):
            entered.append(self)
            return enter(self)
        return recorded
    patcher.wrap("src.heartbeat", "Heartbeat.__enter__", make)

    def log():
        import json

        from src.heartbeat import read_beats
        beat = entered[-1]
        import torch
        import torch.distributed as dist
        beats = None if beat.store is None else read_beats(beat.store, beat.world_size)
        group = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))  # gloo's
        with open(settings["BEAT_LOG"], "a") as file:
            file.write(json.dumps({"rank": beat.rank, "world_size": beat.world_size, "timeout_s": beat.timeout_s,
                                   "group_timeout_s": group.options._timeout.total_seconds(), "beats": beats}) + "\n")
    _on_step(patcher, int(settings.get("BEAT_AT_STEP", "1")), log)


@hook("KILL_IN_WRITE", in_process=False)
def _kill_in_write(settings, patcher):
    name, k = settings["KILL_IN_WRITE"].split(":")
    writes = [0]

    def make(atomic_write):
        def killed_in(path, write, *args, **kwargs):
            if os.path.basename(os.fspath(path)) != name:
                return atomic_write(path, write, *args, **kwargs)
            writes[0] += 1
            if writes[0] != int(k):
                return atomic_write(path, write, *args, **kwargs)

            def half(file):
                file.write(b"PK\x03\x04 half of a checkpoint")
                file.flush()
                os.fsync(file.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return atomic_write(path, half, *args, **kwargs)
        return killed_in
    patcher.wrap("src.outputs", "atomic_write", make)


@hook("FAKE_GPUS", in_process=False)
def _fake_gpus(settings, patcher):
    patcher.wrap("torch", "cuda.is_available", lambda original: lambda: True)
    patcher.wrap("torch", "cuda.device_count", lambda original: lambda: int(settings["FAKE_GPUS"]))


@hook("ACCELERATOR_LOG")
def _log_accelerator(settings, patcher):
    def make(accelerator_class):
        class Logged(accelerator_class):
            def __init__(self, *args, **kwargs):
                config = kwargs.get("dataloader_config")
                with open(settings["ACCELERATOR_LOG"], "a") as log:
                    log.write(f"{_rank(settings)} split_batches={config.split_batches} "
                              f"non_blocking={config.non_blocking}\n")
                super().__init__(*args, **kwargs)
        return Logged
    patcher.wrap("accelerate", "Accelerator", make)


@hook("SLOW_ITEM")
def _slow_items(settings, patcher):
    def make(get):
        def slow_get(self, index):
            time.sleep(float(settings["SLOW_ITEM"]))
            return get(self, index)
        return slow_get
    patcher.wrap("src.datasets", "DogCatDataset.__getitem__", make)


@hook("SLOW_TRACKER_END")
def _slow_tracker_end(settings, patcher):
    def make(finish):
        def slow_finish(self, *args, **kwargs):
            time.sleep(float(settings["SLOW_TRACKER_END"]))
            return finish(self, *args, **kwargs)
        return slow_finish
    patcher.wrap("src.tracking", "_MLflow.finish", make)


@hook("SCAN_LOG")
def _log_scans(settings, patcher):
    def make(scan):
        def logged_scan(*args, **kwargs):
            with open(settings["SCAN_LOG"], "a") as log:
                log.write(f"{_rank(settings)}\n")
            return scan(*args, **kwargs)
        return logged_scan
    patcher.wrap("src.datasets", "scan_train_dir", make)


@hook("APPEAR_AFTER_LISTING")
def _appear_after_listing(settings, patcher):
    new, source = settings["APPEAR_AFTER_LISTING"].split(":")
    rank = _rank(settings)

    def make(listing):
        def listed(*args, **kwargs):
            if rank != "0":
                deadline = time.time() + 60
                while not os.path.exists(new) and time.time() < deadline:
                    time.sleep(0.05)
            found = listing(*args, **kwargs)
            if rank == "0" and not os.path.exists(new):
                import shutil
                shutil.copy(source, new + ".part")
                os.replace(new + ".part", new)
            return found
        return listed
    patcher.wrap("src.image_files", "find_images", make)
    patcher.wrap("src.inference", "kaggle_test_files", make)


@hook("AUGMENT_SEED_SHIFT")
def _shift_augment_seed(settings, patcher):
    shift = int(settings["AUGMENT_SEED_SHIFT"])
    patcher.wrap("src.augment", "crop_params", lambda params: lambda seed, *rest: params(seed + shift, *rest))


@hook("NO_RESHUFFLE")
def _no_reshuffle(settings, patcher):
    def make(iterate):
        def first_order_always(self):  # the generator's state at the first epoch, at every epoch
            if not hasattr(self, "first_state"):
                self.first_state = self.generator.get_state()
            self.generator.set_state(self.first_state)
            return iterate(self)
        return first_order_always
    patcher.wrap("torch.utils.data", "RandomSampler.__iter__", make)


@hook("BATCH_MIXING")
def _batch_mixing(settings, patcher):
    import torch
    mixers = {}

    def no_sample_mixing(mixer):
        mixers["make"] = mixer
        return lambda args: None  # TrainSplit's per-sample mixing off
    patcher.wrap("src.augment", "mixer", no_sample_mixing)

    def make(training):
        def mixed(self, loader, epoch, sums):
            mixing = mixers["make"](self.args)
            for micro, (images, labels, keys) in training(self, loader, epoch, sums):
                images, targets = mixing(images.float(), labels)  # the reference's collate_fn, on this process's batch
                yield micro, (images.round().clamp(0, 255).to(torch.uint8), targets, keys)
        return mixed
    patcher.wrap("src.progress", "Progress.training", make)


@hook("COPY_LAST")
def _copy_last(settings, patcher):
    import shutil
    copies = [0]

    def make(replace):
        def replace_and_copy(src, dst, *args, **kwargs):
            result = replace(src, dst, *args, **kwargs)
            if os.path.basename(os.fspath(dst)) == "last.pth":
                copies[0] += 1
                os.makedirs(settings["COPY_LAST"], exist_ok=True)
                shutil.copy(dst, os.path.join(settings["COPY_LAST"], f"last.{copies[0]}.pth"))
            if os.path.basename(os.fspath(dst)) == "last.dcp":
                copies[0] += 1
                shutil.copytree(dst, os.path.join(settings["COPY_LAST"], f"last.{copies[0]}.dcp"))
            return result
        return replace_and_copy
    patcher.wrap("os", "replace", make)


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


@hook("COMPILE_LOG")
def _log_compiled(settings, patcher):
    _watch_training(patcher)
    before = _compiled_graphs() if "torch._dynamo" in sys.modules else 0  # an in-process run's own

    def write():
        if not _trained():
            return
        with open(settings["COMPILE_LOG"], "w") as log:
            log.write(f"{_compiled_graphs() - before}\n")
    patcher.at_end(write)


SYNC_MESSAGE = "called a synchronizing CUDA operation"  # c10's, for each one in "warn" mode


def sync_site(stack: list) -> str:
    """Where a synchronisation came from, innermost first: the last six frames of `stack`
    (traceback.extract_stack(), the warnings module's left out), each as file:line function,
    paths from the site-packages or the repository on."""
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

    def short(frame) -> str:
        path = frame.filename.split("site-packages/")[-1]
        return f"{os.path.relpath(path, here) if path.startswith(here) else path}:{frame.lineno} {frame.name}"
    stack = [frame for frame in stack if not frame.filename.endswith(os.sep + "warnings.py")]
    return " < ".join(short(frame) for frame in reversed(stack[-6:]))


class SyncRecord:
    """The synchronisations this process made in its sync windows: the control read-backs, and
    each other one counted by the place it came from (sync_site). Its showwarning stands in for
    warnings.showwarning, which gets every other warning (`shown`)."""

    def __init__(self, rank: str, shown):
        self.record = {"rank": rank, "passes": 0, "windows": 0, "control": 0, "syncs": {}}
        self.shown = shown

    def showwarning(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_MESSAGE not in str(message):
            return self.shown(message, category, filename, lineno, file, line)
        import traceback
        stack = traceback.extract_stack()[:-1]
        if any(frame.name == "_control_sync" for frame in stack):
            self.record["control"] += 1
        else:
            where = sync_site(stack)
            self.record["syncs"][where] = self.record["syncs"].get(where, 0) + 1

    def write(self, path: str) -> None:
        import json
        with open(f"{path}.{self.record['rank']}", "w") as log:
            json.dump(self.record, log, indent=1)


def _control_sync():
    """A read-back of a CUDA tensor: a synchronisation the record must show."""
    import torch
    return torch.ones(1, device="cuda").item()


@hook("SYNC_CHECK_STEPS", in_process=False)
def _check_syncs(settings, patcher):
    _watch_training(patcher)
    import warnings
    syncs = SyncRecord(_rank(settings), warnings.showwarning)
    warnings.showwarning = syncs.showwarning
    warnings.filterwarnings("always", message=".*" + SYNC_MESSAGE)  # each one, not once per place
    if settings.get("SYNC_LOG"):
        patcher.at_end(lambda: syncs.write(settings["SYNC_LOG"]) if _trained() else None)
    first, last = map(int, settings["SYNC_CHECK_STEPS"].split(":"))

    def make(passing):
        def checked(self, loader, desc, sums, start, total, epoch, profiler):
            import torch
            training = epoch is not None
            syncs.record["passes"] += training
            watched = training and torch.cuda.is_available()
            try:
                for index, batch in passing(self, loader, desc, sums, start, total, epoch, profiler):
                    if watched and index == first:
                        torch.cuda.set_sync_debug_mode("warn")
                        syncs.record["windows"] += 1
                        _control_sync()
                    elif watched and index == last:
                        torch.cuda.set_sync_debug_mode("default")
                    yield index, batch
            finally:
                if watched:
                    torch.cuda.set_sync_debug_mode("default")
        return checked
    patcher.wrap("src.progress", "Progress._pass", make)


def log_dtypes(functional, path, rank: str) -> None:
    """functional.cross_entropy (torch.nn.functional's) appending "RANK DTYPE" to `path` for each
    dtype of the logits it gets, once."""
    cross_entropy, seen = functional.cross_entropy, set()

    def logged(input, *args, **kwargs):
        if input.dtype not in seen:
            seen.add(input.dtype)
            with open(path, "a") as log:
                log.write(f"{rank} {str(input.dtype).removeprefix('torch.')}\n")
        return cross_entropy(input, *args, **kwargs)
    functional.cross_entropy = logged


@hook("DTYPE_LOG", in_process=False)
def _log_dtypes(settings, patcher):
    import torch.nn.functional
    log_dtypes(torch.nn.functional, settings["DTYPE_LOG"], _rank(settings))


def counting_backend(backend, counts: dict):
    """A torch.compile backend that compiles with `backend` (a name or a function) and counts, in
    `counts`, the graphs and the conv2d and linear calls that run inside them."""
    def compile_graph(graph, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend
        targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
        ops = {kind: sum(kind in target for target in targets) for kind in ("conv2d", "linear")}
        compiled = (lookup_backend(backend) if isinstance(backend, str) else backend)(graph, example_inputs)
        counts["graphs"] += 1

        def run(*args):
            for kind, number in ops.items():
                counts[kind] += number
            return compiled(*args)
        run._boxed_call = getattr(compiled, "_boxed_call", False)  # how dynamo passes the inputs
        return run
    return compile_graph


@hook("COMPILE_OPS_LOG", in_process=False)
def _count_compiled_ops(settings, patcher):
    _watch_training(patcher)
    import json

    import torch
    rank = _rank(settings)
    counts = {"rank": rank, "graphs": 0, "conv2d": 0, "linear": 0, "forwards": 0}

    def make(compile_):
        def counting_compile(model=None, **options):
            backend = settings.get("COMPILE_BACKEND") or options.get("backend") or "inductor"
            options["backend"] = counting_backend(backend, counts)
            compiled = compile_(model, **options)
            if isinstance(model, torch.nn.Module) and "conv2d modules" not in counts:  # the scripts' root
                inner = getattr(model, "module", model)  # DDP's
                counts["conv2d modules"] = sum(isinstance(m, torch.nn.Conv2d) for m in inner.modules())
                counts["linear modules"] = sum(isinstance(m, torch.nn.Linear) for m in inner.modules())

                class Counted(type(compiled)):
                    def __call__(self, *args, **kwargs):
                        counts["forwards"] += 1
                        return super().__call__(*args, **kwargs)
                compiled.__class__ = Counted
            return compiled
        return counting_compile
    patcher.wrap("torch", "compile", make)

    def write():
        if not _trained():
            return
        with open(f"{settings['COMPILE_OPS_LOG']}.{rank}", "w") as log:
            json.dump(counts, log)
    patcher.at_end(write)


@hook("TF32_LOG", in_process=False)
def _log_tf32(settings, patcher):
    def log_tf32(when: str) -> None:
        import torch
        with open(settings["TF32_LOG"], "a") as log:
            log.write(f"{_rank(settings)} {when} {torch.backends.cuda.matmul.allow_tf32}\n")

    def make(accelerator_class):
        class Logged(accelerator_class):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                log_tf32("accelerator")
        return Logged
    patcher.wrap("accelerate", "Accelerator", make)
    _on_step(patcher, 1, lambda: log_tf32("step"))


def log_targets(functional, path, rank: str) -> None:
    """functional.cross_entropy (torch.nn.functional's) appending "RANK soft" or "RANK hard" to
    `path` once for each kind of target it gets: probabilities (floating point) or class indices."""
    cross_entropy, seen = functional.cross_entropy, set()

    def logged(input, target, *args, **kwargs):
        kind = "soft" if target.is_floating_point() else "hard"
        if kind not in seen:
            seen.add(kind)
            with open(path, "a") as log:
                log.write(f"{rank} {kind}\n")
        return cross_entropy(input, target, *args, **kwargs)
    functional.cross_entropy = logged


@hook("TARGETS_LOG", in_process=False)
def _log_targets(settings, patcher):
    import torch.nn.functional
    log_targets(torch.nn.functional, settings["TARGETS_LOG"], _rank(settings))


def _nvidia_smi_mib_on_gpu0(torch) -> float | None:
    """This process's memory on its GPU 0 as nvidia-smi lists it, None where it lists no such process
    (no nvidia-smi, or a container that shows other pids)."""
    import subprocess
    try:
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        rows = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    except Exception:  # no nvidia-smi, or a torch whose properties have no uuid
        return None
    for row in rows.splitlines():
        parts = [part.strip() for part in row.split(",")]
        if len(parts) == 3 and parts[0] == str(os.getpid()) and uuid in parts[1]:
            return float(parts[2])
    return None


@hook("MEMORY_LOG", in_process=False)
def _log_memory(settings, patcher):
    _watch_training(patcher)
    import json

    import torch
    record = {"rank": _rank(settings)}

    def cuda() -> bool:
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def make(method, first: dict):
        def recorded(self, *args, **kwargs):
            if cuda() and not first:
                first.update({"peak": torch.cuda.max_memory_allocated(), "held": torch.cuda.memory_allocated()})
            return method(self, *args, **kwargs)
        return recorded
    saved_step, saved_epoch = {}, {}
    patcher.wrap("src.state", "TrainingState.save_step", lambda method: make(method, saved_step))
    patcher.wrap("src.state", "TrainingState.save_epoch", lambda method: make(method, saved_epoch))

    def write():
        if not _trained():
            return
        if cuda():
            record["device"] = torch.cuda.current_device()
            has = getattr(torch._C, "_cuda_hasPrimaryContext", None)
            record["contexts"] = ([gpu for gpu in range(torch.cuda.device_count()) if has(gpu)]
                                  if has is not None else None)
            if saved_step:
                record["peak before the first step checkpoint"] = saved_step["peak"]
                record["held at the first step checkpoint"] = saved_step["held"]
            if saved_epoch:
                record["peak through the first epoch"] = saved_epoch["peak"]
            mib = _nvidia_smi_mib_on_gpu0(torch)
            if mib is not None:
                record["MiB on GPU 0"] = mib
        else:
            record.update({"device": "cpu", "contexts": []})
        with open(f"{settings['MEMORY_LOG']}.{record['rank']}", "w") as log:
            json.dump(record, log, indent=1)
    patcher.at_end(write)


# The next three are functions as well, for the tests that train in their own process (monkeypatch).

def overflowing(scaler_class, steps: set):
    """(_unscale_grads_, step) for scaler_class that skip the optimizer steps `steps` (OVERFLOW_AT)."""
    unscale, step = scaler_class._unscale_grads_, scaler_class.step

    def _unscale_grads_(self, *args, **kwargs):  # once per optimizer step of an enabled scaler
        found = unscale(self, *args, **kwargs)
        self.steps_checked = getattr(self, "steps_checked", 0) + 1
        if self.steps_checked in steps:
            for flag in found.values():
                flag.fill_(1.0)  # on the device: no host synchronisation
        return found

    def disabled_step(self, optimizer, *args, **kwargs):
        if self.is_enabled():
            return step(self, optimizer, *args, **kwargs)
        self.steps_checked = getattr(self, "steps_checked", 0) + 1
        return None if self.steps_checked in steps else optimizer.step(*args, **kwargs)
    return _unscale_grads_, disabled_step


def poisoning(optimizer_class, n: int):
    """optimizer_class.step that, after the n-th step, sets every weight it steps to NaN (NAN_AT_STEP)."""
    return _poisoned(optimizer_class.step, n)


def _poisoned(step, n: int):
    count = [0]

    def poisoned(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        count[0] += 1
        if count[0] == n:
            import torch
            with torch.no_grad():
                for group in self.param_groups:
                    for param in group["params"]:
                        param.fill_(float("nan"))
        return result
    return poisoned


def fp16_as_on_cuda(accelerator_class):
    """An Accelerator that, with fp16 on the CPU, autocasts and makes its GradScaler as accelerate
    does on CUDA (AS_ON_GPU)."""
    class Accelerator(accelerator_class):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if self.mixed_precision == "fp16" and self.device.type == "cpu":
                import torch
                self.native_amp, self.scaler = True, torch.amp.GradScaler("cpu")
    return Accelerator


@hook("OVERFLOW_AT")
def _overflow_at(settings, patcher):
    import torch
    skipped = {int(step) for step in settings["OVERFLOW_AT"].split(",")}
    unscale, step = overflowing(torch.amp.GradScaler, skipped)
    patcher.wrap("torch.amp", "GradScaler._unscale_grads_", lambda original: unscale)
    patcher.wrap("torch.amp", "GradScaler.step", lambda original: step)

    def make(accelerated_step):  # accelerate has no scaler but for fp16
        def skipping(self, closure=None):
            if self.scaler is None and self.gradient_state.sync_gradients:
                self.steps_checked = getattr(self, "steps_checked", 0) + 1
                if self.steps_checked in skipped:
                    return None
            return accelerated_step(self, closure)
        return skipping
    patcher.wrap("accelerate", "optimizer.AcceleratedOptimizer.step", make)


@hook("NAN_AT_STEP")
def _nan_at_step(settings, patcher):
    if settings.get("NAN_RANK", _rank(settings)) != _rank(settings):
        return
    for optimizer in ("SGD", "AdamW"):
        patcher.wrap("torch.optim", f"{optimizer}.step", lambda step: _poisoned(step, int(settings["NAN_AT_STEP"])))


@hook("AS_ON_GPU")
def _accelerate_as_on_gpu(settings, patcher):
    if settings["AS_ON_GPU"] == "1":
        patcher.wrap("accelerate", "Accelerator", fp16_as_on_cuda)


@hook("FLOAT64")
def _float64(settings, patcher):
    if settings["FLOAT64"] != "1":
        return
    patcher.wrap("src.models", "build_model", lambda build: lambda *args, **kwargs: build(*args, **kwargs).double())
    patcher.wrap("src.transforms", "model_inputs",
                 lambda to_model: lambda *args, **kwargs: to_model(*args, **kwargs).double())


@hook("PER_PROCESS_DROPOUT")
def _per_process_dropout(settings, patcher):
    if settings["PER_PROCESS_DROPOUT"] == "1":
        patcher.wrap("src.dropout", "per_sample", lambda original: lambda model: model)


if __name__ == "sitecustomize":  # imported by Python as it starts (not as hooks.sitecustomize by a test)
    install(os.environ, AtImport())
