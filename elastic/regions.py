"""Moving and summing tensor regions between replica groups whose layouts differ.

Every rank describes what it holds as the checkpoint planners do (`ckpt.layout.rank_layout`:
per tensor its global shape, dtype and the boxes of the global tensor it holds). For one
destination rank and one source group, `route` says which source rank supplies which box
of which tensor. A box held by several ranks of the group (replicas inside it: a
TP-replicated norm, a plain tensor) comes from one of them, chosen by the destination's
rank so the work spreads; under any DTensor layout two ranks' boxes are equal or disjoint,
so the boxes that meet a destination box cover it exactly once, and one that is covered
twice or not at all is a `RegionError`, as is a tensor missing or of another shape or dtype.

`plan_copy` and `plan_sum` turn the routes into what one rank sends to and receives from
each other rank; `copy_regions` and `sum_regions` carry them over a process group of every
rank taking part: point-to-point messages of about `MESSAGE_BYTES` between each pair of
ranks that share anything (a sender packs the next while the last travels), each message's
bytes followed by their crc32c, checked on arrival.

- copy (a heal): each destination box takes the source group's values;
- sum (a cross-group reduction): every rank's boxes become the sum of every group's
  values, added in the groups' order on every rank, so ranks of different layouts that
  hold the same element end with the same bits (elementwise addition in one order).

What a sum costs: each rank receives its own elements once from every other group (a ring
all-reduce of matching layouts moves twice its elements once), and holds one zeroed copy
of its tensors per other group while it adds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from relight.ckpt.state_layout import Box, Piece, RankLayout, TensorLayout, intersect
from relight.errors import RelightError
from relight.storage.checksum import crc32c

__all__ = ["RegionError", "RegionMismatchError", "Segment", "Transfer", "copy_regions",
           "plan_copy", "plan_sum",
           "route", "sum_regions"]

_TAG = 7
MESSAGE_BYTES = 64 << 20
"""About how many bytes one message between two ranks carries."""
SEND_WINDOW = 8
"""Messages a rank has packed and not yet seen delivered: what bounds the host memory a
heal of a large state takes on a sender (`SEND_WINDOW * MESSAGE_BYTES`)."""


class RegionError(RelightError, RuntimeError):
    """Two layouts cannot exchange their regions (a tensor missing or of another shape or
    dtype, a box the source group does not cover exactly once), or a message arrived
    damaged or not at all."""


class RegionMismatchError(RegionError):
    """The layouts describe different states (a tensor missing, of another shape or
    dtype, or a box the source does not cover): no retry can succeed."""


@dataclass(frozen=True, slots=True)
class Segment:
    """Box `box` (global coordinates) of tensor `name`, from piece `src_piece` of rank
    `src` to piece `dst_piece` of rank `dst`."""

    name: str
    src: int
    dst: int
    src_piece: int
    dst_piece: int
    box: Box


@dataclass(slots=True)
class Transfer:
    """One rank's part of an exchange: the segments it sends to each rank and receives
    from each rank, in the order both sides pack and unpack them."""

    sends: dict[int, list[Segment]] = field(default_factory=dict)
    recvs: dict[int, list[Segment]] = field(default_factory=dict)

    def add(self, me: int, segments: list[Segment]) -> None:
        for s in segments:
            if s.src == me:
                self.sends.setdefault(s.dst, []).append(s)
            if s.dst == me:
                self.recvs.setdefault(s.src, []).append(s)


def route(dst: RankLayout, sources: Sequence[RankLayout]) -> list[Segment]:
    """Where every box `dst` holds comes from in the group of ranks `sources`, tensor by
    tensor in `dst`'s (name) order. Both sides must hold the same tensors (names, global
    shapes, dtypes); layouts are free."""
    held: dict[str, list[tuple[int, TensorLayout]]] = {}
    for src in sources:
        for t in src.tensors:
            held.setdefault(t.name, []).append((src.rank, t))
    # The source group may hold more than one destination rank does (a pipeline stage
    # holds its own layers only), never less.
    missing = sorted({t.name for t in dst.tensors} - set(held))
    if missing:
        raise RegionMismatchError(
            f"the state dicts differ: {len(missing)} tensor(s) at rank {dst.rank} that no "
            f"rank of the source group holds (first: {missing[:3]})")
    segments: list[Segment] = []
    for t in dst.tensors:
        boxes: dict[Box, list[tuple[int, int]]] = {}
        for rank, st in held[t.name]:
            if st.shape != t.shape or st.dtype != t.dtype:
                raise RegionMismatchError(
                    f"tensor {t.name!r} is {list(t.shape)} {t.dtype} at rank {dst.rank} "
                    f"and {list(st.shape)} {st.dtype} at rank {rank}: the states differ")
            for i, box in enumerate(st.pieces):
                boxes.setdefault(box, []).append((rank, i))
        for j, want in enumerate(t.pieces):
            covered = 0
            for box, holders in boxes.items():
                inter = intersect(*want, *box)
                if inter is None:
                    continue
                rank, i = holders[dst.rank % len(holders)]
                segments.append(Segment(t.name, rank, dst.rank, i, j, inter))
                covered += math.prod(inter[1])
            if covered != math.prod(want[1]):
                raise RegionMismatchError(
                    f"tensor {t.name!r}: the source group covers {covered} of the "
                    f"{math.prod(want[1])} elements of box {want} that rank {dst.rank} "
                    "holds (its boxes leave a gap or overlap)")
    return segments


def plan_copy(layouts: Sequence[RankLayout], source: Sequence[int], dests: Sequence[int],
              me: int) -> Transfer:
    """Rank `me`'s part of copying the state of the ranks `source` into the ranks `dests`
    (`layouts[r]` describes rank `r` of the exchange's process group)."""
    plan = Transfer()
    sources = [layouts[r] for r in source]
    for d in dests:
        # Every rank routes every destination, its own part or not: a state that cannot
        # take the copy then fails the heal on every member at once, bystanders included
        # (else they would wait out a timeout in the exchange that follows).
        plan.add(me, route(layouts[d], sources))
    return plan


def plan_sum(layouts: Sequence[RankLayout], groups: Sequence[Sequence[int]], me: int
             ) -> Transfer:
    """Rank `me`'s part of summing across `groups` (each a list of exchange ranks): every
    rank receives its boxes from every other group."""
    plan = Transfer()
    for g in groups:
        sources = [layouts[r] for r in g]
        for d in range(len(layouts)):
            if d not in g and (d == me or me in g):
                plan.add(me, route(layouts[d], sources))
    return plan


def _view(t: torch.Tensor, piece: Piece, box: Box) -> torch.Tensor:
    """The part of local tensor `t` that holds `box` of `piece`."""
    index = tuple(slice(ls + o - po, ls + o - po + n) for ls, po, o, n
                  in zip(piece.local_start, piece.offset, box[0], box[1], strict=True))
    return t[index] if index else t


def _nbytes(t: torch.Tensor, box: Box) -> int:
    return math.prod(box[1]) * t.element_size()


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _crc_bytes(body: torch.Tensor) -> torch.Tensor:
    crc = crc32c(body.numpy()) if body.numel() else crc32c(b"")
    return torch.tensor(list(crc.to_bytes(4, "little")), dtype=torch.uint8)


def _pack(segs: list[Segment], tensors: Mapping[str, torch.Tensor],
          pieces: Mapping[str, list[Piece]]) -> torch.Tensor:
    """The message to one rank: every segment's bytes in order, copied once into one
    host buffer, then their crc32c."""
    buf = torch.empty(sum(_nbytes(tensors[s.name], s.box) for s in segs) + 4,
                      dtype=torch.uint8)
    off = 0
    for s in segs:
        src = _view(tensors[s.name], pieces[s.name][s.src_piece], s.box)
        n = _nbytes(src, s.box)
        dst = buf[off:off + n]
        if off % src.element_size() == 0:
            dst.view(src.dtype).view(s.box[1]).copy_(src)
        else:
            dst.copy_(_as_bytes(src.cpu()))
        off += n
    buf[-4:] = _crc_bytes(buf[:-4])
    return buf


def _messages(segs: list[Segment], tensors: Mapping[str, torch.Tensor]
              ) -> list[list[Segment]]:
    """`segs` cut into messages of about `MESSAGE_BYTES` (a segment is never split), so a
    sender packs the next message while the last one travels."""
    out: list[list[Segment]] = []
    size = 0
    for s in segs:
        n = _nbytes(tensors[s.name], s.box)
        if not out or (size + n > MESSAGE_BYTES and out[-1]):
            out.append([])
            size = 0
        out[-1].append(s)
        size += n
    return out


def _exchange(pg: dist.ProcessGroup, plan: Transfer, tensors: Mapping[str, torch.Tensor],
              pieces: Mapping[str, list[Piece]], timeout_s: float
              ) -> list[tuple[int, list[Segment], torch.Tensor]]:
    """Post every receive of `plan`, then pack and send, the destinations in turn; wait
    for all (each bounded by `timeout_s`) and check every message's crc32c. The messages
    received: (source rank, its segments, its body)."""
    wait = timedelta(seconds=timeout_s)
    recvs, sends, received = [], [], []
    try:
        # Every receive is posted before this rank waits for anything, so no send of
        # another rank can wait on this one's progress.
        for src, segs in sorted(plan.recvs.items()):
            for k, msg in enumerate(_messages(segs, tensors)):
                buf = torch.empty(sum(_nbytes(tensors[s.name], s.box) for s in msg) + 4,
                                  dtype=torch.uint8)
                received.append((src, msg, buf))
                recvs.append(pg.recv([buf], src, _TAG + k))
        outgoing = {dst: _messages(segs, tensors) for dst, segs in sorted(plan.sends.items())}
        for k in range(max((len(m) for m in outgoing.values()), default=0)):
            for dst, msgs in outgoing.items():
                if k < len(msgs):
                    if len(sends) >= SEND_WINDOW:
                        sends.pop(0)[0].wait(wait)
                    buf = _pack(msgs[k], tensors, pieces)  # host bytes, read by gloo and crc
                    sends.append((pg.send([buf], dst, _TAG + k), buf))
        for w in [w for w, _ in sends] + recvs:
            w.wait(wait)
    except RuntimeError as exc:  # gloo: a peer closed, died or timed out
        raise RegionError(f"region exchange did not complete (each message waited up to "
                          f"{timeout_s:.0f} s): {exc}") from exc
    bodies = []
    for src, msg, buf in received:
        body = buf[:-4]
        if not torch.equal(_crc_bytes(body), buf[-4:]):
            raise RegionError(f"region exchange: a message from rank {src} arrived with a "
                              "crc32c that differs from the sender's")
        bodies.append((src, msg, body))
    return bodies


def _segments_of(body: torch.Tensor, segs: list[Segment], tensors: Mapping[str, torch.Tensor]
                 ) -> Iterator[tuple[Segment, torch.Tensor]]:
    off = 0
    for s in segs:
        t = tensors[s.name]
        n = _nbytes(t, s.box)
        raw = body[off:off + n]
        if off % t.element_size():  # a dtype view needs an aligned start
            raw = raw.clone()
        yield s, raw.view(t.dtype).reshape(s.box[1])
        off += n


def copy_regions(pg: dist.ProcessGroup, plan: Transfer, tensors: Mapping[str, torch.Tensor],
                 pieces: Mapping[str, list[Piece]], *, timeout_s: float) -> int:
    """Carry out `plan` (from `plan_copy`) on the local tensors `tensors` (by name, with
    their `pieces`); the bytes this rank received."""
    received = _exchange(pg, plan, tensors, pieces, timeout_s)
    for _src, msg, body in received:
        for s, part in _segments_of(body, msg, tensors):
            _view(tensors[s.name], pieces[s.name][s.dst_piece], s.box).copy_(part)
    return sum(b.numel() for _, _, b in received)


def sum_regions(pg: dist.ProcessGroup, plan: Transfer, tensors: Mapping[str, torch.Tensor],
                pieces: Mapping[str, list[Piece]], group_of: Sequence[int], *,
                timeout_s: float) -> int:
    """Carry out `plan` (from `plan_sum`): every local tensor becomes the sum over the
    groups, ((x0 + x1) + x2) + ... in group order on every rank (`group_of[r]`: the group
    index of exchange rank `r`); the bytes this rank received."""
    received = _exchange(pg, plan, tensors, pieces, timeout_s)
    mine, groups = group_of[pg.rank()], max(group_of) + 1
    parts: dict[int, list[tuple[Segment, torch.Tensor]]] = {g: [] for g in range(groups)}
    for src, msg, body in received:
        parts[group_of[src]].extend(_segments_of(body, msg, tensors))
    held = sum(t.numel() for t in tensors.values())
    for g in range(groups):
        got = sum(math.prod(s.box[1]) for s, _ in parts[g])
        if g != mine and got != held:
            raise RegionError(f"cross-group sum: group {g} sent {got} of the {held} elements "
                              f"rank {pg.rank()} holds")

    def add(acc: Mapping[str, torch.Tensor], g: int) -> None:
        for s, part in parts[g]:
            view = _view(acc[s.name], pieces[s.name][s.dst_piece], s.box)
            view.add_(part.to(view.device))  # messages arrive in host memory

    if mine <= 1:
        # Addition commutes bit for bit, so x1 + x0 is x0 + x1: the first two groups' ranks
        # add into their own tensors.
        for g in range(groups):
            if g != mine:
                add(tensors, g)
        return sum(b.numel() for _, _, b in received)
    acc = {n: torch.empty_like(t) for n, t in tensors.items()}
    for s, part in parts[0]:
        _view(acc[s.name], pieces[s.name][s.dst_piece], s.box).copy_(part)
    for g in range(1, groups):
        if g == mine:
            for n, t in acc.items():
                t.add_(tensors[n])
        else:
            add(acc, g)
    for n, t in tensors.items():
        t.copy_(acc[n])
    return sum(b.numel() for _, _, b in received)
