"""Large local objects and the page cache: reads that take it only when it holds the
range, writes that can go around it, and letting an object's pages go.

- `read_aligned`: a range of 1 MiB or more is mapped from the page cache when the cache
  holds every page of it (counted with `cachestat(2)`, which touches nothing): no copy
  and no buffer of the reader's own; else it is read with `O_DIRECT` into the caller's
  aligned buffer, so a cold read allocates no cache pages. A read through the cache into a
  page the kernel must first find is what costs: with earlier checkpoints kept, a reclaim
  per page, and on a virtual machine whose host backs guest memory lazily, a fault on
  the host as well. Reading a 512 MiB checkpoint from 4 processes, cold, took 0.32-0.34 s
  direct against 0.37-0.67 s buffered (2-core VM). A `RWF_NOWAIT` read does not serve as
  the test: on a miss the kernel starts readahead of the range (8 MiB here) before it
  says EAGAIN.
- `write_file(..., direct=True)`: the aligned bulk of an aligned buffer goes out with
  `O_DIRECT`; the remaining tail (under one block) through the cache on the same
  descriptor, after `fcntl` turns the flag off; the caller's fsync covers both.
  `LocalStore` writes through the cache by default: the checkpoint writer keeps the
  newest committed checkpoint cached and writes each save into the pages of older ones
  (`ckpt.page_recycle`); docs/design/ckpt-write-path.md has what that and `O_DIRECT`
  writes cost.
- `drop_cached`: `POSIX_FADV_DONTNEED` on a file's clean pages.

`O_DIRECT` needs the buffer's address, the file offset and each transfer's length
aligned to the device's logical block (`ALIGN` covers 512-byte and 4 KiB devices).
Filesystems that refuse it (the `fcntl` that turns it on fails) get buffered I/O, as do
buffers that are not aligned and transfers under `DIRECT_MIN_BYTES`.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import platform
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["ALIGN", "DIRECT_MIN_BYTES", "BufferPool", "aligned_empty", "cached_pages",
           "drop_cached", "read_aligned", "scratch_bytes", "write_file"]

ALIGN = 4096
"""Alignment of buffer addresses, file offsets and lengths for direct I/O."""

DIRECT_MIN_BYTES = 1 << 20
"""Objects smaller than this are written and read through the page cache: they are
metadata (`zarr.json`, indexes, manifests) that a save's commit and a load read back at
once, and few pages each. The threshold was chosen, not tuned by measurement."""

DIRECT_PIECE = 16 << 20
"""Bytes per direct `write()` call (a multiple of `ALIGN`)."""

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else ALIGN


def aligned_empty(nbytes: int) -> np.ndarray:
    """An uninitialised uint8 array of `nbytes` whose first byte is `ALIGN`-aligned."""
    raw = np.empty(nbytes + ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip: skip + nbytes]


class BufferPool:
    """Aligned buffers reused across the objects of one save or load, so the pages of
    an object are faulted in and zeroed by the kernel once per buffer rather than once
    per object (a fresh 4.45 MB `bytes` per object read cost 33k minor faults per 134 MB,
    and 2-3x the time of reading into reused buffers). At most as many buffers live as
    were taken at once: `take` drops a free buffer too small for the next object before
    it allocates another. Thread-safe."""

    def __init__(self) -> None:
        self.free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A free buffer of at least `nbytes` (the smallest that fits), else a new aligned
        one of exactly `nbytes`."""
        # By position, never `list.remove`: that compares arrays with ==, elementwise.
        with self._lock:
            fits = [i for i, b in enumerate(self.free) if b.size >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].size))
            if self.free:
                self.free.pop(max(range(len(self.free)), key=lambda i: self.free[i].size))
        return aligned_empty(nbytes)

    def give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            self.free.append(buf)

    def clear(self) -> None:
        """Drop the free buffers (those taken stay with their holders)."""
        with self._lock:
            self.free.clear()


def _address(data: Any) -> int | None:
    """The address of `data`'s first byte, or None for objects without one we can see."""
    try:
        return int(np.frombuffer(data, dtype=np.uint8).ctypes.data)
    except (TypeError, ValueError):
        return None


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for `fd`; False if the filesystem refuses it."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
    except OSError as e:
        if e.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            return False
        raise
    return True


def write_file(fd: int, data: Any, direct: bool) -> bool:
    """Write all of `data` (a bytes-like object) at `fd`'s current offset, which must be
    0 for the direct part. With `direct`, an aligned buffer of at least
    `DIRECT_MIN_BYTES` goes mostly around the page cache. Returns whether any byte was
    written direct (False: the filesystem refused, or the buffer did not qualify)."""
    view = memoryview(data).cast("B")
    size = len(view)
    at = 0
    went_direct = False
    bulk = size - size % ALIGN
    address = _address(view)
    if (direct and _O_DIRECT and size >= DIRECT_MIN_BYTES
            and address is not None and address % ALIGN == 0 and _set_direct(fd, True)):
        try:
            while at < bulk:
                try:
                    at += os.write(fd, view[at: min(bulk, at + DIRECT_PIECE)])
                except OSError as e:
                    # A device with a larger logical block than ALIGN: the rest buffered.
                    if e.errno != errno.EINVAL:
                        raise
                    break
                went_direct = True
                if at % ALIGN:  # a short write left the offset unaligned
                    break
        finally:
            _set_direct(fd, False)
    while at < size:
        at += os.write(fd, view[at:])
    return went_direct


def scratch_bytes(start: int, end: int) -> int:
    """Size of the aligned buffer `read_aligned` needs for bytes [start, end)."""
    return (end + -end % ALIGN) - (start - start % ALIGN)


class _CacheRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_CACHESTAT = 451
"""cachestat(2) (Linux 6.5+), the same number in the generic and the x86-64 tables."""
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
_has_cachestat = _libc is not None and platform.machine() in ("x86_64", "aarch64")


def cached_pages(fd: int, start: int, length: int) -> int | None:
    """How many pages of bytes [start, start + length) of `fd` the page cache holds
    (`cachestat(2)`: it counts without touching them, where a `RWF_NOWAIT` read that
    misses starts readahead of the very range, 8 MiB here). None where the kernel lacks
    the call."""
    global _has_cachestat
    if not _has_cachestat or length <= 0:
        return None
    rng, stat = _CacheRange(start, length), _CacheStat()
    assert _libc is not None
    if _libc.syscall(_CACHESTAT, fd, ctypes.byref(rng), ctypes.byref(stat), 0) != 0:
        if ctypes.get_errno() == errno.ENOSYS:
            _has_cachestat = False
        return None
    return int(stat.nr_cache)


def read_aligned(path: str, start: int, end: int,
                 scratch: np.ndarray | Callable[[], np.ndarray]) -> tuple[np.ndarray, bool] | None:
    """Bytes [start, end) of the file at `path`, and whether the page cache served them.

    When the cache holds every page of the range, the range is mapped (`mmap`, pages
    populated at once): the view is of the cached pages themselves, read-only, valid for
    as long as it is referenced; no copy is made and no memory taken. Else the whole
    blocks around the range are read around the cache (`O_DIRECT`) into `scratch` (an
    `ALIGN`-aligned uint8 buffer of at least `scratch_bytes(start, end)`, or a function
    that returns one, called only then), so a cold read allocates no cache pages, and
    the view is of `scratch`. The view is shorter when the file ends first. None when
    the range is under `DIRECT_MIN_BYTES` or the filesystem refuses `O_DIRECT` (read it
    buffered then). Raises what `open` raises for a missing file.

    A mapping faults (SIGBUS) if the file is truncated while it is read; checkpoint
    objects are published whole by rename and never written in place, so only a file
    damaged from outside can be."""
    if not _O_DIRECT or end - start < DIRECT_MIN_BYTES:
        return None
    lo, span = start - start % ALIGN, scratch_bytes(start, end)
    if not callable(scratch):
        _check_scratch(scratch, start, end)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        warm = cached_pages(fd, lo, span) == (lo + span - 1) // _PAGE - lo // _PAGE + 1
        if warm:
            mapped = _map(fd, start, end)
            if mapped is not None:
                return mapped, True
        buf = _check_scratch(scratch(), start, end) if callable(scratch) else scratch
        if not warm and not _set_direct(fd, True):
            return None
        got = 0
        while lo + got < end:
            n = os.preadv(fd, [buf[got:span]], lo + got)
            if n <= 0:  # the file ended
                break
            got += n
            if got % ALIGN and lo + got < end and not warm:  # short: the rest buffered
                _set_direct(fd, False)
        return buf[start - lo: max(start - lo, min(end, lo + got) - lo)], warm
    finally:
        os.close(fd)


def _check_scratch(buf: np.ndarray, start: int, end: int) -> np.ndarray:
    span, address = scratch_bytes(start, end), _address(buf)
    if buf.size < span or address is None or address % ALIGN:
        raise ValueError(f"scratch of {buf.size} bytes at {address} cannot hold the "
                         f"{span} aligned bytes around [{start}, {end})")
    return buf


_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _map(fd: int, start: int, end: int) -> np.ndarray | None:
    """Bytes [start, end) of `fd` as a read-only view of a shared mapping of its pages
    (up to the file's end), or None where the mapping fails (the caller reads instead).
    The mapping lives as long as the view: numpy's base holds it, and it is unmapped when
    the last reference goes."""
    stop = min(end, os.fstat(fd).st_size)
    if stop <= start:
        return None
    at = start - start % mmap.ALLOCATIONGRANULARITY
    try:
        m = mmap.mmap(fd, stop - at, flags=_MAP_FLAGS, prot=mmap.PROT_READ, offset=at)
    except (OSError, ValueError):
        return None
    return np.frombuffer(m, dtype=np.uint8, count=stop - start, offset=start - at)


def drop_cached(path: str) -> None:
    """Drop the file's clean pages from the page cache (`POSIX_FADV_DONTNEED`); the file
    is unchanged. Its pages go back to the kernel's free lists, where the next page-cache
    allocation takes them first. A missing file has none: nothing happens."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
