"""Planning: who writes what, in which storage form; who reads what. Pure functions
over JSON-able layout descriptions, so they are tested without processes.

Save: every rank describes its local layout (`RankLayout`); all ranks gather all
descriptions and compute the same `SavePlan`: identical pieces held by several ranks
(replicas) are written once, by the holder with the least bytes assigned so far, so
the work spreads over replicas. Each tensor is stored as one global zarr array chunked
on the save-time shard boundaries when those form a regular grid ("grid"), else as one
array per distinct piece with its global offset ("pieces"), and tensors no larger than
`pack_bytes` are packed into one byte array per writer ("packed").

Load: every rank describes the global regions it needs; ranks needing the same region
of a tensor form a replica group, one of which reads it and sends it to the others
(`LoadPlan`), spreading the readers over the group.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import UnsupportedStateError
from ckpt.format import StorageKind, inner_chunk_shape, itemsize, numel
from ckpt.gc_pause import gc_paused

__all__ = [
    "TensorLayout", "RankLayout", "PieceWrite", "TensorPlan", "SavePlan", "plan_save",
    "ReadTask", "LoadPlan", "plan_load", "layout_digest", "regular_grid", "intersect",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)


@dataclass(frozen=True, slots=True)
class TensorLayout:
    name: str
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: str
    placements: str
    pieces: tuple[Box, ...]

    def to_json(self) -> list[Any]:
        return [self.name, list(self.path), list(self.shape), self.dtype, self.placements,
                [[list(o), list(s)] for o, s in self.pieces]]

    @staticmethod
    def from_json(j: list[Any]) -> TensorLayout:
        return TensorLayout(j[0], tuple(j[1]), tuple(j[2]), j[3], j[4],
                            tuple((tuple(o), tuple(s)) for o, s in j[5]))


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What one rank holds: tensors (with local pieces) and JSON value names."""

    rank: int
    tensors: tuple[TensorLayout, ...]
    values: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "tensors": [t.to_json() for t in self.tensors],
                "values": list(self.values)}

    @staticmethod
    def from_json(j: dict[str, Any]) -> RankLayout:
        return RankLayout(int(j["rank"]), tuple(TensorLayout.from_json(t) for t in j["tensors"]),
                          tuple(j["values"]))


def intersect(a_off, a_shape, b_off, b_shape) -> Box | None:  # noqa: ANN001 - int sequences
    """The box two boxes share, or None when they share no element."""
    off, shp = [], []
    for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def layout_digest(layout: RankLayout, extra: Any = None) -> str:
    blob = json.dumps([layout.to_json(), extra], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class PieceWrite:
    """One distinct piece of a tensor and the rank that writes it."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    writer: int
    array: str
    """Array (relative to the attempt's data dir) the piece goes into."""
    byte_offset: int = -1
    """For packed pieces: where its bytes start in the writer's packed array."""

    @property
    def nbytes_elems(self) -> int:
        return numel(self.shape)


@dataclass(frozen=True, slots=True)
class TensorPlan:
    name: str
    path: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: str
    placements: str
    storage: StorageKind
    array: str
    chunks: tuple[int, ...]
    inner: tuple[int, ...]
    pieces: tuple[PieceWrite, ...]
    meta_writer: int
    """The rank that writes this tensor's zarr.json ("grid"); pieces' writers write theirs."""

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class SavePlan:
    ranks: tuple[int, ...]
    """Global ranks taking part, in group order; ranks[0] is the coordinator."""
    tensors: dict[str, TensorPlan]
    value_owner: dict[str, int]
    packed_size: dict[int, int]
    """Bytes in each writer's packed array (0 or absent: none)."""
    packed_inner: int
    write_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def coordinator(self) -> int:
        return self.ranks[0]

    def writes_of(self, rank: int) -> list[tuple[TensorPlan, PieceWrite]]:
        return [(t, p) for t in self.tensors.values() for p in t.pieces if p.writer == rank]


def regular_grid(shape: tuple[int, ...], boxes: list[Box]) -> tuple[int, ...] | None:
    """The chunk shape if `boxes` are exactly the cells of a regular grid over `shape`."""
    if not shape:
        return () if len(boxes) == 1 else None
    chunks = tuple(max(s[d] for _, s in boxes) for d in range(len(shape)))
    if any(c == 0 for c in chunks):
        return None
    cells = math.prod(math.ceil(s / c) for s, c in zip(shape, chunks, strict=True))
    if cells != len(boxes):
        return None
    for off, shp in boxes:
        for d in range(len(shape)):
            if off[d] % chunks[d] or shp[d] != min(chunks[d], shape[d] - off[d]):
                return None
    return chunks


@gc_paused
def plan_save(
    layouts: list[RankLayout],
    ranks: tuple[int, ...],
    *,
    pack_bytes: int = 512 * 1024,
    inner_bytes: int = 4 << 20,
    packed_inner: int = 64 * 1024,
) -> SavePlan:
    """The global save plan; every rank computes the same one from the same layouts."""
    by_name: dict[str, TensorLayout] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    value_owner: dict[str, int] = {}
    for lay in sorted(layouts, key=lambda x: x.rank):
        for t in lay.tensors:
            seen = by_name.setdefault(t.name, t)
            if seen.shape != t.shape or seen.dtype != t.dtype:
                raise UnsupportedStateError(
                    f"tensor {t.name!r} has global shape {seen.shape} {seen.dtype} on one rank "
                    f"and {t.shape} {t.dtype} on rank {lay.rank}; every rank must agree",
                    tensor=t.name)
            boxes = holders.setdefault(t.name, {})
            for box in t.pieces:
                if math.prod(box[1]) > 0:
                    boxes.setdefault(box, []).append(lay.rank)
        for v in lay.values:
            if v in by_name:
                raise UnsupportedStateError(f"{v!r} is a tensor on one rank, a value on another")
            value_owner.setdefault(v, lay.rank)
    for v in value_owner:
        if v in by_name:
            raise UnsupportedStateError(f"{v!r} is a tensor on one rank, a value on another")

    # Coverage: distinct pieces must tile the tensor (no Partial, no gaps).
    for name, t in by_name.items():
        total = sum(math.prod(s) for _, s in holders[name])
        if total != numel(t.shape):
            raise UnsupportedStateError(
                f"tensor {name!r}: the ranks' distinct pieces hold {total} elements of "
                f"{numel(t.shape)}; placements disagree across ranks or leave gaps",
                tensor=name)

    # Writers: biggest pieces first, each to the least-loaded holder.
    load: dict[int, int] = {r: 0 for r in ranks}
    jobs = []
    for name, boxes in holders.items():
        item = itemsize(by_name[name].dtype)
        for box, hs in boxes.items():
            jobs.append((math.prod(box[1]) * item, name, box, hs))
    jobs.sort(key=lambda j: (-j[0], j[1], j[2]))
    writer: dict[tuple[str, Box], int] = {}
    for nbytes, name, box, hs in jobs:
        w = min(hs, key=lambda r: (load[r], (r - len(writer)) % max(len(ranks), 1)))
        writer[(name, box)] = w
        load[w] += nbytes

    tensors: dict[str, TensorPlan] = {}
    packed_size: dict[int, int] = {}
    meta_count: dict[int, int] = {}
    for idx, name in enumerate(sorted(by_name)):
        t = by_name[name]
        item = itemsize(t.dtype)
        boxes = sorted(holders[name])
        base = f"t{idx:05d}"
        if numel(t.shape) * item <= pack_bytes:
            pieces = []
            for box in boxes:
                w = writer[(name, box)]
                off = packed_size.get(w, 0)
                pieces.append(PieceWrite(box[0], box[1], w, f"packed/r{w:05d}", off))
                nb = math.prod(box[1]) * item
                packed_size[w] = off + ((nb + 15) // 16) * 16
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.PACKED, "", (), (), tuple(pieces), -1)
            continue
        chunks = regular_grid(t.shape, boxes)
        if chunks is not None:
            inner = inner_chunk_shape(chunks, item, inner_bytes)
            pieces = tuple(PieceWrite(b[0], b[1], writer[(name, b)], base) for b in boxes)
            # zarr.json goes to the piece writer with the fewest so far: each is a small
            # durable put (two fsyncs on files), and Shard(0) would put them all on rank 0.
            meta = min(sorted({p.writer for p in pieces}) or [ranks[0]],
                       key=lambda r: meta_count.get(r, 0))
            meta_count[meta] = meta_count.get(meta, 0) + 1
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.GRID, base, chunks, inner, pieces, meta)
        else:
            pieces = tuple(
                PieceWrite(b[0], b[1], writer[(name, b)], f"{base}/p{k:05d}")
                for k, b in enumerate(boxes))
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.PIECES, base, (), (), pieces, -1)
    write_bytes = {r: 0 for r in ranks}
    for (name, box), w in writer.items():
        write_bytes[w] += math.prod(box[1]) * itemsize(by_name[name].dtype)
    return SavePlan(tuple(ranks), tensors, value_owner, packed_size, packed_inner, write_bytes)


# ---------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class ReadTask:
    """Region `box` of tensor `name`: read by `reader`, sent to `receivers`."""

    name: str
    box: Box
    reader: int
    receivers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LoadPlan:
    tasks: tuple[ReadTask, ...]
    read_bytes: dict[int, int]


@gc_paused
def plan_load(needs: dict[int, list[tuple[str, Box, int]]], broadcast: bool = True) -> LoadPlan:
    """`needs[rank]` = [(tensor name, region, itemsize)]. With `broadcast`, ranks that
    need the same region form a group: the least-loaded member reads, others receive."""
    groups: dict[tuple[str, Box], list[int]] = {}
    sizes: dict[tuple[str, Box], int] = {}
    for rank in sorted(needs):
        for name, box, item in needs[rank]:
            if math.prod(box[1]) == 0:
                continue
            groups.setdefault((name, box), []).append(rank)
            sizes[(name, box)] = math.prod(box[1]) * item
    load: dict[int, int] = {r: 0 for r in needs}
    tasks: list[ReadTask] = []
    order = sorted(groups, key=lambda k: (-sizes[k], k))
    for i, key in enumerate(order):
        members = groups[key]
        if not broadcast:
            for r in members:
                tasks.append(ReadTask(key[0], key[1], r, ()))
                load[r] += sizes[key]
            continue
        # The rotation's modulus once per group: inside the key it was O(members^2), a
        # quadratic term in the replica count of HSDP layouts.
        span = max(members) + 1
        reader = min(members, key=lambda r: (load[r], (r + i) % span))
        load[reader] += sizes[key]
        tasks.append(ReadTask(key[0], key[1], reader, tuple(r for r in members if r != reader)))
    return LoadPlan(tuple(tasks), load)
