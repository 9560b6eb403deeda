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
