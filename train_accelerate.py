"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with Hugging Face accelerate.

Launch with `accelerate launch train_accelerate.py` (after `accelerate config`), or
`accelerate launch --num_processes 4 --mixed_precision bf16 train_accelerate.py`.
"""
import time
from functools import partial

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs

from src.accelerate_checks import check_accelerator, check_launch
from src.batch_norm import sync_batch_norm
from src.checkpoint import resume, run_info, save_epoch, save_step
from src.cli import dist_timeout, parse_args
from src.devices import configure_numerics
from src.dropout import set_samples
from src.ema import WeightAverage
from src.errors import exit_on_error
from src.freeze import epoch_stages
from src.history import done_line, epoch_record, format_record
from src.inference import load_evaluated, show_evaluation
from src.loaders import labelled_data, run_loaders
from src.metrics import batch_sums
from src.models import build_model
from src.outputs import check_writable
from src.process_group import end_process_group
from src.progress import LoaderPass, Progress, run_header
from src.recipe import make_optimizer, make_schedule, steps_per_epoch
from src.seeds import seed_epoch
from src.stopping import Stops
from src.transforms import memory_format, model_inputs


def train_epoch(accelerator, model, loader: LoaderPass, device, args, optimizer, schedule,
                frozen: bool = False) -> torch.Tensor:
    """One pass over the training batches, an optimizer step every --accumulate; the metric sums."""
    model.train(not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = torch.zeros(4, device=device)
    for inputs, labels, samples in loader.batches(sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        set_samples(model, samples.to(device, non_blocking=True))  # each sample's dropout masks
        with accelerator.accumulate(model):  # all-reduce and step on a step's last micro-batch only
            logits = model(inputs)  # the prepared model applies the mixed-precision setting
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
            accelerator.backward(loss)  # divides by --accumulate, scales for fp16
            if args.clip_grad_norm and accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            optimizer.step()  # on a step's last micro-batch only, unless the fp16 scaler skips it
            if accelerator.sync_gradients:
                schedule.step()  # every optimizer step, also one the fp16 scaler skipped
            optimizer.zero_grad(set_to_none=True)
        sums += batch_sums(logits, labels)
    sums = accelerator.reduce(sums, reduction="sum")  # every process's samples
    return sums.cpu()  # waits for the device, so the epoch timings are true


@torch.no_grad()
def evaluate(accelerator, model, loader: LoaderPass, device, args) -> torch.Tensor:
    """One pass over the validation batches; the metric sums."""
    model.eval()
    sums = torch.zeros(4, device=device)
    for inputs, labels in loader.batches(sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        logits = model(inputs)
        # Every process's samples, less those accelerate repeated to fill the last batch.
        sums += batch_sums(*accelerator.gather_for_metrics((logits, labels)))
    return sums.cpu()


def main() -> None:
    args = parse_args(__doc__, amp=False, distributed=True)
    check_launch()
    # split_batches: each loader batch of batch_size x processes is cut into one piece per process,
    # so the global batches are those of train_single.py --batch-size (batch_size x processes).
    # non_blocking: copies from the pinned batches do not make the host wait for the GPU.
    accelerator = Accelerator(
        gradient_accumulation_steps=args.accumulate, log_with="tensorboard" if args.log_dir else None,
        project_dir=args.log_dir, step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),
        kwargs_handlers=[InitProcessGroupKwargs(timeout=dist_timeout(args))])  # as train_ddp.py's
    check_accelerator(accelerator)
    configure_numerics(args.deterministic)  # after Accelerator(), which sets TF32 for dynamo
    processes, device = accelerator.num_processes, accelerator.device
    check_writable(args)
    torch.manual_seed(args.seed)

    data = labelled_data(args)
    global_batch = args.batch_size * processes * args.accumulate
    steps = steps_per_epoch(len(data.train_idx), global_batch)
    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    model = sync_batch_norm(model, device) if args.sync_bn else model  # over every process's samples
    optimizer = make_optimizer(model, args, device)
    ema = WeightAverage(model, optimizer, args.ema_decay)  # --ema-decay, updated at every optimizer step
    schedule = make_schedule(optimizer, args, steps)
    info = run_info(args, global_batch, data.digest)
    history = resume(args, info, model, optimizer, accelerator.scaler, schedule, ema)
    optimizer = accelerator.prepare(optimizer)
    if args.log_dir:
        accelerator.init_trackers("train_accelerate")  # on the main process only
    progress = Progress(args, optimizer, steps, args.batch_size * processes, device, accelerator.log)
    # last.pth also every --save-every-steps optimizer steps, and at the step where SIGTERM, SIGUSR1
    # or Ctrl-C stops the run (src/stopping.py): --resume goes on from there
    progress.stops = Stops(args, history, partial(save_step, args, history, model, optimizer, ema, accelerator.scaler, schedule, info))

    if accelerator.is_main_process:
        print(run_header(args, data, device, processes) + f" (accelerate {accelerator.distributed_type.value}, "
              f"mixed precision {accelerator.mixed_precision})")
    if args.evaluate:  # validate the checkpoint once and stop: nothing trains, nothing is written
        evaluated, start = load_evaluated(args, info, model), time.time()
        net = torch.compile(model) if args.compile else model
        net, val_loader = accelerator.prepare(net, run_loaders(data.dataset, data, args, device, split=processes)[1])
        val_sums = evaluate(accelerator, net, progress.pass_over(val_loader, "validation"), device, args)
        show_evaluation(evaluated, val_sums, time.time() - start)
        return
    since = time.time()
    for stage in epoch_stages(args, model, data.dataset, len(history), device):
        net = torch.compile(stage.net) if args.compile else stage.net
        train_loader, val_loader = run_loaders(stage.data, data, args, device, split=processes)
        net, train_loader, val_loader = accelerator.prepare(net, train_loader, val_loader)
        for epoch in stage.epochs:
            seed_epoch(args.seed, epoch)
            train_loader.set_epoch(epoch)
            desc, start = f"epoch {epoch + 1}/{args.epochs}", time.time()
            train_pass = progress.pass_over(train_loader, f"{desc} train", epoch)
            train_sums = train_epoch(accelerator, net, train_pass, device, args, optimizer, schedule, stage.frozen)
            middle = time.time()
            val_sums = evaluate(accelerator, net, progress.pass_over(val_loader, f"{desc} val"), device, args)
            average_sums = ema.validate(lambda: evaluate(accelerator, net, progress.pass_over(val_loader, f"{desc} average"), device, args))
            history.append(epoch_record(
                epoch=epoch, train_sums=train_sums, val_sums=val_sums, train_seconds=middle - start + train_pass.resumed_seconds,
                val_seconds=time.time() - middle, data_wait_seconds=train_pass.data_wait,
                lr=optimizer.param_groups[0]["lr"], average_sums=average_sums))
            if accelerator.is_main_process:
                is_best = save_epoch(args, history, model, optimizer, accelerator.scaler, schedule, info, ema)
                print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
            progress.epoch_end(history[-1])  # accelerator.log writes on the main process only
            accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        print(done_line(history, args, time.time() - since))
    progress.run_end()
    del model, optimizer, progress.stops  # (the step checkpoints hold them too)
    accelerator.free_memory()  # measured: releasing the model first avoids gloo aborts at exit
    accelerator.end_training()  # closes the trackers and the process group


if __name__ == "__main__":
    try:
        exit_on_error(main)
    finally:
        end_process_group()  # after an error too
