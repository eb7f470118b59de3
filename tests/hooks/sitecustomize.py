"""Test hooks, loaded by every Python process whose PYTHONPATH holds this folder. Each is off
unless its variable is set.

WRITE_LOG=path: log "RANK file" for each os.replace. All our outputs are written to a temporary
name and renamed into place, so this lists every output file write and the rank that made it.

KILL_AT_STEP=n (with KILL_RANK=r, KILL_LOG=path): the process of rank r writes the time to
KILL_LOG and SIGKILLs itself at its n-th optimizer step, in the first attempt only
(TORCHELASTIC_RESTART_COUNT 0): a worker dying mid-epoch.

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
STOP_AT_STEP=n (with STOP_RANK=r, STOP_LOG=path): the process of rank r writes "PID TIME" to
STOP_LOG and stops itself with SIGSTOP at its n-th optimizer step (a rank that stops answering
without dying; whoever reads STOP_LOG kills it).

FAKE_GPUS=n: torch reports n CUDA GPUs, for the checks that run before anything touches a GPU
(in the processes that torchrun starts; in-process tests monkeypatch torch.cuda instead).

ACCELERATOR_LOG=path: write the DataLoaderConfiguration that train_accelerate.py gives accelerate.

SLOW_ITEM=seconds: every training or validation image takes that long to load.
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
COMPILE_LOG=path: at exit, write how many frames torch.compile compiled.
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
TF32_LOG=path: torch.backends.cuda.matmul.allow_tf32 ("RANK WHEN VALUE"), right after accelerate's
Accelerator() is made (WHEN accelerator) and at the first optimizer step (step).

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
import importlib.abc
import importlib.util
import os
import signal
import sys
import time

RANK = os.environ.get("RANK", "0")


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


if os.environ.get("WRITE_LOG") or os.environ.get("INTERRUPT_AT_REPLACE") or os.environ.get("SIGNAL_AT_REPLACE"):
    _replace, _renames = os.replace, {}

    def _logged_replace(src, dst, *args, **kwargs):
        for variable in ("INTERRUPT_AT_REPLACE", "SIGNAL_AT_REPLACE"):
            if os.environ.get(variable):
                name, k = os.environ[variable].split(":")
                if os.path.basename(os.fspath(dst)) == name:
                    _renames[variable] = _renames.get(variable, 0) + 1
                    if _renames[variable] == int(k) and variable == "INTERRUPT_AT_REPLACE":
                        raise KeyboardInterrupt
                    if _renames[variable] == int(k):
                        os.kill(os.getpid(), getattr(signal, os.environ.get("SIGNAL_NAME", "SIGTERM")))
        if os.environ.get("WRITE_LOG"):
            with open(os.environ["WRITE_LOG"], "a") as log:
                log.write(f"{os.environ.get('RANK', '-')} {os.fspath(dst)}\n")
        return _replace(src, dst, *args, **kwargs)

    os.replace = _logged_replace


def _stop_requested() -> int:
    """The stop signal the run's StopSignals (src/stopping.py) has noted, read from its handler."""
    handler = signal.getsignal(signal.SIGTERM)
    return getattr(getattr(handler, "__self__", None), "requested", 0)


def _on_step(n, action):
    """Run action() at the n-th optimizer step of this process."""
    import torch
    for optimizer in (torch.optim.SGD, torch.optim.AdamW):
        step, count = optimizer.step, [0]

        def counted(self, *args, _step=step, _count=count, **kwargs):
            _count[0] += 1
            if _count[0] == n:
                action()
            return _step(self, *args, **kwargs)
        optimizer.step = counted


if (os.environ.get("KILL_AT_STEP") and RANK == os.environ.get("KILL_RANK", "1")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    def _die():
        if os.environ.get("KILL_LOG"):
            with open(os.environ["KILL_LOG"], "w") as log:
                log.write(f"{time.time()}\n")
        os.kill(os.getpid(), signal.SIGKILL)
    _on_step(int(os.environ["KILL_AT_STEP"]), _die)

if (os.environ.get("KILL_AT_SHARD") and RANK == os.environ.get("KILL_RANK", "1")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    def _kill_at_shard(sharded):
        write, shards = sharded._Writer.write_data, [0]

        def write_data(self, *args, **kwargs):
            shards[0] += 1
            if shards[0] == int(os.environ["KILL_AT_SHARD"]):
                os.kill(os.getpid(), signal.SIGKILL)
            return write(self, *args, **kwargs)
        sharded._Writer.write_data = write_data
    _after_import("src.sharded_checkpoint", _kill_at_shard)

if os.environ.get("INTERRUPT_AT_STEP") and RANK == "0":
    _on_step(int(os.environ["INTERRUPT_AT_STEP"]), lambda: os.kill(os.getpid(), signal.SIGINT))

if (os.environ.get("SIGNAL_AT_STEP") and RANK == os.environ.get("SIGNAL_RANK", "0")
        and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
    def _send():
        to_parent = os.environ.get("SIGNAL_TO", "self") == "parent"
        os.kill(os.getppid() if to_parent else os.getpid(), getattr(signal, os.environ.get("SIGNAL_NAME", "SIGTERM")))
        waited = 0.0
        while to_parent and not _stop_requested() and waited < 30:
            time.sleep(0.01)
            waited += 0.01
    _on_step(int(os.environ["SIGNAL_AT_STEP"]), _send)

if os.environ.get("STOP_AT_STEP") and RANK == os.environ.get("STOP_RANK", "1"):
    def _stop():
        with open(os.environ["STOP_LOG"], "w") as log:
            log.write(f"{os.getpid()} {time.time()}\n")
        time.sleep(1)  # src/heartbeat.py's thread writes this step as the rank's place (it looks every 0.25 s)
        os.kill(os.getpid(), signal.SIGSTOP)
    _on_step(int(os.environ["STOP_AT_STEP"]), _stop)

if os.environ.get("KILL_IN_WRITE"):
    def _kill_in_write(outputs):
        name, k = os.environ["KILL_IN_WRITE"].split(":")
        atomic_write, writes = outputs.atomic_write, [0]

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
        outputs.atomic_write = killed_in
    _after_import("src.outputs", _kill_in_write)

if os.environ.get("FAKE_GPUS"):
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: int(os.environ["FAKE_GPUS"])

if os.environ.get("ACCELERATOR_LOG"):
    def _log_accelerator(accelerate):
        class Logged(accelerate.Accelerator):
            def __init__(self, *args, **kwargs):
                config = kwargs.get("dataloader_config")
                with open(os.environ["ACCELERATOR_LOG"], "a") as log:
                    log.write(f"{RANK} split_batches={config.split_batches} non_blocking={config.non_blocking}\n")
                super().__init__(*args, **kwargs)
        accelerate.Accelerator = Logged
    _after_import("accelerate", _log_accelerator)

if os.environ.get("SLOW_ITEM"):
    def _slow(datasets):
        get = datasets.DogCatDataset.__getitem__

        def slow_get(self, index):
            time.sleep(float(os.environ["SLOW_ITEM"]))
            return get(self, index)
        datasets.DogCatDataset.__getitem__ = slow_get
    _after_import("src.datasets", _slow)

if os.environ.get("SCAN_LOG"):
    def _log_scans(datasets):
        scan = datasets.scan_train_dir

        def logged_scan(*args, **kwargs):
            with open(os.environ["SCAN_LOG"], "a") as log:
                log.write(f"{RANK}\n")
            return scan(*args, **kwargs)
        datasets.scan_train_dir = logged_scan
    _after_import("src.datasets", _log_scans)

if os.environ.get("APPEAR_AFTER_LISTING"):
    _new, _source = os.environ["APPEAR_AFTER_LISTING"].split(":")

    def _appearing(listing):
        def listed(*args, **kwargs):
            if RANK != "0":
                deadline = time.time() + 60
                while not os.path.exists(_new) and time.time() < deadline:
                    time.sleep(0.05)
            found = listing(*args, **kwargs)
            if RANK == "0" and not os.path.exists(_new):
                import shutil
                shutil.copy(_source, _new + ".part")
                os.replace(_new + ".part", _new)
            return found
        return listed
    _after_import("src.image_files", lambda module: setattr(module, "find_images", _appearing(module.find_images)))
    _after_import("src.inference",
                  lambda module: setattr(module, "kaggle_test_files", _appearing(module.kaggle_test_files)))

if os.environ.get("AUGMENT_SEED_SHIFT"):
    def _shift(augment):
        params = augment.crop_params
        augment.crop_params = lambda seed, *rest: params(seed + int(os.environ["AUGMENT_SEED_SHIFT"]), *rest)
    _after_import("src.augment", _shift)

if os.environ.get("BATCH_MIXING"):
    _mixers = {}

    def _no_sample_mixing(augment):
        _mixers["make"] = augment.mixer
        augment.mixer = lambda args: None  # TrainSplit's per-sample mixing off
    _after_import("src.augment", _no_sample_mixing)

    def _mix_local_batches(progress):
        import torch
        training = progress.Progress.training

        def mixed(self, loader, epoch, sums):
            mixing = _mixers["make"](self.args)
            for micro, (images, labels, keys) in training(self, loader, epoch, sums):
                images, targets = mixing(images.float(), labels)  # the reference's collate_fn, on this process's batch
                yield micro, (images.round().clamp(0, 255).to(torch.uint8), targets, keys)
        progress.Progress.training = mixed
    _after_import("src.progress", _mix_local_batches)

if os.environ.get("NO_RESHUFFLE"):
    import torch.utils.data as _data
    _iterate = _data.RandomSampler.__iter__

    def _first_order_always(self):  # the generator's state at the first epoch, at every epoch
        if not hasattr(self, "first_state"):
            self.first_state = self.generator.get_state()
        self.generator.set_state(self.first_state)
        return _iterate(self)
    _data.RandomSampler.__iter__ = _first_order_always

if os.environ.get("COPY_LAST"):
    import shutil
    _replace_and_copy, _copies = os.replace, [0]

    def _copy_last(src, dst, *args, **kwargs):
        result = _replace_and_copy(src, dst, *args, **kwargs)
        if os.path.basename(os.fspath(dst)) == "last.pth":
            _copies[0] += 1
            os.makedirs(os.environ["COPY_LAST"], exist_ok=True)
            shutil.copy(dst, os.path.join(os.environ["COPY_LAST"], f"last.{_copies[0]}.pth"))
        if os.path.basename(os.fspath(dst)) == "last.dcp":
            _copies[0] += 1
            shutil.copytree(dst, os.path.join(os.environ["COPY_LAST"], f"last.{_copies[0]}.dcp"))
        return result
    os.replace = _copy_last

if os.environ.get("COMPILE_LOG"):
    import atexit

    def _write_compiled():
        from torch._dynamo.utils import counters
        with open(os.environ["COMPILE_LOG"], "w") as log:
            log.write(f"{counters['stats']['unique_graphs']}\n")
    atexit.register(_write_compiled)

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


if os.environ.get("SYNC_CHECK_STEPS"):
    import atexit
    import warnings
    _syncs = SyncRecord(RANK, warnings.showwarning)
    warnings.showwarning = _syncs.showwarning
    warnings.filterwarnings("always", message=".*" + SYNC_MESSAGE)  # each one, not once per place
    if os.environ.get("SYNC_LOG"):
        atexit.register(_syncs.write, os.environ["SYNC_LOG"])

    def _check_syncs(progress):
        passing = progress.Progress._pass
        first, last = map(int, os.environ["SYNC_CHECK_STEPS"].split(":"))

        def checked(self, loader, desc, sums, start, total, epoch, profiler):
            import torch
            training = epoch is not None
            _syncs.record["passes"] += training
            watched = training and torch.cuda.is_available()
            try:
                for index, batch in passing(self, loader, desc, sums, start, total, epoch, profiler):
                    if watched and index == first:
                        torch.cuda.set_sync_debug_mode("warn")
                        _syncs.record["windows"] += 1
                        _control_sync()
                    elif watched and index == last:
                        torch.cuda.set_sync_debug_mode("default")
                    yield index, batch
            finally:
                if watched:
                    torch.cuda.set_sync_debug_mode("default")
        progress.Progress._pass = checked
    _after_import("src.progress", _check_syncs)

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


if os.environ.get("DTYPE_LOG"):
    import torch.nn.functional
    log_dtypes(torch.nn.functional, os.environ["DTYPE_LOG"], RANK)


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


if os.environ.get("COMPILE_OPS_LOG"):
    import atexit
    import json

    import torch
    _compile, _counts = torch.compile, {"rank": RANK, "graphs": 0, "conv2d": 0, "linear": 0, "forwards": 0}

    def _counting_compile(model=None, **options):
        options["backend"] = counting_backend(options.get("backend") or "inductor", _counts)
        compiled = _compile(model, **options)
        if isinstance(model, torch.nn.Module) and "conv2d modules" not in _counts:  # the scripts' root
            inner = getattr(model, "module", model)  # DDP's
            _counts["conv2d modules"] = sum(isinstance(m, torch.nn.Conv2d) for m in inner.modules())
            _counts["linear modules"] = sum(isinstance(m, torch.nn.Linear) for m in inner.modules())

            class Counted(type(compiled)):
                def __call__(self, *args, **kwargs):
                    _counts["forwards"] += 1
                    return super().__call__(*args, **kwargs)
            compiled.__class__ = Counted
        return compiled
    torch.compile = _counting_compile

    def _write_ops():
        with open(f"{os.environ['COMPILE_OPS_LOG']}.{RANK}", "w") as log:
            json.dump(_counts, log)
    atexit.register(_write_ops)

if os.environ.get("TF32_LOG"):
    def _log_tf32(when: str) -> None:
        import torch
        with open(os.environ["TF32_LOG"], "a") as log:
            log.write(f"{RANK} {when} {torch.backends.cuda.matmul.allow_tf32}\n")

    def _tf32_after_accelerator(accelerate):
        class Logged(accelerate.Accelerator):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                _log_tf32("accelerator")
        accelerate.Accelerator = Logged
    _after_import("accelerate", _tf32_after_accelerator)
    _on_step(1, lambda: _log_tf32("step"))


# The next two are functions as well, for the tests that train in their own process (monkeypatch).

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
    step, count = optimizer_class.step, [0]

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


if os.environ.get("OVERFLOW_AT"):
    import torch
    _SKIPPED = {int(step) for step in os.environ["OVERFLOW_AT"].split(",")}
    torch.amp.GradScaler._unscale_grads_, torch.amp.GradScaler.step = overflowing(torch.amp.GradScaler, _SKIPPED)

    def _skip_without_a_scaler(accelerate):  # accelerate has no scaler but for fp16
        from accelerate.optimizer import AcceleratedOptimizer
        step = AcceleratedOptimizer.step

        def skipping(self, closure=None):
            if self.scaler is None and self.gradient_state.sync_gradients:
                self.steps_checked = getattr(self, "steps_checked", 0) + 1
                if self.steps_checked in _SKIPPED:
                    return None
            return step(self, closure)
        AcceleratedOptimizer.step = skipping
    _after_import("accelerate", _skip_without_a_scaler)

if os.environ.get("NAN_AT_STEP") and os.environ.get("NAN_RANK", RANK) == RANK:
    import torch
    for _optimizer in (torch.optim.SGD, torch.optim.AdamW):
        _optimizer.step = poisoning(_optimizer, int(os.environ["NAN_AT_STEP"]))

if os.environ.get("AS_ON_GPU") == "1":
    def _fp16_as_on_cuda(accelerate):
        accelerate.Accelerator = fp16_as_on_cuda(accelerate.Accelerator)
    _after_import("accelerate", _fp16_as_on_cuda)

if os.environ.get("FLOAT64") == "1":
    def _float64_models(models):
        build = models.build_model
        models.build_model = lambda *args, **kwargs: build(*args, **kwargs).double()
    _after_import("src.models", _float64_models)

    def _float64_inputs(transforms):
        to_model = transforms.model_inputs
        transforms.model_inputs = lambda *args, **kwargs: to_model(*args, **kwargs).double()
    _after_import("src.transforms", _float64_inputs)

if os.environ.get("PER_PROCESS_DROPOUT") == "1":
    def _per_process_dropout(dropout):
        dropout.per_sample = lambda model: model
    _after_import("src.dropout", _per_process_dropout)
