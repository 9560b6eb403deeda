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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from relight.ckpt.errors import UnsupportedStateError
from relight.ckpt.format import StorageKind, inner_chunk_shape, itemsize, numel
from relight.ckpt.gc_pause import gc_paused
from relight.ckpt.grid import MeshGrid, cell_box, cell_index, cell_of_index

__all__ = [
    "TensorLayout", "RankLayout", "PieceWrite", "TensorPlan", "SavePlan", "plan_save",
    "ReadTask", "LoadPlan", "plan_load", "layout_digest", "regular_grid", "intersect",
    "GridPieces", "layouts_from_parts", "GridRead", "GridNeed", "grid_needs_json",
    "parse_grid_needs", "needs_from_json",
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
    grid: MeshGrid | None = None
    """The closed form of the tensor's layout over its whole mesh, when it has one
    (`ckpt.grid`); `pieces` are then this rank's box, or empty in a `compact` form."""

    def to_json(self, compact: bool = False) -> list[Any]:
        pieces = [] if compact and self.grid is not None else [
            [list(o), list(s)] for o, s in self.pieces]
        out = [self.name, list(self.path), list(self.shape), self.dtype, self.placements,
               pieces]
        return out if self.grid is None else [*out, self.grid.to_json()]

    @staticmethod
    def from_json(j: list[Any]) -> TensorLayout:
        return TensorLayout(j[0], tuple(j[1]), tuple(j[2]), j[3], j[4],
                            tuple((tuple(o), tuple(s)) for o, s in j[5]),
                            MeshGrid.from_json(j[6]) if len(j) > 6 else None)


@dataclass(frozen=True, slots=True)
class RankLayout:
    """What one rank holds: tensors (with local pieces) and JSON value names."""

    rank: int
    tensors: tuple[TensorLayout, ...]
    values: tuple[str, ...]
    own: tuple[TensorLayout, ...] = ()
    """Read from the compact form (`layouts_from_parts`): the tensors without a grid,
    whose boxes are this rank's own. `tensors` then holds those with one, and ranks
    that sent the same grids share that tuple."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "tensors": [t.to_json() for t in (*self.tensors, *self.own)],
                "values": list(self.values)}

    @staticmethod
    def from_json(j: dict[str, Any]) -> RankLayout:
        return RankLayout(int(j["rank"]), tuple(TensorLayout.from_json(t) for t in j["tensors"]),
                          tuple(j["values"]))

    def compact(self) -> tuple[bytes, bytes]:
        """The layout as the save's all-gather carries it (`Comm.allgather_shared`): the
        tensors with a grid and the values (the same bytes on every rank of a mesh that
        holds the same tensors), and the tensors without one. No rank: the receiver
        knows it."""
        shared = {"tensors": [t.to_json(True) for t in self.tensors if t.grid is not None],
                  "values": list(self.values)}
        own = [t.to_json() for t in self.tensors if t.grid is None]
        return (json.dumps(shared, separators=(",", ":")).encode(),
                json.dumps(own, separators=(",", ":")).encode())


@gc_paused
def layouts_from_parts(parts: list[tuple[bytes, bytes]], ranks: tuple[int, ...]
                       ) -> list[RankLayout]:
    """Every rank's layout from its `compact` parts, each distinct shared part parsed
    once: ranks that sent the same one share its tensors tuple, which `plan_save` walks
    once for all of them."""
    shared: dict[bytes, tuple[tuple[TensorLayout, ...], tuple[str, ...]]] = {}
    out = []
    for (head, tail), rank in zip(parts, ranks, strict=True):
        got = shared.get(head)
        if got is None:
            j = json.loads(head)
            got = shared[head] = (tuple(TensorLayout.from_json(t) for t in j["tensors"]),
                                  tuple(j["values"]))
        own = () if tail == b"[]" else tuple(TensorLayout.from_json(t) for t in json.loads(tail))
        out.append(RankLayout(rank, got[0], got[1], own))
    return out


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


class GridPieces(Sequence[PieceWrite]):
    """The pieces of a tensor planned in grid form: one per non-empty cell, made on
    demand from the grid (a tensor split 16,384 ways is not 16,384 objects unless
    something walks them). Cells in row-major order, as sorted boxes are."""

    __slots__ = ("grid", "shape", "chunks", "cells", "array", "turn", "packed_offset")

    def __init__(self, grid: MeshGrid, shape: tuple[int, ...], chunks: tuple[int, ...],
                 array: str, turn: int, packed_offset: int = -1) -> None:
        self.grid, self.shape, self.chunks = grid, shape, chunks
        self.cells = grid.cells(shape, chunks)
        self.array, self.turn, self.packed_offset = array, turn, packed_offset

    @property
    def packed(self) -> bool:
        return self.packed_offset >= 0

    def writer(self, cell: tuple[int, ...]) -> int:
        # A packed tensor's cells share one replica, so each writer's packed array has
        # the same slots (`plan_save`); a chunked one's turn moves from cell to cell.
        return self.grid.writer(cell, self.cells, self.turn if self.packed
                                else self.turn + cell_index(cell, self.cells))

    def _piece(self, cell: tuple[int, ...], writer: int) -> PieceWrite:
        off, shp = cell_box(cell, self.shape, self.chunks)
        if self.packed:
            return PieceWrite(off, shp, writer, f"packed/r{writer:05d}", self.packed_offset)
        return PieceWrite(off, shp, writer, self.array)

    def written_by(self, rank: int) -> PieceWrite | None:
        """The piece `rank` writes, if any: a rank holds one cell of a grid tensor."""
        coord = self.grid.coord_of(rank)
        cell = None if coord is None else self.grid.cell_at(coord, self.cells)
        if cell is None or self.writer(cell) != rank:
            return None
        return self._piece(cell, rank)

    def __len__(self) -> int:
        return math.prod(self.cells)

    def __getitem__(self, i: int) -> PieceWrite:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        cell = cell_of_index(i % len(self), self.cells)
        return self._piece(cell, self.writer(cell))

    def __iter__(self) -> Iterator[PieceWrite]:
        for i in range(len(self)):
            cell = cell_of_index(i, self.cells)
            yield self._piece(cell, self.writer(cell))

    def _key(self) -> tuple[Any, ...]:
        return (self.grid, self.shape, self.chunks, self.array, self.turn, self.packed_offset)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, GridPieces):
            return self._key() == other._key()
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._key())


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
    pieces: Sequence[PieceWrite]
    """A tuple, or `GridPieces` for a tensor planned from its grid."""
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

    @property
    def coordinator(self) -> int:
        return self.ranks[0]

    def writes_of(self, rank: int) -> list[tuple[TensorPlan, PieceWrite]]:
        out = []
        for t in self.tensors.values():
            if isinstance(t.pieces, GridPieces):
                p = t.pieces.written_by(rank)
                if p is not None:
                    out.append((t, p))
            else:
                out.extend((t, p) for p in t.pieces if p.writer == rank)
        return out

    def write_bytes_of(self, rank: int) -> int:
        return sum(numel(p.shape) * itemsize(t.dtype) for t, p in self.writes_of(rank))

    @property
    def write_bytes(self) -> dict[int, int]:
        """Bytes each rank writes (walks every piece: for reports and tests)."""
        out = dict.fromkeys(self.ranks, 0)
        for t in self.tensors.values():
            for p in t.pieces:
                out[p.writer] = out.get(p.writer, 0) + numel(p.shape) * itemsize(t.dtype)
        return out


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


def _pad16(n: int) -> int:
    return ((n + 15) // 16) * 16


@gc_paused
def plan_save(
    layouts: list[RankLayout],
    ranks: tuple[int, ...],
    *,
    pack_bytes: int = 512 * 1024,
    inner_bytes: int = 4 << 20,
    packed_inner: int = 64 * 1024,
) -> SavePlan:
    """The global save plan; every rank computes the same one from the same layouts.

    Ranks whose layouts share one tensors tuple (`layouts_from_parts` makes them so when
    their descriptions are equal) are walked once. A tensor every rank of its mesh
    reports with the same `MeshGrid` is planned from the grid: its cells, their writers
    (the holder on the cell's shard coordinates, rotating over the replicated mesh dims)
    and its packed slot, in time that does not grow with the number of its pieces.
    Every other tensor (and a grid tensor some rank reports otherwise) is planned from
    its pieces: identical boxes are replicas, the biggest pieces first go each to its
    least-loaded holder."""
    groups: dict[tuple[int, int], tuple[RankLayout, list[int]]] = {}
    lays = {lay.rank: lay for lay in layouts}
    for lay in sorted(layouts, key=lambda x: x.rank):
        key = (id(lay.tensors), id(lay.values))
        if key in groups:
            groups[key][1].append(lay.rank)
        else:
            groups[key] = (lay, [lay.rank])

    by_name: dict[str, TensorLayout] = {}
    holders: dict[str, dict[Box, list[int]]] = {}
    grid_reports: dict[str, list[tuple[TensorLayout, list[int]]]] = {}
    value_owner: dict[str, int] = {}
    def agreed(t: TensorLayout, rank: int) -> None:
        seen = by_name.setdefault(t.name, t)
        if seen.shape != t.shape or seen.dtype != t.dtype:
            raise UnsupportedStateError(
                f"tensor {t.name!r} has global shape {seen.shape} {seen.dtype} on one rank "
                f"and {t.shape} {t.dtype} on rank {rank}; every rank must agree",
                tensor=t.name)

    for lay, members in groups.values():
        for t in lay.tensors:
            agreed(t, members[0])
            if t.grid is not None:
                grid_reports.setdefault(t.name, []).append((t, members))
            else:
                _add_holders(holders.setdefault(t.name, {}), t.pieces, members)
        for r in members:
            for t in lays[r].own:
                agreed(t, r)
                _add_holders(holders.setdefault(t.name, {}), t.pieces, [r])
        for v in lay.values:
            if v in by_name:
                raise UnsupportedStateError(f"{v!r} is a tensor on one rank, a value on another")
            value_owner.setdefault(v, members[0])
    for v in value_owner:
        if v in by_name:
            raise UnsupportedStateError(f"{v!r} is a tensor on one rank, a value on another")

    grids = _whole_grids(grid_reports, holders)

    # Coverage: distinct pieces must tile the tensor (no Partial, no gaps).
    for name, boxes in holders.items():
        total = sum(math.prod(s) for _, s in boxes)
        if total != numel(by_name[name].shape):
            raise UnsupportedStateError(
                f"tensor {name!r}: the ranks' distinct pieces hold {total} elements of "
                f"{numel(by_name[name].shape)}; placements disagree across ranks or leave "
                "gaps", tensor=name)

    # Writers of the pieces: biggest first, each to the least-loaded holder.
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
    order = sorted(by_name)
    # Packed grid tensors first: each takes one slot at the same offset in every packed
    # array of its writers (one replica of its mesh), so their cells need no offsets of
    # their own. Tensors of the same mesh and replica share a run of slots.
    slots: dict[str, int] = {}
    runs: dict[tuple[MeshGrid, int], list[tuple[str, int]]] = {}
    for idx, name in enumerate(order):
        g = grids.get(name)
        t = by_name[name]
        if g is not None and numel(t.shape) * itemsize(t.dtype) <= pack_bytes:
            cell = numel(g[1]) * itemsize(t.dtype)
            runs.setdefault(_replica_class(g[0], idx), []).append((name, _pad16(cell)))
    for (grid, turn), members in runs.items():
        writers = _replica_ranks(grid, turn)
        base = max((packed_size.get(r, 0) for r in writers), default=0)
        for name, size in members:
            slots[name] = base
            base += size
        for r in writers:
            packed_size[r] = base

    for idx, name in enumerate(order):
        t = by_name[name]
        item = itemsize(t.dtype)
        base = f"t{idx:05d}"
        g = grids.get(name)
        if g is not None:
            grid, chunks = g
            if name in slots:
                pieces = GridPieces(grid, t.shape, chunks, "", idx, slots[name])
                tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                           StorageKind.PACKED, "", (), (), pieces, -1)
                continue
            pieces = GridPieces(grid, t.shape, chunks, base, idx)
            inner = inner_chunk_shape(chunks, item, inner_bytes)
            # zarr.json from the writer of a cell that moves from tensor to tensor.
            meta = pieces.writer(cell_of_index(idx % len(pieces), pieces.cells))
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.GRID, base, chunks, inner, pieces, meta)
            continue
        boxes = sorted(holders[name])
        if numel(t.shape) * item <= pack_bytes:
            piece_list = []
            for box in boxes:
                w = writer[(name, box)]
                off = packed_size.get(w, 0)
                piece_list.append(PieceWrite(box[0], box[1], w, f"packed/r{w:05d}", off))
                packed_size[w] = off + _pad16(math.prod(box[1]) * item)
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.PACKED, "", (), (), tuple(piece_list), -1)
            continue
        chunks = regular_grid(t.shape, boxes)
        if chunks is not None:
            inner = inner_chunk_shape(chunks, item, inner_bytes)
            piece_tuple = tuple(PieceWrite(b[0], b[1], writer[(name, b)], base) for b in boxes)
            # zarr.json goes to the piece writer with the fewest so far: each is a small
            # durable put (two fsyncs on files), and Shard(0) would put them all on rank 0.
            meta = min(sorted({p.writer for p in piece_tuple}) or [ranks[0]],
                       key=lambda r: meta_count.get(r, 0))
            meta_count[meta] = meta_count.get(meta, 0) + 1
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.GRID, base, chunks, inner, piece_tuple, meta)
        else:
            piece_tuple = tuple(
                PieceWrite(b[0], b[1], writer[(name, b)], f"{base}/p{k:05d}")
                for k, b in enumerate(boxes))
            tensors[name] = TensorPlan(name, t.path, t.shape, t.dtype, t.placements,
                                       StorageKind.PIECES, base, (), (), piece_tuple, -1)
    return SavePlan(tuple(ranks), tensors, value_owner, packed_size, packed_inner)


def _add_holders(boxes: dict[Box, list[int]], pieces: tuple[Box, ...],
                 members: list[int]) -> None:
    for r in members:
        for box in pieces:
            if math.prod(box[1]) > 0:
                boxes.setdefault(box, []).append(r)


def _complete_grids(reports: dict[str, list[tuple[MeshGrid, tuple[int, ...], list[int]]]],
                    others: Any) -> set[str]:
    """The tensors to plan from their grids: every report (grid, shape, ranks) of the
    tensor has the same regular grid, its ranks are exactly the grid's mesh, and no rank
    has it in `others` (reports of it in another form)."""
    out: set[str] = set()
    checked: dict[tuple[Any, ...], bool] = {}
    for name, got in reports.items():
        grid, shape = got[0][0], got[0][1]
        if (name in others or grid.chunks(shape) is None
                or any(g != grid or s != shape for g, s, _ in got)):
            continue
        # Keyed by the member lists (shared by every tensor of a layout group).
        key = (grid, tuple(id(m) for _, _, m in got))
        if key not in checked:
            mesh = set(grid.ranks())
            reporters = [r for _, _, m in got for r in m]
            checked[key] = len(reporters) == len(mesh) and set(reporters) == mesh
        if checked[key]:
            out.add(name)
    return out


def _boxes_of(name: str, grid: MeshGrid, shape: tuple[int, ...], members: list[int]
              ) -> list[tuple[int, Box]]:
    """Each rank's box of a grid tensor planned from pieces after all."""
    out = []
    for r in members:
        coord = grid.coord_of(r)
        if coord is None:
            raise UnsupportedStateError(
                f"tensor {name!r}: rank {r} reports a mesh it is not part of", tensor=name)
        box = grid.box_at(coord, shape)
        if box is not None:
            out.append((r, box))
    return out


def _whole_grids(reports: dict[str, list[tuple[TensorLayout, list[int]]]],
                 holders: dict[str, dict[Box, list[int]]]
                 ) -> dict[str, tuple[MeshGrid, tuple[int, ...]]]:
    """The grid tensors planned from their grids (`_complete_grids`). The others join
    `holders`, each rank's box made from its grid."""
    plain = {name: [(t.grid, t.shape, m) for t, m in got] for name, got in reports.items()}
    whole = _complete_grids(plain, holders)  # type: ignore[arg-type]
    out: dict[str, tuple[MeshGrid, tuple[int, ...]]] = {}
    for name, got in reports.items():
        t0 = got[0][0]
        assert t0.grid is not None
        if name in whole:
            chunks = t0.grid.chunks(t0.shape)
            assert chunks is not None
            out[name] = (t0.grid, chunks)
            continue
        boxes = holders.setdefault(name, {})
        for t, members in got:
            assert t.grid is not None
            for r, box in _boxes_of(name, t.grid, t.shape, members):
                _add_holders(boxes, (box,), [r])
    return out


def _replica_class(grid: MeshGrid, turn: int) -> tuple[MeshGrid, int]:
    """Which replica of its mesh writes a packed grid tensor planned with `turn`."""
    rep = math.prod(grid.mesh[m] for m in grid.replicate_dims)
    return grid, turn % max(1, rep)


def _replica_ranks(grid: MeshGrid, turn: int) -> list[int]:
    """The ranks of `grid`'s mesh on replica `turn` (every shard coordinate)."""
    rep = grid.replicate_dims
    fixed: dict[int, int] = {}
    for m in reversed(rep):
        fixed[m] = turn % grid.mesh[m]
        turn //= grid.mesh[m]
    out = [grid.start]
    for m, (size, stride) in enumerate(zip(grid.mesh, grid.strides, strict=True)):
        values = [fixed[m]] if m in fixed else range(size)
        out = [r + i * stride for r in out for i in values]
    return out


# ---------------------------------------------------------------------------- load


@dataclass(frozen=True, slots=True)
class ReadTask:
    """Region `box` of tensor `name`: read by `reader`, sent to `receivers`."""

    name: str
    box: Box
    reader: int
    receivers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GridRead:
    """A tensor every rank of its mesh loads in the same grid form: the ranks holding a
    cell are the mesh's ranks on the cell's shard coordinates; one of them (rotating over
    the replicated mesh dims, cell by cell) reads it and sends it to the others, or with
    `broadcast` off each reads its own. A rank's task is computed from the grid alone."""

    name: str
    shape: tuple[int, ...]
    itemsize: int
    grid: MeshGrid
    chunks: tuple[int, ...]
    turn: int
    """The tensor's position among the grid reads: its rotation and its message tag."""
    broadcast: bool = True

    def task_of(self, rank: int) -> ReadTask | None:
        coord = self.grid.coord_of(rank)
        cells = self.grid.cells(self.shape, self.chunks)
        cell = None if coord is None else self.grid.cell_at(coord, cells)
        if cell is None:
            return None
        box = cell_box(cell, self.shape, self.chunks)
        if not self.broadcast:
            return ReadTask(self.name, box, rank, ())
        reader = self.grid.writer(cell, cells, self.turn + cell_index(cell, cells))
        holders = self.grid.holders(cell, cells)
        return ReadTask(self.name, box, reader, tuple(r for r in holders if r != reader))

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class LoadPlan:
    tasks: tuple[ReadTask, ...]
    read_bytes: dict[int, int]
    """Bytes each rank reads for `tasks` (the grid reads' are not counted here)."""
    grid_reads: tuple[GridRead, ...] = ()

    def mine(self, rank: int) -> list[tuple[int, ReadTask]]:
        """(tag, task) for every task `rank` reads or receives; a task's tag is the
        same on its reader and its receivers."""
        out = [(i, t) for i, t in enumerate(self.tasks)
               if t.reader == rank or rank in t.receivers]
        for g in self.grid_reads:
            task = g.task_of(rank)
            if task is not None and (task.reader == rank or rank in task.receivers):
                out.append((len(self.tasks) + g.turn, task))
        return out

    @property
    def total_read_bytes(self) -> int:
        """Bytes the whole group reads."""
        return sum(self.read_bytes.values()) + sum(
            g.nbytes * (1 if g.broadcast else g.grid.replicas) for g in self.grid_reads)


GridNeed = tuple[str, tuple[int, ...], int, MeshGrid]
"""A tensor a rank loads whose target layout has a grid: name, shape, itemsize, grid."""


def grid_needs_json(needs: list[GridNeed], wanted: list[str]) -> bytes:
    """A rank's grid needs and the names it wants, as `Comm.allgather_shared` carries
    them: equal on every rank of a mesh that loads the same state dict."""
    return json.dumps({"grids": [[n, list(s), i, g.to_json()] for n, s, i, g in needs],
                       "wanted": wanted}, separators=(",", ":")).encode()


@gc_paused
def parse_grid_needs(parts: list[bytes], ranks: tuple[int, ...]
                     ) -> list[tuple[list[GridNeed], list[str], list[int]]]:
    """Each distinct `grid_needs_json` text once: (needs, wanted, the ranks that sent it)."""
    seen: dict[bytes, tuple[list[GridNeed], list[str], list[int]]] = {}
    for text, rank in zip(parts, ranks, strict=True):
        got = seen.get(text)
        if got is None:
            j = json.loads(text)
            got = seen[text] = ([(n, tuple(s), i, MeshGrid.from_json(g))
                                 for n, s, i, g in j["grids"]], j["wanted"], [])
        got[2].append(rank)
    return list(seen.values())


@gc_paused
def needs_from_json(docs: list[list[Any]], ranks: tuple[int, ...]
                    ) -> dict[int, list[tuple[str, Box, int]]]:
    """`plan_load`'s needs from each rank's JSON list of [name, [offset, shape], itemsize]
    (with the collector paused: at thousands of ranks its passes over the new tuples
    cost more than building them)."""
    return {r: [(n, (tuple(b[0]), tuple(b[1])), i) for n, b, i in doc] if doc else []
            for r, doc in zip(ranks, docs, strict=True)}


@gc_paused
def plan_load(needs: dict[int, list[tuple[str, Box, int]]], broadcast: bool = True,
              grids: list[tuple[list[GridNeed], list[str], list[int]]] = ()) -> LoadPlan:
    """`needs[rank]` = [(tensor name, region, itemsize)]. With `broadcast`, ranks that
    need the same region form a group: the least-loaded member reads, others receive.
    `grids` (`parse_grid_needs`): tensors whose every rank of the mesh loads them in the
    same grid are planned per tensor (`GridRead`); the rest join `needs` box by box."""
    reports: dict[str, list[tuple[MeshGrid, tuple[int, ...], list[int]]]] = {}
    items: dict[str, int] = {}
    for got, _, members in grids:
        for name, shape, item, grid in got:
            reports.setdefault(name, []).append((grid, shape, members))
            items[name] = item
    plain = {name for rank in needs for name, _, _ in needs[rank]}
    whole = _complete_grids(reports, plain)
    needs = {r: list(v) for r, v in needs.items()}
    for name, got in reports.items():
        if name not in whole:
            for grid, shape, members in got:
                for r, box in _boxes_of(name, grid, shape, members):
                    needs.setdefault(r, []).append((name, box, items[name]))
    grid_reads = []
    for turn, name in enumerate(sorted(whole)):
        grid, shape, _ = reports[name][0]
        chunks = grid.chunks(shape)
        assert chunks is not None
        grid_reads.append(GridRead(name, shape, items[name], grid, chunks, turn, broadcast))

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
    return LoadPlan(tuple(tasks), load, tuple(grid_reads))
