"""Saves that keep failing stop the run (`SaveFailurePolicy`), loudly, at every step."""

from __future__ import annotations

import logging

import pytest
import torch

from relight import ckpt, storage
from relight.storage.testing import FaultPlan, FaultyStore


def _state(seed: int) -> dict:
    return {"w": torch.full((64, 64), float(seed)), "step": seed}


def _failing(root: storage.Store) -> FaultyStore:
    """Every put under a step's directory fails past the retry budget."""
    faulty = FaultyStore(root, FaultPlan(fail_fraction=1.0, fail_times=10**6,
                                         ops=("put",), key_contains="step-"))
    faulty.retry = storage.RetryPolicy(max_attempts=1)
    return faulty


def test_consecutive_failed_saves_stop_the_run(tmp_path, caplog) -> None:
    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(_failing(root), keep_last=2)
    with caplog.at_level(logging.ERROR, logger="relight.ckpt.manager"):
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))  # reports step 1: 1 in a row
        mgr.save(3, _state(3))  # reports step 2: 2 in a row
        with pytest.raises(ckpt.SavesFailingError) as e:
            mgr.save(4, _state(4))  # step 3 failed too: the third in a row
    err = e.value
    assert isinstance(err, ckpt.CheckpointSaveError)
    assert root.url in str(err) and "last 3 checkpoint saves" in str(err), err
    assert "step 3" in str(err) and isinstance(err.__cause__, ckpt.CheckpointSaveError)
    assert mgr.consecutive_failed_saves == 3 and mgr.failed_saves == 3
    lines = [r.getMessage() for r in caplog.records if r.name == "relight.ckpt.manager"]
    assert [m.split(" failed")[0] for m in lines] == [f"checkpoint step {s}" for s in (1, 2, 3)]
    assert "(1 in a row; the run stops at 3)" in lines[0], lines


def test_wait_raises_the_policy_error_too(tmp_path) -> None:
    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(_failing(root), keep_last=2,
                                 on_failures=ckpt.SaveFailurePolicy(max_consecutive=2))
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    with pytest.raises(ckpt.SavesFailingError, match="last 2 checkpoint saves"):
        mgr.wait()
    with pytest.raises(ckpt.SavesFailingError):  # asked again: the same answer, no recount
        mgr.wait()
    assert mgr.consecutive_failed_saves == 2


def test_a_committed_save_resets_the_count(tmp_path) -> None:
    root = storage.open_store(tmp_path / "run")
    plan = FaultPlan(fail_fraction=1.0, fail_times=10**6, ops=("put",),
                     key_contains="step-000000000002")
    faulty = FaultyStore(root, plan)
    faulty.retry = storage.RetryPolicy(max_attempts=1)
    mgr = ckpt.CheckpointManager(faulty, keep_last=5,
                                 on_failures=ckpt.SaveFailurePolicy(max_consecutive=2))
    for s in (1, 2, 3, 4):
        mgr.save(s, _state(s))
    mgr.wait()
    assert mgr.failed_saves == 1 and mgr.consecutive_failed_saves == 0
    assert mgr.committed_steps() == [1, 3, 4]


def test_policy_off_only_logs_and_counts(tmp_path) -> None:
    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(_failing(root), keep_last=2,
                                 on_failures=ckpt.SaveFailurePolicy(max_consecutive=None))
    for s in range(1, 6):
        mgr.save(s, _state(s))
    assert mgr.failed_saves == 4
    with pytest.raises(ckpt.CheckpointSaveError) as e:
        mgr.wait()
    assert not isinstance(e.value, ckpt.SavesFailingError)
    with pytest.raises(ValueError, match="max_consecutive"):
        ckpt.SaveFailurePolicy(max_consecutive=0)
