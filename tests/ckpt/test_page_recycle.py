"""A save's shard objects take the page-cache pages of the process's previous save
(`ckpt.page_recycle`): after two saves only the newer one's objects are cached, both
load bitwise, and a load of the cached one is served by the cache."""

from __future__ import annotations

import os

import pytest
import torch

from relight import ckpt, storage
from relight.ckpt.page_recycle import PageRecycler
from relight.ckpt.resources import resources
from relight.storage.direct_io import cached_pages
from relight.storage.memory_store import MemoryStore
from tests.storage.filesystems import on_memory_filesystem


def _cached(path: str) -> int | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_pages(fd, 0, os.path.getsize(path))
    finally:
        os.close(fd)


def _shard_objects(root: str) -> list[str]:
    """The checkpoint's files of 1 MiB and more (its shard objects)."""
    found = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    return [p for p in found if os.path.getsize(p) >= 1 << 20]


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(8, 1024, 256, generator=g)}


def test_a_save_writes_into_the_pages_of_the_previous_one(tmp_path):
    if on_memory_filesystem(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a memory filesystem: its pages are the file")
    resources().recycler.forget()
    first, second = _state(1), _state(2)
    ckpt.save(first, str(tmp_path / "a"))
    old = _shard_objects(str(tmp_path / "a"))
    assert old, "the checkpoint has shard objects of 1 MiB and more"
    if _cached(old[0]) is None:
        pytest.skip("this kernel lacks cachestat(2): cached pages cannot be counted")
    assert all(_cached(p) > 0 for p in old), "a save leaves its objects in the page cache"

    ckpt.save(second, str(tmp_path / "b"))
    assert [_cached(p) for p in old] == [0] * len(old), "the older save's pages were taken"
    new = _shard_objects(str(tmp_path / "b"))
    assert all(_cached(p) > 0 for p in new)

    for name, want in (("a", first), ("b", second)):
        store = storage.open_store(str(tmp_path / name))
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        ckpt.load(got, store)
        assert all(torch.equal(got[k], want[k]) for k in want), name
        cached = store.stats.snapshot()["bytes_read_cached"]
        if name == "a":
            assert cached == 0, "the cold checkpoint was read around the cache"
        else:
            assert cached >= sum(os.path.getsize(p) for p in new) // 2, cached
    resources().recycler.forget()


def test_the_recycler_drops_about_as_many_bytes_as_each_write_takes():
    dropped: list[str] = []

    class Recorder(MemoryStore):
        def _drop_cached(self, path: str) -> None:
            dropped.append(path.rsplit("/", 1)[-1])

    store = Recorder(storage.parse_url("memory://recycle/x"))
    r = PageRecycler()
    r.begin_save()
    assert r.make_room(store, "a1", 10) == 0 and dropped == [], "nothing older to drop"
    r.make_room(store, "a2", 10)
    r.make_room(store, "a3", 30)
    r.begin_save()
    assert r.make_room(store, "b1", 15) == 20 and dropped == ["a1", "a2"]
    assert r.make_room(store, "b2", 100) == 30 and dropped == ["a1", "a2", "a3"]
    r.begin_save()  # the third save takes the second's pages
    assert r.make_room(store, "c1", 1) == 15 and dropped[-1] == "b1"
