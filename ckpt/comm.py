"""The few collectives the engine needs, over JSON (never pickle), with timeouts.

On the caller's groups they run on the calling (foreground) thread only: a background
save thread uses a gloo group of its own (`ckpt.commit_group`). Each says what it waits
for: a collective that fails or times out raises `CollectiveError` naming the
operation, the rank and the group, and that every rank of the group must make the same
call.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relight.ckpt.errors import CollectiveError
from relight.ckpt.gc_pause import gc_paused

__all__ = ["Comm", "parse_json_list", "ranks_text"]

GENERIC = "a checkpoint collective"
INLINE_BYTES = 120
"""Payload bytes `Comm.allgather_bytes` carries in its first all-gather, beside each
rank's length: a load's agreement (a digest and an error flag) and a barrier fit, so
they take one all-gather, not a sizes all-gather and a data all-gather. Kept small: at
16,384 ranks every rank receives 128 bytes of each."""


@gc_paused
def parse_json_list(blobs: list[bytes]) -> list[Any]:
    """Each blob's JSON value, with the garbage collector paused: what a collective
    gathered at thousands of ranks parses into millions of small objects at once (4,096
    ranks' indexes: 1.19 s with the collector running, 0.59 s paused)."""
    return [json.loads(b) for b in blobs]


def ranks_text(ranks: tuple[int, ...]) -> str:
    """A group's ranks for a message: in full up to 16, else the first and last and how
    many (an error at 4,096 ranks listed every one of them)."""
    if len(ranks) <= 16:
        return str(list(ranks))
    return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


class Comm:
    """A view of one process group: rank, size, global ranks, JSON all-gather, gather to
    the coordinator, p2p."""

    def __init__(self, group: Any = None, timeout_s: float = 300.0) -> None:
        self.active = dist.is_available() and dist.is_initialized()
        self.group = group
        self.timeout = timedelta(seconds=timeout_s)
        if self.active:
            self.rank = dist.get_rank()
            self.size = dist.get_world_size(group)
            self.ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            backend = dist.get_backend(group)
            self.device = (torch.device("cuda", torch.cuda.current_device())
                           if "nccl" in str(backend) else torch.device("cpu"))
        else:
            self.rank, self.size, self.ranks = 0, 1, (0,)
            self.device = torch.device("cpu")

    @property
    def coordinator(self) -> int:
        return self.ranks[0]

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    def _wait(self, work: Any, what: str) -> None:
        if work is None:
            return
        try:
            try:
                work.wait(self.timeout)
            except TypeError:  # backends whose wait takes no timeout
                work.wait()
        except RuntimeError as e:  # gloo: "Operation timed out!"; NCCL: DistBackendError
            raise CollectiveError(
                f"rank {self.rank}: {what} did not complete (waited up to "
                f"{self.timeout.total_seconds():.0f} s for ranks {ranks_text(self.ranks)}): "
                f"{type(e).__name__}: {e}. Every rank of the process group must make the "
                "same ckpt call (ckpt.save, ckpt.load, CheckpointManager.save and .restore "
                "are collective: calling them on rank 0 only hangs here); a rank that "
                "skipped it, died or is stuck leaves the others waiting") from e

    def _all_gather(self, out: list[torch.Tensor], buf: torch.Tensor) -> Any:
        """Start an all-gather of `buf` into `out` (one tensor per rank); its work."""
        return dist.all_gather(out, buf, group=self.group, async_op=True)

    def _gather(self, buf: torch.Tensor, out: list[torch.Tensor] | None) -> Any:
        """Start a gather of `buf` into `out` on the coordinator (None elsewhere)."""
        return dist.gather(buf, out, dst=self.coordinator, group=self.group, async_op=True)

    def _broadcast(self, buf: torch.Tensor, src: int) -> Any:
        """Start a broadcast of `buf` from global rank `src`."""
        return dist.broadcast(buf, src=src, group=self.group, async_op=True)

    def _padded(self, payload: bytes, width: int) -> torch.Tensor:
        """`payload` in a zero-padded uint8 tensor of `width` bytes on the group's device."""
        buf = torch.zeros(width, dtype=torch.uint8, device=self.device)
        if payload:
            buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buf

    def _buffers(self, width: int) -> list[torch.Tensor]:
        """One receive buffer of `width` bytes per rank of the group."""
        return [torch.zeros(width, dtype=torch.uint8, device=self.device)
                for _ in range(self.size)]

    @staticmethod
    def _unpadded(out: list[torch.Tensor], lens: list[int]) -> list[bytes]:
        """Each rank's payload: the first `lens[i]` bytes of its padded buffer."""
        return [bytes(o[:n].cpu().numpy().tobytes()) for o, n in zip(out, lens, strict=True)]

    def allgather_bytes(self, payload: bytes, what: str = GENERIC) -> list[bytes]:
        """Every rank's payload, in group order. The length and the first `INLINE_BYTES`
        travel in one fixed-width all-gather; only when some rank's payload is longer
        does a second carry the rest (each collective here waits for the slowest rank,
        and on a ring, as gloo's all-gather is, takes a hop per rank)."""
        if not self.active or self.size == 1:
            return [payload]
        width = 8 + INLINE_BYTES
        out = self._buffers(width)
        self._wait(self._all_gather(
            out, self._padded(len(payload).to_bytes(8, "little") + payload[:INLINE_BYTES],
                              width)), what)
        heads = self._rows(out)
        lens = [int.from_bytes(h[:8], "little") for h in heads]
        rest = max(lens) - INLINE_BYTES
        if rest <= 0:
            return [h[8: 8 + n] for h, n in zip(heads, lens, strict=True)]
        tails_out = self._buffers(rest)
        self._wait(self._all_gather(tails_out, self._padded(payload[INLINE_BYTES:], rest)),
                   what)
        tails = self._unpadded(tails_out, [max(0, n - INLINE_BYTES) for n in lens])
        return [h[8: 8 + min(n, INLINE_BYTES)] + t
                for h, n, t in zip(heads, lens, tails, strict=True)]

    @staticmethod
    def _rows(out: list[torch.Tensor]) -> list[bytes]:
        """Each rank's buffer as bytes, in one conversion of the stacked buffers."""
        flat = torch.stack(out).cpu().numpy().tobytes()
        w = out[0].numel()
        return [flat[i * w: (i + 1) * w] for i in range(len(out))]

    def allgather_fixed(self, payload: bytes, width: int, what: str = GENERIC) -> list[bytes]:
        """One all-gather of a fixed-width payload (the cheap per-save handshake)."""
        if len(payload) > width:
            raise ValueError(f"payload of {len(payload)} bytes exceeds width {width}")
        if not self.active or self.size == 1:
            return [payload.ljust(width, b"\0")]
        buf = self._padded(payload, width)
        out = self._buffers(width)
        self._wait(self._all_gather(out, buf), what)
        return [bytes(o.cpu().numpy().tobytes()) for o in out]

    def gather_fixed(self, payload: bytes, width: int,
                     what: str = GENERIC) -> list[bytes] | None:
        """One gather of a fixed-width payload to the coordinator (None on the others).
        Unlike an all-gather, whose ring takes as many hops as the group has ranks, the
        coordinator receives from every rank at once."""
        if len(payload) > width:
            raise ValueError(f"payload of {len(payload)} bytes exceeds width {width}")
        return self.gather_bytes(payload.ljust(width, b"\0"), [width] * self.size, what)

    def broadcast_fixed(self, payload: bytes, width: int,
                        what: str = GENERIC) -> bytes:
        """The coordinator's fixed-width `payload` on every rank (others pass b"")."""
        if len(payload) > width:
            raise ValueError(f"payload of {len(payload)} bytes exceeds width {width}")
        if not self.active or self.size == 1:
            return payload.ljust(width, b"\0")
        buf = self._padded(payload if self.is_coordinator else b"", width)
        self._wait(self._broadcast(buf, self.coordinator), what)
        return bytes(buf.cpu().numpy().tobytes())

    def ask_coordinator(self, payload: bytes, width: int,
                        decide: Callable[[list[bytes]], bytes], reply_width: int,
                        what: str = GENERIC) -> bytes:
        """Every rank's fixed-width `payload` goes to the coordinator, which runs
        `decide` on all of them (in group order) and broadcasts its fixed-width reply to
        every rank: one gather and one broadcast, the way every rank learns something
        about every other without a ring all-gather."""
        got = self.gather_fixed(payload, width, what)
        return self.broadcast_fixed(decide(got) if got is not None else b"", reply_width,
                                    what)

    def gather_bytes(self, payload: bytes, lens: list[int],
                     what: str = GENERIC) -> list[bytes] | None:
        """Every rank's payload, in group order, on the coordinator only (None on the
        others). The coordinator passes every rank's payload length, known from an
        earlier collective; the others may pass only the longest, so this is one gather
        and nothing else."""
        if not self.active or self.size == 1:
            return [payload]
        width = max(1, *lens)
        buf = self._padded(payload, width)
        out = self._buffers(width) if self.is_coordinator else None
        self._wait(self._gather(buf, out), what)
        if out is None:
            return None
        return self._unpadded(out, lens)

    def allgather_shared(self, shared: bytes, own: bytes, what: str = GENERIC
                         ) -> list[tuple[bytes, bytes]]:
        """Every rank's (`shared`, `own`) pair, in group order. `shared` is what many
        ranks send alike (the layout of a mesh's tensors): it travels as a digest in the
        all-gather of the `own` parts, and each distinct text that some rank lacks once,
        broadcast by the first rank that has it (when every rank sends the same text, as
        the ranks of one mesh loading or saving the same state dict do, nothing more
        travels). Ranks with equal shared texts get the same bytes object."""
        if not self.active or self.size == 1:
            return [(shared, own)]
        head = hashlib.sha256(shared).digest()[:16] + len(shared).to_bytes(8, "little")
        got = self.allgather_bytes(head + own, what)
        first: dict[bytes, int] = {}
        holders: dict[bytes, int] = {}
        for i, g in enumerate(got):
            first.setdefault(g[:16], i)
            holders[g[:16]] = holders.get(g[:16], 0) + 1
        texts: dict[bytes, bytes] = {}
        for digest, i in first.items():  # the same order on every rank
            n = int.from_bytes(got[i][16:24], "little")
            mine = self.ranks[i] == self.rank
            if holders[digest] == self.size:  # every rank holds this text already
                texts[digest] = shared
                continue
            if n == 0:
                texts[digest] = b""
                continue
            buf = self._padded(shared if mine else b"", n)
            self._wait(self._broadcast(buf, self.ranks[i]), what)
            texts[digest] = shared if mine else bytes(buf.cpu().numpy().tobytes())
        return [(texts[g[:16]], g[24:]) for g in got]

    def allgather_json(self, obj: Any, what: str = GENERIC) -> list[Any]:
        blobs = self.allgather_bytes(json.dumps(obj, separators=(",", ":")).encode(), what)
        return parse_json_list(blobs)

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]], what: str = GENERIC) -> None:
        """Point-to-point: (tensor, global peer rank, tag); a send and its receive share a tag."""
        if not self.active:
            return
        works = []
        for t, peer, tag in sends:
            works.append(dist.isend(t.to(self.device), dst=peer, group=self.group, tag=tag))
        bufs = []
        for t, peer, tag in recvs:
            b = t if t.device == self.device else torch.empty_like(t, device=self.device)
            bufs.append((t, b))
            works.append(dist.irecv(b, src=peer, group=self.group, tag=tag))
        for w in works:
            self._wait(w, what)
        for t, b in bufs:
            if b is not t:
                t.copy_(b)

    def barrier(self, what: str = GENERIC) -> None:
        if self.active and self.size > 1:
            self.allgather_bytes(b"", what)
