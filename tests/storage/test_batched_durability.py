"""Deferred durability (`Store.deferred()` / `sync()`): puts are readable at once, made
durable by one sync, and a checkpoint rank's index is only put once its objects are."""

from __future__ import annotations

import os

import pytest
import torch

from relight import ckpt, storage
from relight.ckpt.crc_table import TABLE_NAME
from relight.ckpt.format import COMMIT_KEY, DATA_PREFIX, INDEX_PREFIX, MANIFEST_KEY
from relight.ckpt.tiered import TieredStore
from relight.storage import InjectedFaultError, StorageError, fsspec_store
from relight.storage.faulty import OPERATIONS
from relight.storage.testing import FaultPlan, FaultyStore

NO_RETRY = storage.RetryPolicy(max_attempts=1)


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """Every path fsynced, in order: directories by name (`_fsync_path`), files by their
    descriptor (a temp file's name, "<file>" kept to tell them apart)."""
    seen: list[str] = []
    real_path, real_fsync = fsspec_store._fsync_path, os.fsync

    def by_path(path: str) -> None:
        real_path(path)
        seen.append(path.rstrip("/") or "/")

    def by_fd(fd: int) -> None:
        real_fsync(fd)
        if not os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            seen.append("<file>")

    monkeypatch.setattr(fsspec_store, "_fsync_path", by_path)
    monkeypatch.setattr(os, "fsync", by_fd)
    return seen


class RecordingStore(FaultyStore):
    """Logs every operation it sees, sync included, in order; injects nothing."""

    def __init__(self, inner: storage.Store, events: list[tuple[str, str]]) -> None:
        super().__init__(inner, FaultPlan(ops=OPERATIONS))
        self.events = events

    def _enter(self, op: str, path: str) -> int | None:
        self.events.append((op, path))
        return super()._enter(op, path)

    def _with_location(self, location: storage.StorageLocation) -> storage.Store:
        return RecordingStore(self.inner._with_location(location), self.events)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    big = {f"w{i}": torch.randn(256, 1024, generator=g) for i in range(4)}  # one object each
    return {**big, "bias": torch.randn(16, generator=g)}  # packed


def test_deferred_puts_are_readable_at_once_and_flushed_by_sync(tmp_path, fsynced) -> None:
    store = storage.open_store(tmp_path / "s")
    batch = store.deferred()
    batch.put("a/b/c/x", b"one")
    batch.child("a").put("q/y", b"two")
    assert store.get("a/b/c/x") == b"one" and store.get("a/q/y") == b"two"
    # Each file's data is flushed by its put; no directory until the sync.
    assert fsynced == ["<file>", "<file>"]
    batch.sync()
    root = str(tmp_path / "s")
    # The objects' directories and the parent of every directory the puts created.
    dirs = {f"{root}/a/b/c", f"{root}/a/b", f"{root}/a", root, str(tmp_path), f"{root}/a/q"}
    assert sorted(fsynced[2:]) == sorted(dirs), "each directory flushed exactly once"
    fsynced.clear()
    batch.sync()  # nothing new: nothing flushed twice
    assert fsynced == []
    assert store.list("") == ["a/b/c/x", "a/q/y"]


def test_plain_put_flushes_the_directories_it_created(tmp_path, fsynced) -> None:
    store = storage.open_store(tmp_path / "s")
    store.put("k/l/m", b"x")
    root = str(tmp_path / "s")
    assert fsynced[0] == "<file>"
    assert sorted(fsynced[1:]) == sorted([f"{root}/k/l", f"{root}/k", root, str(tmp_path)])


@pytest.mark.parametrize("kind", ["nofsync", "memory"])
def test_sync_is_free_where_puts_need_no_flush(tmp_path, fsynced, kind) -> None:
    if kind == "nofsync":
        store = fsspec_store.LocalStore(storage.parse_url(str(tmp_path / "s")), fsync=False)
    else:
        store = storage.open_store(f"memory://durability-{os.getpid()}/{tmp_path.name}")
    batch = store.deferred()
    batch.put("p/q", b"v")
    batch.sync()
    assert store.get("p/q") == b"v" and fsynced == []


def test_failed_sync_raises_typed_and_is_not_retried(tmp_path) -> None:
    inner = storage.open_store(tmp_path / "s")
    faulty = FaultyStore(inner, FaultPlan(fail_at=frozenset({0}), ops=("sync",)))
    batch = faulty.deferred()
    batch.put("d/x", b"v")
    with pytest.raises(InjectedFaultError):
        batch.sync()
    # A flush that failed once may have dropped pages: the batch stays failed.
    with pytest.raises(StorageError, match="earlier sync"):
        batch.sync()
    assert [e[1] for e in faulty.log.events] == ["sync"]


def test_default_plans_do_not_count_sync(tmp_path) -> None:
    faulty = FaultyStore(storage.open_store(tmp_path / "s"), FaultPlan(fail_at=frozenset({1})))
    faulty.retry = NO_RETRY
    batch = faulty.deferred()
    batch.put("a", b"1")
    batch.sync()
    with pytest.raises(InjectedFaultError):
        batch.put("b", b"2")  # operation 1: the sync was not counted


def test_tiered_store_delegates_deferral_and_sync(tmp_path) -> None:
    inner = storage.open_store(tmp_path / "persistent")
    faulty = FaultyStore(inner, FaultPlan(fail_at=frozenset({0}), ops=("sync",)))
    tiered = TieredStore(faulty, str(tmp_path / "tier"), budget_bytes=1 << 20)
    batch = tiered.child(f"step-{1:012d}").deferred()
    batch.put(f"{DATA_PREFIX}x/c/0", b"payload")
    tiered.flush()
    assert inner.get(f"step-{1:012d}/{DATA_PREFIX}x/c/0") == b"payload"
    assert tiered.tier_stats.copied_bytes == len(b"payload")  # the tier copy still queued
    with pytest.raises(InjectedFaultError):
        batch.sync()


def test_save_syncs_every_object_before_the_rank_index(tmp_path, fsynced) -> None:
    events: list[tuple[str, str]] = []
    store = RecordingStore(storage.open_store(tmp_path / "c"), events)
    ckpt.save(_state(), store)
    order = [(op, p) for op, p in events if op in ("put", "sync")]
    index_at = next(i for i, (op, p) in enumerate(order)
                    if op == "put" and f"/{INDEX_PREFIX}" in p)
    sync_at = [i for i, (op, _) in enumerate(order) if op == "sync"]
    data_puts = [i for i, (op, p) in enumerate(order) if op == "put" and f"/{DATA_PREFIX}" in p
                 and not p.endswith(TABLE_NAME)]
    assert len(sync_at) == 1 and len(data_puts) >= 4
    assert max(data_puts) < sync_at[0] < index_at
    # The coordinator's chunk crc32c table: a plain put (durable when it returns), after
    # every rank's index and before the manifest that binds it.
    (table_at,) = [i for i, (op, p) in enumerate(order) if op == "put" and p.endswith(TABLE_NAME)]
    manifest_at = next(i for i, (op, p) in enumerate(order)
                       if op == "put" and p.endswith(f"/{MANIFEST_KEY}"))
    assert index_at < table_at < manifest_at
    root = str(tmp_path / "c")
    objects = storage.open_store(root).list(DATA_PREFIX)
    assert objects and all(os.path.dirname(f"{root}/{k}") in fsynced for k in objects)
    assert fsynced.count("<file>") >= len(objects)
    got = {k: torch.zeros_like(v) for k, v in _state().items()}
    ckpt.load(got, root)
    assert all(torch.equal(got[k], v) for k, v in _state().items())


def test_failed_sync_fails_the_save_and_writes_no_index(tmp_path) -> None:
    root = storage.open_store(tmp_path / "c")
    faulty = FaultyStore(root, FaultPlan(fail_at=frozenset({0}), ops=("sync",)))
    with pytest.raises(ckpt.CheckpointSaveError, match="injected fault"):
        ckpt.save(_state(), faulty)
    assert faulty.log.events and faulty.log.events[0][1] == "sync"
    indexes = root.list(INDEX_PREFIX)
    assert indexes and all(k.endswith(".error.json") for k in indexes)
    assert not root.exists(COMMIT_KEY)
