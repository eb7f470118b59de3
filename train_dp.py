"""Fine-tune VGG16 (or another torchvision classifier) on Dogs vs. Cats with nn.DataParallel over all GPUs."""
import time
from functools import partial

import torch
import torch.nn.functional as F

from src.checkpoint import resume, run_info, save_epoch, save_step
from src.cli import amp_dtype, parse_args
from src.data_parallel import AutocastDataParallel, check_data_parallel
from src.devices import training_device
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
from src.progress import LoaderPass, Progress, run_header
from src.recipe import make_optimizer, make_schedule, optimizer_step, steps_per_epoch
from src.seeds import seed_epoch
from src.stopping import Stops
from src.transforms import memory_format, model_inputs


def train_epoch(model, loader: LoaderPass, device, args, optimizer, scaler, schedule,
                frozen: bool = False) -> torch.Tensor:
    """One pass over the training batches, an optimizer step every --accumulate; the metric sums."""
    model.train(not frozen)  # a frozen backbone keeps dropout and batch norm fixed
    sums = torch.zeros(4, device=device)
    for step, (inputs, labels, samples) in enumerate(loader.batches(sums)):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        set_samples(model, samples.to(device, non_blocking=True))  # each sample's dropout masks
        last = (step + 1) % args.accumulate == 0  # the last micro-batch of an optimizer step
        with torch.autocast(device.type, amp_dtype(args), enabled=args.amp != "no"):
            logits = model(inputs)
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)
        scaler.scale(loss / args.accumulate).backward()  # gradients add up over micro-batches
        if last:
            optimizer_step(model, optimizer, scaler, schedule, args.clip_grad_norm)
        sums += batch_sums(logits, labels)
    return sums.cpu()  # waits for the device, so the epoch timings are true


@torch.no_grad()
def evaluate(model, loader: LoaderPass, device, args) -> torch.Tensor:
    """One pass over the validation batches; the metric sums."""
    model.eval()
    sums = torch.zeros(4, device=device)
    for inputs, labels in loader.batches(sums):
        inputs = model_inputs(inputs, device, args.channels_last)
        labels = labels.to(device, non_blocking=True)
        with torch.autocast(device.type, amp_dtype(args), enabled=args.amp != "no"):
            logits = model(inputs)
        sums += batch_sums(logits, labels)
    return sums.cpu()


def main() -> None:
    args = parse_args(__doc__)
    check_data_parallel(args)
    device = training_device(args.deterministic, args.amp)
    check_writable(args)
    torch.manual_seed(args.seed)

    data = labelled_data(args)
    global_batch = args.batch_size * args.accumulate
    steps = steps_per_epoch(len(data.train_idx), global_batch)
    model = build_model(args.arch, args.weights, args.dropout).to(device, memory_format=memory_format(args))
    optimizer = make_optimizer(model, args, device)
    ema = WeightAverage(model, optimizer, args.ema_decay)  # --ema-decay, updated at every optimizer step
    schedule = make_schedule(optimizer, args, steps)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    info = run_info(args, global_batch, data.digest)
    history = resume(args, info, model, optimizer, scaler, schedule, ema)
    progress = Progress(args, optimizer, steps, args.batch_size, device)
    # last.pth also every --save-every-steps optimizer steps, and at the step where SIGTERM, SIGUSR1
    # or Ctrl-C stops the run (src/stopping.py): --resume goes on from there
    progress.stops = Stops(args, history, partial(save_step, args, history, model, optimizer, ema, scaler, schedule, info))

    print(run_header(args, data, device))
    if args.evaluate:  # validate the checkpoint once and stop: nothing trains, nothing is written
        evaluated, start = load_evaluated(args, info, model), time.time()
        net = torch.compile(model) if args.compile else model
        val_loader = run_loaders(data.dataset, data, args, device)[1]
        val_sums = evaluate(net, progress.pass_over(val_loader, "validation"), device, args)
        show_evaluation(evaluated, val_sums, time.time() - start)
        return
    since = time.time()
    for stage in epoch_stages(args, model, data.dataset, len(history), device):
        net = AutocastDataParallel(stage.net)  # splits each batch across the GPUs, gathers outputs on the first
        net = torch.compile(net) if args.compile else net
        train_loader, val_loader = run_loaders(stage.data, data, args, device)
        for epoch in stage.epochs:
            seed_epoch(args.seed, epoch)
            train_loader.sampler.set_epoch(epoch)
            desc, start = f"epoch {epoch + 1}/{args.epochs}", time.time()
            train_pass = progress.pass_over(train_loader, f"{desc} train", epoch)
            train_sums = train_epoch(net, train_pass, device, args, optimizer, scaler, schedule, stage.frozen)
            middle = time.time()
            val_sums = evaluate(net, progress.pass_over(val_loader, f"{desc} val"), device, args)
            average_sums = ema.validate(lambda: evaluate(net, progress.pass_over(val_loader, f"{desc} average"), device, args))
            history.append(epoch_record(
                epoch=epoch, train_sums=train_sums, val_sums=val_sums, train_seconds=middle - start + train_pass.resumed_seconds,
                val_seconds=time.time() - middle, data_wait_seconds=train_pass.data_wait,
                lr=optimizer.param_groups[0]["lr"], average_sums=average_sums))
            is_best = save_epoch(args, history, model, optimizer, scaler, schedule, info, ema)
            progress.epoch_end(history[-1])
            print(format_record(history[-1], args.epochs) + ("  best so far" if is_best else ""))
    print(done_line(history, args, time.time() - since))
    progress.run_end()


if __name__ == "__main__":
    exit_on_error(main)
