"""Progress watchdog: a hang becomes a non-zero exit, which the supervisor turns into a restart.

A collective that waits on a dead peer can block far longer than a step should take. The
watchdog thread exits the whole process (``os._exit``: a blocked main thread cannot run
``sys.exit`` handlers) when no step completes within ``timeout_s``, after dumping every
thread's stack so the hang can be diagnosed.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

from relight.exit_codes import WATCHDOG_EXIT_CODE
from relight.rank_log import RankStepLogger

__all__ = ["WATCHDOG_EXIT_CODE", "Watchdog"]

log = logging.getLogger(__name__)



class Watchdog:
    """Call :meth:`start`, then :meth:`beat` after every completed step; :meth:`stop` at end."""

    def __init__(self, timeout_s: float, *, rank: int = 0, poll_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.rank = rank
        self.poll_s = poll_s if poll_s is not None else min(1.0, max(0.05, timeout_s / 10))
        self.step = 0
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relight-watchdog", daemon=True)

    def start(self) -> Watchdog:
        if self.timeout_s > 0:
            self._last = time.monotonic()
            self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.step = step
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            idle = time.monotonic() - self._last
            if idle > self.timeout_s:
                RankStepLogger(log, self.rank, self.step).error(
                    "watchdog: no step completed for %.1f s (limit %.1f s); "
                    "exiting with status %d so the job restarts",
                    idle, self.timeout_s, WATCHDOG_EXIT_CODE,
                )
                try:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                    sys.stderr.flush()
                finally:
                    os._exit(WATCHDOG_EXIT_CODE)
