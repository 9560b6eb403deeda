"""The local and peer tiers through the trainer: 2 gloo ranks, each a node of its own
(`checkpoint.local_tier_node`), a file store as the persistent tier, a tmpfs directory for
the nodes' tiers, one peer replica; a worker restart (fresh processes) after the save.
The tests run in order on one saved checkpoint (each restores it and stops)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from relight.ckpt.local_tier import local_tier_dir
from relight.storage import open_store
from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

WORLD = 2
STEP = 2
STOP = ["--train.steps=10", f"--train.stop_at={STEP}"]
"""A run that stops before its last step keeps its tiers; a complete one drops them."""


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(WORLD)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def saved(pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local = tempfile.mkdtemp(prefix="relight-tier-test-", dir=shm)
    root = tmp_path_factory.mktemp("tiers") / "ckpt"
    args = [f"--checkpoint.url={root}", f"--checkpoint.local_tier_dir={local}",
            f"--checkpoint.every={STEP}", "--checkpoint.peer_replicas=1"]
    results = _train(pool, args + STOP)
    assert all(r["tiers"]["peer_copied_bytes"] > 0 for r in results)
    pool.restart()  # the restarted workers find the tiers in node memory, nothing else
    nodes = {n: Path(local_tier_dir(local, open_store(root).url, n)) for n in ("n0", "n1")}
    try:
        yield {"args": args, "nodes": nodes, "state": _merged(results)}
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _train(pool: RankPool, overrides: list[str]) -> list[dict]:
    return pool.run("tests.tiers.cases:train", WORLD, overrides=overrides, node_per_rank=True)


def _merged(results: list[dict]) -> dict:
    return {k: v for r in results for k, v in r["state"].items()}


def _restore(pool: RankPool, saved: dict) -> list[dict]:
    # stop_at=STEP: restore step STEP and stop, so the state returned is the restored one
    results = _train(pool, saved["args"] + STOP)
    got, want = _merged(results), saved["state"]
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), f"{k} differs after the restore"
    assert got["train"]["step"] == STEP
    assert all(r["restored_step"] == STEP for r in results)
    return [r["restore_io"] for r in results]


def _served(io: list[dict], tier: str) -> int:
    return sum(r["tiers"]["served"][tier] for r in io)


def test_restart_same_layout_reads_no_data_from_persistent_store(pool: RankPool,
                                                                 saved: dict) -> None:
    io = _restore(pool, saved)
    assert _served(io, "persistent") == 0, io
    for r in io:
        assert r["tiers"]["served"]["local"] > 0, r
        assert "checksum" not in r["tiers"]["misses"], r
        # Only the manifest, index and step records came from the persistent store.
        assert r["persistent_bytes_read"] < r["tiers"]["served"]["local"] / 4, r


def test_bit_flip_in_local_copy_is_caught_and_the_next_tier_used(pool: RankPool,
                                                                 saved: dict) -> None:
    files = [p for p in saved["nodes"]["n0"].glob(f"step-{STEP:012d}/**/*") if p.is_file()]
    victim = max(files, key=lambda p: p.stat().st_size)
    good = victim.read_bytes()
    bad = bytearray(good)
    bad[len(bad) // 3] ^= 0x10
    victim.write_bytes(bytes(bad))
    try:
        io = _restore(pool, saved)
    finally:
        victim.write_bytes(good)
    assert io[0]["tiers"]["misses"].get("checksum", 0) >= 1, io
    # The next tier: n1 holds n0's replica, so nothing comes from the persistent store.
    assert _served(io, "peer") >= victim.stat().st_size
    assert _served(io, "persistent") == 0, io


def test_lost_node_restores_from_its_peer(pool: RankPool, saved: dict) -> None:
    shutil.rmtree(saved["nodes"]["n1"])  # node n1 is lost with its copy and its replicas
    io = _restore(pool, saved)
    assert _served(io, "persistent") == 0, io
    assert io[1]["tiers"]["served"]["peer"] > 0 and io[1]["tiers"]["served"]["local"] == 0
    assert io[0]["tiers"]["served"]["local"] > 0


def test_complete_run_drops_its_local_tier(pool: RankPool, saved: dict) -> None:
    _train(pool, saved["args"] + [f"--train.steps={STEP}"])
    assert not any(p.is_file() for n in saved["nodes"].values() for p in n.rglob("*"))
