"""What the engine keeps per process between saves and loads: one `EngineResources`
object, reached through `resources()`.

It holds the save in flight (a process runs one save at a time), the commit group of
asynchronous saves, the cached save plan
with its reusable staging buffers, the thread pools of direct shard reads, and the
lock that serializes chunk decoding. At interpreter exit it lets an async save still
in flight commit (see `EngineResources.finish_at_exit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relight.ckpt.commit_group import CommitGroup
from relight.ckpt.handle import SaveHandle
from relight.ckpt.layout import LayoutMemo
from relight.ckpt.page_recycle import PageRecycler
from relight.ckpt.plan import PieceWrite, SavePlan, TensorPlan
from relight.ckpt.staging import StagingBuffers
from relight.storage import Store
from relight.storage.direct_io import BufferPool

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["CachedPlan", "EngineResources", "READ_THREADS", "SAVE_WORKER_NICE",
           "SAVE_WORKER_NICE_ENV", "SaveWorker", "resources", "wait_inflight", "wait_staged"]

READ_THREADS = {"memory": 2, "direct": 8, "remote": 8}
"""Shard-read threads per process: a read from memory (`memory`) is a copy, CPU work on
cores the ranks share; a read of files, around the page cache unless it holds the
range (`direct`, `storage.direct_io`), and a request to S3 (`remote`) wait on the
device or the network, so more in flight hide the latency. 4 ranks, 512 MiB around the
cache, 8 loads of each kind alternated between 8 and 2 threads: resharded loads
0.33-0.38 s with 8 against 0.31-0.49 s with 2; same-layout loads 0.26-0.59 s against
0.27-0.38 s (one slow round with 8)."""

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


@dataclass
class CachedPlan:
    """The save plan of the last layout seen, and the staging buffers it reuses."""

    ident: str
    """The attempt id of the save that made it: the same on every rank that holds it."""
    ranks: tuple[int, ...]
    """The group's global ranks."""
    mine: str
    """This rank's layout digest when the plan was made."""
    digests: tuple[str, ...] | None
    """Every rank's layout digest then, on the coordinator (the handshake compares them);
    None on the other ranks."""
    plan: SavePlan
    bufs: StagingBuffers = field(default_factory=StagingBuffers)
    _writes: dict[int, list[tuple[TensorPlan, PieceWrite]]] = field(default_factory=dict)

    def writes_of(self, rank: int) -> list[tuple[TensorPlan, PieceWrite]]:
        """`plan.writes_of(rank)`, computed once per plan: it walks every piece of every
        rank (millions at thousands of ranks), and a cached plan serves every save."""
        got = self._writes.get(rank)
        if got is None:
            got = self._writes[rank] = self.plan.writes_of(rank)
        return got


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


class EngineResources:
    """The engine's process-wide state. One instance per process (`resources()`);
    tests and benchmarks read `cached` (the staging buffers) and may set it to None to
    free them."""

    def __init__(self) -> None:
        self.inflight: SaveHandle | None = None
        """This process's latest save (done or not)."""
        self.save_worker = SaveWorker()
        self.cached: CachedPlan | None = None
        self.commit_group: CommitGroup | None = None
        """The gloo group of the asynchronous saves' commits (`ckpt.commit_group`)."""
        self.crashed = False
        """The main thread died of an uncaught exception (see `note_crashes`)."""
        self._hooked = False
        self._pool_lock = threading.Lock()
        self._read_pools: dict[str, ThreadPoolExecutor] = {}
        self.decode_lock = threading.Lock()
        """One thread per process checks and copies fetched chunks (CPU); fetches overlap."""
        self.read_buffers = BufferPool()
        """What the read threads fetch shard bytes into, reused within a load and dropped
        when it ends (`ckpt.engine.load`)."""
        self.layouts = LayoutMemo()
        """This rank's layout and digest from the last save (`ckpt.layout.LayoutMemo`)."""
        self.recycler = PageRecycler()
        """The page-cache pages this process's next save writes into (`ckpt.page_recycle`)."""

    def read_pool(self, store: Store) -> ThreadPoolExecutor:
        """Threads for direct shard reads, shared by every load of this process."""
        kind = {"file": "direct", "memory": "memory"}.get(store.location.scheme, "remote")
        with self._pool_lock:
            if kind not in self._read_pools:
                self._read_pools[kind] = ThreadPoolExecutor(
                    max_workers=READ_THREADS[kind], thread_name_prefix="ckpt-read")
            return self._read_pools[kind]

    def note_crashes(self) -> None:
        """Chain `sys.excepthook` once (at the first async save) to note an uncaught
        exception, so that exit does not wait for a save that may never commit."""
        if self._hooked:
            return
        self._hooked = True
        previous = sys.excepthook

        def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
            self.crashed = True
            previous(tp, value, tb)

        sys.excepthook = hook

    def wait_staged(self) -> float:
        """Wait until the latest save no longer reads the state; seconds waited."""
        h = self.inflight
        return 0.0 if h is None else h.wait_staged()

    def wait_inflight(self) -> float:
        """Wait for the save in flight (if any); returns seconds waited."""
        h = self.inflight
        if h is None or h.done():
            return 0.0
        t0 = time.perf_counter()
        h._done.wait()
        return time.perf_counter() - t0

    def finish_at_exit(self) -> None:
        """At interpreter exit, let the async save in flight commit instead of dying with
        its (daemon) thread, and say so: the script forgot `wait()`. Not when the process
        dies of an uncaught exception (a fault: its peers may be gone, the commit may
        never come, and a supervisor waits for this process to exit before restarting)."""
        h = self.inflight
        if h is None:
            return
        if h._done.is_set():
            _join_tail(h)
            return
        if self.crashed:
            logger.warning("exiting on an uncaught exception while the async save of step %s "
                           "to %s is still running: not waiting for it (it stays uncommitted)",
                           h.step, h.url)
            return
        limit = h._exit_wait_s
        logger.warning("the async save of step %s to %s is still running at interpreter "
                       "exit; waiting up to %.0f s for it to commit (call "
                       "CheckpointManager.wait() or handle.wait() before the script ends)",
                       h.step, h.url, limit)
        if not h._done.wait(limit):
            logger.error("the save of step %s to %s did not finish within %.0f s: the process "
                         "exits and leaves it uncommitted", h.step, h.url, limit)
            return
        if h._error is not None:
            logger.error("the save of step %s to %s failed: %s", h.step, h.url, h._error)
        else:
            logger.warning("the save of step %s to %s committed before exit", h.step, h.url)
        _join_tail(h)


_TAIL_JOIN_S = 60.0
"""Bound on the wait for a done save's thread to return: it only frees and calls back."""


def _join_tail(h: SaveHandle) -> None:
    """Wait for the save worker to let go of a finished save, not only for its handle to
    be done, then end the worker's threads: they are daemons, and one still running
    (freeing the save's buffers, calling back, or, below the caller's priority, not yet
    back in its queue) when the interpreter finalizes is stopped by a forced unwind that
    can abort the process inside torch's C++ ("terminate called without an active
    exception"), after the commit, with exit status 134."""
    worker = _RESOURCES.save_worker
    if not worker.is_worker():
        h._tail.wait(_TAIL_JOIN_S)
        worker.close(join_s=_TAIL_JOIN_S)


_RESOURCES = EngineResources()


def resources() -> EngineResources:
    """This process's `EngineResources`."""
    return _RESOURCES


def wait_staged() -> float:
    """Wait until this process's latest save no longer reads the state (pipelined
    staging); returns seconds waited. Returns at once when nothing is staging."""
    return _RESOURCES.wait_staged()


def wait_inflight() -> float:
    """Wait for this process's save in flight (if any); returns seconds waited."""
    return _RESOURCES.wait_inflight()


# Before `concurrent.futures` refuses new work at shutdown (the save's thread pools would
# fail with "cannot schedule new futures after interpreter shutdown"): threading's exit
# hooks run newest first, ahead of `atexit`, and the executors registered theirs when
# this module imported them.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_RESOURCES.finish_at_exit)
else:  # pragma: no cover - CPython < 3.9
    atexit.register(_RESOURCES.finish_at_exit)
