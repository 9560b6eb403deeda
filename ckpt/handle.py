"""`SaveHandle`: a save in progress, as a `concurrent.futures.Future`."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

__all__ = ["SaveHandle"]


class SaveHandle(Future):
    """A save in progress: a `concurrent.futures.Future` (as DCP's `async_save` returns)
    whose result is None once the checkpoint is committed, and whose exception is the
    save's failure: `result()`, `exception()`, `done()`, `add_done_callback()` work as
    on any future (callbacks run in the save's thread). `wait()` blocks until committed
    and raises the failure; `wait_staged()` until the state may change. A save cannot be
    cancelled once started."""

    def __init__(self, url: str, step: int | None) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()  # started: cancel() returns False
        self.url = url
        self.step = step
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.stall_s = 0.0
        """Seconds the caller was blocked (wait for the previous save + plan + staging,
        unless the staging is pipelined)."""
        self.stage_s = 0.0
        """Seconds copying into the staging buffers (in the caller's thread, or in the
        background with pipelined staging)."""
        self.staged_s = 0.0
        """Seconds from the call until the state was no longer read (staging done)."""
        self._staged = threading.Event()
        self._t0 = time.perf_counter()
        self.waited_s = 0.0
        self.total_s = 0.0
        self.bytes_written = 0
        self._tail = threading.Event()
        """Set once the save's thread has let go of the save (buffers freed, callbacks
        run), after `_done`."""
        self._exit_wait_s = 600.0
        """How long interpreter exit waits for this save if it is still running."""

    def staged(self) -> bool:
        """Whether the save no longer reads the state (it may be changed)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block until the save no longer reads the state; returns seconds waited. A
        staging failure is raised by `wait()`, not here."""
        if self._staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not self._staged.wait(timeout):
            raise TimeoutError(f"save to {self.url} still staging after {timeout} s")
        return time.perf_counter() - t0

    def _mark_staged(self) -> None:
        if not self._staged.is_set():
            self.staged_s = time.perf_counter() - self._t0
            self._staged.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.url} still running after {timeout} s")
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._mark_staged()
        self._done.set()
        # After `_done`: a done-callback that calls `wait()` must not block on itself.
        if error is None:
            self.set_result(None)
        else:
            self.set_exception(error)
