"""What the nodes' logs say about a run that went wrong: the last error a training
process raised, and whether an agent left because the job's rendezvous was closed.

A node's log is its agent's stdout and stderr, which its workers share: a script that
fails before its first step leaves its traceback there and nothing in the metrics. The
report names that error instead of only "reached step 0".
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["closed_rendezvous", "last_error", "last_errors"]

TRACEBACK = "Traceback (most recent call last):"
LAUNCHER_ERRORS = ("ChildFailedError", "SignalException")
"""Exceptions the launcher raises about its workers (a summary, not the cause)."""
CLOSED = "RendezvousClosedError"


def _exception_lines(lines: Sequence[str]) -> Iterable[str]:
    """The exception line ending each traceback in `lines`: the first line after
    `Traceback (most recent call last):` that is not indented (the frames are)."""
    inside = False
    for line in lines:
        if TRACEBACK in line:
            inside = True
            continue
        if inside and line.strip() and not line[:1].isspace():
            inside = False
            yield line.strip()


def last_error(text: str) -> str | None:
    """The last exception a traceback in `text` ended with (`ModuleNotFoundError: No
    module named 'x'`), skipping the launcher's summaries of its workers' failures."""
    found = [line for line in _exception_lines(text.splitlines())
             if not any(name in line.split(":", 1)[0] for name in LAUNCHER_ERRORS)]
    return found[-1] if found else None


def last_errors(logs: Iterable[Path], limit: int = 2) -> list[str]:
    """The distinct last errors of the node logs `logs` (`<error> (<log name>)`), at most
    `limit`; a log that cannot be read has none."""
    out: list[str] = []
    seen: set[str] = set()
    for path in logs:
        try:
            err = last_error(path.read_text(errors="replace"))
        except OSError:
            continue
        if err is not None and err not in seen:
            seen.add(err)
            out.append(f"{err} ({path.name})")
    return out[:limit]


def closed_rendezvous(text: str) -> bool:
    """Whether an agent's log shows it left because the job's rendezvous was closed
    (the job had finished, or was stopped, before the agent could join)."""
    return CLOSED in text
