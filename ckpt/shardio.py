"""Direct I/O of uncompressed zarr v3 shard objects, without tensorstore.

A shard object of the `sharding_indexed` codec as `ckpt.format.zarr_metadata` declares
it without compression is simple: every inner chunk in C order of the inner grid, each
its raw little-endian C-order bytes followed by their crc32c (4 bytes, little endian),
then the shard index, `(offset, nbytes)` uint64 little-endian pairs in the same order,
followed by its own crc32c. These are exactly the bytes tensorstore writes when every
chunk is stored (`store_data_equal_to_fill_value`; tests/ckpt/test_shardio.py compares
the two byte for byte), so plain tensorstore and zarr-python read what we write.

Why do it ourselves: tensorstore's encode, checksum and copy passes cost a rank about
4x the CPU time of `torch.save` for the same bytes (docs/ckpt.md). Here a shard is
one copy into `bytes` per inner chunk (the tile gather), one crc32c pass, one join and
one `Store.put`; a read is one ranged get per inner chunk it needs, one crc32c pass and
one copy into the target. Compressed arrays, 0-d arrays and shards that are not whole
(the partial edge chunk of an uneven grid) stay with tensorstore.

Checks on read: the whole chunk-plus-crc is run through crc32c, which for an intact
chunk always gives the CRC-32C residue (so no slice of the data is copied to check
it); a missing object, a truncated one, an index entry marked missing or pointing
outside the object are `MissingChunkError`, a bad crc `ChecksumMismatchError`, each
naming the tensor and the object.
"""

from __future__ import annotations

import itertools
import struct
import sys
from dataclasses import dataclass
from typing import Any

import google_crc32c
import numpy as np

from ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, MissingChunkError
from storage import ObjectNotFoundError, ObjectTruncatedError, Store

__all__ = ["ShardGeometry", "direct_ok", "shard_key", "encode_shard", "read_shard_region"]

RESIDUE = 0x48674BC7
"""crc32c(data + crc32c(data) as 4 little-endian bytes) for any data."""
MISSING = (1 << 64) - 1
"""Index entry of a chunk that is not stored."""


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """One shard object: its (outer chunk) shape, its inner chunk shape, the item size."""

    shape: tuple[int, ...]
    inner: tuple[int, ...]
    itemsize: int

    @property
    def grid(self) -> tuple[int, ...]:
        return tuple(s // i for s, i in zip(self.shape, self.inner, strict=True))

    @property
    def n_chunks(self) -> int:
        return int(np.prod(self.grid, dtype=np.int64))

    @property
    def chunk_bytes(self) -> int:
        return int(np.prod(self.inner, dtype=np.int64)) * self.itemsize

    @property
    def index_bytes(self) -> int:
        return 16 * self.n_chunks + 4

    @property
    def object_bytes(self) -> int:
        return self.n_chunks * (self.chunk_bytes + 4) + self.index_bytes

    def tile(self, cell: tuple[int, ...]) -> tuple[slice, ...]:
        return tuple(slice(c * i, (c + 1) * i) for c, i in zip(cell, self.inner, strict=True))

    def cells(self) -> Any:
        return itertools.product(*(range(g) for g in self.grid))

    def overlapping(self, region: tuple[slice, ...]) -> list[tuple[int, tuple[int, ...]]]:
        """(linear index, cell) of every inner chunk that `region` (in shard coordinates)
        overlaps, in storage order."""
        ranges = [range(r.start // i, (r.stop - 1) // i + 1)
                  for r, i in zip(region, self.inner, strict=True)]
        strides = [int(np.prod(self.grid[d + 1:], dtype=np.int64)) for d in range(len(self.grid))]
        return [(sum(c * s for c, s in zip(cell, strides, strict=True)), cell)
                for cell in itertools.product(*ranges)]


def direct_ok(shape: tuple[int, ...] | list[int], inner: tuple[int, ...] | list[int],
              compression: str | None) -> bool:
    """Whether a whole shard of this shape and inner chunking takes the direct path."""
    return (compression is None and sys.byteorder == "little" and len(shape) >= 1
            and len(inner) == len(shape)
            and all(s > 0 and i > 0 and s % i == 0 for s, i in zip(shape, inner, strict=True)))


def shard_key(array: str, cell: tuple[int, ...] | list[int]) -> str:
    """Object key of outer chunk `cell` of an array (zarr v3 default key encoding, '/')."""
    return f"{array}/c/" + "/".join(str(int(c)) for c in cell)


def _crc_le(data: bytes) -> bytes:
    return struct.pack("<I", google_crc32c.value(data))


def encode_shard(arr: np.ndarray, geo: ShardGeometry) -> bytes:
    """The shard object of `arr` (the whole outer chunk, any strides)."""
    if tuple(arr.shape) != geo.shape or arr.dtype.itemsize != geo.itemsize:
        raise ValueError(f"array {arr.shape} {arr.dtype} does not fit shard {geo}")
    step = geo.chunk_bytes + 4
    parts: list[bytes] = []
    for cell in geo.cells():
        # tobytes() gathers the tile in C order into one new bytes object: the only copy
        # before the join (google_crc32c takes bytes, not views).
        data = arr[geo.tile(cell)].tobytes()
        parts.append(data)
        parts.append(_crc_le(data))
    n = geo.n_chunks
    index = np.empty((n, 2), dtype="<u8")
    index[:, 0] = np.arange(n, dtype=np.uint64) * np.uint64(step)
    index[:, 1] = step
    raw = index.tobytes()
    parts.append(raw)
    parts.append(_crc_le(raw))
    return b"".join(parts)


def _get(store: Store, key: str, start: int, end: int, url: str, tensor: str, what: str) -> bytes:
    try:
        return store.get(key, start, end)
    except ObjectNotFoundError as e:
        raise MissingChunkError(
            f"tensor {tensor!r}, object {url}/{key}: the object is missing ({e}); the "
            "checkpoint is incomplete, restore an older one", url=url, tensor=tensor,
            obj=key) from e
    except ObjectTruncatedError as e:
        raise MissingChunkError(
            f"tensor {tensor!r}, object {url}/{key}: {what} is truncated ({e}); restore an "
            "older checkpoint", url=url, tensor=tensor, obj=key) from e


def read_shard_region(store: Store, key: str, geo: ShardGeometry, region: tuple[slice, ...],
                      out: np.ndarray, *, url: str, tensor: str) -> int:
    """Fill `out` (shape of `region`, the dtype stored) with `region` of the shard object
    at `key`, fetching only the inner chunks it overlaps. Returns the bytes fetched."""
    end = geo.object_bytes
    raw = _get(store, key, end - geo.index_bytes, end, url, tensor, "the shard index")
    if google_crc32c.value(raw) != RESIDUE:
        raise ChecksumMismatchError(
            f"tensor {tensor!r}, object {url}/{key}: the shard index fails its crc32c; the "
            "stored bytes are damaged, restore an older checkpoint", url=url, tensor=tensor,
            obj=key)
    entries = np.frombuffer(raw, dtype="<u8", count=2 * geo.n_chunks).reshape(-1, 2)
    fetched = len(raw)
    step = geo.chunk_bytes + 4
    count = geo.chunk_bytes // geo.itemsize
    for lin, cell in geo.overlapping(region):
        off, nb = int(entries[lin, 0]), int(entries[lin, 1])
        if off == MISSING:
            raise MissingChunkError(
                f"tensor {tensor!r}, object {url}/{key}: inner chunk {cell} is not stored; "
                "the checkpoint is incomplete, restore an older one", url=url, tensor=tensor,
                obj=key)
        if nb != step or off + nb > end - geo.index_bytes:
            raise CorruptCheckpointError(
                f"tensor {tensor!r}, object {url}/{key}: index entry of inner chunk {cell} "
                f"({off}, {nb}) does not fit the shard; restore an older checkpoint",
                url=url, tensor=tensor, obj=key)
        data = _get(store, key, off, off + nb, url, tensor, f"inner chunk {cell}")
        fetched += nb
        if google_crc32c.value(data) != RESIDUE:
            raise ChecksumMismatchError(
                f"tensor {tensor!r}, object {url}/{key}: inner chunk {cell} fails its crc32c; "
                "the stored bytes are damaged, restore an older checkpoint", url=url,
                tensor=tensor, obj=key)
        chunk = np.frombuffer(data, dtype=out.dtype, count=count).reshape(geo.inner)
        src, dst = [], []
        for r, t in zip(region, geo.tile(cell), strict=True):
            lo, hi = max(r.start, t.start), min(r.stop, t.stop)
            src.append(slice(lo - t.start, hi - t.start))
            dst.append(slice(lo - r.start, hi - r.start))
        out[tuple(dst)] = chunk[tuple(src)]
    return fetched
