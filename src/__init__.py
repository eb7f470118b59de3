"""The training library: what the six train_*.py scripts share. Each script calls its mode's own
torch or accelerate API itself; what guards those calls, and what every mode does alike, is here.
The commands around training are in src/tools/ (they import this library; the scripts never
import them). One module per subject, no import circle:

The run
    state.py          the training state (model, optimizer, scaler, schedule, weight average,
                      history, place in the epoch) and its verbs: resume, save, stop
    checkpoint.py     what best.pth, best.json and last.pth hold; reading a last back (last.pth or last.dcp)
    sharded_checkpoint.py  FSDP's last.dcp: each rank's shards through torch.distributed.checkpoint
    checkpoint_writer.py  rank 0's step checkpoints written in a thread while training goes on
    stopping.py       SIGTERM, SIGUSR1, Ctrl-C, SIGHUP: the handlers and the agreement of every rank
    outputs.py        the files a command writes: checked at start, the run lock, atomic writes
    history.py        the per-epoch records, the best epoch, the lines a run prints
    plot.py           the training curves (--plot), marked as a run's
    progress.py       the progress bar, data-wait clock, TensorBoard, the profiler's hooks
    tracking.py       --track: MLflow and W&B runs, one per training run across every stop
    profiling.py      --profile: torch.profiler's trace and its table
    errors.py         how a command ends: one-line errors (exit 2), a stop (75), the group after an error
    cli.py            the flags of every training script
    config.py         the run's flags as one typed object (Config), which every module reading a flag takes
Data
    datasets.py       the images, their labels, and the processes of the loader workers
    loaders.py        the split, the validation shards, the loader options, skipping finished steps
    cache.py          --cache: decoded pixels on disk, memory-mapped
    augment.py        the training split as the model sees it: --augment's draws per sample
    transforms.py     resizing in the workers, normalising on the device
    image_files.py    image files named on predict's command line
The model and the recipe
    models.py         a torchvision classifier with a 2-class head, its weights
    recipe.py         optimizer, learning-rate schedule, the optimizer step
    dropout.py        dropout drawn per sample, the same in every mode
    batch_norm.py     --sync-bn
    ema.py            --ema-decay: the weight average
    freeze.py         --freeze, --freeze-epochs: the frozen backbone, its feature cache, the stages
    metrics.py        the metric sums kept on the device
    divergence.py     a loss or weights that are not finite
    seeds.py          every random draw as a function of the seed and its place
The processes
    process_group.py  what guards init_process_group: the store, one GPU per process, a world of one,
                      the same flags on every rank
    ranks.py          which rank speaks, what rank 0 reads for all, restarts
    heartbeat.py      naming a rank that stopped answering
    fsdp.py           FSDP2's units, validation on shards, whole tensors for checkpoints, bytes held
    data_parallel.py  nn.DataParallel with --amp's dtype and channels-last replicas
    accelerate_checks.py  what train_accelerate.py refuses before any work
    ray_driver.py     train_ray.py's driver: Ray installed, --address, --num-workers, stops sent on, how it ended
    ray_worker.py     train_ray.py's workers: ending without failing, the driver's stops, reporting and restoring last.pth
    devices.py        the device, its numerics, CPUs and workers, the machine's name
Using a model
    inference.py      best.pth with its best.json, probabilities for files, --evaluate
    safe_csv.py       the CSV files the tools write
    terminal.py       file names made safe to print
"""
