"""A training run's configuration: its flags (src.cli parses them) and what they imply, as one
typed object that every module reading a flag takes."""
import dataclasses
from typing import Any


@dataclasses.dataclass(kw_only=True)
class Config:
    """A training run's flags, as parse_args returns them: one field per flag of build_parser (in
    its order), then what parse_args derives. The fields are what the type checker reads: a flag
    misspelt, removed or used as another type fails `make lint`. `flags` names the flags this
    script's parser has (train_accelerate.py has no --amp, a one-process script no --dist-timeout):
    as_dict() holds those alone, as the parsed namespace did."""

    data_dir: str
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    image_size: int
    arch: str
    weights: str
    dropout: float | None
    val_fraction: float | None  # None with --val-dir: no split
    val_dir: str | None
    seed: int
    workers: int  # capped to this process's CPUs (cap_workers); the parser's None is resolved
    checkpoint: str
    plot: str
    resume: bool
    save_every_steps: int | None
    evaluate: bool
    cache: str | None
    channels_last: bool
    compile: bool
    deterministic: bool
    overwrite: bool
    augment: bool
    auto_augment: str | None
    ra_magnitude: int
    augmix_severity: int
    random_erase: float
    mixup_alpha: float
    cutmix_alpha: float
    optimizer: str
    weight_decay: float
    lr_schedule: str
    warmup_epochs: float
    label_smoothing: float
    clip_grad_norm: float | None
    accumulate: int
    sync_bn: bool
    ema_decay: float | None
    best_by: str
    freeze: bool
    freeze_epochs: int
    log_dir: str | None
    log_every: int
    profile: bool
    track: list[str] | None
    tracking_uri: str | None
    amp: str = "no"  # a script without --amp (train_accelerate.py) trains in full precision here
    dist_timeout: float = 60.0  # minutes; a script without --dist-timeout has no peers to wait for
    # train_ray.py's own (src.cli.add_ray_flags)
    num_workers: int = 1
    address: str | None = None
    storage_path: str | None = None
    max_failures: int = 3
    local_rank: int | None = None
    # Derived by parse_args: the command line as typed (the script and argv), the script's name
    # without "train_" ("ddp"), and --evaluate's file (the state_dict --weights FILE, else --checkpoint).
    command: list[str] = dataclasses.field(default_factory=list)
    mode: str = "single"
    evaluate_file: str | None = None
    flags: tuple[str, ...] = dataclasses.field(default=(), repr=False, compare=False)

    def as_dict(self) -> dict[str, Any]:
        """The flags of this script's parser, then command, mode and (with --evaluate) evaluate_file:
        what best.json records and the ranks compare."""
        kept = {*self.flags, "command", "mode"} | ({"evaluate_file"} if self.evaluate_file is not None else set())
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self) if field.name in kept}
