"""A step checkpoint (last.pth inside an epoch) written beside the training instead of in its way
(docs/reliability.md#what-a-step-checkpoint-costs).

A save takes a host copy of every tensor of the checkpoint, queued behind the step that made them,
and returns; a thread then writes the copy to disk (src.outputs.atomic_torch_save: a temporary
file, flushed, renamed onto last.pth) while the next steps train. On a GPU the copies go into
pinned host memory without making the host wait (the thread waits for them, on a CUDA event, after
making the training thread's GPU its own: a new thread's CUDA calls would go to GPU 0),
and the optimizer's next in-place update is queued after them on the same stream, so the file
holds the state at the save's step. On a CPU the copy is a memory copy in the training thread:
the next step would change the tensors in place while the thread reads them. The host buffers
are kept from one save to the next (allocating and pinning a GB costs more than filling it).
FSDP's step checkpoints (src/sharded_checkpoint.py) stage their shards in the same way (HostCopies).

One write at a time: a save first waits for the write before it (its buffers are reused), and so
does every other write of last.pth (the epoch's: an older step's write must not land after it)
and the end of the training block, however it ends. A write that fails (a full disk) raises its
one-line error there, in the training thread. A process killed mid-write leaves the previous
last.pth whole (the rename comes last) and a temporary file, which the next start removes.
"""
import threading
from pathlib import Path
from typing import Any, Callable

import torch
from torch.distributed.tensor import DTensor

from src.outputs import atomic_torch_save


class Later:
    """A number that a device tensor holds (the fp16 gradient scaler's scale, the weight average's
    skipped updates), for a checkpoint that holds it as a Python number: HostCopies copies the
    tensor with the others, and the thread that writes makes the number (`number(tensor)`, by
    `numbers`) once the copies are done. Read at the save, it would make the host wait for the
    device there (torch's GradScaler.state_dict reads two so)."""

    def __init__(self, tensor: torch.Tensor, number: Callable[[torch.Tensor], Any]):
        self.tensor, self.number = tensor, number


def numbers(value: Any) -> Any:
    """`value` with each Later made its number (after the copies it holds are done)."""
    if isinstance(value, Later):
        return value.number(value.tensor)
    if isinstance(value, dict):
        return {key: numbers(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(numbers(item) for item in value)
    return value


class HostCopies:
    """Host copies of a checkpoint's tensors, each in a buffer kept for its place in the checkpoint
    from one save to the next. A tensor on a GPU is copied into pinned memory without making the
    host wait (`copy` returns the Copied behind the copies: whoever reads the buffers waits for it,
    not the training thread); on a CPU the copy is made at once. A DTensor (an FSDP shard) becomes a
    DTensor of the same mesh and placements whose local tensor is the host copy: torch's
    DTensor.from_local would move that back to the mesh's device (a second GPU copy of the shards,
    made with the host waiting), which torch's own staging for dcp.async_save avoids too."""

    def __init__(self) -> None:
        self.buffers: dict[tuple, torch.Tensor] = {}  # host copies, by place in the checkpoint
        self.pinned = False  # whether the copy in the making copies from a GPU

    def copy(self, value: Any) -> tuple[Any, "Copied | None"]:
        """(`value` with each tensor replaced by its host copy, the Copied after the copies or None)."""
        self.pinned = False
        copy = self._copy(value, ())
        return copy, Copied() if self.pinned else None

    def _copy(self, value: Any, where: tuple) -> Any:
        if isinstance(value, DTensor):
            local = self._copy_tensor(value.to_local(), where)
            # DTensor's own constructor, as torch's staging makes its copies: no check, no move, no collective.
            return DTensor(local, value._spec, requires_grad=False)
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, where)
        if isinstance(value, Later):
            return Later(self._copy_tensor(value.tensor, where), value.number)
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*where, i)) for i, item in enumerate(value))
        return value

    def _copy_tensor(self, tensor: torch.Tensor, where: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        pinned = tensor.is_cuda
        self.pinned |= pinned
        # The tensor's own strides where it is dense (a channels-last weight stays channels-last).
        dense = tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))
        stride = tensor.stride() if dense else torch.empty(tensor.shape, device="meta").stride()
        buffer = self.buffers.get(where)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.stride() != stride or buffer.is_pinned() != pinned):
            buffer = torch.empty_strided(tensor.shape, stride, dtype=tensor.dtype, device="cpu", pin_memory=pinned)
            self.buffers[where] = buffer
        buffer.copy_(tensor, non_blocking=pinned)
        return buffer


class Copied:
    """The end of a save's copies into pinned host memory: a CUDA event recorded behind them, on
    the training thread's GPU, before the next step's kernels."""

    def __init__(self) -> None:
        self.event, self.device = torch.cuda.Event(), torch.cuda.current_device()
        self.event.record()

    def wait(self) -> None:
        """In the thread that reads the copies: the event's GPU made this thread's first (a new
        thread's CUDA calls would go to GPU 0, where every rank would open a context), then the wait."""
        torch.cuda.set_device(self.device)  # the event's GPU, before this thread's first CUDA call
        self.event.synchronize()  # this thread waits for the copies; training goes on


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread, from host copies of its tensors."""

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.copies = HostCopies()

    def save(self, state: dict, path: Path) -> None:
        """Write `state` (nested dicts, lists and tuples of tensors and plain values) to `path`, in
        the background; returns once its tensors' copies are queued (on a GPU) or made (on a CPU)."""
        self.wait()
        copy, done = self.copies.copy(state)
        self.thread = threading.Thread(target=self._write, args=(copy, done, Path(path)),
                                       name="checkpoint writer")  # not a daemon: an exit waits for it
        self.thread.start()

    def wait(self) -> None:
        """Until the write in progress (if any) is on disk; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error

    def busy(self) -> bool:
        """Whether a write is in progress."""
        return self.thread is not None and self.thread.is_alive()

    def _write(self, state: dict, done: Copied | None, path: Path) -> None:
        try:
            if done is not None:
                done.wait()
            atomic_torch_save(numbers(state), path)
        except BaseException as error:  # raised in the training thread by wait()
            self.error = error
