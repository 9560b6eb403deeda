"""Exit statuses of a Relight worker, in one place: the agent and the chaos verifier
read them, and `relight train --help` lists them.

0 is done and 1 any other error (a fault: the agent restarts the group). The agent
(`elastic.agent.RelightAgent`) does not restart a group whose failed workers all exited
with one of `FATAL_EXIT_CODES`: the same config and the same stored state would fail the
same way again.
"""

from __future__ import annotations

import signal

__all__ = ["CONFIG_EXIT_CODE", "FATAL_EXIT_CODES", "HUNG_EXIT_CODE",
           "NO_LOADABLE_CHECKPOINT_EXIT_CODE", "PREEMPTED_EXIT_CODE", "WATCHDOG_EXIT_CODE"]

CONFIG_EXIT_CODE = 2
"""Bad config or layout (`ConfigError`, `LayoutError`)."""

NO_LOADABLE_CHECKPOINT_EXIT_CODE = 65
"""Committed checkpoints exist, storage answered, and every one is damaged or of an
unsupported version (`ckpt.NoLoadableCheckpointError`; EX_DATAERR)."""

WATCHDOG_EXIT_CODE = 75
"""The watchdog saw no step complete in time (EX_TEMPFAIL: try again)."""

PREEMPTED_EXIT_CODE = 76
"""Stopped on a preemption notice (whether or not the emergency checkpoint could be
written; the log says which)."""

HUNG_EXIT_CODE = 128 + signal.SIGTERM
"""A notice came but the step in flight never finished (what the default SIGTERM action
would have given a shell)."""

FATAL_EXIT_CODES = frozenset({CONFIG_EXIT_CODE, NO_LOADABLE_CHECKPOINT_EXIT_CODE})
"""Statuses no restart can fix."""
