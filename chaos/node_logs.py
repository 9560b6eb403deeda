"""What the nodes' logs say about a run that went wrong: the last error a training
process raised, and whether an agent left because the job's rendezvous was closed.

A node's log is its agent's stdout and stderr, which its workers share: a script that
fails before its first step leaves its traceback there and nothing in the metrics. The
report names that error instead of only "reached step 0".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from relight.chaos.logs import StepRecord

__all__ = ["came_after_finish", "closed_rendezvous", "last_error", "last_errors",
           "with_last_errors"]

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


def came_after_finish(codes: dict[int, int | None], workers_seen: dict[int, set[int]],
                      log_of: Callable[[int], str]) -> set[int]:
    """Nodes that came after the job had finished: another node exited 0, and this one
    started no worker and left because the job's rendezvous was closed (a replacement
    whose agent started late, on a loaded machine, after the survivors reached the
    target). Such a node did nothing wrong and nothing of the job's; its exit status 1
    is no evidence against the run."""
    if not any(c == 0 for c in codes.values()):
        return set()
    return {i for i, c in codes.items()
            if c != 0 and not workers_seen.get(i) and closed_rendezvous(log_of(i))}


def with_last_errors(detail: str, records: list[StepRecord], logs: list[Path]) -> str:
    """`detail` of a run that did not finish, with the last errors its node logs show:
    a script that failed before its first step left nothing in the metrics, and the
    reason is only there."""
    errors = last_errors(logs)
    if not errors:
        return detail
    what = ("the training script failed before its first step" if not records
            else "last error in the node logs")
    return f"{detail}; {what}: {'; '.join(errors)}"
