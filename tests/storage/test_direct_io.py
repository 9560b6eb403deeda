"""Objects written and read around the page cache (`storage.direct_io`): the bytes are
exact whatever the size, offset, alignment or range; filesystems and buffers that do
not qualify fall back to buffered I/O; a large put leaves no page of the object cached."""

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

import storage
from storage import direct_io
from storage.direct_io import ALIGN, DIRECT_MIN_BYTES, aligned_empty, read_range, write_file
from storage.fsspec_store import LocalStore

MiB = 1 << 20


def _fstype(path: str) -> str:
    """The type of the filesystem holding `path` (longest mount point that contains it)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, fstype
    return kind


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
    """A directory whose filesystem takes O_DIRECT (skip where it does not)."""
    if not _takes_direct(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} ({_fstype(str(tmp_path))}) refuses O_DIRECT")
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
    for rng in ((start, end), (start, None), (None, None), (start, size + 9000)):
        got = read_range(path, *rng)
        want = data.tobytes()[rng[0] or 0: rng[1]]
        if got is None:  # the caller reads it buffered
            assert len(want) < DIRECT_MIN_BYTES or not takes
        else:
            assert type(got) is bytes and got == want
    os.unlink(path)


def test_large_aligned_put_goes_around_the_page_cache(direct_dir):
    """What direct I/O is for: the put's pages are not left in the cache (mincore)."""
    store = LocalStore(storage.parse_url(str(direct_dir / "s")))
    blob = _data(5 * MiB + 123)[: 5 * MiB + 123]
    store.put("a/b.bin", memoryview(blob))
    path = str(direct_dir / "s" / "a" / "b.bin")
    assert store.get("a/b.bin") == blob.tobytes()
    assert store.get("a/b.bin", 4097, 3 * MiB) == blob.tobytes()[4097: 3 * MiB]
    cached = _resident_pages(path)
    # Only the tail under one block goes through the cache; reads do not add pages.
    assert cached <= 1, f"{cached} pages of the object are in the page cache"

    buffered = LocalStore(storage.parse_url(str(direct_dir / "b")), direct_io=False)
    buffered.put("a/b.bin", memoryview(blob))
    assert _resident_pages(str(direct_dir / "b" / "a" / "b.bin")) > 1000, (
        "the check cannot see cached pages: it would pass whatever the put did")


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


def test_a_filesystem_that_refuses_o_direct_gets_buffered_io(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def refuse(fd, cmd, arg=0):  # noqa: ANN001, ANN202
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct_io.fcntl, "fcntl", refuse)
    blob = _data(2 * MiB)[: 2 * MiB]
    store = LocalStore(storage.parse_url(str(tmp_path)))
    store.put("x", memoryview(blob))
    assert read_range(str(tmp_path / "x"), 0, 2 * MiB) is None
    assert store.get("x") == blob.tobytes()
    assert store.get("x", 10, 2 * MiB - 10) == blob.tobytes()[10: 2 * MiB - 10]


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
    assert read_range(path, 5, 3 * MiB) == blob.tobytes()[5:]


def test_missing_and_truncated_objects_raise_what_the_store_promises(direct_dir):
    store = LocalStore(storage.parse_url(str(direct_dir)))
    with pytest.raises(FileNotFoundError):
        read_range(str(direct_dir / "nope"), 0, 2 * MiB)
    with pytest.raises(storage.ObjectNotFoundError):
        store.get("nope", 0, 2 * MiB)
    blob = _data(2 * MiB)[: 2 * MiB]
    store.put("t", memoryview(blob))
    with pytest.raises(storage.ObjectTruncatedError):
        store.get("t", 0, 3 * MiB)


def test_the_environment_turns_direct_io_off(monkeypatch, tmp_path):
    assert storage.open_store(str(tmp_path)).direct_io
    monkeypatch.setenv(storage.open.DIRECT_IO_ENV, "0")
    assert not storage.open_store(str(tmp_path)).direct_io
