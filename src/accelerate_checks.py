"""What train_accelerate.py checks before any work: bfloat16 on this process's GPU (before
Accelerator(), which would fail with a traceback), then fp16 where accelerate would not use it,
and the processes the Accelerator sees against those launched."""
import os

from src.devices import check_bf16
from src.errors import UserError


def check_launch() -> None:
    """Refuse `--mixed_precision bf16` (accelerate launch sets ACCELERATE_MIXED_PRECISION) on a
    GPU without bfloat16."""
    check_bf16(os.environ.get("ACCELERATE_MIXED_PRECISION"), int(os.environ.get("LOCAL_RANK", 0)))


def check_accelerator(accelerator) -> None:
    """Refuse a launch where each process would train alone on all the data, and fp16 where
    accelerate would not autocast to it (on a CPU it trains in float32 and says fp16)."""
    if accelerator.mixed_precision == "fp16" and not accelerator.native_amp:
        raise UserError(f"--mixed_precision fp16: accelerate does not autocast to float16 on a "
                        f"{accelerator.device.type}, the run would be float32; use --mixed_precision bf16",
                        quiet=not accelerator.is_main_process)
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched > 1 and accelerator.num_processes == 1:
        raise UserError(f"launched as {launched} processes but accelerate sees one, so each would "
                        "train alone on all the data; without GPUs run ACCELERATE_USE_CPU=1 "
                        f"accelerate launch --multi_gpu --num_processes {launched} train_accelerate.py")
