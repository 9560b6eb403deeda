"""Staging: copying this rank's write pieces into reusable host buffers.

The copy is all a save needs from the live state. By default it runs in the caller's
thread before `save()` returns. With `SaveOptions(pipelined_staging=True)` an async save
returns once the copy is scheduled and the copy runs first thing in the save's
background thread (CheckFreq, FAST'21): the caller must not change the saved tensors
in place until `SaveHandle.wait_staged()` returns; `ckpt.guard_optimizer` makes an
optimizer's next `step()` wait for it. On CUDA the background copy runs on its own
stream, after an event recorded on the caller's stream when `save()` was called, so it
sees every kernel queued before the save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckpt.format import align, itemsize, numel
from ckpt.plan import PieceWrite, TensorPlan

__all__ = ["StagingBuffers", "Stager"]

Staged = dict[tuple[str, tuple[int, ...]], torch.Tensor]


@dataclass
class StagingBuffers:
    """Host buffers reused by every save with the same plan (pinned for CUDA sources)."""

    staging: torch.Tensor | None = None
    slots: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = field(default_factory=dict)
    packed: torch.Tensor | None = None


class Stager:
    """One save's copy job: `(tensor plan, piece write, source view)` for each write of
    this rank. Built in the caller's thread (buffers are allocated there, once per
    plan); `run()` copies, in whichever thread calls it."""

    def __init__(self, copies: list[tuple[TensorPlan, PieceWrite, torch.Tensor]],
                 bufs: StagingBuffers, *, need_copy: bool, packed_size: int,
                 packed_inner: int, background: bool) -> None:
        self.copies, self.bufs, self.need_copy = copies, bufs, need_copy
        self.cuda = any(src.is_cuda for _, _, src in copies)
        self.ready: Any = None
        if self.cuda and background:
            self.ready = torch.cuda.Event()
            self.ready.record()  # on the caller's current stream
        if packed_size:
            padded = align(packed_size, packed_inner)
            if bufs.packed is None or bufs.packed.numel() != padded:
                bufs.packed = torch.zeros(padded, dtype=torch.uint8, pin_memory=self._pin())
        if need_copy and bufs.staging is None:
            total = 0
            for t, p, _ in copies:
                if t.storage != "packed":
                    nb = numel(p.shape) * itemsize(t.dtype)
                    bufs.slots[(t.name, p.offset)] = (total, nb)
                    total = align(total + nb)
            bufs.staging = torch.empty(total, dtype=torch.uint8, pin_memory=self._pin())
        self.packed_size = packed_size

    def _pin(self) -> bool:
        return self.cuda and torch.cuda.is_available()

    @property
    def nbytes(self) -> int:
        return sum(src.numel() * src.element_size() for _, _, src in self.copies)

    def run(self) -> tuple[Staged, np.ndarray | None]:
        """Copy; returns the staged pieces by (tensor, offset) and the packed buffer."""
        if self.ready is not None:
            stream = torch.cuda.Stream(device=self.copies[0][2].device)
            with torch.cuda.stream(stream):
                stream.wait_event(self.ready)
                out = self._copy()
            stream.synchronize()
            return out
        out = self._copy()
        if self.cuda:
            torch.cuda.synchronize()
        return out

    def _copy(self) -> tuple[Staged, np.ndarray | None]:
        staged: Staged = {}
        bufs = self.bufs
        with torch.no_grad():
            for t, p, src in self.copies:
                nb = numel(p.shape) * itemsize(t.dtype)
                if t.storage == "packed":
                    assert bufs.packed is not None
                    dst = bufs.packed[p.byte_offset: p.byte_offset + nb]
                    dst.view(src.dtype).view(p.shape).copy_(src, non_blocking=src.is_cuda)
                elif self.need_copy:
                    assert bufs.staging is not None
                    off, _ = bufs.slots[(t.name, p.offset)]
                    dst = bufs.staging[off: off + nb].view(src.dtype).view(p.shape)
                    dst.copy_(src, non_blocking=src.is_cuda)
                    staged[(t.name, p.offset)] = dst
                else:
                    staged[(t.name, p.offset)] = src.contiguous()
        packed = bufs.packed.numpy() if self.packed_size and bufs.packed is not None else None
        return staged, packed
