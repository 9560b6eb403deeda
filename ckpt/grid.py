"""A tensor's layout in closed form: placements on a device mesh whose pieces form a
regular grid.

A DTensor's pieces follow from three things every rank of its mesh shares: the global
shape, the mesh (its shape and which global rank sits where) and which mesh dims split
which tensor dims. When the mesh's ranks are an affine function of the coordinates (a
`DeviceMesh` made by `init_device_mesh`, and any slice of one, is) and the splits give a
regular grid, that description (`MeshGrid`) is the same on every rank and a few dozen
bytes long. The save planner then works per tensor instead of per (rank, piece): at
16,384 ranks that is the difference between millions of pieces and a few thousand
tensors. Each rank's own box, the holders of a cell and a cell's writer are computed
from the description when needed (`box_at`, `coord_of`, `writer`).

The grid is regular when, for each tensor dim, one mesh dim splits it (torch's chunk
sizes: `ceil(n / k)`, the last cells smaller or absent), or several split it and all
but the innermost cut equal blocks that the innermost's chunks tile (1,024 rows over
8-way tensor and 256-way FSDP parallelism: one row per cell, ranks past the 128th of
each block empty). Anything else (other uneven nested splits, strided shards other than
FSDP over tensor parallelism) keeps the per-piece form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["MeshGrid", "cell_box", "cell_index", "cell_of_index"]

Box = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class MeshGrid:
    mesh: tuple[int, ...]
    """The mesh's shape."""
    start: int
    strides: tuple[int, ...]
    """Global rank at mesh coordinate c: `start + sum(c[i] * strides[i])`."""
    splits: tuple[tuple[int, ...], ...]
    """Per tensor dim, the mesh dims (of more than one rank) that split it, outermost
    first."""

    def to_json(self) -> list[Any]:
        return [list(self.mesh), self.start, list(self.strides), [list(s) for s in self.splits]]

    @staticmethod
    def from_json(j: list[Any]) -> MeshGrid:
        return MeshGrid(tuple(j[0]), int(j[1]), tuple(j[2]), tuple(tuple(s) for s in j[3]))

    # -- the mesh -----------------------------------------------------------------------

    @property
    def size(self) -> int:
        return math.prod(self.mesh)

    def rank_at(self, coord: tuple[int, ...]) -> int:
        return self.start + sum(c * s for c, s in zip(coord, self.strides, strict=True))

    def coord_of(self, rank: int) -> tuple[int, ...] | None:
        """The mesh coordinate of global `rank`, None when it is not in the mesh. Strides
        of a (sliced) row-major mesh nest, so the largest stride is decoded first."""
        rest = rank - self.start
        if rest < 0:
            return None
        coord = [0] * len(self.mesh)
        for d in sorted(range(len(self.mesh)), key=lambda i: -self.strides[i]):
            if self.mesh[d] == 1 or self.strides[d] == 0:
                continue
            c = rest // self.strides[d]
            if c >= self.mesh[d]:
                return None
            coord[d] = c
            rest -= c * self.strides[d]
        return tuple(coord) if rest == 0 else None

    def ranks(self) -> list[int]:
        out = [self.start]
        for size, stride in zip(self.mesh, self.strides, strict=True):
            out = [r + i * stride for r in out for i in range(size)]
        return out

    @property
    def replicas(self) -> int:
        """How many ranks hold each cell."""
        return math.prod(self.mesh[m] for m in self.replicate_dims)

    @property
    def replicate_dims(self) -> tuple[int, ...]:
        split = {m for s in self.splits for m in s}
        return tuple(m for m in range(len(self.mesh)) if m not in split)

    # -- the grid -----------------------------------------------------------------------

    def _dim(self, n: int, split: tuple[int, ...]) -> tuple[int, int] | None:
        """(chunk, cells per innermost block) of a tensor dim of `n` split by `split`:
        every split but the innermost must cut equal blocks, and the innermost's chunks
        (torch's `ceil(block / k)`) must tile each block when there are several blocks,
        else the cells do not form one regular grid."""
        if n == 0:
            return None
        block = n
        for m in split[:-1]:
            if block % self.mesh[m]:
                return None
            block //= self.mesh[m]
        if not split:
            return block, 1
        chunk = -(-block // self.mesh[split[-1]])
        if len(split) > 1 and block % chunk:
            return None
        return chunk, -(-block // chunk)

    def chunks(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The cell shape over `shape`, or None when the splits do not give a regular
        grid."""
        if len(shape) != len(self.splits):
            return None
        out = []
        for n, split in zip(shape, self.splits, strict=True):
            got = self._dim(n, split)
            if got is None:
                return None
            out.append(got[0])
        return tuple(out)

    def cells(self, shape: tuple[int, ...], chunks: tuple[int, ...]) -> tuple[int, ...]:
        """Non-empty cells per tensor dim."""
        return tuple(-(-n // c) for n, c in zip(shape, chunks, strict=True))

    def _inner(self, cells: int, split: tuple[int, ...]) -> int:
        """Cells per innermost block along a dim that has `cells` cells."""
        return cells // math.prod(self.mesh[m] for m in split[:-1]) if split else 1

    def cell_at(self, coord: tuple[int, ...], cells: tuple[int, ...]) -> tuple[int, ...] | None:
        """The cell the mesh coordinate holds, None when its piece is empty."""
        out = []
        for split, count in zip(self.splits, cells, strict=True):
            if not split:
                out.append(0)
                continue
            inner = self._inner(count, split)
            if coord[split[-1]] >= inner:
                return None
            outer = 0
            for m in split[:-1]:
                outer = outer * self.mesh[m] + coord[m]
            out.append(outer * inner + coord[split[-1]])
        return tuple(out)

    def box_at(self, coord: tuple[int, ...], shape: tuple[int, ...]) -> Box | None:
        """The box the mesh coordinate holds, None when empty or not a regular grid."""
        chunks = self.chunks(shape)
        if chunks is None:
            return None
        cell = self.cell_at(coord, self.cells(shape, chunks))
        return None if cell is None else cell_box(cell, shape, chunks)

    def writer(self, cell: tuple[int, ...], cells: tuple[int, ...], turn: int) -> int:
        """The global rank that writes `cell`: its shard coordinates, and on the
        replicated mesh dims the `turn`-th holder (turns differ from cell to cell and
        tensor to tensor, so the writes spread over the replicas)."""
        coord = [0] * len(self.mesh)
        for split, i, count in zip(self.splits, cell, cells, strict=True):
            if not split:
                continue
            inner = self._inner(count, split)
            coord[split[-1]] = i % inner
            i //= inner
            for m in reversed(split[:-1]):
                coord[m] = i % self.mesh[m]
                i //= self.mesh[m]
        rep = self.replicate_dims
        turn %= max(1, math.prod(self.mesh[m] for m in rep))
        for m in reversed(rep):
            coord[m] = turn % self.mesh[m]
            turn //= self.mesh[m]
        return self.rank_at(tuple(coord))


    def holders(self, cell: tuple[int, ...], cells: tuple[int, ...]) -> list[int]:
        """The ranks that hold `cell`: its shard coordinates on every replica."""
        out = [self.writer(cell, cells, 0)]
        for m in self.replicate_dims:
            out = [r + i * self.strides[m] for r in out for i in range(self.mesh[m])]
        return out


def cell_box(cell: tuple[int, ...], shape: tuple[int, ...], chunks: tuple[int, ...]) -> Box:
    off = tuple(i * c for i, c in zip(cell, chunks, strict=True))
    return off, tuple(min(c, n - o) for c, n, o in zip(chunks, shape, off, strict=True))


def cell_index(cell: tuple[int, ...], cells: tuple[int, ...]) -> int:
    """Row-major position of `cell`."""
    i = 0
    for c, n in zip(cell, cells, strict=True):
        i = i * n + c
    return i


def cell_of_index(i: int, cells: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for n in reversed(cells):
        out.append(i % n)
        i //= n
    return tuple(reversed(out))
