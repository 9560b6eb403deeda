"""A save's shard objects take the page-cache pages of the process's older saves, never
the newest committed one's (`ckpt.page_recycle`): after three saves the second's and
the third's objects are cached, the first's are not; all load bitwise, the cached
ones from the cache, the other around it."""

from __future__ import annotations

import os

import pytest
import torch

from relight import ckpt, storage
from relight.ckpt.page_recycle import PageRecycler
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


def test_a_save_takes_the_pages_of_older_saves_and_keeps_the_newest_committed(tmp_path):
    if on_memory_filesystem(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on a memory filesystem: its pages are the file")
    ckpt.default_checkpointer().recycler.forget()
    states = {name: _state(seed) for seed, name in enumerate("abc", start=1)}
    ckpt.save(states["a"], str(tmp_path / "a"))
    objs = {"a": _shard_objects(str(tmp_path / "a"))}
    assert objs["a"], "the checkpoint has shard objects of 1 MiB and more"
    if _cached(objs["a"][0]) is None:
        pytest.skip("this kernel lacks cachestat(2): cached pages cannot be counted")
    assert all(_cached(p) > 0 for p in objs["a"]), "a save leaves its objects in the page cache"

    # The second save keeps the first's pages: it is the newest committed checkpoint,
    # the one a restore during or right after this save reads.
    ckpt.save(states["b"], str(tmp_path / "b"), async_save=True).wait()
    objs["b"] = _shard_objects(str(tmp_path / "b"))
    assert all(_cached(p) > 0 for p in objs["a"] + objs["b"]), "both checkpoints cached"

    # The third takes the first's pages and keeps the second's.
    ckpt.save(states["c"], str(tmp_path / "c"))
    objs["c"] = _shard_objects(str(tmp_path / "c"))
    assert [_cached(p) for p in objs["a"]] == [0] * len(objs["a"]), "the oldest save's pages"
    assert all(_cached(p) > 0 for p in objs["b"] + objs["c"])

    for name, want in states.items():
        store = storage.open_store(str(tmp_path / name))
        got = {k: torch.zeros_like(v) for k, v in want.items()}
        ckpt.load(got, store)
        assert all(torch.equal(got[k], want[k]) for k in want), name
        cached = store.stats.snapshot()["bytes_read_cached"]
        if name == "a":
            assert cached == 0, "the cold checkpoint was read around the cache"
        else:
            assert cached >= sum(os.path.getsize(p) for p in objs[name]) // 2, (name, cached)
    ckpt.default_checkpointer().recycler.forget()


def test_the_recycler_drops_about_as_many_bytes_as_each_write_takes():
    dropped: list[str] = []

    class Recorder(MemoryStore):
        def _drop_cached(self, path: str) -> None:
            dropped.append(path.rsplit("/", 1)[-1])

    store = Recorder(storage.parse_url("memory://recycle/x"))
    r = PageRecycler()
    a = r.begin_save()
    assert r.make_room(store, "a1", 10) == 0 and dropped == [], "nothing older to drop"
    r.make_room(store, "a2", 10)
    r.make_room(store, "a3", 30)
    r.committed(a)
    b = r.begin_save()
    assert r.make_room(store, "b1", 15) == 0 and dropped == [], "the newest committed is kept"
    r.committed(b)
    r.begin_save()  # the third save takes the first's pages, not the second's
    assert r.make_room(store, "c1", 15) == 20 and dropped == ["a1", "a2"]
    assert r.make_room(store, "c2", 100) == 30 and dropped == ["a1", "a2", "a3"]
    assert r.make_room(store, "c3", 100) == 0, "the second save's pages stay"
    assert r.kept() == ["b1"]


def test_a_failed_save_does_not_displace_the_kept_one():
    dropped: list[str] = []

    class Recorder(MemoryStore):
        def _drop_cached(self, path: str) -> None:
            dropped.append(path.rsplit("/", 1)[-1])

    store = Recorder(storage.parse_url("memory://recycle/y"))
    r = PageRecycler()
    a = r.begin_save()
    r.make_room(store, "a1", 10)
    r.committed(a)
    r.begin_save()  # fails: never committed
    r.make_room(store, "f1", 10)
    r.begin_save()
    assert r.make_room(store, "c1", 10) == 10 and dropped == ["f1"], "the failed save's pages"
    assert r.kept() == ["a1"]
