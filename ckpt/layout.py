"""Where the local data of a tensor sits in its global tensor.

A plain tensor is one piece covering everything (treated as replicated). A DTensor's
local tensor covers, per tensor dim, the global indices that its placements give the
current rank; we follow DTensor's own sharding rules (the same ones behind
`torch.distributed.tensor._utils.compute_local_shape_and_global_offset`) but keep
every index rather than the first, because strided sharding (FSDP2 over TP) can give
a rank non-contiguous rows. Each maximal contiguous block is one `Piece`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from relight.ckpt.errors import UnsupportedStateError
from relight.ckpt.flatten import FlatState
from relight.ckpt.format import dtype_name
from relight.ckpt.grid import MeshGrid
from relight.ckpt.plan import RankLayout, TensorLayout, layout_digest

try:  # private in torch; present in 2.4+ under this name
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard
except ImportError:  # pragma: no cover - older torch
    _get_shard_size_and_offsets = None
    _StridedShard = Shard

__all__ = ["LayoutMemo", "Piece", "local_pieces", "local_view", "describe_placements",
           "rank_layout",
           "mesh_grid"]


@dataclass(frozen=True, slots=True)
class Piece:
    """A contiguous box of the global tensor held locally."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    local_start: tuple[int, ...]
    """Where the box starts in the local tensor (same shape)."""

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def describe_placements(t: torch.Tensor) -> str:
    if isinstance(t, DTensor):
        return ",".join(repr(p) for p in t.placements) + f"@{tuple(t.device_mesh.shape)}"
    return "local"


def _runs(indices: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal contiguous runs of a (sorted or not) 1-D index tensor: (local_start,
    length, global). Vectorized: a rank's dim can hold tens of millions of indices (a
    flat 1-D state), and a Python pass over them cost seconds per new layout, i.e. per
    restarted process."""
    n = int(indices.numel())
    if n == 0:
        return []
    idx = indices.reshape(-1).to(torch.long)
    breaks = torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks])
    ends = torch.cat([breaks, torch.tensor([n], dtype=torch.long)])
    return [(s, e - s, g) for s, e, g in zip(starts.tolist(), ends.tolist(),
                                              idx[starts].tolist(), strict=True)]


def _dim_indices(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                 coord: list[int], placements, name: str) -> dict[int, torch.Tensor]:
    offsets: dict[int, torch.Tensor | None] = {}
    local = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise UnsupportedStateError(
                f"tensor {name!r} has a Partial placement; redistribute it to Shard or "
                "Replicate before checkpointing", tensor=name)
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise UnsupportedStateError(
                f"tensor {name!r} has unsupported placement {p!r}", tensor=name)
        d = p.dim
        size, idx = _get_shard_size_and_offsets(
            local[d], mesh_shape[mesh_dim], coord[mesh_dim], p, offsets.get(d),
            global_shape[d], False)
        local[d] = int(size)
        offsets[d] = idx if size else torch.empty(0, dtype=torch.long)
    return {d: (torch.empty(0, dtype=torch.long) if idx is None
                else torch.as_tensor(idx, dtype=torch.long))
            for d, idx in offsets.items()}


def local_pieces(t: torch.Tensor, name: str = "") -> tuple[tuple[int, ...], list[Piece]]:
    """(global shape, local pieces). Empty list when the rank holds no element."""
    if not isinstance(t, DTensor):
        shape = tuple(t.shape)
        return shape, [Piece((0,) * len(shape), shape, (0,) * len(shape))]
    shape = tuple(t.shape)
    mesh = t.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return shape, []
    local = t._local_tensor
    key = (shape, tuple(mesh.shape), tuple(coord), tuple(repr(p) for p in t.placements),
           tuple(local.shape))
    cached = _CACHE.get(key)
    if cached is not None:
        return shape, cached
    pieces = _dtensor_pieces(t, shape, mesh, coord, local, name)
    if len(_CACHE) > 100_000:
        _CACHE.clear()
    _CACHE[key] = pieces
    return shape, pieces


_CACHE: dict[tuple, list[Piece]] = {}


def _dtensor_pieces(t, shape, mesh, coord, local, name) -> list[Piece]:  # noqa: ANN001
    dims = _dim_indices(shape, tuple(mesh.shape), list(coord), t.placements, name)
    per_dim: list[list[tuple[int, int, int]]] = []
    for d, extent in enumerate(shape):
        if d in dims:
            idx = dims[d]
            if idx.numel() != local.shape[d]:
                raise UnsupportedStateError(
                    f"tensor {name!r}: local shape {tuple(local.shape)} does not match its "
                    f"placements {t.placements} (dim {d}: {idx.numel()} indices); a padded "
                    "local tensor? pass the unpadded DTensor", tensor=name)
            per_dim.append(_runs(idx))
        else:
            per_dim.append([(0, extent, 0)])
    if any(len(r) == 0 for r in per_dim) or any(s == 0 for s in local.shape):
        return []
    pieces = []
    for combo in itertools.product(*per_dim):
        pieces.append(Piece(
            offset=tuple(g for _, _, g in combo),
            shape=tuple(n for _, n, _ in combo),
            local_start=tuple(s for s, _, _ in combo),
        ))
    return pieces


def local_view(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The local tensor's slice holding `piece`."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    index = tuple(slice(s, s + n) for s, n in zip(piece.local_start, piece.shape, strict=True))
    return local[index] if index else local




def rank_layout(flat: FlatState, rank: int, grids: bool = False
                ) -> tuple[RankLayout, dict[str, list[Piece]]]:
    """What this rank holds, as the planners see it (every tensor's global shape, dtype
    and the boxes it holds, in name order), and each tensor's local pieces. `grids`:
    DTensors whose layout has a closed form (`mesh_grid`, with `rank` their global
    rank) carry it too."""
    tensors = []
    pieces_of: dict[str, list[Piece]] = {}
    for name, ref in sorted(flat.tensors.items()):
        shape, pieces = local_pieces(ref.tensor, name)
        pieces_of[name] = pieces
        boxes = tuple((p.offset, p.shape) for p in pieces)
        grid = mesh_grid(ref.tensor, rank, boxes) if grids else None
        tensors.append(TensorLayout(
            name, ref.path, shape, dtype_name(ref.tensor.dtype, name),
            describe_placements(ref.tensor), boxes, grid))
    return RankLayout(rank, tuple(tensors), tuple(sorted(flat.values))), pieces_of


class LayoutMemo:
    """This rank's layout, its pieces and its digest from the last save, handed back
    while the state keeps its structure (names, shapes, dtypes, placements, meshes, local
    shapes): every save of a training run asks again, and building the layout and the
    sha256 of its JSON is 1-1.5 ms of an async save's stall at 60 tensors (4 ranks on 2
    cores), where comparing the structure is about a tenth of it."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._meshes: tuple[Any, ...] = ()
        """The meshes the key names by id, held so no other mesh can take their id."""
        self._got: tuple[RankLayout, dict[str, list[Piece]], str] | None = None

    def of(self, flat: FlatState, rank: int, extra: Any
           ) -> tuple[RankLayout, dict[str, list[Piece]], str]:
        """`rank_layout(flat, rank, grids=True)` and `layout_digest` of it with `extra`
        (JSON), from the memo when the structure and `extra` are the last call's."""
        parts: list[tuple[Any, ...]] = []
        meshes: list[Any] = []
        for name, ref in flat.tensors.items():
            t = ref.tensor
            if isinstance(t, DTensor):
                meshes.append(t.device_mesh)
                parts.append((name, ref.path, t.shape, t.dtype, id(t.device_mesh),
                              t.placements, t._local_tensor.shape))
            else:
                parts.append((name, ref.path, t.shape, t.dtype, type(t)))
        key = (rank, repr(extra), tuple(parts), tuple(flat.values))
        if self._got is None or key != self._key:
            lay, pieces = rank_layout(flat, rank, grids=True)
            self._key, self._meshes = key, tuple(meshes)
            self._got = (lay, pieces, layout_digest(lay, extra))
        return self._got


Boxes = tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


def mesh_grid(t: torch.Tensor, rank: int, boxes: Boxes) -> MeshGrid | None:
    """The closed form of DTensor `t`'s layout (`ckpt.grid`), or None: not a DTensor,
    a mesh whose ranks are not affine in the coordinates, splits without a regular grid,
    or a grid that does not give this rank (global `rank`) exactly `boxes` (a safety
    net: the rule below is checked against DTensor's own on every rank)."""
    if not isinstance(t, DTensor):
        return None
    mesh = t.device_mesh
    key = (id(mesh), tuple(mesh.shape), tuple(repr(p) for p in t.placements), len(t.shape))
    shape = tuple(t.shape)
    # A save asks again for every tensor each time: the answer depends only on these.
    mine_key = (key, shape, boxes, rank)
    if mine_key in _MINE:
        return _MINE[mine_key]
    hit = _GRIDS.get(key)
    if hit is None:
        if len(_GRIDS) > 10_000:
            _GRIDS.clear()
            _MINE.clear()
        hit = _GRIDS[key] = _grid_of(mesh, t.placements, len(t.shape))
    if len(_MINE) > 100_000:
        _MINE.clear()
    _MINE[mine_key] = _checked(hit[0], mesh, rank, shape, boxes)
    return _MINE[mine_key]


def _checked(grid: MeshGrid | None, mesh: Any, rank: int, shape: tuple[int, ...],
             boxes: Boxes) -> MeshGrid | None:
    """`grid` when it gives this rank exactly `boxes` of a tensor of `shape`, else None."""
    if grid is None:
        return None
    coord = mesh.get_coordinate()
    if coord is None or grid.coord_of(rank) != tuple(coord) or grid.chunks(shape) is None:
        return None
    box = grid.box_at(tuple(coord), shape)
    if box is None:
        return grid if not boxes else None
    return grid if boxes == (box,) else None


_GRIDS: dict[tuple, tuple[MeshGrid | None, object]] = {}
"""Keyed by the mesh's id, with the mesh kept beside its grid so the id stays its own."""
_MINE: dict[tuple, MeshGrid | None] = {}
"""`mesh_grid`'s answers, keyed by `_GRIDS`' key (whose mesh it keeps alive), the global
shape, this rank's boxes and its rank; cleared with it."""


def _grid_of(mesh, placements, ndim: int) -> tuple[MeshGrid | None, object]:  # noqa: ANN001
    ranks = mesh.mesh.to(torch.long)
    shape = tuple(ranks.shape)
    start = int(ranks.reshape(-1)[0])
    strides = []
    for d, size in enumerate(shape):
        index = [0] * len(shape)
        index[d] = 1
        strides.append(int(ranks[tuple(index)]) - start if size > 1 else 0)
    expect = torch.full(shape, start, dtype=torch.long)
    for d, (size, stride) in enumerate(zip(shape, strides, strict=True)):
        view = [1] * len(shape)
        view[d] = size
        expect = expect + (torch.arange(size, dtype=torch.long) * stride).reshape(view)
    if not torch.equal(expect, ranks):
        return None, mesh
    per_dim: list[list[tuple[int, object]]] = [[] for _ in range(ndim)]
    for m, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)) or not 0 <= p.dim < ndim:
            return None, mesh
        per_dim[p.dim].append((m, p))
    splits = []
    for entries in per_dim:
        strided = [p for _, p in entries if _StridedShard is not Shard
                   and isinstance(p, _StridedShard)]
        if strided:
            # FSDP over tensor parallelism: the strided shard (outer mesh dim) splits
            # each block of the inner mesh dim's shard, so the inner dim splits first.
            first, second = (entries + [(None, None)] * 2)[:2]
            if (len(entries) != 2 or strided != [first[1]]
                    or first[1].split_factor != shape[second[0]]):
                return None, mesh
            entries = [second, first]
        # A mesh dim of one rank splits nothing (and would break the innermost rule).
        splits.append(tuple(m for m, _ in entries if shape[m] > 1))
    return MeshGrid(shape, start, tuple(strides), tuple(splits)), mesh
