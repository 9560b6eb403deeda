"""The save worker runs asynchronous saves below the training's CPU priority, and so do
the threads it starts to write; the caller's own priority is left as it was."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from relight import ckpt
from relight.ckpt import save_worker as res_mod
from relight.ckpt.save_worker import SaveWorker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="per-thread nice values are Linux's")


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _priorities_seen_by_a_job(worker: SaveWorker) -> tuple[int, int]:
    """(the worker thread's nice, the nice of a thread the job starts)."""
    seen: dict[str, int] = {}

    def job() -> None:
        seen["worker"] = _nice()
        t = threading.Thread(target=lambda: seen.__setitem__("child", _nice()))
        t.start()
        t.join()

    tail = threading.Event()
    worker.submit(job, tail)
    try:
        assert tail.wait(60), "the save worker did not run the job within 60 s"
    finally:
        worker.close()
    return seen["worker"], seen["child"]


def test_worker_and_its_threads_run_below_the_caller() -> None:
    caller = _nice()
    want = min(19, caller + res_mod.SAVE_WORKER_NICE)
    assert res_mod.SAVE_WORKER_NICE > 0
    assert _priorities_seen_by_a_job(SaveWorker()) == (want, want)
    assert _nice() == caller


def test_closed_worker_lets_go_of_its_threads() -> None:
    def mine() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t not in before]
    before = set(threading.enumerate())
    worker = SaveWorker()
    tail = threading.Event()
    worker.submit(lambda: None, tail)
    assert tail.wait(60)
    assert sorted(t.name for t in mine()) == ["ckpt-save-worker", "ckpt-stage"]
    worker.close()
    for t in mine():
        t.join(60)  # each ends at the None its queue gets next
    assert mine() == []


class _Job:
    """A job a weakref can follow (a function defined here would stay referenced)."""

    def __call__(self) -> None:
        pass


def test_worker_lets_go_of_a_job_before_its_tail() -> None:
    """A done save's buffers are freed before exit stops waiting for it (`_join_tail`):
    a daemon thread freeing tensors while the interpreter finalizes aborts the process."""
    import weakref

    worker = SaveWorker()
    try:
        for _ in range(3):
            job, tail = _Job(), threading.Event()
            gone = weakref.ref(job)
            worker.submit(job, tail)
            del job
            assert tail.wait(60), "the save worker did not run the job within 60 s"
            assert gone() is None, "the worker still holds the job after its tail was set"
    finally:
        worker.close()


def test_zero_keeps_the_process_priority(monkeypatch) -> None:
    monkeypatch.setattr(res_mod, "SAVE_WORKER_NICE", 0)
    caller = _nice()
    assert _priorities_seen_by_a_job(SaveWorker()) == (caller, caller)


def test_async_save_writes_from_the_lowered_worker(tmp_path, monkeypatch) -> None:
    """A real async save: its files are written from threads at the worker's lowered
    priority."""
    from relight.storage.fsspec_store import LocalStore

    caller = _nice()
    put_nices: list[int] = []
    real_write = LocalStore._write_temp

    def write_temp(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        put_nices.append(_nice())
        return real_write(self, *a, **k)

    monkeypatch.setattr(LocalStore, "_write_temp", write_temp)
    h = ckpt.save({"w": torch.arange(4096.0)}, tmp_path / "ck", async_save=True)
    h.wait()
    assert ckpt.verify(tmp_path / "ck").ok
    assert put_nices and set(put_nices) == {min(19, caller + res_mod.SAVE_WORKER_NICE)}
    assert _nice() == caller


def test_pipelined_staging_runs_at_the_callers_priority(tmp_path, monkeypatch) -> None:
    """The copy the training waits for is not slowed with the writes."""
    from relight.ckpt import staging

    caller = _nice()
    copy_nices: list[int] = []
    real_run = staging.Stager.run

    def run(self):  # noqa: ANN001, ANN202
        copy_nices.append(_nice())
        return real_run(self)

    monkeypatch.setattr(staging.Stager, "run", run)
    state = {"w": torch.arange(4096.0)}
    h = ckpt.save(state, tmp_path / "ck", async_save=True,
                  options=ckpt.SaveOptions(pipelined_staging=True))
    h.wait()
    assert copy_nices == [caller]
    assert ckpt.verify(tmp_path / "ck").ok


def test_failed_pipelined_staging_fails_the_save(tmp_path, monkeypatch) -> None:
    from relight.ckpt import staging

    def run(self):  # noqa: ANN001, ANN202
        raise RuntimeError("staging copy failed")

    monkeypatch.setattr(staging.Stager, "run", run)
    h = ckpt.save({"w": torch.zeros(64)}, tmp_path / "ck", async_save=True,
                  options=ckpt.SaveOptions(pipelined_staging=True))
    err = h.exception(timeout=60)
    assert isinstance(err, ckpt.CheckpointSaveError) and "staging copy failed" in str(err)
    assert not (tmp_path / "ck").exists() or not ckpt.verify(tmp_path / "ck").ok


@pytest.mark.parametrize(("raw", "want"), [("", 10), ("0", 0), (" 19 ", 19), ("3", 3)])
def test_nice_from_the_environment(monkeypatch, raw: str, want: int) -> None:
    monkeypatch.setenv(res_mod.SAVE_WORKER_NICE_ENV, raw)
    assert res_mod._nice_from_env() == want


@pytest.mark.parametrize("raw", ["-1", "20", "ten", "1.5"])
def test_bad_nice_in_the_environment_names_the_variable(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(res_mod.SAVE_WORKER_NICE_ENV, raw)
    with pytest.raises(ValueError, match=f"RELIGHT_SAVE_WORKER_NICE .*0 to 19.*{raw!r}"):
        res_mod._nice_from_env()
