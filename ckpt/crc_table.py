"""The chunk crc32c table: which crc32c belongs to which inner chunk, out of the manifest.

A save records the crc32c of every inner chunk it stores, so that a load can tell a
well-formed chunk in the wrong place (another tensor's, another position's, another
checkpoint's) from the right one (docs/format.md, "Chunk binding"). Those records grow
with the number of data objects: 4.4 million objects for Llama-3-70B on 16,384 ranks,
over 200 MB as JSON lists, which every rank would parse. So they live in one binary
object per save attempt, `data/<attempt>/chunk_crc32c.bin`: little-endian uint32, array
after array in the manifest's order, each array's objects in C order of its grid and
each object's inner chunks in storage order. The manifest keeps, per array, where its
block starts, how many entries it has, the crc32c of the block's bytes and the entries
that are not stored (`chunk_crc32c_table`): a few dozen bytes per array, and the
manifest's own crc32c in the commit marker binds the blocks.

A load reads only the blocks of the arrays it opens (one ranged get each, checked
against the manifest before use; a table of at most 1 MiB in one get) and keeps them
for the rest of the load.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckpt.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingChunkError,
    UnsafePathError,
)
from ckpt.format import check_path, chunk_key
from storage import ObjectNotFoundError, ObjectTruncatedError, Store
from storage.checksum import crc32c

__all__ = ["TABLE_FIELD", "TABLE_NAME", "ArrayGeometry", "ChunkCrcTable", "encode_table"]

TABLE_FIELD = "chunk_crc32c_table"
TABLE_NAME = "chunk_crc32c.bin"
NOT_STORED = 0
"""The entry written for a chunk that is not stored; the record lists those entries."""
WHOLE_BYTES = 1 << 20
"""A table this small is fetched whole on first use (one read instead of one per array)."""


@dataclass(frozen=True, slots=True)
class ArrayGeometry:
    """The data objects of one array: its grid of objects, inner chunks per object."""

    array: str
    tensor: str
    """The tensor it stores, or '' for a packed array of several small tensors."""
    grid: tuple[int, ...]
    per_object: int

    @property
    def entries(self) -> int:
        return math.prod(self.grid) * self.per_object

    def keys(self) -> Iterable[str]:
        return (chunk_key(self.array, cell)
                for cell in itertools.product(*(range(g) for g in self.grid)))

    def object_index(self, key: str) -> int | None:
        """Position of object `key` in C order of the grid, or None if it is not one."""
        head, sep, tail = key.partition(f"{self.array}/c")
        if head or sep == "" or (tail and not tail.startswith("/")):
            return None
        parts = tail.split("/")[1:]
        if len(parts) != len(self.grid) or not all(p.isdigit() for p in parts):
            return None
        lin = 0
        for p, g in zip(parts, self.grid, strict=True):
            c = int(p)
            if c >= g:
                return None
            lin = lin * g + c
        return lin


def array_of_key(key: str) -> str:
    """The array a data object key belongs to (`<array>/c/...` or a 0-d `<array>/c`)."""
    return key[:-2] if key.endswith("/c") else key.rpartition("/c/")[0]


def encode_table(arrays: Iterable[ArrayGeometry], crcs: Mapping[str, list[int | None]],
                 key: str) -> tuple[bytes, dict[str, Any]]:
    """The table of `arrays` with the crcs the ranks reported, and the manifest's record
    of it (object `key`). Raises KeyError/ValueError naming an object whose crcs are
    missing or of the wrong count: the save cannot bind that object."""
    parts: list[np.ndarray] = []
    record: dict[str, list[Any]] = {}
    start = 0
    for geo in arrays:
        block = np.empty(geo.entries, dtype="<u4")
        missing: list[int] = []
        at = 0
        for obj in geo.keys():
            got = crcs.get(obj)
            if got is None:
                raise KeyError(f"no chunk crc32c reported for data object {obj}")
            if len(got) != geo.per_object:
                raise ValueError(f"data object {obj}: {len(got)} chunk crc32c reported for "
                                 f"{geo.per_object} inner chunks")
            for i, c in enumerate(got):
                if c is None:
                    missing.append(at + i)
            block[at: at + geo.per_object] = [NOT_STORED if c is None else c for c in got]
            at += geo.per_object
        entry: list[Any] = [start, geo.entries, crc32c(block.tobytes())]
        if missing:
            entry.append(missing)
        record[geo.array] = entry
        parts.append(block)
        start += geo.entries
    blob = b"".join(p.tobytes() for p in parts)
    return blob, {"object": key, "bytes": len(blob), "arrays": record}


def _bad(url: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {url}: '{TABLE_FIELD}' {what}; the manifest "
                                  "is damaged", url=url)


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True, slots=True)
class _Block:
    start: int
    count: int
    crc: int
    missing: frozenset[int]


class ChunkCrcTable:
    """A committed checkpoint's chunk crc32c table: checked against the manifest's arrays
    when built, read block by block from `store` on first use of each array."""

    def __init__(self, record: Any, arrays: Iterable[ArrayGeometry], url: str,
                 store: Store | None = None) -> None:
        self.url = url
        self.store = store
        if not isinstance(record, dict) or not isinstance(record.get("arrays"), dict):
            raise _bad(url, "is not an object with 'arrays'")
        try:
            self.key = check_path(record.get("object"), url)
        except UnsafePathError as e:
            raise UnsafePathError(f"checkpoint {url}: '{TABLE_FIELD}' names object "
                                  f"{str(record.get('object'))[:80]!r}, which leaves the "
                                  "checkpoint root; the manifest is damaged or hostile",
                                  url=url, obj=e.obj) from None
        nbytes = record.get("bytes")
        if not _uint(nbytes) or nbytes % 4:
            raise _bad(url, f"has 'bytes' {str(nbytes)[:40]}, not a multiple of 4")
        self.nbytes: int = nbytes
        self.geometry: dict[str, ArrayGeometry] = {}
        self.blocks: dict[str, _Block] = {}
        raw = record["arrays"]
        for geo in arrays:
            if geo.array in self.geometry:
                continue
            self.geometry[geo.array] = geo
            entry = raw.get(geo.array)
            where = f"array {geo.array}" + (f" of tensor {geo.tensor!r}" if geo.tensor else "")
            if not (isinstance(entry, list) and len(entry) in (3, 4)
                    and all(_uint(v) for v in entry[:3])):
                raise _bad(url, f"has no [start, count, crc32c] entry for {where}")
            start, count, crc = entry[:3]
            if count != geo.entries or crc >= 1 << 32 or start + count > nbytes // 4:
                raise _bad(url, f"entry of {where} ({start}, {count} entries) does not fit "
                           f"its {geo.entries} inner chunks in a table of {nbytes} bytes")
            missing = entry[3] if len(entry) == 4 else []
            if not (isinstance(missing, list) and all(_uint(i) and i < count for i in missing)):
                raise _bad(url, f"lists chunks not stored of {where} outside its entries")
            self.blocks[geo.array] = _Block(start, count, crc, frozenset(missing))
        self._loaded: dict[str, np.ndarray] = {}
        self._whole: bytes | None = None
        self._lock = threading.Lock()

    def _fetch(self, lo: int, hi: int) -> bytes:
        assert self.store is not None
        if self.nbytes > WHOLE_BYTES:
            return self.store.get(self.key, lo, hi) if hi > lo else b""
        with self._lock:
            whole = self._whole
        if whole is None:
            whole = self.store.get(self.key)
            with self._lock:
                self._whole = whole
        return whole[lo:hi]

    def _block(self, array: str) -> np.ndarray:
        with self._lock:
            got = self._loaded.get(array)
        if got is not None:
            return got
        if self.store is None:
            raise RuntimeError("this manifest was not read from storage; its chunk crc32c "
                               "table cannot be fetched")
        b = self.blocks[array]
        lo, hi = 4 * b.start, 4 * (b.start + b.count)
        try:
            raw = self._fetch(lo, hi)
        except (ObjectNotFoundError, ObjectTruncatedError) as e:
            raise MissingChunkError(
                f"checkpoint {self.url}: the chunk crc32c table {self.key} is missing or "
                f"truncated ({e}); restore an older checkpoint", url=self.url,
                obj=self.key) from e
        if len(raw) != hi - lo or crc32c(raw) != b.crc:
            raise ChecksumMismatchError(
                f"checkpoint {self.url}: the block of array {array} in {self.key} "
                f"({len(raw)} bytes, crc32c {crc32c(raw)}) is not the one the manifest "
                f"records ({hi - lo} bytes, crc32c {b.crc}); restore an older checkpoint",
                url=self.url, obj=self.key)
        got = np.frombuffer(raw, dtype="<u4")
        with self._lock:
            self._loaded.setdefault(array, got)
        return got

    def crcs_of(self, key: str) -> list[int | None]:
        """The crc32c recorded for each inner chunk of data object `key` (None: not
        stored). Raises `CorruptCheckpointError` for a key the manifest does not have."""
        array = array_of_key(key)
        geo = self.geometry.get(array)
        lin = None if geo is None else geo.object_index(key)
        if geo is None or lin is None:
            raise CorruptCheckpointError(
                f"checkpoint {self.url}: object {key} is not a data object of the manifest",
                url=self.url, obj=key)
        n = geo.per_object
        vals: list[int | None] = self._block(array)[lin * n: (lin + 1) * n].tolist()
        missing = self.blocks[array].missing
        if missing:
            base = lin * n
            vals = [None if base + i in missing else v for i, v in enumerate(vals)]
        return vals
