"""`SaveWorker`: the kept threads that run a checkpointer's asynchronous saves, below the
training's priority."""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["SAVE_WORKER_NICE", "SAVE_WORKER_NICE_ENV", "SaveWorker"]

SAVE_WORKER_NICE_ENV = "RELIGHT_SAVE_WORKER_NICE"


def _nice_from_env() -> int:
    raw = os.environ.get(SAVE_WORKER_NICE_ENV, "").strip()
    if not raw:
        return 10
    try:
        nice = int(raw)
    except ValueError:
        nice = -1
    if not 0 <= nice <= 19:
        raise ValueError(f"{SAVE_WORKER_NICE_ENV} must be an integer from 0 to 19 (how many "
                         f"nice levels below the training the save worker runs), got {raw!r}")
    return nice


SAVE_WORKER_NICE = _nice_from_env()
"""How much lower than the thread that saves the save worker runs (Linux nice values are
per thread; the threads it starts to write inherit it). An asynchronous save hands the
worker its job and returns, and the worker encodes and writes while the training goes
on: with more busy threads than cores, the training then shared its cores with the
save. 4 ranks on 2 cores, a CPU-bound step run right after each async save returned
(medians of 8 saves, 7 runs each): the step took 0.24-0.34 s against 0.34-0.49 s at
the same priority (0.36-0.37 s at nice 5, two runs), and 0.11-0.16 s (one run 0.24 s)
with no save running; the save was durable 0.51-0.68 s after it started, against 0.45-0.59 s.

Read from `RELIGHT_SAVE_WORKER_NICE` (0-19, default 10) when the module loads. 0 runs
the worker at the caller's priority: for a node whose other CPU-bound work (data-loader
processes at the training's priority) would otherwise starve the saves."""


Job = tuple[Callable[[], None], threading.Event] | None
"""A job and the event set once it has returned; None ends the thread."""


class SaveWorker:
    """The threads that run this process's asynchronous saves, one after another, started
    at the first and kept. A save hands the worker its job and returns: starting a thread
    per save made `save()` wait until the new thread ran (`Thread.start`), 0.1-2.2 ms of
    the stall with 4 ranks on 2 cores, and more on a loaded machine.

    The worker runs `SAVE_WORKER_NICE` below the caller. Pipelined staging, which the
    training waits for (`wait_staged`), goes to a second kept thread at the caller's
    priority (`run_staging`): a thread cannot take back the priority it gave up, and
    threads inherit their starter's, so both are started from the caller."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._stagings: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stager: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Callable[[], None], tail: threading.Event) -> None:
        """Run `job` after the jobs before it; set `tail` once it has returned and the
        worker holds nothing of it."""
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # first, or forked
                self._jobs, self._stagings = queue.SimpleQueue(), queue.SimpleQueue()
                self._stager = _start(self._stagings, "ckpt-stage", 0)
                self._thread = _start(self._jobs, "ckpt-save-worker", SAVE_WORKER_NICE)
            self._jobs.put((job, tail))

    def is_worker(self) -> bool:
        return threading.current_thread() is self._thread

    def running(self) -> tuple[threading.Thread, ...]:
        """This worker's threads alive now (the save worker, the stager): none before
        its first save or after `close`."""
        with self._lock:
            return tuple(t for t in (self._thread, self._stager)
                         if t is not None and t.is_alive())

    def close(self, join_s: float = 0.0) -> None:
        """End both threads once the jobs handed over before have run, waiting up to
        `join_s` for each (at interpreter exit; an instance made on the side, in a test,
        lets go of its threads). A later `submit` starts new ones."""
        with self._lock:
            threads = [t for t in (self._thread, self._stager) if t is not None]
            if threads:
                self._jobs.put(None)
                self._stagings.put(None)
                self._thread = self._stager = None
        for t in threads:
            if t is not threading.current_thread():
                t.join(join_s)

    def run_staging(self, copy: Callable[[], T]) -> T:
        """`copy()` on the staging thread (the caller's priority): its result, or its
        error raised here. Called by a job; run in place off the worker."""
        if not self.is_worker():
            return copy()
        staged: Future[T] = Future()

        def job() -> None:
            try:
                staged.set_result(copy())
            except BaseException as e:  # noqa: BLE001 - raised in the worker below
                staged.set_exception(e)
        self._stagings.put((job, threading.Event()))
        return staged.result()


def _start(jobs: queue.SimpleQueue[Job], name: str, nice: int) -> threading.Thread:
    thread = threading.Thread(target=_run_jobs, args=(jobs, nice), name=name, daemon=True)
    thread.start()
    return thread


def _run_jobs(jobs: queue.SimpleQueue[Job], nice: int) -> None:
    _lower_priority(nice)
    while (item := jobs.get()) is not None:
        job, tail = item
        del item  # `del job` below must leave the job unreferenced
        try:
            job()
        except BaseException:  # noqa: BLE001 - a job reports through its handle
            logger.exception("an asynchronous save's job raised")
        finally:
            del job  # its buffers go before the tail is said to be done
            tail.set()


def _lower_priority(by: int) -> None:
    """Raise the calling thread's nice value by `by` (at most to 19), where the platform
    has per-thread nice values (Linux); elsewhere leave it."""
    if by <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except OSError as err:  # a sandbox that forbids it: run at the process's priority
        logger.debug("the save worker keeps its priority: %s", err)


