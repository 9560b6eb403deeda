"""The layout of a checkpoint root: where each step lives, how the manager records steps,
and which steps count as committed.

    step-000000000100/          one checkpoint (see ckpt.format), committed by its COMMIT
    step-000000000100/data/...  its data objects (`ckpt.format.DATA_PREFIX`)
    steps/000000000100.json     the manager's record of a step (written just before COMMIT)
    steps/000000000100.pending  written when a save starts; removed after commit

A step counts as committed only when its record exists *and* its COMMIT marker does (the
record is written first, so every rank that sees COMMIT finds it); GC deletes COMMIT
first, so a half-deleted step is never loaded. The records let the newest committed step
be found with one small listing instead of listing every chunk.

Everything that reads or writes these names goes through this module: the manager, the
`relight ckpt` CLI, the tiers (`ckpt.tiered`, `ckpt.peer`), the chaos probe and the
agent's metrics.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from relight.ckpt.format import COMMIT_KEY, DATA_PREFIX
from relight.storage import StorageError, Store

__all__ = ["RECORDS", "StepRecord", "commit_key", "committed_steps", "is_committed",
           "is_newest_committed", "list_records", "newest_committed_step", "parse_record_key",
           "pending_key", "recorded_steps", "record_key", "step_dir", "step_of_data_key",
           "step_of_dir"]

RECORDS = "steps/"
"""The prefix of the manager's step records."""
_STEP_DIR = re.compile(r"^step-(\d+)$")
_DATA_KEY = re.compile(r"^step-(\d+)/" + re.escape(DATA_PREFIX))


def step_dir(step: int) -> str:
    """The prefix (below the root) of `step`'s checkpoint."""
    return f"step-{step:012d}"


def step_of_dir(name: str) -> int | None:
    """The step of a step prefix (`step_dir(step)`), or None for any other name."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def step_of_data_key(key: str) -> int | None:
    """The step of a checkpoint data object's key (relative to the root), or None for
    every other key (manifests, markers, records, indexes)."""
    m = _DATA_KEY.match(key)
    return int(m.group(1)) if m else None


def commit_key(step: int) -> str:
    """The key of `step`'s COMMIT marker."""
    return f"{step_dir(step)}/{COMMIT_KEY}"


def record_key(step: int) -> str:
    """The key of `step`'s commit record."""
    return f"{RECORDS}{step:012d}.json"


def pending_key(step: int) -> str:
    """The key of the note that `step`'s save has started (holds the start's unix time)."""
    return f"{RECORDS}{step:012d}.pending"


def parse_record_key(key: str) -> tuple[int, str] | None:
    """(step, "json" or "pending") of a key listed under `RECORDS`; None for anything else."""
    stem, _, ext = key[len(RECORDS):].partition(".")
    if not key.startswith(RECORDS) or not stem.isdigit() or ext not in ("json", "pending"):
        return None
    return int(stem), ext


@dataclass
class StepRecord:
    step: int
    committed: bool
    created: float
    record: bool = False
    """A commit record exists (its COMMIT may still be missing after a crash)."""


def is_committed(store: Store, step: int) -> bool:
    """Whether `step`'s COMMIT marker exists (one existence check)."""
    return store.exists(commit_key(step))


def list_records(store: Store) -> dict[int, StepRecord]:
    """Steps the manager knows about: committed records win over pending ones."""
    out: dict[int, StepRecord] = {}
    for key in store.list(RECORDS):
        parsed = parse_record_key(key)
        if parsed is None:
            continue
        step, ext = parsed
        if ext == "json":
            created = 0.0
            try:
                created = float(json.loads(store.get(key)).get("created_unix", 0.0))
            except (StorageError, ValueError, AttributeError):
                pass
            out[step] = StepRecord(step, is_committed(store, step), created, record=True)
        elif step not in out:
            created = 0.0
            try:
                created = float(store.get(key).decode() or 0.0)
            except (StorageError, ValueError):
                pass
            out.setdefault(step, StepRecord(step, False, created))
    return out


def recorded_steps(store: Store) -> list[int]:
    """Steps with a commit record, newest first (one listing; COMMIT not checked)."""
    steps = []
    for key in store.list(RECORDS):
        parsed = parse_record_key(key)
        if parsed is not None and parsed[1] == "json":
            steps.append(parsed[0])
    return sorted(steps, reverse=True)


def committed_steps(store: Store) -> list[int]:
    """Steps whose record and COMMIT marker both exist (ascending): one listing, then the
    markers' existence checks side by side (each is a round trip to object storage, and a
    restart waits for them)."""
    recorded = recorded_steps(store)
    if len(recorded) <= 1:
        return [s for s in recorded if is_committed(store, s)]
    with ThreadPoolExecutor(min(8, len(recorded)), thread_name_prefix="relight-ls") as pool:
        found = list(pool.map(lambda s: is_committed(store, s), recorded))
    return sorted(s for s, ok in zip(recorded, found, strict=True) if ok)


def newest_committed_step(store: Store) -> int | None:
    """The newest committed step, checking markers from the newest record down: one
    listing and, normally, one existence check."""
    return next((s for s in recorded_steps(store) if is_committed(store, s)), None)


def is_newest_committed(store: Store, step: int) -> bool:
    """Whether `step` is committed and no newer recorded step is: its marker check and the
    listing of the records side by side (independent round trips), then the markers of
    the newer records, if any. No object bytes are read."""
    with ThreadPoolExecutor(1, thread_name_prefix="relight-tier-check") as pool:
        own = pool.submit(is_committed, store, step)
        newer = [s for s in recorded_steps(store) if s > step]
        return own.result() and not any(is_committed(store, s) for s in newer)
