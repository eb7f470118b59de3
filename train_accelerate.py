"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with Hugging Face accelerate.

Launch with `accelerate launch train_accelerate.py` (after `accelerate config`), or
`accelerate launch --num_processes 4 --mixed_precision bf16 train_accelerate.py`.
"""
import time
from typing import cast

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Subset

from src.accelerate_checks import check_accelerator, check_launch
from src.augment import TrainSplit
from src.batch_norm import sync_batch_norm
from src.checkpoint import run_info
from src.cli import Config, dist_timeout, parse_args
from src.devices import configure_numerics
from src.dropout import set_samples
from src.ema import WeightAverage
from src.errors import exit_on_error
from src.freeze import epoch_stages
from src.heartbeat import Heartbeat
from src.history import done_line, format_record
from src.inference import load_evaluated, show_evaluation
from src.loaders import Data, check_batches, labelled_data, loader_options
from src.metrics import batch_sums
from src.models import build_model
from src.outputs import lock_outputs
from src.process_group import check_same_flags, joined_store, watch_ranks
from src.progress import Progress, run_header
from src.recipe import make_optimizer, make_schedule, steps_per_epoch
from src.seeds import seed_epoch
from src.state import TrainingState
from src.tracking import PROJECT, Tracker, rank_0_tracker, requested
from src.transforms import memory_format, model_inputs


def loaders(dataset: Dataset, data: Data, args: Config, device: torch.device, processes: int) -> tuple[DataLoader, DataLoader]:
    """The training and validation loaders over `dataset` (the images, or a frozen stage's
    backbone outputs), before accelerate prepares them: each loader batch of --batch-size x
    processes is cut into one piece per process (split_batches)."""
    train_set = TrainSplit(dataset, data.train_idx, args)  # augmented, with each sample's dropout key
    # The order of each epoch: the permutation of the training split that seed + epoch draws (the
    # loop seeds the generator), train_single.py's: the global batches are the same.
    train_sampler = RandomSampler(train_set, generator=torch.Generator())
    train_loader = DataLoader(train_set, args.batch_size * processes, sampler=train_sampler, drop_last=True,
                              **loader_options(args, device))
    val_loader = DataLoader(Subset(dataset, data.val_idx), args.batch_size * processes,
                            **loader_options(args, device))
    return train_loader, val_loader


def train_epoch(accelerator: Accelerator, model: nn.Module, loader: DataLoader, epoch: int, progress: Progress, state: TrainingState,
                args: Config, device: torch.device, frozen: bool = False) -> torch.Tensor:
    """One pass over the epoch's training batches, an optimizer step every --accumulate; the metric sums."""
    model.train(not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = state.epoch_sums(device)  # a resumed epoch's finished steps are in them already
    for _, (inputs, labels, keys) in progress.training(loader, epoch, sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        set_samples(model, keys.to(device, non_blocking=True))  # each sample's dropout masks
        with accelerator.accumulate(model):  # all-reduce and step on a step's last micro-batch only
            logits = model(inputs)  # the prepared model applies the mixed-precision setting
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
            accelerator.backward(loss)  # divides by --accumulate, scales for fp16
            if args.clip_grad_norm and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            state.optimizer.step()  # on a step's last micro-batch only, unless the fp16 scaler skips it
            if accelerator.sync_gradients:
                state.schedule.step()  # every optimizer step, also one the fp16 scaler skipped
            state.optimizer.zero_grad(set_to_none=True)
        sums += batch_sums(logits, labels)
        if accelerator.sync_gradients:  # that was a step's last micro-batch
            state.step += 1
            # Every process makes the state's calls below (under a launcher the ranks agree through them): never
            # only rank 0, which would wait alone in their collectives.
            stop = state.stop_agreed()  # SIGTERM, SIGUSR1, SIGHUP or Ctrl-C came to any process (src/stopping.py)
            if stop or state.checkpoint_due():  # or --save-every-steps
                state.save_step(sums)  # last.pth at this step: --resume goes on from here
            if stop:
                state.stop()  # exit code 75, with the command that goes on
    sums = accelerator.reduce(sums, reduction="sum")  # every process's samples
    return sums.cpu()  # waits for the device, so the epoch timings are true


@torch.no_grad()
def evaluate(accelerator: Accelerator, model: nn.Module, loader: DataLoader, what: str, progress: Progress, args: Config,
             device: torch.device) -> torch.Tensor:
    """One pass over the validation batches; the metric sums."""
    model.eval()
    sums = torch.zeros(4, device=device)  # summed loss, correct, samples, log loss (src.metrics.batch_sums)
    for inputs, labels in progress.validation(loader, what, sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        logits = model(inputs)
        # Every process's samples, less those accelerate repeated to fill the last batch.
        sums += batch_sums(*accelerator.gather_for_metrics((logits, labels)))
    return sums.cpu()


def train(args: Config, accelerator: Accelerator, heartbeat: Heartbeat, tracker: Tracker) -> None:
    """The run: build, resume, then per epoch train, validate, save."""
    processes, device = accelerator.num_processes, accelerator.device
    torch.manual_seed(args.seed)
    data = labelled_data(args, dist_timeout(args.dist_timeout).total_seconds())
    check_batches(data, args, processes)
    global_batch = args.batch_size * processes * args.accumulate
    steps = steps_per_epoch(len(data.train_idx), global_batch)
    model = build_model(args.arch, args.weights, args.dropout).to(device).to(memory_format=memory_format(args.channels_last))
    model = sync_batch_norm(model, device) if args.sync_bn else model  # over every process's samples
    optimizer = make_optimizer(model, args, device)
    ema = WeightAverage(model, optimizer, args.ema_decay)  # --ema-decay, updated at every optimizer step
    schedule = make_schedule(optimizer, args, steps)  # not prepared (step_scheduler_with_optimizer=False): as in every mode
    info = run_info(args, global_batch, data.digest, data.val_digest)
    state = TrainingState(args, info, model, optimizer, accelerator.scaler, schedule, ema, steps, heartbeat)
    state.resume()  # --resume: last.pth into all of them, and where it stopped
    # The optimizer is prepared now, the model per stage below (--freeze-epochs changes what trains):
    # AcceleratedOptimizer skips zero_grad and step on all but a step's last micro-batch.
    state.optimizer = accelerator.prepare(optimizer)  # steps on a step's last micro-batch only, with the fp16 scaler
    # The trackers of log_with, on the main process only: last.pth's tracked runs continued (their ids)
    accelerator.init_trackers(PROJECT if args.track else "train_accelerate",
                              init_kwargs=tracker.init_kwargs(state.tracked_ids, info))
    state.track(tracker, accelerator)  # --track: its runs' ids saved with the run, each epoch logged once
    # TensorBoard's scalars (accelerator.log would send them to --track's runs too, whose own are once each)
    progress = Progress(args, state, args.batch_size * processes, device,
                        accelerator.get_tracker("tensorboard").log if args.log_dir else None)

    if accelerator.is_main_process:
        print(run_header(args, data, device, processes) + f" (accelerate {accelerator.distributed_type.value}, "
              f"mixed precision {accelerator.mixed_precision})")
    if args.evaluate:  # validate the checkpoint once and stop: nothing trains, nothing is written
        evaluated, start = load_evaluated(args, info, model), time.time()
        net = cast(nn.Module, torch.compile(model)) if args.compile else model
        net, val_loader = accelerator.prepare(net, loaders(data.dataset, data, args, device, processes)[1])
        val_sums = evaluate(accelerator, net, val_loader, "validation", progress, args, device)
        show_evaluation(evaluated, val_sums, time.time() - start)
        return
    since = time.time()
    with state.stop_signals():  # from here SIGTERM, SIGUSR1, SIGHUP and Ctrl-C stop the run after an optimizer step
        for stage in epoch_stages(args, model, data.dataset, state.epoch, device):
            net = cast(nn.Module, torch.compile(stage.net)) if args.compile else stage.net
            train_loader, val_loader = loaders(stage.data, data, args, device, processes)
            # prepare() wraps the sampler; its generator, kept here, still draws each epoch's permutation
            order = train_loader.sampler.generator  # type: ignore[attr-defined]  # its RandomSampler's
            net, train_loader, val_loader = accelerator.prepare(net, train_loader, val_loader)
            for epoch in stage.epochs:
                if state.stop_agreed(now=True):  # a signal since the last epoch's saves
                    state.stop()
                seed_epoch(args.seed, epoch)
                order.manual_seed(args.seed + epoch)
                train_loader.set_epoch(epoch)  # and the training split's: dropout and augmentation draws
                start = time.time()
                batches = accelerator.skip_first_batches(train_loader, state.step * args.accumulate)
                train_sums = train_epoch(accelerator, net, batches, epoch, progress, state, args, device, stage.frozen)
                middle = time.time()
                val_sums = evaluate(accelerator, net, val_loader, "val", progress, args, device)
                average_sums = ema.validate(lambda: evaluate(accelerator, net, val_loader, "average", progress, args, device))
                record = state.record(train_sums, val_sums, average_sums, middle - start, time.time() - middle)
                # best.pth: the plain model's state_dict (each process holds it whole); rank 0 writes.
                is_best = state.save_epoch(record, accelerator.get_state_dict(model))
                if accelerator.is_main_process:
                    print(format_record(record, args.epochs) + ("  best so far" if is_best else ""))
                progress.epoch_end(record)  # TensorBoard's tracker writes on the main process only
                accelerator.wait_for_everyone()  # no process starts the next epoch while the main one writes
    if accelerator.is_main_process:
        print(done_line(state.history, args, time.time() - since))
    progress.run_end()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, script=__file__, amp=False, distributed=True)
    check_launch()  # guard: a sharding plugin asked for, more processes than GPUs, bf16 where a GPU lacks it
    trackers = (["tensorboard"] if args.log_dir else []) + requested(args)  # --log-dir's, --track's
    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,
    # so the global batches are those of train_single.py --batch-size (batch_size x processes).
    # non_blocking: copies from the pinned batches do not make the host wait for the GPU.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulate, log_with=trackers or None,  # None: no warning of an empty list
        project_dir=args.log_dir, step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=dist_timeout(args.dist_timeout))])  # as train_ddp.py's
    check_accelerator(accelerator)  # guard: a launch where each process would train alone, fp16 without autocast
    configure_numerics(args.deterministic)  # after Accelerator(), which sets TF32 for dynamo
    check_same_flags(args)  # guard: every process launched with the main process's flags (paths and --workers aside)
    # guard: a rank that stops answering named (watch_ranks, in the store of the group accelerate joined); every output checked,
    # their folder locked; --track's stores checked, on the main process (its runs end before end_training())
    with watch_ranks(joined_store(), args.dist_timeout, accelerator.device) as heartbeat, lock_outputs(args), \
            rank_0_tracker(args) as tracker:
        train(args, accelerator, heartbeat, tracker)
    accelerator.free_memory()  # what accelerate still holds of the run (measured: gloo can abort at exit otherwise)
    accelerator.end_training()  # closes the trackers and the process group


if __name__ == "__main__":
    exit_on_error(main)
