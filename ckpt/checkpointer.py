"""`Checkpointer`: the checkpoint engine as an object, and the process's default one
behind `ckpt.save` / `ckpt.load`.

A checkpointer keeps what makes its next save cheap: the cached save plan with the
staging buffers it reuses, this rank's layout memo, the save worker that persists
asynchronous saves, the gloo group their commits go over, and the page-cache pages of
its last save (`ckpt.page_recycle`). A `CheckpointManager` owns one; two managers in one
process (a model and an EMA copy, say) no longer throw each other's plan out. What every
load of the process shares (read threads, the decode lock) lives in `ckpt.read_pools`.

At interpreter exit every checkpointer lets an async save still in flight commit (see
`Checkpointer.finish_at_exit`).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Mapping
from typing import Any

from relight.ckpt.commit import CommitHooks
from relight.ckpt.commit_group import CommitGroup
from relight.ckpt.handle import SaveHandle
from relight.ckpt.layout import LayoutMemo
from relight.ckpt.loader import LoadInfo, load
from relight.ckpt.options import SaveOptions
from relight.ckpt.page_recycle import PageRecycler
from relight.ckpt.save_worker import SaveWorker
from relight.ckpt.saver import CachedPlan
from relight.ckpt.saver import save as _save
from relight.storage import Store

logger = logging.getLogger(__name__)

__all__ = ["Checkpointer", "default_checkpointer", "load", "save", "wait_inflight",
           "wait_staged"]

_TAIL_JOIN_S = 60.0
"""Bound on the wait for a done save's thread to return: it only frees and calls back."""


class Checkpointer:
    """Saves and loads sharded checkpoints; keeps, between saves, what makes the next one
    cheap. One save in flight at a time: a save first waits for the previous one."""

    def __init__(self) -> None:
        self.inflight: SaveHandle | None = None
        """The latest save (done or not)."""
        self.save_worker = SaveWorker()
        self.cached: CachedPlan | None = None
        """The last save plan and its staging buffers; tests and benchmarks read the
        buffers and may set it to None to free them."""
        self.commit_group: CommitGroup | None = None
        """The gloo group of the asynchronous saves' commits (`ckpt.commit_group`)."""
        self.layouts = LayoutMemo()
        """This rank's layout and digest from the last save (`ckpt.layout.LayoutMemo`)."""
        self.recycler = PageRecycler()
        """The page-cache pages the next save writes into (`ckpt.page_recycle`)."""
        _LIVE.add(self)
        # The worker's threads wait on their queues, which do not hold the checkpointer:
        # once it is gone (a save running holds it), they are told to end.
        self._release = weakref.finalize(self, self.save_worker.close)

    def close(self) -> None:
        """Wait for the save in flight, then end the save worker's threads (a later
        save starts them again)."""
        self.wait_inflight()
        h = self.inflight
        if h is not None:
            self._join_tail(h)
        self.save_worker.close()

    def save(self, state_dict: Mapping[str, Any], url: str | os.PathLike[str] | Store,
             async_save: bool = False, *, step: int | None = None,
             config: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
             process_group: Any = None, options: SaveOptions | None = None,
             hooks: CommitHooks | None = None) -> SaveHandle:
        """Save `state_dict` as one checkpoint at `url`; every rank of the group calls.

        Args:
            state_dict: nested dicts/lists of tensors (plain or DTensor), objects with
                `state_dict()`/`load_state_dict()`, and JSON values.
            url: where the checkpoint goes (a `storage` URL or `Store`); it must not hold
                a committed checkpoint.
            async_save: return once the state is staged (the only blocking part) and
                persist and commit in a background thread; else return once committed.
            step: recorded in the manifest and the commit marker.
            config: JSON recorded in the manifest (`LoadInfo.config` on load).
            layout: JSON recorded in the manifest: how the run was parallelized.
            process_group: the group saving together (default: the default group, or
                this process alone when torch.distributed is not initialized).
            options: how the save is planned and persisted (`SaveOptions`).
            hooks: writes of the caller at fixed points of the commit
                (`ckpt.commit.CommitHooks`), run on the coordinator (in the background
                thread when asynchronous).

        Returns:
            A `SaveHandle` (a `concurrent.futures.Future`): `wait()` blocks until
            committed and raises the save's failure; `wait_staged()` until the state may
            change.

        Raises:
            CheckpointExistsError: `url` holds a committed checkpoint (synchronous saves
                here; asynchronous ones from `wait()`).
            UnsupportedStateError: a value cannot be checkpointed (e.g. a Partial
                DTensor, an unsupported dtype, a non-JSON value), raised on every rank.
            CollectiveError: a rank of the group did not make the same call in time.
            CheckpointSaveError: persisting or committing failed (synchronous saves here,
                asynchronous ones from `wait()`); `failures` names the ranks.
        """
        return _save(self, state_dict, url, async_save, step=step, config=config,
                     layout=layout, process_group=process_group, options=options,
                     hooks=hooks)

    def load(self, state_dict: dict[str, Any], url: str | os.PathLike[str] | Store, *,
             strict: bool = True, process_group: Any = None, broadcast: bool = True,
             collective_timeout_s: float = 300.0) -> LoadInfo:
        """Load a committed checkpoint into `state_dict` in place (`ckpt.loader.load`)."""
        return load(state_dict, url, strict=strict, process_group=process_group,
                    broadcast=broadcast, collective_timeout_s=collective_timeout_s)

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

    def note_crashes(self) -> None:
        """At the first async save of the process, chain `sys.excepthook` to note an
        uncaught exception, so that exit does not wait for a save that may never commit."""
        global _HOOKED
        with _HOOK_LOCK:
            if _HOOKED:
                return
            _HOOKED = True
            previous = sys.excepthook

            def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
                global _CRASHED
                _CRASHED = True
                previous(tp, value, tb)

            sys.excepthook = hook

    def finish_at_exit(self) -> None:
        """At interpreter exit, let the async save in flight commit instead of dying with
        its (daemon) thread, and say so: the script forgot `wait()`. Not when the process
        dies of an uncaught exception (a fault: its peers may be gone, the commit may
        never come, and a supervisor waits for this process to exit before restarting)."""
        h = self.inflight
        if h is None:
            return
        if h._done.is_set():
            self._join_tail(h)
            return
        if _CRASHED:
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
        self._join_tail(h)

    def _join_tail(self, h: SaveHandle) -> None:
        """Wait for the save worker to let go of a finished save, not only for its handle
        to be done, then end the worker's threads: they are daemons, and one still
        running (freeing the save's buffers, calling back, or, below the caller's
        priority, not yet back in its queue) when the interpreter finalizes is stopped by
        a forced unwind that can abort the process inside torch's C++ ("terminate called
        without an active exception"), after the commit, with exit status 134."""
        if not self.save_worker.is_worker():
            h._tail.wait(_TAIL_JOIN_S)
            self.save_worker.close(join_s=_TAIL_JOIN_S)


_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()
"""Every checkpointer of the process (the save worker holds one with a save running)."""
_HOOK_LOCK = threading.Lock()
_HOOKED = False
_CRASHED = False
"""The main thread died of an uncaught exception (see `Checkpointer.note_crashes`)."""

_DEFAULT: Checkpointer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_checkpointer() -> Checkpointer:
    """The process's checkpointer behind `ckpt.save` and `ckpt.load`."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Checkpointer()
        return _DEFAULT


def save(state_dict: Mapping[str, Any], url: str | os.PathLike[str] | Store,
         async_save: bool = False, *, step: int | None = None,
         config: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
         process_group: Any = None, options: SaveOptions | None = None,
         hooks: CommitHooks | None = None) -> SaveHandle:
    """Save `state_dict` as one checkpoint at `url`; every rank of the group calls. Runs
    on the process's default checkpointer: arguments, the returned `SaveHandle` and the
    errors are `Checkpointer.save`'s (`help(relight.Checkpointer.save)`)."""
    return default_checkpointer().save(state_dict, url, async_save, step=step, config=config,
                                       layout=layout, process_group=process_group,
                                       options=options, hooks=hooks)


def wait_staged() -> float:
    """Wait until no save of this process reads the state any more (pipelined staging);
    returns seconds waited. Returns at once when nothing is staging."""
    return sum(cp.wait_staged() for cp in list(_LIVE))


def wait_inflight() -> float:
    """Wait for every save of this process in flight; returns seconds waited."""
    return sum(cp.wait_inflight() for cp in list(_LIVE))


def _finish_all_at_exit() -> None:
    for cp in list(_LIVE):
        cp.finish_at_exit()


# Before `concurrent.futures` refuses new work at shutdown (the save's thread pools would
# fail with "cannot schedule new futures after interpreter shutdown"): threading's exit
# hooks run newest first, ahead of `atexit`, and the executors registered theirs when
# this module imported them.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_all_at_exit)
else:  # pragma: no cover - CPython < 3.9
    atexit.register(_finish_all_at_exit)
