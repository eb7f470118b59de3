"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with Ray Train, DDP in each worker.

Ray Train starts the workers and their process group, here or on a Ray cluster: python train_ray.py --num-workers 4
"""
import contextlib
import time
from typing import cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from src.augment import TrainSplit
from src.batch_norm import sync_batch_norm
from src.checkpoint import run_info
from src.cli import Config, amp_dtype, dist_timeout, parse_args
from src.dropout import set_samples
from src.ema import WeightAverage
from src.errors import exit_on_error
from src.freeze import epoch_stages
from src.heartbeat import Heartbeat
from src.history import done_line, format_record
from src.loaders import Data, ShardSampler, check_batches, labelled_data, loader_options, skip_first_batches
from src.metrics import batch_sums
from src.models import build_model
from src.outputs import lock_outputs
from src.process_group import joined_store, process_device, watch_ranks
from src.progress import Progress, run_header
from src.ray_driver import RunControl, check_workers, end_as_told, hangs_end_the_run, reachable, require_ray, stops_to_workers, storage_path
from src.ray_worker import driver_link, on_this_worker, restore_last, saved_last, worker_outcome
from src.recipe import make_optimizer, make_schedule, optimizer_step, steps_per_epoch
from src.seeds import seed_epoch
from src.state import TrainingState
from src.tracking import Tracker, rank_0_tracker
from src.transforms import memory_format, model_inputs

try:  # Ray Train is an extra (requirements-ray.txt): without it, main() says what to install
    import ray.train.torch
except Exception:  # not installed (ImportError), or failing as it imports (versions that do not fit)
    ray = None  # require_ray says which, in one line


def loaders(dataset: Dataset, data: Data, args: Config, device: torch.device, rank: int, world_size: int) -> tuple[DataLoader, DataLoader]:
    """This rank's training and validation loaders over `dataset` (the images, or a frozen stage's
    backbone outputs)."""
    train_set = TrainSplit(dataset, data.train_idx, args)  # augmented, with each sample's dropout key
    # DDP's own sampler (not ray.train.torch.prepare_data_loader): each epoch's permutation (seed +
    # epoch: set_epoch), every world_size-th sample from the rank-th, so train_single.py's batches.
    train_sampler: DistributedSampler[int] = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                                                shuffle=True, seed=args.seed, drop_last=True)
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler, drop_last=True,
                              **loader_options(args, device))
    val_set = Subset(dataset, data.val_idx)
    val_loader = DataLoader(val_set, args.batch_size, sampler=ShardSampler(len(val_set), world_size, rank),
                            **loader_options(args, device))  # guard: each validation image on one rank, once
    return train_loader, val_loader


def train_epoch(model: DDP, loader: DataLoader, epoch: int, progress: Progress, state: TrainingState,
                args: Config, device: torch.device, frozen: bool = False) -> torch.Tensor:
    """One pass over the epoch's training batches, an optimizer step every --accumulate; the metric sums."""
    model.train(not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = state.epoch_sums(device)  # a resumed epoch's finished steps are in them already
    for micro, (inputs, labels, keys) in progress.training(loader, epoch, sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        set_samples(model, keys.to(device, non_blocking=True))  # each sample's dropout masks
        last = (micro + 1) % args.accumulate == 0  # the last micro-batch of an optimizer step
        # The gradients of all but a step's last micro-batch stay on each rank: one all-reduce a step.
        with contextlib.nullcontext() if last else model.no_sync():
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
            stop = state.stop_agreed()  # SIGTERM, SIGUSR1, SIGHUP or Ctrl-C came to any rank (src/stopping.py)
            if stop or state.checkpoint_due():  # or --save-every-steps
                state.save_step(sums)  # last.pth at this step: --resume goes on from here
                with saved_last(state) as folder:  # rank 0's, which Ray Train keeps: a restart goes on from here
                    ray.train.report({"step": state.run_step}, checkpoint=ray.train.Checkpoint.from_directory(folder) if folder else None)
            if stop:
                state.stop()  # exit code 75, with the command that goes on
    dist.all_reduce(sums)  # every rank's samples
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
    dist.all_reduce(sums)  # every rank's sums: each validation sample is in exactly one shard
    return sums.cpu()


def train(args: Config, device: torch.device, rank: int, world_size: int, heartbeat: Heartbeat, tracker: Tracker,
          checkpoint: "ray.train.Checkpoint | None", control: "ray.actor.ActorHandle") -> None:
    """The run: build, resume, then per epoch train, validate, save."""
    torch.manual_seed(args.seed)
    data = labelled_data(args, dist_timeout(args.dist_timeout).total_seconds())
    check_batches(data, args, world_size)
    global_batch = args.batch_size * world_size * args.accumulate
    steps = steps_per_epoch(len(data.train_idx), global_batch)
    model = build_model(args.arch, args.weights, args.dropout).to(device).to(memory_format=memory_format(args.channels_last))
    model = sync_batch_norm(model, device) if args.sync_bn else model  # over every process's samples
    optimizer = make_optimizer(model, args, device)
    ema = WeightAverage(model, optimizer, args.ema_decay)  # --ema-decay, updated at every optimizer step
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    info = run_info(args, global_batch, data.digest, data.val_digest)
    state = TrainingState(args, info, model, optimizer, scaler, schedule, ema, steps, heartbeat)
    if checkpoint and rank == 0:  # Ray Train restarted the workers: the last checkpoint reported
        with checkpoint.as_directory() as folder:
            restore_last(args, folder)  # its last.pth beside --checkpoint, where the one there is older or gone
    state.resume()  # --resume or a restart: last.pth into all of them, and where it stopped
    state.track(tracker)  # --track: a new tracked run, or last.pth's continued; its ids saved with the run
    progress = Progress(args, state, args.batch_size * world_size, device, bars=False)  # Ray forwards whole lines
    if rank == 0:
        print(run_header(args, data, device, world_size))
    since = time.time()
    with state.stop_signals() as signals, driver_link(control, signals, heartbeat):  # a stop to the driver; a hung rank's line to it
        for stage in epoch_stages(args, model, data.dataset, state.epoch, device):
            # DDP all-reduces the gradients of the parameters that train in this stage, no others.
            net = DDP(stage.net, device_ids=[device.index] if device.type == "cuda" else None)
            net = cast(DDP, torch.compile(net)) if args.compile else net
            train_loader, val_loader = loaders(stage.data, data, args, device, rank, world_size)
            for epoch in stage.epochs:
                if state.stop_agreed(now=True):  # a signal since the last epoch's saves
                    state.stop()
                seed_epoch(args.seed, epoch)
                train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]  # its DistributedSampler
                train_loader.dataset.set_epoch(epoch)  # type: ignore[attr-defined]  # TrainSplit's: augmentation and dropout draw from (seed, epoch, sample)
                start = time.time()
                batches = skip_first_batches(train_loader, state.step * args.accumulate)  # a resumed epoch's done
                train_sums = train_epoch(net, batches, epoch, progress, state, args, device, stage.frozen)
                middle = time.time()
                val_sums = evaluate(net, val_loader, "val", progress, args, device)
                average_sums = ema.validate(lambda: evaluate(net, val_loader, "average", progress, args, device))
                record = state.record(train_sums, val_sums, average_sums, middle - start, time.time() - middle)
                is_best = state.save_epoch(record)  # history.json, last.pth, and best.pth if better (rank 0)
                with saved_last(state) as folder:  # the epoch's last.pth to Ray Train, with its record
                    ray.train.report(record, checkpoint=ray.train.Checkpoint.from_directory(folder) if folder else None)
                if rank == 0:
                    progress.epoch_end(record)
                    print(format_record(record, args.epochs) + ("  best so far" if is_best else ""))
    if rank == 0:
        print(done_line(state.history, args, time.time() - since))
    progress.run_end()


def train_loop_per_worker(config: dict) -> dict:
    """One worker: Ray started its process and process group (RANK, WORLD_SIZE, LOCAL_RANK set); its outcome to the driver."""
    with worker_outcome() as outcome:  # a stop or bad input ends the loop here, not as a failed worker
        context = ray.train.get_context()  # this worker's place in the group
        rank, world_size = context.get_world_rank(), context.get_world_size()
        checkpoint = ray.train.get_checkpoint()  # after a lost worker, the last one reported (None at the start)
        args = on_this_worker(config["args"], config["control"], checkpoint)  # a restart resumes
        device = process_device(args.deterministic, args.amp)  # guard: this worker's GPU (LOCAL_RANK of the node's), or the CPU
        # guard: a rank that stops answering named; every output checked, their folder locked; --track's stores checked on rank 0
        with watch_ranks(joined_store(), args.dist_timeout, device) as heartbeat, lock_outputs(args), rank_0_tracker(args) as tracker:
            train(args, device, rank, world_size, heartbeat, tracker, checkpoint, config["control"])
    return outcome


def main(argv: list[str] | None = None) -> None:
    args = parse_args(__doc__, argv, script=__file__, distributed=True, ray=True)
    require_ray(ray is not None)
    ray.init(address=reachable(args.address))  # a local Ray instance, or the running cluster at --address
    use_gpu = check_workers(args.num_workers, ray.cluster_resources())  # a GPU each where there are GPUs; enough of them
    control = ray.remote(RunControl).remote()  # the driver's stop signals, for rank 0
    trainer = ray.train.torch.TorchTrainer(
        train_loop_per_worker, train_loop_config={"args": args, "control": control},
        scaling_config=ray.train.ScalingConfig(num_workers=args.num_workers, use_gpu=use_gpu),
        # gloo or NCCL, as torchrun's scripts; a peer that stops answering fails a collective after --dist-timeout
        torch_config=ray.train.torch.TorchConfig(timeout_s=int(dist_timeout(args.dist_timeout).total_seconds())),
        run_config=ray.train.RunConfig(
            storage_path=storage_path(args),  # the reported checkpoints, where every node sees them
            failure_config=ray.train.FailureConfig(max_failures=args.max_failures),  # a lost worker: a restart from there
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1)))
    with stops_to_workers(control), hangs_end_the_run(control):  # SIGTERM, SIGUSR1, SIGHUP: a stop at a step; a hung worker: its line
        result = trainer.fit()
    ray.shutdown()
    end_as_told(result.return_value)  # rank 0's: finished, stopped (exit 75) or bad input (exit 2)

if __name__ == "__main__":
    exit_on_error(main)
