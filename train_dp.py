"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with nn.DataParallel over all GPUs."""
import time
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset

from src.augment import TrainSplit
from src.checkpoint import run_info
from src.cli import Config, amp_dtype, parse_args
from src.data_parallel import AutocastDataParallel, check_data_parallel
from src.devices import training_device
from src.dropout import set_samples
from src.ema import WeightAverage
from src.errors import exit_on_error
from src.freeze import epoch_stages
from src.history import done_line, format_record
from src.inference import load_evaluated, show_evaluation
from src.loaders import Data, check_batches, labelled_data, loader_options, skip_first_batches
from src.metrics import batch_sums
from src.models import build_model
from src.outputs import lock_outputs
from src.progress import Progress, run_header
from src.recipe import make_optimizer, make_schedule, optimizer_step, steps_per_epoch
from src.seeds import seed_epoch
from src.state import TrainingState
from src.tracking import Tracker, rank_0_tracker
from src.transforms import memory_format, model_inputs


def loaders(dataset: Dataset, data: Data, args: Config, device: torch.device) -> tuple[DataLoader, DataLoader]:
    """The training and validation loaders over `dataset` (the images, or a frozen stage's
    backbone outputs)."""
    train_set = TrainSplit(dataset, data.train_idx, args)  # augmented, with each sample's dropout key
    # The order of each epoch: the permutation of the training split that seed + epoch draws (the
    # loop seeds the generator), the one that DistributedSampler shares out in train_ddp.py.
    train_sampler = RandomSampler(train_set, generator=torch.Generator())
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True,
                              **loader_options(args, device))
    val_loader = DataLoader(Subset(dataset, data.val_idx), args.batch_size, **loader_options(args, device))
    return train_loader, val_loader


def train_epoch(model: nn.Module, loader: DataLoader, epoch: int, progress: Progress, state: TrainingState,
                args: Config, device: torch.device, frozen: bool = False) -> torch.Tensor:
    """One pass over the epoch's training batches, an optimizer step every --accumulate; the metric sums."""
    model.train(not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = state.epoch_sums(device)  # a resumed epoch's finished steps are in them already
    for micro, (inputs, labels, keys) in progress.training(loader, epoch, sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        set_samples(model, keys.to(device, non_blocking=True))  # each sample's dropout masks
        last = (micro + 1) % args.accumulate == 0  # the last micro-batch of an optimizer step
        with torch.autocast(device.type, amp_dtype(args.amp), enabled=args.amp != "no"):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
        state.scaler.scale(loss / args.accumulate).backward()  # gradients add up over micro-batches
        sums += batch_sums(logits, labels)
        if last:
            optimizer_step(model, state.optimizer, state.scaler, state.schedule, args.clip_grad_norm)
            state.step += 1
            # Every process makes the state's calls below (under a launcher the ranks agree through them): never
            # only rank 0, which would wait alone in their collectives.
            stop = state.stop_agreed()  # SIGTERM, SIGUSR1, SIGHUP or Ctrl-C came (src/stopping.py)
            if stop or state.checkpoint_due():  # or --save-every-steps
                state.save_step(sums)  # last.pth at this step: --resume goes on from here
            if stop:
                state.stop()  # exit code 75, with the command that goes on
    return sums.cpu()  # waits for the device, so the epoch timings are true


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, what: str, progress: Progress, args: Config, device: torch.device) -> torch.Tensor:
    """One pass over the validation batches; the metric sums."""
    model.eval()
    sums = torch.zeros(4, device=device)  # summed loss, correct, samples, log loss (src.metrics.batch_sums)
    for inputs, labels in progress.validation(loader, what, sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, amp_dtype(args.amp), enabled=args.amp != "no"):
            logits = model(inputs)
        sums += batch_sums(logits, labels)
    return sums.cpu()


def train(args: Config, device: torch.device, tracker: Tracker) -> None:
    """The run: build, resume, then per epoch train, validate, save."""
    torch.manual_seed(args.seed)
    data = labelled_data(args)
    check_batches(data, args)
    global_batch = args.batch_size * args.accumulate
    steps = steps_per_epoch(len(data.train_idx), global_batch)
    model = build_model(args.arch, args.weights, args.dropout).to(device).to(memory_format=memory_format(args.channels_last))
    optimizer = make_optimizer(model, args, device)
    ema = WeightAverage(model, optimizer, args.ema_decay)  # --ema-decay, updated at every optimizer step
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    info = run_info(args, global_batch, data.digest, data.val_digest)
    state = TrainingState(args, info, model, optimizer, scaler, schedule, ema, steps)
    state.resume()  # --resume: last.pth into all of them, and where it stopped
    state.track(tracker)  # --track: a new tracked run, or last.pth's continued; its ids saved with the run
    progress = Progress(args, state, args.batch_size, device)

    print(run_header(args, data, device))
    if args.evaluate:  # validate the checkpoint once and stop: nothing trains, nothing is written
        evaluated, start = load_evaluated(args, info, model), time.time()
        net = cast(nn.Module, torch.compile(model)) if args.compile else model
        val_sums = evaluate(net, loaders(data.dataset, data, args, device)[1], "validation", progress, args, device)
        show_evaluation(evaluated, val_sums, time.time() - start)
        return
    since = time.time()
    with state.stop_signals():  # from here SIGTERM, SIGUSR1, SIGHUP and Ctrl-C stop the run after an optimizer step
        for stage in epoch_stages(args, model, data.dataset, state.epoch, device):
            # nn.DataParallel (a subclass whose replicas keep --amp's dtype): each batch split across the
            # GPUs, one replica per GPU in a thread, outputs gathered on the first
            net = AutocastDataParallel(stage.net)
            net = cast(nn.Module, torch.compile(net)) if args.compile else net
            train_loader, val_loader = loaders(stage.data, data, args, device)
            for epoch in stage.epochs:
                if state.stop_agreed(now=True):  # a signal since the last epoch's saves
                    state.stop()
                seed_epoch(args.seed, epoch)
                train_loader.sampler.generator.manual_seed(args.seed + epoch)  # type: ignore[attr-defined]  # its RandomSampler's
                train_loader.dataset.set_epoch(epoch)  # type: ignore[attr-defined]  # TrainSplit's: augmentation and dropout draw from (seed, epoch, sample)
                start = time.time()
                batches = skip_first_batches(train_loader, state.step * args.accumulate)  # a resumed epoch's done
                train_sums = train_epoch(net, batches, epoch, progress, state, args, device, stage.frozen)
                middle = time.time()
                val_sums = evaluate(net, val_loader, "val", progress, args, device)
                average_sums = ema.validate(lambda: evaluate(net, val_loader, "average", progress, args, device))
                record = state.record(train_sums, val_sums, average_sums, middle - start, time.time() - middle)
                is_best = state.save_epoch(record)  # history.json, last.pth, and best.pth if better
                progress.epoch_end(record)
                print(format_record(record, args.epochs) + ("  best so far" if is_best else ""))
    print(done_line(state.history, args, time.time() - since))
    progress.run_end()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, script=__file__)
    check_data_parallel(args)  # guard: --compile or --sync-bn with DataParallel, bf16 where a GPU lacks it
    device = training_device(args.deterministic, args.amp)
    # Every output checked, their folder locked for this run; --track's stores checked, on rank 0
    with lock_outputs(args), rank_0_tracker(args) as tracker:
        train(args, device, tracker)


if __name__ == "__main__":
    exit_on_error(main)
