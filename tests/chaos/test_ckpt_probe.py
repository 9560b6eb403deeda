"""The harness's view of a checkpoint root: committed steps and whole-tensor reads."""

from __future__ import annotations

import torch

import ckpt
from chaos.ckpt_probe import CheckpointProbe
from storage import open_store


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
    from chaos.runner import _copy_store

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
