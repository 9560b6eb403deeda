"""Objects written and read around the page cache (`storage.direct_io`): the bytes are
exact whatever the size, offset, alignment, range or cache state; filesystems and
buffers that do not qualify fall back to buffered I/O; a direct put and a cold view read
leave no page of the object cached; a warm view read is served by the cache."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relight import storage
from relight.storage import direct_io
from relight.storage.direct_io import (
    ALIGN,
    DIRECT_MIN_BYTES,
    BufferPool,
    aligned_empty,
    cached_pages,
    drop_cached,
    read_aligned,
    scratch_bytes,
    write_file,
)
from relight.storage.fsspec_store import LocalStore
from tests.storage.filesystems import fstype, on_memory_filesystem

MiB = 1 << 20


def _data(n: int, seed: int = 0) -> np.ndarray:
    buf = aligned_empty(n + ALIGN)
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)
    return buf


def _write(path: str, data, direct: bool = True) -> bool:  # noqa: ANN001
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        went = write_file(fd, data, direct)
        os.fsync(fd)
    finally:
        os.close(fd)
    return went


def _takes_direct(directory) -> bool:  # noqa: ANN001
    probe = os.path.join(directory, "probe")
    try:
        return _write(probe, aligned_empty(DIRECT_MIN_BYTES))
    finally:
        os.unlink(probe)


@pytest.fixture
def direct_dir(tmp_path):
    """A directory on a disk filesystem that takes O_DIRECT (skip elsewhere: on a memory
    filesystem the pages are the file, so no write or read goes around them)."""
    if on_memory_filesystem(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a memory filesystem ({fstype(str(tmp_path))})")
    if not _takes_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} ({fstype(str(tmp_path))}) refuses O_DIRECT")
    return tmp_path


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 3 * MiB + 5000), skew=st.sampled_from([0, 0, 1, 512, 4095]),
       lo=st.floats(0, 1), hi=st.floats(0, 1))
def test_bytes_round_trip_at_any_size_offset_and_range(tmp_path, size, skew, lo, hi):
    data = _data(size + skew, seed=size)[skew: skew + size]
    path = str(tmp_path / f"obj-{size}-{skew}")
    takes = _takes_direct(tmp_path)
    went = _write(path, data)
    assert went == (takes and skew % ALIGN == 0 and size >= DIRECT_MIN_BYTES)
    with open(path, "rb") as f:
        assert f.read() == data.tobytes()
    start, end = sorted((int(lo * size), int(hi * size)))
    # Memory filesystems (tmpfs) keep their pages whatever `drop_cached` says.
    counts = _cache_counts(path) and not on_memory_filesystem(str(tmp_path))
    for state in ("warm", "cold"):  # the read above left every page cached
        if state == "cold":
            drop_cached(path)
        for a_, b_ in ((start, end), (0, size), (start, size + 9000)):
            scratch = aligned_empty(scratch_bytes(a_, b_))
            got = read_aligned(path, a_, b_, scratch)
            want = data.tobytes()[a_: b_]
            if got is None:  # the caller reads it buffered
                assert b_ - a_ < DIRECT_MIN_BYTES or (not takes and state == "cold")
                continue
            view, warm = got
            assert view.tobytes() == want
            in_scratch = 0 <= view.ctypes.data - scratch.ctypes.data < scratch.size
            assert in_scratch != warm, "a cold read goes into scratch, a warm one is mapped"
            if counts and b_ <= size:
                assert warm == (state == "warm"), (state, a_, b_)
            # A live mapping holds its pages in the cache (`drop_cached` cannot drop them).
            del view, got
    store = LocalStore(storage.parse_url(str(tmp_path)))
    key = os.path.basename(path)
    pool = BufferPool()
    scratch = pool.take(scratch_bytes(start, end))
    assert store.get_view(key, start, end, scratch) == data.tobytes()[start:end]
    os.unlink(path)


def _cache_counts(path: str) -> bool:
    """Whether this kernel counts a file's cached pages (`cachestat(2)`, Linux 6.5+)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd, 0, 1) is not None
    finally:
        os.close(fd)


def test_large_aligned_put_goes_around_the_page_cache(direct_dir):
    """What direct I/O is for: the put's pages are not left in the cache (mincore)."""
    store = LocalStore(storage.parse_url(str(direct_dir / "s")), direct_io=True)
    blob = _data(5 * MiB + 123)[: 5 * MiB + 123]
    store.put("a/b.bin", memoryview(blob))
    path = str(direct_dir / "s" / "a" / "b.bin")
    scratch = aligned_empty(scratch_bytes(4097, 5 * MiB))
    view = store.get_view("a/b.bin", 4097, 5 * MiB, scratch)
    assert view == blob.tobytes()[4097: 5 * MiB] and view.readonly
    cached = _resident_pages(path)
    # Only the tail under one block goes through the cache; view reads add no pages.
    assert cached <= 1, f"{cached} pages of the object are in the page cache"

    buffered = LocalStore(storage.parse_url(str(direct_dir / "b")))
    buffered.put("a/b.bin", memoryview(blob))
    assert _resident_pages(str(direct_dir / "b" / "a" / "b.bin")) > 1000, (
        "the check cannot see cached pages: it would pass whatever the put did")


def test_view_reads_take_the_cache_when_it_holds_the_range_and_go_around_it_else(direct_dir):
    """A buffered put leaves the object cached: a view read is served from there (and
    counted as such). Once `drop_cached` has let its pages go, a view read comes from the
    device without putting them back."""
    store = LocalStore(storage.parse_url(str(direct_dir)))
    blob = _data(5 * MiB + 123)[: 5 * MiB + 123]
    store.put("o", memoryview(blob))
    path = str(direct_dir / "o")
    if not _cache_counts(path):
        pytest.skip("this kernel lacks cachestat(2): every view read goes around the cache")
    pages = _resident_pages(path)
    assert pages > 1000
    scratch = aligned_empty(scratch_bytes(0, len(blob)))
    assert store.get_view("o", 7, len(blob), scratch) == blob.tobytes()[7:]
    assert store.stats.bytes_read_cached == len(blob) - 7

    store.drop_cached("o")
    assert _resident_pages(path) == 0
    assert store.get_view("o", 7, len(blob), scratch) == blob.tobytes()[7:]
    assert store.stats.bytes_read_cached == len(blob) - 7, "the cold read was not the cache's"
    assert _resident_pages(path) == 0, "a cold view read put the object into the cache"
    store.drop_cached("missing")  # nothing to drop: no error


def _resident_pages(path: str) -> int:
    """How many of the file's pages are in the page cache (mincore(2) over a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = os.path.getsize(path)
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), size) as m:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        try:
            if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            return sum(v & 1 for v in vec)
        finally:
            del addr  # the buffer export must end before the mapping closes


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io(direct_dir, monkeypatch):
    tmp_path = direct_dir  # a disk filesystem, whose cached pages can be dropped
    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):  # noqa: ANN001, ANN202
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse)
    blob = _data(2 * MiB)[: 2 * MiB]
    store = LocalStore(storage.parse_url(str(tmp_path)), direct_io=True)
    store.put("x", memoryview(blob))
    drop_cached(str(tmp_path / "x"))
    scratch = aligned_empty(scratch_bytes(10, 2 * MiB - 10))
    assert read_aligned(str(tmp_path / "x"), 10, 2 * MiB - 10, scratch) is None
    assert store.get_view("x", 10, 2 * MiB - 10, scratch) == blob.tobytes()[10: 2 * MiB - 10]
    assert store.get("x") == blob.tobytes()


def test_a_device_with_larger_blocks_finishes_the_write_buffered(direct_dir, monkeypatch):
    """EINVAL from a direct write (the device's block is larger than ALIGN): the rest of
    the object is written through the cache, and its bytes are exact."""
    real = os.write
    calls = {"direct": 0}

    def picky(fd, data):  # noqa: ANN001, ANN202
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            calls["direct"] += 1
            if calls["direct"] > 1:
                raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data)

    monkeypatch.setattr(direct_io.os, "write", picky)
    monkeypatch.setattr(direct_io, "DIRECT_PIECE", MiB)
    blob = _data(3 * MiB + 77)[: 3 * MiB + 77]
    path = str(direct_dir / "o")
    assert _write(path, blob)
    assert calls["direct"] == 2
    with open(path, "rb") as f:
        assert f.read() == blob.tobytes()


def test_a_short_direct_read_finishes_through_the_cache(direct_dir, monkeypatch):
    blob = _data(3 * MiB)[: 3 * MiB]
    path = str(direct_dir / "o")
    _write(path, blob)
    real = os.preadv
    state = {"first": True}

    def short(fd, bufs, offset):  # noqa: ANN001, ANN202
        got = real(fd, bufs, offset)
        if state["first"]:  # one read that reports stopping off a block boundary
            state["first"] = False
            return min(got, ALIGN + 100)
        return got

    monkeypatch.setattr(direct_io.os, "preadv", short)
    scratch = aligned_empty(scratch_bytes(5, 3 * MiB))
    view, warm = read_aligned(path, 5, 3 * MiB, scratch)
    assert view.tobytes() == blob.tobytes()[5:] and not warm


def test_missing_and_truncated_objects_raise_what_the_store_promises(direct_dir):
    store = LocalStore(storage.parse_url(str(direct_dir)))
    scratch = aligned_empty(scratch_bytes(0, 3 * MiB))
    with pytest.raises(FileNotFoundError):
        read_aligned(str(direct_dir / "nope"), 0, 2 * MiB, scratch)
    with pytest.raises(storage.ObjectNotFoundError):
        store.get_view("nope", 0, 2 * MiB, scratch)
    blob = _data(2 * MiB)[: 2 * MiB]
    store.put("t", memoryview(blob))
    with pytest.raises(storage.ObjectTruncatedError):
        store.get_view("t", 0, 3 * MiB, scratch)
    with pytest.raises(ValueError, match="cannot hold"):
        read_aligned(str(direct_dir / "t"), 1, 2 * MiB, scratch[1:])


def test_buffer_pool_reuses_and_bounds_its_buffers():
    pool = BufferPool()
    a, b = pool.take(3 * MiB), pool.take(MiB)
    assert a.ctypes.data % ALIGN == 0 and b.ctypes.data % ALIGN == 0
    pool.give_back(a)
    pool.give_back(b)
    assert pool.take(MiB) is b, "the smallest free buffer that fits"
    c = pool.take(4 * MiB)  # none fits: the largest free one (a) is dropped first
    assert c.size == 4 * MiB and pool.free == []
    pool.give_back(c)
    pool.clear()
    assert pool.free == []


def test_the_environment_turns_direct_writes_on(monkeypatch, tmp_path):
    assert not storage.open_store(str(tmp_path)).direct_io
    monkeypatch.setenv(storage.open.DIRECT_IO_ENV, "1")
    assert storage.open_store(str(tmp_path)).direct_io
