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

Binding (docs/format.md, "chunk_crc32c"): a chunk's crc32c covers its bytes, not its
place, so a well-formed chunk copied from another tensor or position would pass those
checks. The save records every stored chunk's crc32c (`encode_shard(..., crcs=)` hands
back the ones it computes; `stored_crcs` reads them out of an object tensorstore wrote)
and the manifest carries them; a read given `expect` compares each chunk's stored crc
(4 bytes it fetched anyway) with the recorded one.

A shard at the edge of an uneven grid (`ShardGeometry.valid`) keeps the full outer
chunk's index, with the inner chunks wholly outside the array marked missing and the
others stored in full (padded), back to back: what tensorstore writes.

Reads also cover what tensorstore writes and we do not: zstd shards (each inner chunk a
zstd frame of its bytes, then the crc32c of the frame; fetched whole, since the object's
size is not known from its geometry) and 0-d arrays. So every load checks every chunk it
uses against the manifest's record (`direct_read_ok`); only writes keep the narrower
`direct_ok`.
"""

from __future__ import annotations

import ctypes
import itertools
import struct
import sys
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard

from relight.ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, MissingChunkError
from relight.storage import ObjectNotFoundError, ObjectTruncatedError, Store
from relight.storage.checksum import crc32c
from relight.storage.direct_io import BufferPool, scratch_bytes

__all__ = ["ShardGeometry", "direct_ok", "direct_read_ok", "grid_geometry", "encode_shard",
           "read_shard_region", "stored_crcs"]

RESIDUE = 0x48674BC7
"""crc32c(data + crc32c(data) as 4 little-endian bytes) for any data."""
MISSING = (1 << 64) - 1
"""Index entry of a chunk that is not stored."""


@dataclass(frozen=True, slots=True)
class ShardGeometry:
    """One shard object: its (outer chunk) shape, its inner chunk shape, the item size,
    and for an edge shard of an uneven grid the extent of it inside the array (`valid`;
    None: all of it)."""

    shape: tuple[int, ...]
    inner: tuple[int, ...]
    itemsize: int
    valid: tuple[int, ...] | None = None

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
    def n_stored(self) -> int:
        """Inner chunks stored: those that overlap the array (all but at an edge)."""
        if self.valid is None:
            return self.n_chunks
        return int(np.prod([-(-v // i) for v, i in zip(self.valid, self.inner, strict=True)],
                           dtype=np.int64))

    @property
    def index_bytes(self) -> int:
        return 16 * self.n_chunks + 4

    @property
    def object_bytes(self) -> int:
        return self.n_stored * (self.chunk_bytes + 4) + self.index_bytes

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


def grid_geometry(shape: tuple[int, ...], chunks: tuple[int, ...], inner: tuple[int, ...],
                  cell: tuple[int, ...], itemsize: int) -> ShardGeometry:
    """The shard at `cell` of a grid tensor of `shape` chunked `chunks` / `inner` (an edge
    shard of an uneven grid gets its `valid` extent)."""
    chunks = tuple(chunks)
    valid = tuple(min(c, s - k * c) for s, k, c in zip(shape, cell, chunks, strict=True))
    return ShardGeometry(chunks, tuple(inner), itemsize, None if valid == chunks else valid)


def direct_ok(shape: tuple[int, ...] | list[int], inner: tuple[int, ...] | list[int],
              compression: str | None) -> bool:
    """Whether a whole shard of this shape and inner chunking is written directly."""
    return compression is None and len(shape) >= 1 and direct_read_ok(shape, inner, None)


def direct_read_ok(shape: tuple[int, ...] | list[int], inner: tuple[int, ...] | list[int],
                   compression: str | None) -> bool:
    """Whether a shard of this shape and inner chunking is read directly: uncompressed or
    zstd, 0-d included (tensorstore writes those)."""
    return (compression in (None, "zstd") and sys.byteorder == "little"
            and len(inner) == len(shape)
            and all(s > 0 and i > 0 and s % i == 0 for s, i in zip(shape, inner, strict=True)))


def crc32c_of(buf: np.ndarray, lo: int, hi: int) -> int:
    """crc32c of bytes [lo, hi) of a C-contiguous uint8 array, without copying them."""
    return crc32c(buf[lo:hi])


def _new_bytes(n: int) -> tuple[bytes | bytearray, np.ndarray]:
    """A new `bytes` of length n and a writable uint8 view of its storage. Filling a bytes
    object before anyone else holds it is how C code builds one
    (PyBytes_FromStringAndSize(NULL, n)); it lets the shard be assembled with one copy
    and handed to `Store.put`, which would copy anything that is not `bytes`."""
    if sys.implementation.name != "cpython":  # pragma: no cover - other interpreters
        ba = bytearray(n)
        return ba, np.frombuffer(ba, dtype=np.uint8)
    b = _PY_NEW_BYTES(None, n)
    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(_PY_BYTES_PTR(b)))
    return b, view


if sys.implementation.name == "cpython":
    _PY_NEW_BYTES = ctypes.pythonapi.PyBytes_FromStringAndSize
    _PY_NEW_BYTES.restype, _PY_NEW_BYTES.argtypes = ctypes.py_object, (ctypes.c_void_p,
                                                                       ctypes.c_ssize_t)
    _PY_BYTES_PTR = ctypes.pythonapi.PyBytes_AsString
    _PY_BYTES_PTR.restype, _PY_BYTES_PTR.argtypes = ctypes.c_void_p, (ctypes.py_object,)


def _as_bytes_grid(arr: np.ndarray) -> np.ndarray:
    """`arr` as uint8 with the last dim widened by the item size (a view when the last
    dim is contiguous), so tiles copy as raw bytes whatever the dtype."""
    if arr.ndim == 0 or arr.strides[-1] != arr.itemsize:
        arr = np.ascontiguousarray(arr)
    return arr.view(np.uint8)


def encode_shard(arr: np.ndarray, geo: ShardGeometry, crcs: list[int | None] | None = None,
                 *, into: np.ndarray | None = None) -> bytes | memoryview:
    """The shard object of `arr` (the whole outer chunk, any strides): one copy of the
    data (the tile gather), one crc32c pass, no other copy. The crc32c of each inner
    chunk, in storage order, is appended to `crcs` when given (the manifest records them).

    Into a new `bytes`, or, given `into` (a uint8 buffer of at least
    `geo.object_bytes`), into that buffer, returning a view of its first
    `geo.object_bytes`: a writer that reuses its buffers does not fault in and zero
    fresh pages for every object."""
    if (tuple(arr.shape) != geo.shape or arr.dtype.itemsize != geo.itemsize
            or geo.valid is not None):
        raise ValueError(f"array {arr.shape} {arr.dtype} does not fit shard {geo}")
    step = geo.chunk_bytes + 4
    n = geo.n_chunks
    out: bytes | bytearray | memoryview
    if into is None:
        out, buf = _new_bytes(geo.object_bytes)
    else:
        if into.dtype != np.uint8 or into.ndim != 1 or into.size < geo.object_bytes:
            raise ValueError(f"buffer {into.shape} {into.dtype} cannot hold shard {geo}")
        buf = into[: geo.object_bytes]
        out = memoryview(buf)
    src = _as_bytes_grid(arr)
    item = geo.itemsize
    tile_shape = (*geo.inner[:-1], geo.inner[-1] * item)
    index = np.empty((n, 2), dtype="<u8")
    for i, cell in enumerate(geo.cells()):
        lo = i * step
        t = geo.tile(cell)
        last = slice(t[-1].start * item, t[-1].stop * item)
        np.copyto(buf[lo: lo + geo.chunk_bytes].reshape(tile_shape), src[(*t[:-1], last)])
        crc = crc32c_of(buf, lo, lo + geo.chunk_bytes)
        struct.pack_into("<I", buf, lo + geo.chunk_bytes, crc)
        if crcs is not None:
            crcs.append(crc)
        index[i] = (lo, step)
    at = n * step
    buf[at: at + 16 * n] = index.reshape(-1).view(np.uint8)
    struct.pack_into("<I", buf, at + 16 * n, crc32c_of(buf, at, at + 16 * n))
    return bytes(out) if isinstance(out, bytearray) else out


def _get(store: Store, key: str, start: int | None, end: int | None, url: str, tensor: str,
         what: str, buffers: BufferPool | None = None,
         taken: list[np.ndarray] | None = None) -> np.ndarray:
    """Bytes [start, end) of `key`, as uint8: when `buffers` is given and the range is
    known, a view (`Store.get_view`) of the cached pages or of a buffer from `buffers`
    (taken only if the store reads into it, noted in `taken`, to be given back once the
    bytes are used), else a new array."""
    try:
        if buffers is not None and taken is not None and end is not None:
            def scratch() -> np.ndarray:
                buf = buffers.take(scratch_bytes(start or 0, end))
                taken.append(buf)
                return buf
            return np.frombuffer(store.get_view(key, start or 0, end, scratch), np.uint8)
        return np.frombuffer(store.get(key, start, end), np.uint8)
    except ObjectNotFoundError as e:
        raise MissingChunkError(
            f"tensor {tensor!r}, object {url}/{key}: the object is missing ({e}); the "
            "checkpoint is incomplete, restore an older one", url=url, tensor=tensor,
            obj=key) from e
    except ObjectTruncatedError as e:
        raise MissingChunkError(
            f"tensor {tensor!r}, object {url}/{key}: {what} is truncated ({e}); restore an "
            "older checkpoint", url=url, tensor=tensor, obj=key) from e


def stored_crcs(blob: bytes | np.ndarray, n_chunks: int, *, url: str, key: str,
                tensor: str) -> list[int | None]:
    """The crc32c stored after each inner chunk of a whole shard object (the last 4
    bytes of its index entry's span; None for a chunk not stored), read from the index
    without a pass over the data. For objects written by tensorstore (zstd: the crc of
    the compressed bytes, which is what a reader checks)."""
    raw = np.frombuffer(blob, np.uint8) if not isinstance(blob, np.ndarray) else blob
    ib = 16 * n_chunks + 4
    if raw.size < ib or crc32c_of(raw, raw.size - ib, raw.size) != RESIDUE:
        raise _damaged(url, key, tensor, "the shard index")
    entries = raw[raw.size - ib: raw.size - 4].view("<u8").reshape(-1, 2)
    out: list[int | None] = []
    for off, nb in entries.tolist():
        if off == MISSING:
            out.append(None)
            continue
        if nb < 4 or off + nb > raw.size - ib:
            raise CorruptCheckpointError(
                f"tensor {tensor!r}, object {url}/{key}: index entry ({off}, {nb}) does not "
                "fit the shard; restore an older checkpoint", url=url, tensor=tensor, obj=key)
        out.append(int(raw[off + nb - 4: off + nb].view("<u4")[0]))
    return out


def misplaced(url: str, key: str, tensor: str, what: str, got: int | None,
              want: int | None) -> ChecksumMismatchError:
    """A well-formed chunk whose crc32c is not the one the manifest records for this
    place: bytes of another tensor, position or checkpoint."""
    return ChecksumMismatchError(
        f"tensor {tensor!r}, object {url}/{key}: {what} has crc32c {got}, the manifest "
        f"records {want} for this place; the chunk was swapped or copied from elsewhere, "
        "restore an older checkpoint", url=url, tensor=tensor, obj=key)


def _decode(run: np.ndarray, at: int, geo: ShardGeometry, lin: int, cell: tuple[int, ...],
            region: tuple[slice, ...], out: np.ndarray, url: str, key: str,
            tensor: str, expect: list[int | None] | None) -> None:
    """Check the inner chunk at `run[at:]` (its crc32c, and against `expect[lin]` when
    given) and copy its part of `region` into `out`."""
    _check_chunk(run, at, at + geo.chunk_bytes + 4, lin, cell, url, key, tensor, expect)
    _place(run[at: at + geo.chunk_bytes].view(out.dtype).reshape(geo.inner), geo, cell,
           region, out)


def _check_chunk(buf: np.ndarray, lo: int, hi: int, lin: int, cell: tuple[int, ...],
                 url: str, key: str, tensor: str, expect: list[int | None] | None) -> None:
    """The stored chunk `buf[lo:hi]` (its bytes, then their crc32c): intact, and the one
    the manifest records for place `lin` when `expect` is given."""
    if crc32c_of(buf, lo, hi) != RESIDUE:
        raise _damaged(url, key, tensor, f"inner chunk {cell}")
    if expect is not None:
        got = int(buf[hi - 4: hi].view("<u4")[0])
        if got != expect[lin]:
            raise misplaced(url, key, tensor, f"inner chunk {cell}", got, expect[lin])


def _entry(entries: np.ndarray, lin: int, cell: tuple[int, ...], fits: Any, url: str,
           key: str, tensor: str) -> tuple[int, int]:
    """Index entry `lin` as (offset, nbytes): stored, and accepted by `fits(off, nb)`."""
    off, nb = int(entries[lin, 0]), int(entries[lin, 1])
    if off == MISSING:
        raise MissingChunkError(
            f"tensor {tensor!r}, object {url}/{key}: inner chunk {cell} is not stored; "
            "the checkpoint is incomplete, restore an older one", url=url, tensor=tensor,
            obj=key)
    if not fits(off, nb):
        raise CorruptCheckpointError(
            f"tensor {tensor!r}, object {url}/{key}: index entry of inner chunk {cell} "
            f"({off}, {nb}) does not fit the shard; restore an older checkpoint",
            url=url, tensor=tensor, obj=key)
    return off, nb


def _place(chunk: np.ndarray, geo: ShardGeometry, cell: tuple[int, ...],
           region: tuple[slice, ...], out: np.ndarray) -> None:
    """Copy the part of inner chunk `cell` that `region` overlaps into `out`."""
    src, dst = [], []
    for r, t in zip(region, geo.tile(cell), strict=True):
        lo, hi = max(r.start, t.start), min(r.stop, t.stop)
        src.append(slice(lo - t.start, hi - t.start))
        dst.append(slice(lo - r.start, hi - r.start))
    out[tuple(dst)] = chunk[tuple(src)]


def _damaged(url: str, key: str, tensor: str, what: str) -> ChecksumMismatchError:
    return ChecksumMismatchError(
        f"tensor {tensor!r}, object {url}/{key}: {what} fails its crc32c; the stored bytes "
        "are damaged, restore an older checkpoint", url=url, tensor=tensor, obj=key)


def read_shard_region(store: Store, key: str, geo: ShardGeometry, region: tuple[slice, ...],
                      out: np.ndarray, *, url: str, tensor: str,
                      cpu: AbstractContextManager[Any] | None = None,
                      expect: list[int | None] | None = None,
                      compression: str | None = None,
                      buffers: BufferPool | None = None, gap_bytes: int = 0) -> int:
    """Fill `out` (shape of `region`, the dtype stored) with `region` of the shard object
    at `key`. Returns the bytes fetched: the whole object in one get when every inner
    chunk is needed, else only the inner chunks `region` overlaps (adjacent ones in one
    ranged get), after the index that says where they are, unless `expect` binds them
    (below). `cpu` (e.g. a lock shared by reader threads) is held while fetched bytes are
    checked and copied, not while fetching. `expect`: the crc32c the manifest records for
    each inner chunk (storage order), checked for every chunk read
    (`ChecksumMismatchError` naming the chunk on a mismatch). `buffers`: where the fetched
    bytes go (`Store.get_view`), reused by the reads that follow; without it each fetch
    is a new `bytes`. `gap_bytes`: needed chunks at most this far apart come in one
    ranged get, the bytes between them fetched and dropped (where a request costs more
    than moving that many bytes: `ckpt.read_pools.READ_GAP_BYTES`).

    A partial read whose chunks `expect` records reads them where this module and
    tensorstore put them (chunk `i` at `i * (chunk_bytes + 4)`) without the index: each
    chunk's own crc32c and the manifest's record for its place bind it as the index
    would, and the index read is a request waited for before any chunk's (on S3 a round
    trip per object). A chunk found elsewhere (another writer's order, or damage) sends
    the read through the index, which then says which."""
    if expect is not None and len(expect) != geo.n_chunks:
        raise CorruptCheckpointError(
            f"tensor {tensor!r}, object {url}/{key}: the manifest records {len(expect)} "
            f"chunk checksums for a shard of {geo.n_chunks} inner chunks; the manifest is "
            "damaged", url=url, tensor=tensor, obj=key)
    if compression is not None:
        return _read_compressed(store, key, geo, region, out, url=url, tensor=tensor,
                                cpu=cpu, expect=expect)
    end = geo.object_bytes
    data_end = end - geo.index_bytes
    cells = geo.overlapping(region)
    step = geo.chunk_bytes + 4
    whole = len(cells) == geo.n_stored
    fetched = [0]  # bytes fetched, a first try at the canonical places included
    if not whole and expect is not None and all(expect[lin] is not None for lin, _ in cells):
        try:
            _read_spans(store, key, geo, [(lin * step, lin, cell) for lin, cell in cells],
                        None, region, out, url, tensor, cpu, expect, buffers, fetched,
                        gap_bytes)
            return fetched[0]
        except CorruptCheckpointError:
            pass  # not at its canonical place: the index says where, or what is wrong
    taken: list[np.ndarray] = []
    if whole:
        blob = _get(store, key, 0, end, url, tensor, "the shard", buffers, taken)
        raw = blob[data_end:]
    else:
        raw = _get(store, key, data_end, end, url, tensor, "the shard index")
    try:
        if crc32c_of(raw, 0, raw.size) != RESIDUE:
            raise _damaged(url, key, tensor, "the shard index")
        entries = raw[:-4].view("<u8").reshape(-1, 2)
        spans: list[tuple[int, int, tuple[int, ...]]] = []
        for lin, cell in cells:
            off, _nb = _entry(entries, lin, cell,
                              lambda o, n: n == step and o + n <= data_end, url, key, tensor)
            spans.append((off, lin, cell))
        fetched[0] += end if whole else raw.size
        _read_spans(store, key, geo, spans, blob if whole else None, region, out, url, tensor,
                    cpu, expect, buffers, fetched, gap_bytes)
        return fetched[0]
    finally:
        _give_back(buffers, taken)


def _read_spans(store: Store, key: str, geo: ShardGeometry,
                spans: list[tuple[int, int, tuple[int, ...]]], blob: np.ndarray | None,
                region: tuple[slice, ...], out: np.ndarray, url: str, tensor: str,
                cpu: AbstractContextManager[Any] | None, expect: list[int | None] | None,
                buffers: BufferPool | None, fetched: list[int], gap_bytes: int = 0) -> None:
    """Check and place the inner chunks at `spans` ((offset, storage position, cell)):
    from `blob` (the whole object, already fetched), else fetched run by run (chunks
    stored back to back, or at most `gap_bytes` apart, in one ranged get). Adds the
    bytes fetched here to `fetched[0]` as each run arrives (so that a read that fails
    part-way still counts them)."""
    step = geo.chunk_bytes + 4
    i = 0
    while i < len(spans):
        j = i + 1  # a run of chunks close enough to share one ranged get
        while j < len(spans) and 0 <= spans[j][0] - (spans[j - 1][0] + step) <= gap_bytes:
            j += 1
        taken: list[np.ndarray] = []
        try:
            if blob is not None:
                run, base = blob, 0
            else:
                lo, hi = spans[i][0], spans[j - 1][0] + step
                run = _get(store, key, lo, hi, url, tensor, "an inner chunk", buffers, taken)
                base = lo
                fetched[0] += hi - lo
            with cpu or nullcontext():
                for off, lin, cell in spans[i:j]:
                    _decode(run, off - base, geo, lin, cell, region, out, url, key, tensor,
                            expect)
        finally:
            _give_back(buffers, taken)
        i = j


def _give_back(buffers: BufferPool | None, taken: list[np.ndarray]) -> None:
    while buffers is not None and taken:
        buffers.give_back(taken.pop())


def _read_compressed(store: Store, key: str, geo: ShardGeometry, region: tuple[slice, ...],
                     out: np.ndarray, *, url: str, tensor: str,
                     cpu: AbstractContextManager[Any] | None,
                     expect: list[int | None] | None) -> int:
    """`read_shard_region` of a zstd shard: the whole object in one get, then per inner
    chunk `region` needs: its frame's crc32c, the manifest's record, a decompression to
    exactly one inner chunk of bytes, the copy."""
    blob = _get(store, key, None, None, url, tensor, "the shard")
    ib = geo.index_bytes
    if blob.size < ib or crc32c_of(blob, blob.size - ib, blob.size) != RESIDUE:
        raise _damaged(url, key, tensor, "the shard index")
    data_end = blob.size - ib
    entries = blob[data_end: blob.size - 4].view("<u8").reshape(-1, 2)
    with cpu or nullcontext():
        for lin, cell in geo.overlapping(region):
            off, nb = _entry(entries, lin, cell,
                             lambda o, n: n > 4 and o + n <= data_end, url, key, tensor)
            _check_chunk(blob, off, off + nb, lin, cell, url, key, tensor, expect)
            try:
                raw = zstandard.ZstdDecompressor().decompress(
                    blob[off: off + nb - 4], max_output_size=geo.chunk_bytes)
            except zstandard.ZstdError as e:
                raise CorruptCheckpointError(
                    f"tensor {tensor!r}, object {url}/{key}: inner chunk {cell} is not a "
                    f"zstd frame ({e}); restore an older checkpoint", url=url, tensor=tensor,
                    obj=key) from e
            if len(raw) != geo.chunk_bytes:
                raise CorruptCheckpointError(
                    f"tensor {tensor!r}, object {url}/{key}: inner chunk {cell} decompresses "
                    f"to {len(raw)} bytes, not {geo.chunk_bytes}; restore an older checkpoint",
                    url=url, tensor=tensor, obj=key)
            _place(np.frombuffer(raw, out.dtype).reshape(geo.inner), geo, cell, region, out)
    return int(blob.size)
