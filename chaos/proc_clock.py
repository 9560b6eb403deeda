"""When a process started, on the wall clock, exact to one scheduler tick.

The harness decides whether a worker is one of the group restarted after a fault by
comparing the worker's start with the fault's time. psutil's `create_time()` cannot
serve: it adds the process's start ticks to the boot time from /proc/stat, which the
kernel gives in whole seconds, so every start reads up to a second early (0.38 s and
0.45 s on two machines). A worker restarted faster than that error (a warm start
restarts a user's worker in 0.2-0.35 s) looked older than the fault that caused its
restart, the recovery was never seen, and every later fault that waits for it never
fired. Here the boot time comes from the clock the start ticks count on
(`CLOCK_BOOTTIME`), read beside the wall clock at the moment of the conversion.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import psutil

__all__ = ["CLOCK_TICK_S", "boot_time", "start_time", "started_after"]

CLOCK_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
"""The unit of /proc's start times (10 ms on Linux): a start time read from it is up to
one tick early (the kernel truncates), never late."""


def boot_time() -> float:
    """Unix time of the boot, to the microsecond: the wall clock minus the time since
    boot, both read now (so a wall-clock step since the boot is accounted for)."""
    return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)


def start_time(pid: int) -> float:
    """Unix time process `pid` started, at most one tick (`CLOCK_TICK_S`) early. Raises
    ProcessLookupError when there is no such process. Off Linux (no /proc), psutil's
    reading, with its error."""
    if not sys.platform.startswith("linux"):
        try:
            return psutil.Process(pid).create_time()
        except psutil.NoSuchProcess as exc:
            raise ProcessLookupError(pid) from exc
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise ProcessLookupError(pid) from exc
    # Field 22, starttime; the command name (field 2) may hold spaces and parentheses,
    # so count from the last ')'.
    ticks = int(stat.rsplit(")", 1)[1].split()[19])
    return boot_time() + ticks * CLOCK_TICK_S


def started_after(started_at: float, t: float) -> bool:
    """Whether a process whose `start_time` reads `started_at` may have started at or
    after unix time `t`: the reading is up to one tick early, so one tick of slack, and
    no more (a process started before `t` reads before it)."""
    return started_at + CLOCK_TICK_S >= t
