"""The save handle is a `concurrent.futures.Future`, and an async save still running at
interpreter exit commits (with a warning) instead of dying with its thread."""

from __future__ import annotations

import concurrent.futures as cf
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from relight import ckpt, storage
from relight.storage.testing import FaultPlan, FaultyStore


def test_handle_is_a_future(tmp_path) -> None:
    h = ckpt.save({"w": torch.arange(64.0)}, tmp_path / "ck", async_save=True)
    assert isinstance(h, cf.Future)
    seen: list[tuple[str, BaseException | None]] = []
    called = threading.Event()

    def cb(f: cf.Future) -> None:
        seen.append((threading.current_thread().name, f.exception()))
        called.set()

    h.add_done_callback(cb)
    done, _ = cf.wait([h], timeout=60)
    assert done == {h}
    assert h.result(timeout=60) is None and h.exception() is None and h.done()
    assert not h.cancel() and not h.cancelled()
    assert called.wait(60) and seen[0][1] is None
    assert ckpt.verify(tmp_path / "ck").ok
    late: list[cf.Future] = []
    h.add_done_callback(late.append)  # on a finished future: called at once
    assert late == [h]


def test_failed_save_is_the_futures_exception(tmp_path) -> None:
    root = storage.open_store(tmp_path / "ck")
    faulty = FaultyStore(root, FaultPlan(fail_fraction=1.0, fail_times=10**6,
                                         ops=("put",)))
    faulty.retry = storage.RetryPolicy(max_attempts=1)
    h = ckpt.save({"w": torch.zeros(8)}, faulty, async_save=True)
    err = h.exception(timeout=60)
    assert isinstance(err, ckpt.CheckpointSaveError)
    with pytest.raises(ckpt.CheckpointSaveError):
        h.result()
    with pytest.raises(ckpt.CheckpointSaveError):
        h.wait()
    assert h.error is err


SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, torch
    from relight import ckpt, storage
    from relight.storage.testing import FaultPlan, FaultyStore
    # atexit runs after the engine's exit hook (threading's run first): what is left then
    # runs while the interpreter finalizes.
    atexit.register(lambda: print("left at exit:", sorted(
        t.name for t in threading.enumerate() if t.name.startswith("ckpt-")), flush=True))
    root = storage.open_store(sys.argv[1])
    # Each index put sleeps: the save is surely still running when the script ends.
    slow = FaultyStore(root, FaultPlan(latency_s=0.5, ops=("put",), key_contains="index/"))
    mgr = ckpt.CheckpointManager(slow)
    mgr.save(1, {"w": torch.arange(16.0)}, async_save=True)
    print("returned", flush=True)  # no mgr.wait(): the common mistake
    if len(sys.argv) > 2:
        raise RuntimeError("a fault")  # dies of it: exit must not wait for the save
""")


def test_async_save_in_flight_at_exit_commits_and_warns(tmp_path) -> None:
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(root)], capture_output=True,
                         text=True, timeout=120, env=env, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr
    assert "returned" in out.stdout
    assert "still running at interpreter exit" in out.stderr, out.stderr
    assert "call CheckpointManager.wait()" in out.stderr
    assert "left at exit: []" in out.stdout  # the save worker's threads ended
    mgr = ckpt.CheckpointManager(root)
    assert mgr.latest_step() == 1
    sd = {"w": torch.zeros(16)}
    mgr.restore(sd)
    assert torch.equal(sd["w"], torch.arange(16.0))


def test_exit_on_an_uncaught_exception_does_not_wait(tmp_path) -> None:
    root = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(root), "crash"],
                         capture_output=True, text=True, timeout=120, env=env, cwd=os.getcwd())
    assert out.returncode == 1 and "RuntimeError: a fault" in out.stderr, out.stderr
    assert "not waiting for it" in out.stderr, out.stderr
    assert ckpt.CheckpointManager(root).latest_step() is None
