"""The manifest: what a committed checkpoint holds, as frozen dataclasses.

`Manifest` mirrors `manifest.json` field for field (docs/format.md): one `TensorEntry`
per tensor, stored in one of three forms (`StorageKind`): a regular grid of save-time
shards (`GRID`), one array per distinct piece (`PIECES`), or byte ranges of a writer's
packed array (`PACKED`, each piece a `PieceEntry`). `Manifest.to_json()` is the exact
JSON the writer encodes (`ckpt.commit.encode_manifest`); `Manifest.from_json(obj, url)`
checks untrusted JSON before anything is allocated or opened from it and raises typed
`ckpt.errors` naming the bad field. `read_manifest(store)` reads the one of a committed
checkpoint, checked against its commit marker.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from relight.ckpt.crc_table import TABLE_FIELD, ArrayGeometry, ChunkCrcTable
from relight.ckpt.errors import (
    AbsurdShapeError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from relight.ckpt.format import (
    CHUNK_CRCS,
    COMMIT_KEY,
    DTYPES,
    MANIFEST_KEY,
    MAX_NUMEL,
    StorageKind,
    check_path,
    check_shape,
    check_version,
    numel,
    zarr_metadata,
)
from relight.ckpt.gc_pause import gc_paused
from relight.storage import ObjectNotFoundError, Store
from relight.storage.checksum import crc32c

logger = logging.getLogger(__name__)

__all__ = ["Manifest", "PieceEntry", "StorageKind", "TensorEntry", "chunk_objects", "crc32c",
           "data_arrays", "parse_manifest", "read_commit", "read_manifest", "validate"]

MAX_CHUNKS = 10_000_000

FIELDS = ("format", "version", "writer", "step", "created", "created_unix", "attempt",
          "compression", "world_size", "ranks", "config", "layout", "tensors", "values",
          "packed", "packed_inner", "bytes", "index", CHUNK_CRCS, TABLE_FIELD)
"""The manifest's fields, in the order the writer writes them."""


def _ints(v: Any) -> tuple[int, ...]:
    return tuple(v)


@dataclass(frozen=True, slots=True)
class PieceEntry:
    """One stored piece of a `PIECES` or `PACKED` tensor: the box it covers, where."""

    offset: tuple[int, ...]
    shape: tuple[int, ...]
    array: str
    """The array holding it: its own (`PIECES`), or a writer's packed array (`PACKED`)."""
    inner: tuple[int, ...] | None = None
    """`PIECES`: inner chunk shape of its array."""
    byte_offset: int | None = None
    """`PACKED`: where its bytes start in the packed array."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"offset": list(self.offset), "shape": list(self.shape),
                               "array": self.array}
        if self.byte_offset is not None:
            out["byte_offset"] = self.byte_offset
        if self.inner is not None:
            out["inner"] = list(self.inner)
        return out

    @classmethod
    def _from_json(cls, p: Mapping[str, Any]) -> PieceEntry:
        inner = p.get("inner")
        return cls(_ints(p["offset"]), _ints(p["shape"]), p["array"],
                   None if inner is None else _ints(inner), p.get("byte_offset"))


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor at its global shape, and how it is stored."""

    shape: tuple[int, ...]
    dtype: str
    """A key of `ckpt.format.DTYPES`."""
    storage: StorageKind
    path: tuple[Any, ...] | None = None
    """Its path in the saved state dict (keys and list indices)."""
    placements: Any = None
    """How it was placed when saved (`ckpt.layout.describe_placements`), for people."""
    array: str | None = None
    """`GRID`: the array at global shape."""
    chunks: tuple[int, ...] | None = None
    """`GRID`: the outer chunk (save-time shard) shape. `PACKED` in grid form: the shape
    of its pieces, which are the cells of a regular grid over the tensor."""
    inner: tuple[int, ...] | None = None
    """`GRID`: the inner chunk shape."""
    pieces: tuple[PieceEntry, ...] = ()
    """`PIECES`, `PACKED` in list form: the pieces that tile it."""
    cell_arrays: tuple[str, ...] = ()
    """`PACKED` in grid form: the packed array of each cell, in C order."""
    cell_byte_offsets: tuple[int, ...] = ()
    """`PACKED` in grid form: where each cell's bytes start in its packed array."""

    @property
    def packed_grid(self) -> bool:
        return self.storage is StorageKind.PACKED and self.chunks is not None

    def piece_list(self) -> tuple[PieceEntry, ...]:
        """The pieces that tile it, whichever form the manifest lists them in."""
        if not self.packed_grid:
            return self.pieces
        assert self.chunks is not None
        cells = itertools.product(*(range(0, s, c) for s, c in zip(self.shape, self.chunks,
                                                                     strict=True)))
        return tuple(
            PieceEntry(off, tuple(min(c, s - o) for o, c, s in zip(off, self.chunks, self.shape,
                                                                     strict=True)),
                       arr, byte_offset=bo)
            for off, arr, bo in zip(cells, self.cell_arrays, self.cell_byte_offsets,
                                    strict=True))

    def piece_arrays(self) -> list[str]:
        """The arrays its pieces are in, each once, in order (not `GRID`)."""
        return list(dict.fromkeys(self.cell_arrays if self.packed_grid
                                  else (p.array for p in self.pieces)))

    def to_json(self, packed_index: Mapping[str, int] | None = None) -> dict[str, Any]:
        """Its JSON; `packed_index` maps packed arrays to their position in the manifest's
        sorted `packed` (the grid form names them by position)."""
        out: dict[str, Any] = {}
        if self.path is not None:
            out["path"] = list(self.path)
        out.update(shape=list(self.shape), dtype=self.dtype, storage=self.storage.value)
        if self.placements is not None:
            out["placements"] = self.placements
        if self.storage is StorageKind.GRID:
            assert self.chunks is not None and self.inner is not None
            out.update(array=self.array, chunks=list(self.chunks), inner=list(self.inner))
        elif self.packed_grid:
            assert self.chunks is not None and packed_index is not None
            out.update(chunks=list(self.chunks),
                       arrays=[packed_index[a] for a in self.cell_arrays],
                       byte_offsets=list(self.cell_byte_offsets))
        else:
            out["pieces"] = [p.to_json() for p in self.pieces]
        return out

    @classmethod
    def _from_json(cls, t: Mapping[str, Any], packed_names: list[str]) -> TensorEntry:
        kind = StorageKind(t["storage"])
        path = None if t.get("path") is None else tuple(t["path"])
        if kind is StorageKind.GRID:
            return cls(_ints(t["shape"]), t["dtype"], kind, path, t.get("placements"),
                       t["array"], _ints(t["chunks"]), _ints(t["inner"]))
        if "pieces" not in t:  # PACKED in grid form
            return cls(_ints(t["shape"]), t["dtype"], kind, path, t.get("placements"),
                       chunks=_ints(t["chunks"]),
                       cell_arrays=tuple(packed_names[i] for i in t["arrays"]),
                       cell_byte_offsets=tuple(t["byte_offsets"]))
        return cls(_ints(t["shape"]), t["dtype"], kind, path, t.get("placements"),
                   pieces=tuple(PieceEntry._from_json(p) for p in t["pieces"]))

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].itemsize

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.itemsize


@dataclass(frozen=True, slots=True)
class Manifest:
    """A checkpoint's `manifest.json`. Fields a checkpoint may lack (written before they
    existed) are None; `to_json` leaves out what the source lacked."""

    format: str
    version: int
    tensors: Mapping[str, TensorEntry]
    values: Mapping[str, Any]
    """JSON values by state-dict name."""
    writer: Any = None
    step: int | None = None
    created: str | None = None
    created_unix: float | None = None
    attempt: str | None = None
    """The save attempt that wrote it: data objects live under `data/<attempt>/`."""
    compression: str | None = None
    world_size: int | None = None
    ranks: list[int] | None = None
    config: Any = None
    layout: Any = None
    packed: Mapping[str, int] = field(default_factory=dict)
    """Packed array -> its size in bytes."""
    packed_inner: int = 1
    """Inner chunk size of the packed arrays."""
    bytes: int | None = None
    """Payload bytes of every tensor."""
    index: Mapping[str, str] | None = None
    """Rank (as a string) -> its index object."""
    chunk_crc32c: Mapping[str, list[int | None]] | None = None
    """Data object -> the crc32c of each inner chunk, inline (checkpoints written before
    the table; None otherwise)."""
    chunk_crc32c_table: Mapping[str, Any] | None = None
    """The record of the chunk crc32c table (`ckpt.crc_table`); None: no table."""
    crc_table: ChunkCrcTable | None = field(default=None, compare=False, repr=False)
    """That table, checked against the tensors, read from storage on demand."""
    absent: frozenset[str] = frozenset()
    """Fields of `FIELDS` the source JSON lacked (left out again by `to_json`)."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Fields this reader does not know, kept as they were."""

    def to_json(self) -> dict[str, Any]:
        """The manifest as JSON, in the writer's field order."""
        out: dict[str, Any] = {}
        for name in FIELDS:
            if name in self.absent:
                continue
            if name == "tensors":
                index = {a: i for i, a in enumerate(sorted(self.packed))}
                out[name] = {n: t.to_json(index) for n, t in self.tensors.items()}
            else:
                v = getattr(self, name)
                out[name] = dict(v) if isinstance(v, Mapping) else v
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, m: Any, url: str, store: Store | None = None) -> Manifest:
        """Check untrusted manifest JSON and build the manifest; raises typed
        `ckpt.errors` (`UnsupportedVersionError`, `CorruptCheckpointError` and its
        subclasses) naming the bad field, before anything is allocated from it.
        `store`: where its chunk crc32c table is read from (`chunk_crcs`)."""
        _check_structure(m, url)
        packed_names = sorted(m.get("packed", {}))
        out = cls(
            format=m["format"], version=m["version"],
            tensors={n: TensorEntry._from_json(t, packed_names)
                     for n, t in m["tensors"].items()},
            values=m["values"], writer=m.get("writer"), step=m.get("step"),
            created=m.get("created"), created_unix=m.get("created_unix"),
            attempt=m.get("attempt"), compression=m.get("compression"),
            world_size=m.get("world_size"), ranks=m.get("ranks"), config=m.get("config"),
            layout=m.get("layout"), packed=m.get("packed", {}),
            packed_inner=m.get("packed_inner", 1), bytes=m.get("bytes"), index=m.get("index"),
            chunk_crc32c=m.get(CHUNK_CRCS), chunk_crc32c_table=m.get(TABLE_FIELD),
            absent=frozenset(f for f in FIELDS if f not in m),
            extra={k: v for k, v in m.items() if k not in FIELDS})
        _check_chunk_crcs(out, m.get(CHUNK_CRCS), url)
        if TABLE_FIELD in m:
            if CHUNK_CRCS in m:
                raise _bad(url, f"both '{CHUNK_CRCS}' and '{TABLE_FIELD}' record chunk crc32c")
            out = replace(out, crc_table=ChunkCrcTable(m[TABLE_FIELD], data_arrays(out), url,
                                                       store))
        return out

    def meta_of(self, name: str, piece: PieceEntry | None = None) -> dict[str, Any]:
        """zarr metadata of a tensor's array (grid) or of one of its pieces."""
        t = self.tensors[name]
        comp = self.compression
        if piece is None:
            assert t.chunks is not None and t.inner is not None
            return zarr_metadata(list(t.shape), t.dtype, list(t.chunks), list(t.inner), comp)
        if t.storage is StorageKind.PACKED:
            size = self.packed[piece.array]
            return zarr_metadata([size], "uint8", [size], [self.packed_inner], comp)
        assert piece.inner is not None
        return zarr_metadata(list(piece.shape), t.dtype, list(piece.shape), list(piece.inner),
                             comp)

    def chunk_crcs(self, key: str) -> list[int | None] | None:
        """The crc32c recorded at save for each inner chunk of data object `key`, in
        storage order (None: that chunk is not stored), or None for a checkpoint written
        before they were recorded (from_json made sure every object has its record)."""
        if self.crc_table is not None:
            return self.crc_table.crcs_of(key)
        if self.chunk_crc32c_table is not None:
            raise RuntimeError("this manifest was built in memory, not read from storage "
                               "(read_manifest): its chunk crc32c table is not open")
        crcs = self.chunk_crc32c
        return None if crcs is None else crcs[key]

    def packed_users(self, array: str) -> list[str]:
        """The tensors stored in packed array `array`, sorted."""
        return sorted(n for n, t in self.tensors.items() if t.storage is StorageKind.PACKED
                      and array in t.piece_arrays())

    def expected_objects(self) -> dict[str, str]:
        """Every object the checkpoint must hold -> the tensor (or '') it belongs to."""
        out: dict[str, str] = {}
        for name, t in self.tensors.items():
            if t.storage is StorageKind.GRID:
                out[f"{t.array}/zarr.json"] = name
            else:
                for a in t.piece_arrays():
                    out[f"{a}/zarr.json"] = name if t.storage is StorageKind.PIECES else ""
        for key, name, _n in chunk_objects(self):
            out.setdefault(key, name)
        if self.crc_table is not None:
            out[self.crc_table.key] = ""
        return out


def _inner_count(shape: tuple[int, ...] | list[int], inner: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s, i in zip(shape, inner, strict=True):
        n *= -(-s // i)
    return n


def data_arrays(m: Manifest) -> Iterator[ArrayGeometry]:
    """Every array holding data objects, once each, in the chunk crc32c table's order:
    each grid tensor's array and each piece's array in the manifest's order, then the
    packed arrays (several tensors share one) in sorted order."""
    for name, t in m.tensors.items():
        if t.storage is StorageKind.GRID:
            assert t.array is not None and t.chunks is not None and t.inner is not None
            grid = tuple(-(-s // c) for s, c in zip(t.shape, t.chunks, strict=True))
            yield ArrayGeometry(t.array, name, grid, _inner_count(t.chunks, t.inner))
        elif t.storage is StorageKind.PIECES:
            for p in t.pieces:
                if numel(p.shape) > 0:
                    assert p.inner is not None
                    yield ArrayGeometry(p.array, name, (1,) * len(p.shape),
                                        _inner_count(p.shape, p.inner))
    inner = m.packed_inner
    for a in sorted(m.packed):
        size = m.packed[a]
        if size > 0:
            yield ArrayGeometry(a, "", (1,), -(-size // inner))


def chunk_objects(m: Manifest) -> Iterator[tuple[str, str, int]]:
    """(key, tensor or '' for a packed array, inner chunks) of every data object of a
    manifest: one per grid cell, piece array and packed array."""
    for geo in data_arrays(m):
        for key in geo.keys():
            yield key, geo.tensor, geo.per_object


def _check_chunk_crcs(m: Manifest, crcs: Any, url: str) -> None:
    """`chunk_crc32c` (optional: older checkpoints lack it) must list, for every data
    object, one crc32c (an int in [0, 2^32), or null for a chunk not
    stored) per inner chunk: the reader compares each chunk it reads with it."""
    if crcs is None:
        return
    if not isinstance(crcs, dict):
        raise _bad(url, "'chunk_crc32c' is not an object; the manifest is damaged")
    # Objects per array counted first, without listing a claimed 10^7-cell grid.
    got: dict[str, int] = {}
    for key in crcs:
        arr = key[:-2] if key.endswith("/c") else key.rpartition("/c/")[0]
        got[arr] = got.get(arr, 0) + 1
    seen: set[str] = set()
    for name, t in m.tensors.items():
        if t.storage is StorageKind.GRID:
            assert t.array is not None and t.chunks is not None
            arrays = {t.array: _inner_count(t.shape, t.chunks) if t.shape else 1}
        elif t.storage is StorageKind.PACKED:
            arrays = {a: int(m.packed.get(a, 0) > 0) for a in t.piece_arrays()}
        else:
            arrays = {p.array: int(numel(p.shape) > 0) for p in t.pieces}
        for arr, want in arrays.items():
            if arr in seen:  # a packed array several tensors share
                continue
            seen.add(arr)
            have = got.pop(arr, 0)
            if have != want:
                raise _bad(url, f"'chunk_crc32c' lists {have} objects of array {arr} of "
                           f"tensor {name!r}, which has {want}; the manifest is damaged", name)
    # Entries of arrays no tensor names are never read (a tensor dropped from the
    # manifest is the loader's MissingKeyError to report): left alone.
    for key, name, n in chunk_objects(m):
        v = crcs.get(key)
        if not (isinstance(v, list) and len(v) == n and all(
                c is None or (isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 32)
                for c in v)):
            what = "no entry" if v is None else f"{type(v).__name__} {str(v)[:60]}"
            raise CorruptCheckpointError(
                f"checkpoint {url}: 'chunk_crc32c' of object {key}"
                + (f" (tensor {name!r})" if name else " (packed small tensors)")
                + f" is {what}, not a list of {n} crc32c values; the manifest is damaged",
                url=url, tensor=name, obj=key)


def _bad(url: str, msg: str, tensor: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {url}: {msg}", url=url, tensor=tensor,
                                  obj=MANIFEST_KEY)


def _check_cells(url: str, name: str, shape: Any, chunks: Any, what: str) -> None:
    """Refuse a grid of more than MAX_CHUNKS chunks: a reader would allocate its index
    (16 bytes a chunk) before reading a byte of data."""
    cells = 1
    for g, c in zip(shape, chunks, strict=True):
        cells *= -(-g // c) if c > 0 else 0
    if cells > MAX_CHUNKS:
        raise AbsurdShapeError(
            f"checkpoint {url}: {what} {name!r} claims {cells} chunks (limit {MAX_CHUNKS}); "
            "the manifest is damaged", url=url, tensor=name, obj=MANIFEST_KEY)


MAX_OVERLAP_CELLS = 1 << 24
"""Most cells of the pieces' boundary grid the overlap check marks (64 MiB of counts)."""


def _overlap(boxes: list[tuple[list[int], list[int]]]) -> bool | None:
    """Whether any two non-empty boxes overlap, exactly: every dim is cut at every box's
    edges, each box adds 1 over the cells it covers (+-1 at its corners, then a running
    sum along every dim), and a cell counted twice is an overlap. Linear in the boxes
    and the cells, vectorized; None when that grid has over `MAX_OVERLAP_CELLS` cells."""
    boxes = [(o, s) for o, s in boxes if numel(s)]
    if len(boxes) < 2:
        return False
    ndim = len(boxes[0][0])
    if ndim == 0:
        return True
    lo = np.array([o for o, _ in boxes], dtype=np.int64)
    hi = lo + np.array([s for _, s in boxes], dtype=np.int64)
    cuts = [np.unique(np.concatenate([lo[:, d], hi[:, d]])) for d in range(ndim)]
    if math.prod(len(c) - 1 for c in cuts) > MAX_OVERLAP_CELLS:
        return None
    at = [(np.searchsorted(c, lo[:, d]), np.searchsorted(c, hi[:, d]))
          for d, c in enumerate(cuts)]
    counts = np.zeros([len(c) for c in cuts], dtype=np.int32)
    for corner in itertools.product((0, 1), repeat=ndim):
        np.add.at(counts, tuple(at[d][bit] for d, bit in enumerate(corner)),
                  -1 if sum(corner) % 2 else 1)
    for d in range(ndim):
        np.cumsum(counts, axis=d, out=counts)
    return bool((counts > 1).any())


def _check_partition(url: str, name: str, shape: list[int],
                     boxes: list[tuple[list[int], list[int]]]) -> None:
    """A tensor's pieces must tile it exactly: a missing or overlapping piece would leave
    part of the target unwritten (wrong values, not an error) if it got past here. With
    the element count equal, no overlap means no gap either."""
    total = sum(numel(s) for _, s in boxes)
    overlap = total == numel(shape) and _overlap(boxes)
    if total != numel(shape) or overlap:
        raise _bad(url, f"tensor {name!r}: its {len(boxes)} piece(s) cover {total} of "
                   f"{numel(shape)} elements{' and overlap' if overlap else ''}; the manifest "
                   "is damaged", name)


def _int_list(v: Any, n: int) -> np.ndarray | None:
    """`v` as int64 if it is a JSON list of `n` non-negative ints below 2^62, else None."""
    if not isinstance(v, list) or len(v) != n or not all(type(x) is int for x in v):
        return None  # (type, not isinstance: a bool is an int too)
    try:
        a = np.array(v, dtype=np.int64).reshape(n)
    except OverflowError:
        return None
    return a if n == 0 or (a.min() >= 0 and a.max() < 1 << 62) else None


def _check_packed_grid(url: str, name: str, t: Mapping[str, Any], shape: list[int],
                       names: list[str], sizes: np.ndarray) -> None:
    """A packed tensor in grid form: its pieces are the cells of a regular grid of
    `chunks`; `arrays[i]` (a position in the sorted `packed`) and `byte_offsets[i]` say
    where cell i (C order) is, and its bytes must lie inside that array."""
    chunks = check_shape(t.get("chunks"), url, name, "chunks")
    if len(chunks) != len(shape) or any(c <= 0 for c in chunks):
        raise AbsurdShapeError(
            f"checkpoint {url}: packed tensor {name!r} has piece shape {chunks} that does "
            f"not fit shape {shape}", url=url, tensor=name, obj=MANIFEST_KEY)
    _check_cells(url, name, shape, chunks, "packed tensor")
    cells = math.prod(-(-s // c) for s, c in zip(shape, chunks, strict=True))
    arrays = _int_list(t.get("arrays"), cells)
    offsets = _int_list(t.get("byte_offsets"), cells)
    if arrays is None or offsets is None or (cells and arrays.max() >= len(names)):
        raise _bad(url, f"packed tensor {name!r} needs 'arrays' (positions in the sorted "
                   f"'packed', below {len(names)}) and 'byte_offsets', {cells} "
                   "non-negative ints each", name)
    # Bytes of every cell (edge cells are partial), in C order, as int64.
    nbytes = np.full((), DTYPES[t["dtype"]].itemsize, dtype=np.int64)
    for s, c in zip(shape, chunks, strict=True):
        nbytes = np.multiply.outer(nbytes, np.minimum(c, s - np.arange(0, s, c,
                                                                      dtype=np.int64)))
    over = offsets + nbytes.reshape(-1) > sizes[arrays] if cells else np.zeros(0, bool)
    if over.any():
        i = int(np.argmax(over))
        raise AbsurdShapeError(
            f"checkpoint {url}: packed piece {i} of {name!r} at byte {int(offsets[i])} does "
            f"not fit its array {names[int(arrays[i])]!r}", url=url, tensor=name,
            obj=MANIFEST_KEY)


@gc_paused
def validate(m: Any, url: str) -> None:
    """Check manifest JSON as every load does (`Manifest.from_json`), without keeping it."""
    Manifest.from_json(m, url)


def _check_structure(m: Any, url: str) -> None:
    """Structural checks before anything is allocated or opened from the manifest."""
    check_version(m, url)
    if not isinstance(m.get("tensors"), dict) or not isinstance(m.get("values"), dict):
        raise _bad(url, "manifest lacks 'tensors' or 'values'")
    packed = m.get("packed", {})
    if not isinstance(packed, dict):
        raise _bad(url, "manifest 'packed' is not an object")
    inner = m.get("packed_inner", 1)
    if not isinstance(inner, int) or isinstance(inner, bool) or not 0 < inner <= MAX_NUMEL:
        raise AbsurdShapeError(
            f"checkpoint {url}: packed_inner {inner!r} is not an int in [1, {MAX_NUMEL}]; the "
            "manifest is damaged", url=url, obj=MANIFEST_KEY)
    for arr, size in packed.items():  # (a 1-D array each: its checks inline, ~16k of them)
        check_path(arr, url)
        if type(size) is not int or not 0 <= size < MAX_NUMEL:
            check_shape([size], url, arr, "packed size")  # raises, naming it
        if -(-size // inner) > MAX_CHUNKS:
            _check_cells(url, arr, [size], [inner], "packed array")  # raises, naming it
    names: list[str] | None = None
    sizes = np.zeros(0, np.int64)
    for name, t in m["tensors"].items():
        if not isinstance(t, dict):
            raise _bad(url, f"tensor entry {name!r} is not an object", name)
        if not isinstance(t.get("dtype"), str) or t["dtype"] not in DTYPES:
            raise _bad(url, f"tensor {name!r} has unknown dtype {t.get('dtype')!r}", name)
        shape = check_shape(t.get("shape"), url, name)
        storage = t.get("storage")
        if storage == StorageKind.GRID:
            check_path(t.get("array"), url, name)
            chunks = check_shape(t.get("chunks"), url, name, "chunks")
            inner_s = check_shape(t.get("inner"), url, name, "inner chunks")
            if len(chunks) != len(shape) or len(inner_s) != len(shape) or any(
                c <= 0 or i <= 0 or c % i for c, i in zip(chunks, inner_s, strict=True)):
                raise AbsurdShapeError(
                    f"checkpoint {url}: tensor {name!r} has chunks {chunks} / inner {inner_s} "
                    f"that do not fit shape {shape}", url=url, tensor=name, obj=MANIFEST_KEY)
            _check_cells(url, name, shape, chunks, "tensor")
            _check_cells(url, name, chunks, inner_s, "shard of tensor")
        elif storage == StorageKind.PACKED and "pieces" not in t:
            if names is None:  # once, and only for a manifest that has the grid form
                names = sorted(packed)
                sizes = np.array([packed[k] for k in names], dtype=np.int64)
            _check_packed_grid(url, name, t, shape, names, sizes)
        elif storage in (StorageKind.PIECES, StorageKind.PACKED):
            pieces = t.get("pieces")
            if not isinstance(pieces, list):
                raise _bad(url, f"tensor {name!r} has no piece list", name)
            boxes = []
            for p in pieces:
                if not isinstance(p, dict):
                    raise _bad(url, f"tensor {name!r} has a piece that is not an object", name)
                check_path(p.get("array"), url, name)
                off = check_shape(p.get("offset"), url, name, "piece offset")
                shp = check_shape(p.get("shape"), url, name, "piece shape")
                if len(off) != len(shape) or len(shp) != len(shape) or any(
                    o + s > g for o, s, g in zip(off, shp, shape, strict=True)):
                    raise AbsurdShapeError(
                        f"checkpoint {url}: tensor {name!r} has a piece at {off} of shape "
                        f"{shp} outside its shape {shape}", url=url, tensor=name,
                        obj=p.get("array"))
                if storage == StorageKind.PACKED:
                    bo = p.get("byte_offset")
                    size = packed.get(p["array"])
                    nb = numel(shp) * DTYPES[t["dtype"]].itemsize
                    if not isinstance(bo, int) or size is None or bo < 0 or bo + nb > size:
                        raise AbsurdShapeError(
                            f"checkpoint {url}: packed piece of {name!r} at byte {bo!r} does "
                            f"not fit its array {p['array']!r}", url=url, tensor=name,
                            obj=p.get("array"))
                else:
                    inner_s = check_shape(p.get("inner"), url, name, "inner chunks")
                    if len(inner_s) != len(shp) or any(
                            i <= 0 or s % i for s, i in zip(shp, inner_s, strict=True)):
                        raise AbsurdShapeError(
                            f"checkpoint {url}: piece inner chunks {inner_s} do not divide "
                            f"{shp} for {name!r}", url=url, tensor=name, obj=p.get("array"))
                    _check_cells(url, name, shp, inner_s, "piece of tensor")
                boxes.append((off, shp))
            _check_partition(url, name, shape, boxes)
        else:
            raise _bad(url, f"tensor {name!r} has unknown storage {storage!r}", name)


def read_commit(store: Store) -> dict[str, Any]:
    url = store.url
    try:
        raw = store.get(COMMIT_KEY)
    except ObjectNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {url} (no {COMMIT_KEY} marker): it does not exist, "
            "or its save did not finish; use an older checkpoint", url=url,
            obj=COMMIT_KEY) from None
    try:
        commit = json.loads(raw)
        if not isinstance(commit, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{url}/{COMMIT_KEY} is not valid JSON ({e})", url=url,
                                     obj=COMMIT_KEY) from None
    return commit


def read_manifest(store: Store) -> Manifest:
    """The manifest of the committed checkpoint at `store`, checked against its marker."""
    url = store.url
    commit = read_commit(store)
    try:
        raw = store.get(MANIFEST_KEY)
    except ObjectNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint {url} is committed but {MANIFEST_KEY} is missing", url=url,
            obj=MANIFEST_KEY) from None
    if len(raw) != commit.get("manifest_bytes") or crc32c(raw) != commit.get("manifest_crc32c"):
        raise ChecksumMismatchError(
            f"checkpoint {url}: {MANIFEST_KEY} ({len(raw)} bytes, crc32c {crc32c(raw)}) does not "
            f"match its commit marker ({commit.get('manifest_bytes')} bytes, crc32c "
            f"{commit.get('manifest_crc32c')}); the manifest is damaged", url=url,
            obj=MANIFEST_KEY)
    return parse_manifest(raw, url, store)


@gc_paused
def parse_manifest(raw: bytes, url: str, store: Store | None = None) -> Manifest:
    """The manifest in `raw` (the bytes of a `manifest.json`), checked as every load
    checks it; `store`: where its chunk crc32c table is read from."""
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CorruptCheckpointError(f"{url}/{MANIFEST_KEY} is not valid JSON ({e})", url=url,
                                     obj=MANIFEST_KEY) from None
    return Manifest.from_json(m, url, store)
