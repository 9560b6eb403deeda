"""The harness's view of a checkpoint root: committed steps and whole-tensor reads."""

from __future__ import annotations

import torch

from relight import ckpt
from relight.chaos.ckpt_probe import CheckpointProbe
from relight.storage import open_store


def test_probe_reads_committed_state_whole(tmp_path) -> None:
    root = tmp_path / "root"
    mgr = ckpt.CheckpointManager(str(root), keep_last=None)
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    mgr.save(5, {"model": {"w": weights, "b": torch.ones(2)}, "train": {"step": 5}},
             async_save=False)
    probe = CheckpointProbe(open_store(root))
    assert probe.scan()[5].committed
    state = probe.read_state(5)
    tensors = {k: v for k, v in state.items() if not k.startswith("value:")}
    assert set(tensors) == {"model/w", "model/b"}
    assert torch.equal(tensors["model/w"], weights)
    assert torch.equal(tensors["model/b"], torch.ones(2))
    assert any(v == {"step": 5} or v == 5 for k, v in state.items() if k.startswith("value:"))


def test_reference_copied_out_of_its_store_reads_the_same(tmp_path) -> None:
    # --reference-cache keeps the reference checkpoints in a local dir whatever store the
    # reference run wrote them to (the S3 server dies with the run).
    from relight.chaos.runner import _copy_store

    src_url = "memory://chaos-ref-copy"
    mgr = ckpt.CheckpointManager(src_url, keep_last=None)
    weights = torch.arange(6, dtype=torch.float32)
    mgr.save(3, {"model": {"w": weights}, "train": {"step": 3}}, async_save=False)
    copied = _copy_store(open_store(src_url), open_store(tmp_path / "cache"))
    assert copied == len(open_store(src_url).list()) > 0
    probe = CheckpointProbe(open_store(tmp_path / "cache"))
    assert probe.committed_steps() == [3]
    assert torch.equal(probe.read_state(3)["model/w"], weights)
    assert probe.verify_all() == {3: None}


def test_refused_resave_of_a_committed_step_is_not_a_new_commit(tmp_path) -> None:
    # After a fallback past a damaged checkpoint the job reaches its step again; the save is
    # refused (a committed checkpoint is never overwritten) but leaves objects of a new
    # attempt. The harness must not take that for a fresh commit (chaos seed 8 did, and then
    # expected the damaged checkpoint to verify).
    import pytest

    root = tmp_path / "root"
    mgr = ckpt.CheckpointManager(str(root), keep_last=None)
    state = {"model": {"w": torch.ones(4)}, "train": {"step": 7}}
    mgr.save(7, state, async_save=False)
    probe = CheckpointProbe(open_store(root))
    first = probe.commits()
    assert [s for s, _ in first] == [7] and None not in {a for _, a in first}
    with pytest.raises(ckpt.CheckpointExistsError):  # async: refused in the background
        mgr.save(7, state, async_save=True)
        mgr.wait()
    store = open_store(root)
    stray = [k for k in store.list() if "/index/" in k or "/data/" in k]
    assert len({k.split("/")[2] for k in stray}) == 2  # the refused attempt left its error
    assert probe.commits() == first
