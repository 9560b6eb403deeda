"""The chunk crc32c table: which crc32c belongs to which inner chunk, out of the manifest.

A save records the crc32c of every inner chunk it stores, so that a load can tell a
well-formed chunk in the wrong place (another tensor's, another position's, another
checkpoint's) from the right one (docs/format.md, "Chunk binding"). Those records grow
with the number of data objects: 4.4 million objects for Llama-3-70B on 16,384 ranks,
over 200 MB as JSON lists, which every rank would parse. So they live in one binary
object per save attempt, `data/<attempt>/chunk_crc32c.bin`: little-endian uint32, array
after array in the table's order (`ckpt.manifest.data_arrays`: the grid and piece arrays
in the manifest's order, then the packed arrays sorted), each array's objects in C
order of its grid and each object's inner chunks in storage order. Where each array's
block starts and how long it is follow from the manifest's shapes; the manifest keeps
the crc32c of each block's bytes, by position, and the entries of chunks that are not
stored (`chunk_crc32c_table`): a few bytes per array, and the manifest's own crc32c in
the commit marker binds the blocks.

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

from relight.ckpt.errors import (
    ChecksumMismatchError,
    CorruptCheckpointError,
    MissingChunkError,
    UnsafePathError,
)
from relight.ckpt.format import check_path, chunk_key
from relight.storage import ObjectNotFoundError, ObjectTruncatedError, Store
from relight.storage.checksum import crc32c

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
    """The table of `arrays` (in table order) with the crcs the ranks reported, and the
    manifest's record of it (object `key`). Raises KeyError/ValueError naming an object
    whose crcs are missing or of the wrong count: the save cannot bind that object."""
    parts: list[np.ndarray] = []
    block_crcs: list[int] = []
    not_stored: list[list[Any]] = []
    for pos, geo in enumerate(arrays):
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
        if missing:
            not_stored.append([pos, missing])
        block_crcs.append(crc32c(block.tobytes()))
        parts.append(block)
    blob = b"".join(p.tobytes() for p in parts)
    record: dict[str, Any] = {"object": key, "bytes": len(blob), "crc32c": block_crcs}
    if not_stored:
        record["not_stored"] = not_stored
    return blob, record


def _bad(url: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {url}: '{TABLE_FIELD}' {what}; the manifest "
                                  "is damaged", url=url)


def _uint(v: Any) -> bool:
    return type(v) is int and v >= 0  # (type, not isinstance: a bool is an int too)


def _where(geo: ArrayGeometry) -> str:
    return f"array {geo.array}" + (f" of tensor {geo.tensor!r}" if geo.tensor else "")


@dataclass(frozen=True, slots=True)
class _Block:
    geo: ArrayGeometry
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
        if not isinstance(record, dict) or type(record.get("crc32c")) is not list:
            raise _bad(url, "is not an object with a 'crc32c' list")
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
        crcs = record["crc32c"]
        self._arrays = list(arrays)
        if not all(type(c) is int for c in crcs):  # (type: a bool is an int too)
            bad = next(i for i, c in enumerate(crcs) if type(c) is not int)
            raise _bad(url, f"has crc32c {str(crcs[bad])[:40]} for {self._at(bad)}")
        values = np.array(crcs, dtype=object)
        out = (values < 0) | (values >= 1 << 32) if len(crcs) else np.zeros(0, bool)
        if out.any():
            bad = int(np.argmax(out))
            raise _bad(url, f"has crc32c {crcs[bad]} for {self._at(bad)}")
        self._crcs: list[int] = crcs
        entries = [g.entries for g in self._arrays]
        if len(crcs) != len(entries) or 4 * sum(entries) != nbytes:
            raise _bad(url, f"records {len(crcs)} arrays in {nbytes} bytes; the manifest's "
                       f"{len(entries)} arrays have {sum(entries)} inner chunks "
                       f"({4 * sum(entries)} bytes)")
        self._not_stored: dict[int, frozenset[int]] = {}
        for item in record.get("not_stored", []):
            if not (type(item) is list and len(item) == 2 and _uint(item[0])
                    and item[0] < len(entries) and type(item[1]) is list):
                raise _bad(url, f"has a 'not_stored' item {str(item)[:60]} that is not "
                           "[array position, [entries]]")
            pos, which = item
            if not all(_uint(i) and i < entries[pos] for i in which):
                raise _bad(url, f"lists chunks not stored of {self._at(pos)} outside its "
                           "entries")
            self._not_stored[pos] = frozenset(which)
        self._blocks: dict[str, _Block] | None = None
        self._loaded: dict[str, np.ndarray] = {}
        self._whole: bytes | None = None
        self._lock = threading.Lock()

    def _at(self, pos: int) -> str:
        return _where(self._arrays[pos]) if pos < len(self._arrays) else f"position {pos}"

    @property
    def blocks(self) -> dict[str, _Block]:
        """Array -> its block: built on first use (a load opens a few arrays of many)."""
        with self._lock:
            if self._blocks is None:
                blocks, start = {}, 0
                for pos, geo in enumerate(self._arrays):
                    blocks[geo.array] = _Block(geo, start, geo.entries, self._crcs[pos],
                                               self._not_stored.get(pos, frozenset()))
                    start += geo.entries
                self._blocks = blocks
            return self._blocks

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
        block = self.blocks.get(array)
        geo = None if block is None else block.geo
        lin = None if geo is None else geo.object_index(key)
        if geo is None or lin is None:
            raise CorruptCheckpointError(
                f"checkpoint {self.url}: object {key} is not a data object of the manifest",
                url=self.url, obj=key)
        n = geo.per_object
        vals: list[int | None] = self._block(array)[lin * n: (lin + 1) * n].tolist()
        missing = block.missing
        if missing:
            base = lin * n
            vals = [None if base + i in missing else v for i, v in enumerate(vals)]
        return vals
