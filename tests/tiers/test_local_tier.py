"""The local tier through the trainer: real gloo ranks, a file store as the persistent tier,
a tmpfs directory as the local tier, a worker restart (fresh processes) in between."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

WORLD = 2
STEP = 2


@pytest.fixture(scope="module")
def pool() -> Iterator[RankPool]:
    p = RankPool(WORLD)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def saved(pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Two steps checkpointed at 2 with the local tier on, then a worker restart."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local = tempfile.mkdtemp(prefix="relight-tier-test-", dir=shm)
    root = tmp_path_factory.mktemp("tiers") / "ckpt"
    args = [f"--checkpoint.url={root}", f"--checkpoint.local_tier_dir={local}",
            "--checkpoint.every=2"]
    results = pool.run("tests.tiers.cases:train", WORLD, overrides=args + ["--train.steps=2"])
    pool.restart()  # the restarted workers find the tier in node memory, nothing else
    try:
        yield {"args": args, "local": local, "state": _merged(results), "first": results}
    finally:
        shutil.rmtree(local, ignore_errors=True)


def _merged(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        out.update(r["state"])
    return out


def _assert_equal(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), f"{k} differs after the restore"
    assert got["train"]["step"] == STEP


def _resume(pool: RankPool, saved: dict) -> list[dict]:
    # steps=STEP: restore step STEP and stop, so the state returned is the restored one
    return pool.run("tests.tiers.cases:train", WORLD,
                    overrides=saved["args"] + [f"--train.steps={STEP}"])


def test_restart_same_layout_reads_no_data_from_persistent_store(pool: RankPool,
                                                                 saved: dict) -> None:
    results = _resume(pool, saved)
    for r in results:
        assert r["restored_step"] == STEP
        io = r["restore_io"]
        assert io["tiers"]["served"]["persistent"] == 0, io
        assert io["tiers"]["misses"] == {}, io
        assert io["tiers"]["served"]["local"] > 0, io
        # Only the manifest, index and step records came from the persistent store.
        assert io["persistent_bytes_read"] < io["tiers"]["served"]["local"] / 4, io
    _assert_equal(_merged(results), saved["state"])


def test_bit_flip_in_local_copy_falls_back_to_persistent_store(pool: RankPool,
                                                                saved: dict) -> None:
    files = [p for p in Path(saved["local"]).rglob("*")
             if p.is_file() and ".meta" not in p.parts and f"step-{STEP:012d}" in p.parts]
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    results = _resume(pool, saved)
    misses = sum(r["restore_io"]["tiers"]["misses"].get("checksum", 0) for r in results)
    assert misses >= 1
    assert sum(r["restore_io"]["tiers"]["served"]["persistent"] for r in results) > 0
    _assert_equal(_merged(results), saved["state"])
