"""What train_accelerate.py checks before any work: bfloat16 on this process's GPU (before
Accelerator(), which would fail with a traceback), a request for a sharding plugin (FSDP,
DeepSpeed, Megatron-LM) that it does not support, then fp16 where accelerate would not use it,
and the processes and the distributed type the Accelerator sees against those launched."""
import os

from accelerate.utils import DistributedType, parse_flag_from_env

from src.devices import check_bf16, check_gpus
from src.errors import UserError

# What `accelerate launch` sets for --use_fsdp, --use_deepspeed, --use_megatron_lm (or a config
# file's distributed_type). The Accelerator reads them, but enables FSDP only on its multi-GPU
# device types: on a CPU it trains plain DDP and says nothing; without DeepSpeed or Megatron-LM
# installed it stops with a traceback; and on GPUs FSDP and DeepSpeed refuse the optimizer that
# this script prepares apart from the model.
SHARDING_REQUESTS = {"ACCELERATE_USE_FSDP": "FSDP", "ACCELERATE_USE_DEEPSPEED": "DeepSpeed",
                     "ACCELERATE_USE_MEGATRON_LM": "Megatron-LM"}


def _instead() -> str:
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return (f"train_accelerate.py trains with accelerate's DDP only; to shard the model over the "
            f"processes run torchrun --nproc_per_node={processes} train_fsdp.py")


def check_launch() -> None:
    """Refuse `--mixed_precision bf16` (accelerate launch sets ACCELERATE_MIXED_PRECISION) on a
    GPU without bfloat16, and a request for FSDP, DeepSpeed or Megatron-LM."""
    for variable, plugin in SHARDING_REQUESTS.items():
        if parse_flag_from_env(variable):  # accelerate's own reading: true, 1, yes, on
            raise UserError(f"accelerate was asked for {plugin} ({variable}={os.environ[variable]}); "
                            + _instead(), quiet=int(os.environ.get("RANK", 0)) != 0)
    # accelerate itself would fail later, with NCCL's "Duplicate GPU detected".
    check_gpus(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), "accelerate launch --num_processes {gpus}")
    check_bf16(os.environ.get("ACCELERATE_MIXED_PRECISION"), int(os.environ.get("LOCAL_RANK", 0)))


def check_accelerator(accelerator) -> None:
    """Refuse a launch where each process would train alone on all the data, every distributed
    type but one process and DDP on one kind of device (NO, MULTI_CPU, MULTI_GPU and the other
    MULTI_* types), and fp16 where accelerate would not autocast to it (on a CPU it trains in
    float32 and says fp16)."""
    kind = accelerator.distributed_type
    if kind != DistributedType.NO and not kind.value.startswith("MULTI_"):
        raise UserError(f"accelerate's distributed type is {kind.value}; " + _instead(),
                        quiet=not accelerator.is_main_process)
    if accelerator.mixed_precision == "fp16" and not accelerator.native_amp:
        raise UserError(f"--mixed_precision fp16: accelerate does not autocast to float16 on a "
                        f"{accelerator.device.type}, the run would be float32; use --mixed_precision bf16",
                        quiet=not accelerator.is_main_process)
    launched = int(os.environ.get("WORLD_SIZE", 1))
    if launched > 1 and accelerator.num_processes == 1:
        raise UserError(f"launched as {launched} processes but accelerate sees one, so each would "
                        "train alone on all the data; without GPUs run ACCELERATE_USE_CPU=1 "
                        f"accelerate launch --multi_gpu --num_processes {launched} train_accelerate.py",
                        quiet=os.environ.get("RANK", "0") != "0")
