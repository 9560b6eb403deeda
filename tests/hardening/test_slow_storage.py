"""Storage slower than the checkpoint interval: the next save waits or is skipped, per
`CheckpointManager(busy=...)`, with at most one save in flight and its staging buffers
reused: the backlog never holds more than one save's buffers."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from relight import ckpt
from relight.storage.testing import FaultPlan, FaultyStore

from ._util import assert_bitwise, local_store, tally

LATENCY_S = 0.02
"""Added to every put: one save (about 20 puts) then takes far longer than a step."""
STEP_S = 0.01


def big_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(2048, 2048, generator=g), "b": torch.randn(64, generator=g)}


def zeros() -> dict:
    return {"w": torch.zeros(2048, 2048), "b": torch.zeros(64)}


def slow_manager(tmp_path, busy: str) -> ckpt.CheckpointManager:
    root = local_store(tmp_path / "run")
    slow = FaultyStore(root, FaultPlan(latency_s=LATENCY_S, ops=("put",)))
    return ckpt.CheckpointManager(slow, keep_last=2, busy=busy)


def staging_buffers(mgr: ckpt.CheckpointManager) -> set[int]:
    """Addresses of the host buffers the manager's engine keeps between saves (whatever
    its internals call them: every tensor held by its cached plan, one level down)."""
    cached = mgr.checkpointer.cached
    found = set()
    for obj in (cached, *vars(cached).values()):
        for v in getattr(obj, "__dict__", {}).values():
            if isinstance(v, torch.Tensor):
                found.add(v.data_ptr())
    assert found, "no staging buffer found in the engine's cached plan"
    return found


def save_threads() -> int:
    return sum(t.name.startswith("ckpt-save-") for t in threading.enumerate())


def train(mgr: ckpt.CheckpointManager, steps: range, state: dict) -> list[float]:
    """A loop that updates the state and saves every step; returns each save's stall."""
    stalls = []
    others = save_threads() - sum(t.name.startswith("ckpt-save-")
                                  for t in mgr.checkpointer.save_worker.running())
    for step in steps:
        time.sleep(STEP_S)
        state["w"][0, 0] = float(step)  # this step's update, saved below
        t0 = time.perf_counter()
        mgr.save(step, state)
        stalls.append(time.perf_counter() - t0)
        assert save_threads() - others <= 1  # this manager runs one save at a time
    return stalls


@pytest.mark.parametrize("busy", ["wait", "skip"])
def test_bounded_memory_and_one_save_in_flight(tmp_path, busy: str, caplog) -> None:
    mgr = slow_manager(tmp_path, busy)
    state = big_state(0)
    with caplog.at_level(logging.INFO, logger="relight.ckpt.manager"):
        stalls = train(mgr, range(1, 5), state)
        staging = staging_buffers(mgr)
        stalls += train(mgr, range(5, 15), state)
        mgr.wait()
    assert staging_buffers(mgr) == staging
    persisted = mgr.committed_steps()
    if busy == "wait":
        assert mgr.waited_saves >= 12 and mgr.skipped_saves == 0
        assert "busy=wait" in caplog.text
        assert persisted == [13, 14]
        assert sum(stalls) > 12 * LATENCY_S  # each save waited for a whole persist
    else:
        assert mgr.skipped_saves >= 7 and mgr.waited_saves == 0
        assert "busy=skip" in caplog.text
        assert 1 <= len(persisted) <= 14 - mgr.skipped_saves
        taken = 14 - mgr.skipped_saves
        # Skipping never waits for storage: the loop stalled less than the saves took.
        assert sum(stalls) < taken * 20 * LATENCY_S
    # The newest checkpoint holds the state as it was when its save was called, though
    # the loop kept changing it while the save persisted.
    last = persisted[-1]
    got = zeros()
    assert mgr.restore(got) == last
    want = big_state(0)
    want["w"][0, 0] = float(last)
    assert_bitwise(got, want)
    tally("faults_injected", 14)
    tally("runs_completed")
    tally("checkpoints_checked")


def test_skip_then_a_forced_save_waits(tmp_path) -> None:
    mgr = slow_manager(tmp_path, "skip")
    state = big_state(1)
    h1 = mgr.save(1, state)
    assert h1 is not None and not h1.done()
    assert mgr.save(2, state) is None and mgr.skipped_saves == 1
    h3 = mgr.save(3, state, busy="wait")  # the last step: must be taken
    assert h1.done() and h3 is not None
    mgr.wait()
    assert mgr.committed_steps() == [1, 3]
    got = zeros()
    assert mgr.restore(got) == 3
    assert_bitwise(got, state)
    tally("runs_completed")
    tally("checkpoints_checked")


def test_busy_policy_is_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="busy"):
        ckpt.CheckpointManager(tmp_path / "x", busy="queue")
    mgr = ckpt.CheckpointManager(tmp_path / "x")
    with pytest.raises(ValueError, match="'later'"):
        mgr.save(1, {"a": torch.zeros(1)}, busy="later")
    tally("bad_inputs", 2)
