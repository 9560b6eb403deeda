"""`ckpt.tiered.TieredStore` on its own: what it copies, what it serves, what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relight.ckpt.format import COMMIT_KEY, DATA_PREFIX
from relight.ckpt.root_layout import step_dir
from relight.ckpt.root_layout import step_of_data_key as step_of_key
from relight.ckpt.tiered import TieredStore
from relight.storage import open_store


def _commit(store, step: int) -> None:  # noqa: ANN001
    store.put(f"steps/{step:012d}.json", b"{}")
    store.put(f"{step_dir(step)}/{COMMIT_KEY}", b"{}")


def _data(step: int, name: str) -> str:
    return f"{step_dir(step)}/{DATA_PREFIX}a1/{name}"


@pytest.fixture()
def stores(tmp_path: Path) -> tuple:
    persistent = open_store(tmp_path / "persistent")
    tiered = TieredStore(persistent, str(tmp_path / "local"), budget_bytes=10_000)
    return persistent, tiered, tmp_path / "local"


def test_key_layout_matches_the_checkpoint_engine() -> None:
    assert step_of_key(f"{step_dir(42)}/{DATA_PREFIX}x/t0/c/0") == 42
    assert step_of_key(f"{step_dir(42)}/manifest.json") is None
    assert step_of_key("steps/000000000042.json") is None


def test_newest_committed_step_is_served_locally_older_and_uncommitted_are_not(stores) -> None:
    persistent, tiered, _ = stores
    step = tiered.child(step_dir(1))  # the engine writes through a child per step
    step.put(f"{DATA_PREFIX}a1/t0/c/0", b"x" * 100)
    tiered.flush()
    again = TieredStore(persistent, tiered.local_dir, 10_000)  # a restarted worker
    assert again.get(_data(1, "t0/c/0")) == b"x" * 100
    assert again.tier_stats.misses == {"not_newest_committed": 1}  # not committed yet
    _commit(persistent, 1)
    again = TieredStore(persistent, tiered.local_dir, 10_000)
    assert again.get(_data(1, "t0/c/0"), 10, 20) == b"x" * 10
    assert again.tier_stats.served == {"local": 10, "peer": 0, "persistent": 0}
    assert again.get(f"{step_dir(1)}/{COMMIT_KEY}") == b"{}"  # markers: persistent only
    assert again.tier_stats.served == {"local": 10, "peer": 0, "persistent": 0}
    _commit(persistent, 2)
    again = TieredStore(persistent, tiered.local_dir, 10_000)
    assert again.get(_data(1, "t0/c/0")) == b"x" * 100
    assert again.tier_stats.misses == {"not_newest_committed": 1}
    assert again.tier_stats.served == {"local": 0, "peer": 0, "persistent": 100}


def test_copy_of_another_object_under_the_same_path_is_refused(stores) -> None:
    persistent, tiered, local = stores
    tiered.put(_data(1, "t0/c/0"), b"y" * 50)
    tiered.flush()
    _commit(persistent, 1)
    meta = local / ".meta" / f"{_data(1, 't0/c/0')}.json"
    doc = json.loads(meta.read_text())
    meta.write_text(json.dumps(doc | {"url": "file:///elsewhere/" + doc["key"]}))
    again = TieredStore(persistent, tiered.local_dir, 10_000)
    assert again.get(_data(1, "t0/c/0")) == b"y" * 50
    assert again.tier_stats.misses == {"other_key": 1}


def test_budget_and_eviction(stores) -> None:
    persistent, tiered, local = stores
    for i in range(3):
        tiered.put(_data(1, f"t{i}/c/0"), b"a" * 3000)
    tiered.put(_data(1, "t9/c/0"), b"a" * 3000)  # 12000 > 10000: skipped
    tiered.flush()
    assert tiered.tier_stats.skipped_budget == 1
    _commit(persistent, 1)
    # Step 2 begins: step 1 is the newest committed one and stays while there is room,
    # then is dropped to make room for step 2.
    tiered.put(_data(2, "t0/c/0"), b"b" * 1000)
    tiered.flush()
    assert (local / step_dir(1)).exists()
    tiered.put(_data(2, "t1/c/0"), b"b" * 1000)
    tiered.flush()
    assert not (local / step_dir(1)).exists()
    assert tiered.tier_stats.evicted_steps == 1
    held = sum(p.stat().st_size for p in local.rglob("*") if p.is_file() and ".meta" not in
               p.parts)
    assert held == 2000 <= 10_000


def test_older_committed_step_dropped_once_newer_commits(stores, monkeypatch) -> None:
    import relight.ckpt.local_tier as tiered_mod

    monkeypatch.setattr(tiered_mod, "POLL_S", 0.05)
    persistent, _, local = stores
    tiered = TieredStore(persistent, str(local), budget_bytes=10_000)
    tiered.put(_data(1, "t0/c/0"), b"a" * 100)
    tiered.flush()
    _commit(persistent, 1)
    tiered.put(_data(2, "t0/c/0"), b"b" * 100)
    tiered.flush()
    assert (local / step_dir(1)).exists()  # step 2 is not committed: keep step 1
    _commit(persistent, 2)
    import time

    deadline = time.monotonic() + 10
    while (local / step_dir(1)).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not (local / step_dir(1)).exists()
    assert (local / step_dir(2)).exists()


def test_replicas_held_for_a_dead_node_serve_the_survivor(tmp_path: Path) -> None:
    """Node a pushes its objects to node b's replica server; a dies with its memory; b,
    now alone (no peers to ask), reads a's objects from the replicas it holds."""
    from relight.ckpt.local_tier import REPLICA_DIR
    from relight.ckpt.peer import PeerServer

    persistent = open_store(tmp_path / "persistent")
    b_dir = tmp_path / "b"
    server = PeerServer(str(b_dir / REPLICA_DIR), host="127.0.0.1")
    try:
        a = TieredStore(persistent, str(tmp_path / "a"), 10_000)
        a.attach_peers([server.address], [server.address])
        a.put(_data(1, "t0/c/0"), b"a" * 80)
        a.flush()
    finally:
        server.close()
    _commit(persistent, 1)
    b = TieredStore(persistent, str(b_dir), 10_000)
    assert b.get(_data(1, "t0/c/0"), 5, 25) == b"a" * 20
    assert b.tier_stats.served == {"local": 0, "peer": 20, "persistent": 0}
    # A damaged replica is refused like a damaged local copy: the persistent one is read.
    held = b_dir / REPLICA_DIR / _data(1, "t0/c/0")
    held.write_bytes(b"b" * 80)
    b = TieredStore(persistent, str(b_dir), 10_000)
    assert b.get(_data(1, "t0/c/0")) == b"a" * 80
    assert b.tier_stats.served == {"local": 0, "peer": 0, "persistent": 80}
    assert b.tier_stats.misses == {"absent": 1, "checksum": 1}
