"""`ckpt.open_checkpoint_root` in one process: the store stack it builds, with and without
tiers, and the options it refuses."""

from __future__ import annotations

import os

import pytest
import torch

from relight import ckpt
from relight.ckpt.tiered import TieredStore
from relight.storage import open_store


def test_without_tiers_the_root_is_the_persistent_store(tmp_path) -> None:
    root = ckpt.open_checkpoint_root(tmp_path / "root")
    assert root.store is root.persistent and root.store.url == open_store(tmp_path / "root").url
    assert root.tiered is None and root.peer_server is None and root.tier_stats is None
    assert root.drop_local_tier() is False
    root.close()


def test_with_tiers_a_new_root_restores_from_the_local_tier_and_drops_it(tmp_path) -> None:
    opts = ckpt.TierOptions(local_dir=str(tmp_path / "shm"), budget_bytes=1 << 20,
                            node="n0", peer_replicas=1, peer_host="127.0.0.1")
    root = ckpt.open_checkpoint_root(tmp_path / "root", opts)
    try:
        assert isinstance(root.store, TieredStore) and root.tiered is root.store
        assert root.peer_server is not None  # this process is its node's first rank
        assert root.peer_server.address.startswith("127.0.0.1:")
        w = torch.arange(4096, dtype=torch.float32)
        ckpt.CheckpointManager(root.store).save(1, {"w": w}, async_save=False)
        root.tiered.flush()
        assert root.tier_stats.copied_bytes > 0

        again = ckpt.open_checkpoint_root(tmp_path / "root", ckpt.TierOptions(
            local_dir=opts.local_dir, budget_bytes=opts.budget_bytes, node="n0"))
        got = {"w": torch.zeros(4096)}
        assert ckpt.CheckpointManager(again.store).restore(got) == 1
        assert torch.equal(got["w"], w)
        served = again.tier_stats.served
        assert served["local"] > 0 and served["peer"] == 0 and served["persistent"] == 0

        assert root.drop_local_tier() is True
        assert not os.path.exists(root.tiered.local_dir)
    finally:
        root.close()
    assert root.peer_server is None


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"local_dir": "", "budget_bytes": 1}, "local_dir"),
    ({"local_dir": "/dev/shm/x", "budget_bytes": -1}, "budget_bytes"),
    ({"local_dir": "/dev/shm/x", "budget_bytes": 1, "peer_replicas": -1}, "peer_replicas"),
])
def test_tier_options_refuse_bad_values_by_name(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"TierOptions.{field}"):
        ckpt.TierOptions(**kwargs)
