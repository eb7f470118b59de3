"""A step checkpoint (last.pth inside an epoch) written beside the training instead of in its way
(docs/reliability.md#what-a-step-checkpoint-costs).

A save takes a host copy of every tensor of the checkpoint, queued behind the step that made them,
and returns; a thread then writes the copy to disk (src.outputs.atomic_torch_save: a temporary
file, flushed, renamed onto last.pth) while the next steps train. On a GPU the copies go into
pinned host memory without making the host wait (the thread waits for them, on a CUDA event),
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

import torch
from torch.distributed.tensor import DTensor

from src.outputs import atomic_torch_save


class HostCopies:
    """Host copies of a checkpoint's tensors, each in a buffer kept for its place in the checkpoint
    from one save to the next. A tensor on a GPU is copied into pinned memory without making the
    host wait (`copy` returns a CUDA event recorded after the copies: whoever reads the buffers
    waits for it, not the training thread); on a CPU the copy is made at once. A DTensor (an FSDP
    shard) becomes a DTensor of the same mesh and placements whose local tensor is the host copy:
    torch's DTensor.from_local would move that back to the mesh's device (a second GPU copy of the
    shards, made with the host waiting), as torch's own staging for dcp.async_save avoids too."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}  # host copies, by place in the checkpoint
        self.pinned = False  # whether the copy in the making copies from a GPU

    def copy(self, value) -> tuple:
        """(`value` with each tensor replaced by its host copy, the CUDA event after the copies or None)."""
        self.pinned = False
        copy = self._copy(value, ())
        done = None
        if self.pinned:
            done = torch.cuda.Event()
            done.record()  # after the copies, before the next step's kernels
        return copy, done

    def _copy(self, value, where: tuple):
        if isinstance(value, DTensor):
            local = self._copy_tensor(value.to_local(), where)
            # DTensor's own constructor, as torch's staging makes its copies: no check, no move, no collective.
            return DTensor(local, value._spec, requires_grad=False)  # type: ignore[call-arg]  # torch's stub lacks it
        if isinstance(value, torch.Tensor):
            return self._copy_tensor(value, where)
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*where, i)) for i, item in enumerate(value))
        return value

    def _copy_tensor(self, tensor: torch.Tensor, where: tuple) -> torch.Tensor:
        tensor = tensor.detach()
        pinned = on_gpu(tensor)
        self.pinned |= pinned
        # The tensor's own strides where it is dense (a channels-last weight stays channels-last).
        dense = tensor.is_contiguous() or (tensor.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last))
        stride = tensor.stride() if dense else torch.empty(tensor.shape, device="meta").stride()
        buffer = self.buffers.get(where)
        if (buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype
                or buffer.stride() != stride or buffer.is_pinned() != pinned):
            buffer = host_buffer(tensor.shape, stride, tensor.dtype, pinned)
            self.buffers[where] = buffer
        buffer.copy_(tensor, non_blocking=pinned)
        return buffer


def on_gpu(tensor: torch.Tensor) -> bool:
    """Whether a tensor's host copy is pinned and made without the host waiting."""
    return tensor.is_cuda


def host_buffer(shape, stride, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An empty host tensor of that layout, in pinned (page-locked) memory where asked."""
    return torch.empty_strided(shape, stride, dtype=dtype, device="cpu", pin_memory=pinned)


class CheckpointWriter:
    """Writes one checkpoint at a time in a background thread, from host copies of its tensors."""

    def __init__(self):
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

    def _write(self, state: dict, done, path: Path) -> None:
        try:
            if done is not None:
                done.synchronize()  # this thread waits for the copies; training goes on
            atomic_torch_save(state, path)
        except BaseException as error:  # raised in the training thread by wait()
            self.error = error
