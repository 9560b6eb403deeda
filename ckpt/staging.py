"""Staging: copying this rank's write pieces into reusable host buffers.

The copy is all a save needs from the live state. By default it runs in the caller's
thread before `save()` returns. With `SaveOptions(pipelined_staging=True)` an async save
returns once the copy is scheduled and the copy runs first thing in the save's
background thread (CheckFreq, FAST'21): the caller must not change the saved tensors
in place until `SaveHandle.wait_staged()` returns; `ckpt.guard_optimizer` makes an
optimizer's next `step()` wait for it.

Sources on an accelerator (CUDA) are copied the same way on both paths: on a side stream
of the process (one per device, reused by every save) that first waits for an event
recorded on the caller's current stream when `save()` was called, so the copy sees every
kernel queued before the save and none queued after it; into page-locked host buffers,
so each piece is one DMA transfer (`non_blocking`); and the side stream is synchronized
before the pieces are handed on. The stager holds its sources until then, so the caching
allocator cannot hand their memory to new tensors while a background copy is still
queued, even when the caller drops every reference of its own. CPU sources take the
same code with no stream, event or pinning.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relight.ckpt.format import StorageKind, align, itemsize, numel
from relight.ckpt.plan import PieceWrite, TensorPlan

logger = logging.getLogger(__name__)

__all__ = ["StagingBuffers", "Stager", "host_buffer"]

Staged = dict[tuple[str, tuple[int, ...]], torch.Tensor]

_SIDE_STREAMS: dict[torch.device, Any] = {}
"""Device -> the stream staging copies run on (created once per device and process)."""


def _side_stream(device: torch.device) -> Any:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = torch.get_device_module(device.type).Stream(device=device)
        _SIDE_STREAMS[device] = stream
    return stream


def host_buffer(nbytes: int, pin_for: str | None = None) -> torch.Tensor:
    """A uint8 host tensor of exactly `nbytes`, page-locked for DMA from `pin_for` (an
    accelerator type such as "cuda"; None: ordinary memory).

    On CUDA the memory is allocated as ordinary host memory and registered with the
    driver (`cudaHostRegister`) rather than taken from torch's pinned-memory allocator,
    which rounds every block up to a power of two: 33 GiB of state would hold 64 GiB of
    page-locked memory. The registration is undone when the tensor is freed."""
    if pin_for is None or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    if pin_for == "cuda":
        cudart = getattr(torch.cuda, "cudart", lambda: None)()
        register = getattr(cudart, "cudaHostRegister", None)
        if register is not None:
            buf = torch.empty(nbytes, dtype=torch.uint8)
            ptr = buf.data_ptr()
            err = register(ptr, nbytes, 0)
            if int(err) == 0:
                weakref.finalize(buf, cudart.cudaHostUnregister, ptr)
                return buf
            logger.warning("cudaHostRegister of %d bytes failed (%s); staging uses torch's "
                           "pinned allocator instead", nbytes, err)
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _source_device(copies: list[tuple[TensorPlan, PieceWrite, torch.Tensor]]
                   ) -> torch.device | None:
    """The one accelerator device the sources live on (None: all on the CPU)."""
    found: tuple[str, torch.device] | None = None
    for t, _, src in copies:
        if src.device.type == "cpu":
            continue
        dev = src.device if src.device.index is not None else torch.device(
            src.device.type, torch.get_device_module(src.device.type).current_device())
        if found is None:
            found = (t.name, dev)
        elif found[1] != dev:
            raise ValueError(f"one rank's state is on two devices: {found[0]!r} on "
                             f"{found[1]}, {t.name!r} on {dev}; a rank saves from one "
                             "accelerator (and the CPU)")
    return None if found is None else found[1]


@dataclass
class StagingBuffers:
    """Host buffers reused by every save with the same plan (pinned for device sources)."""

    staging: torch.Tensor | None = None
    slots: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = field(default_factory=dict)
    packed: torch.Tensor | None = None
    pinned_for: str | None = None
    """The accelerator type the buffers are page-locked for (None: ordinary memory)."""


class Stager:
    """One save's copy job: `(tensor plan, piece write, source view)` for each write of
    this rank. Built in the caller's thread (buffers are allocated there, once per
    plan; on an accelerator the "state is ready" event is recorded there); `run()`
    copies, in whichever thread calls it."""

    def __init__(self, copies: list[tuple[TensorPlan, PieceWrite, torch.Tensor]],
                 bufs: StagingBuffers, *, need_copy: bool, packed_size: int,
                 packed_inner: int, background: bool) -> None:
        self.copies, self.bufs, self.need_copy = copies, bufs, need_copy
        self.device = _source_device(copies)
        self.stream: Any = None
        self.ready: Any = None
        if self.device is not None:
            mod = torch.get_device_module(self.device.type)
            self.stream = _side_stream(self.device)
            self.ready = mod.Event()
            self.ready.record(mod.current_stream(self.device))
        pin = None if self.device is None else self.device.type
        if bufs.pinned_for != pin:  # the state moved between CPU and device: new buffers
            bufs.staging, bufs.packed, bufs.pinned_for = None, None, pin
            bufs.slots.clear()
        if packed_size:
            padded = align(packed_size, packed_inner)
            if bufs.packed is None or bufs.packed.numel() != padded:
                bufs.packed = host_buffer(padded, pin).zero_()
        if need_copy and bufs.staging is None:
            total = 0
            for t, p, _ in copies:
                if t.storage is not StorageKind.PACKED:
                    nb = numel(p.shape) * itemsize(t.dtype)
                    bufs.slots[(t.name, p.offset)] = (total, nb)
                    total = align(total + nb)
            bufs.staging = host_buffer(total, pin)
        self.packed_size = packed_size

    @property
    def nbytes(self) -> int:
        return sum(src.numel() * src.element_size() for _, _, src in self.copies)

    def run(self) -> tuple[Staged, np.ndarray | None]:
        """Copy; returns the staged pieces by (tensor, offset) and the packed buffer. On an
        accelerator it returns once the side stream has finished every copy."""
        if self.device is None:
            return self._copy()
        mod = torch.get_device_module(self.device.type)
        with mod.stream(self.stream):
            self.stream.wait_event(self.ready)
            out = self._copy()
        self.stream.synchronize()
        return out

    def _copy(self) -> tuple[Staged, np.ndarray | None]:
        staged: Staged = {}
        bufs = self.bufs
        with torch.no_grad():
            for t, p, src in self.copies:
                nb = numel(p.shape) * itemsize(t.dtype)
                dma = src.device.type != "cpu"
                if t.storage is StorageKind.PACKED:
                    assert bufs.packed is not None
                    dst = bufs.packed[p.byte_offset: p.byte_offset + nb]
                    dst.view(src.dtype).view(p.shape).copy_(src, non_blocking=dma)
                elif self.need_copy:
                    assert bufs.staging is not None
                    off, _ = bufs.slots[(t.name, p.offset)]
                    dst = bufs.staging[off: off + nb].view(src.dtype).view(p.shape)
                    dst.copy_(src, non_blocking=dma)
                    staged[(t.name, p.offset)] = dst
                else:
                    staged[(t.name, p.offset)] = src.contiguous()
        packed = bufs.packed.numpy() if self.packed_size and bufs.packed is not None else None
        return staged, packed
