"""Storage faults inside training processes, handed over through the environment: a
testing hook (`storage.testing` is where tests and the chaos harness import it from).

The chaos runner cannot reach into a training process, so the process opens its store
through `wrap_store_from_env(store)`, which honours one environment variable:

- `RELIGHT_FAULT_PLAN='{"fail_fraction": 0.2, "seed": 3}'` - a `storage.testing.FaultPlan` as JSON,
  fixed for the life of the process;
- `RELIGHT_FAULT_PLAN='@/run/dir/fault-plan.json'` - a file holding such JSON, re-read when
  it changes (checked at most every `RELOAD_S`); a missing or empty file means no faults.
  The runner rewrites the file to start and stop a fault at any moment of the run.

Unset, the store is returned unchanged: no cost outside chaos runs. `open_store` applies
this to every store it opens when the variable is set (the opt-in), so a training process
needs no code of its own for it.
The JSON is parsed with `json` and checked field by field: nothing is evaluated.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from relight.errors import RelightError
from relight.storage.base import Store
from relight.storage.faulty import OPERATIONS, FaultLog, FaultPlan, FaultyStore
from relight.storage.url import StorageLocation

logger = logging.getLogger(__name__)

__all__ = [
    "FAULT_PLAN_ENV",
    "FaultPlanError",
    "ReloadingFaultyStore",
    "plan_from_json",
    "plan_to_json",
    "wrap_store_from_env",
    "write_plan_file",
]

FAULT_PLAN_ENV = "RELIGHT_FAULT_PLAN"
"""The variable that opts a process into storage faults (a fault plan, or ``@file``)."""
RELOAD_S = 0.2

_FIELDS: dict[str, type | tuple[type, ...]] = {
    "seed": int,
    "fail_at": list,
    "fail_fraction": (int, float),
    "fail_times": int,
    "ops": list,
    "key_contains": str,
    "latency_s": (int, float),
    "corrupt_writes": (int, float),
    "truncate_writes": (int, float),
    "corrupt_reads": (int, float),
}


class FaultPlanError(RelightError, ValueError):
    """The fault plan JSON is malformed; the message names the field."""


def plan_from_json(text: str, where: str = FAULT_PLAN_ENV) -> FaultPlan:
    """Parse and check a fault plan. Unknown fields and wrong types raise `FaultPlanError`."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise FaultPlanError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise FaultPlanError(f"{where}: must be a JSON object of FaultPlan fields")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        want = _FIELDS.get(key)
        if want is None:
            raise FaultPlanError(f"{where}: unknown field {key!r}; known: {sorted(_FIELDS)}")
        if not isinstance(value, want) or isinstance(value, bool):
            raise FaultPlanError(f"{where}: field {key!r} has the wrong type ({value!r})")
        if key == "fail_at":
            if not all(isinstance(i, int) for i in value):
                raise FaultPlanError(f"{where}: fail_at must be a list of integers")
            value = frozenset(value)
        elif key == "ops":
            bad = [op for op in value if op not in OPERATIONS]
            if bad:
                raise FaultPlanError(f"{where}: unknown ops {bad}; known: {list(OPERATIONS)}")
            value = tuple(value)
        kwargs[key] = value
    try:
        return FaultPlan(**kwargs)
    except ValueError as exc:
        raise FaultPlanError(f"{where}: {exc}") from None


def plan_to_json(plan: Mapping[str, Any]) -> str:
    """JSON for a plan given as a dict of FaultPlan fields (checked by parsing it back)."""
    text = json.dumps(dict(plan), sort_keys=True)
    plan_from_json(text, "plan_to_json")
    return text


def write_plan_file(path: str | os.PathLike[str], plan: Mapping[str, Any] | None) -> None:
    """Atomically replace the plan file: `None` clears it (no faults)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(plan_to_json(plan) if plan else "")
    os.replace(tmp, path)


class ReloadingFaultyStore(FaultyStore):
    """A `FaultyStore` whose plan is re-read from a file whenever the file changes."""

    def __init__(self, inner: Store, plan_path: Path, log: FaultLog | None = None) -> None:
        super().__init__(inner, FaultPlan(), log)
        self.plan_path = plan_path
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0
        self._reload_lock = threading.Lock()
        self._reload(force=True)

    def _reload(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RELOAD_S:
            return
        with self._reload_lock:
            self._checked = now
            try:
                st = self.plan_path.stat()
                stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            if stamp == self._stamp and not force:
                return
            self._stamp = stamp
            text = self.plan_path.read_text() if stamp and stamp[1] else ""
            plan = plan_from_json(text, str(self.plan_path)) if text.strip() else FaultPlan()
            if plan != self.plan:
                logger.warning("fault plan for %s is now %s", self.inner.url, plan)
            self.plan = plan

    def _enter(self, op: str, path: str) -> int | None:
        self._reload()
        return super()._enter(op, path)

    def _with_location(self, location: StorageLocation) -> Store:
        child = ReloadingFaultyStore(self.inner._with_location(location), self.plan_path,
                                     self.log)
        child.retry = self.retry
        return child


def wrap_store_from_env(store: Store, environ: Mapping[str, str] | None = None) -> Store:
    """`store`, wrapped in a fault-injecting store when `RELIGHT_FAULT_PLAN` is set."""
    env = os.environ if environ is None else environ
    value = env.get(FAULT_PLAN_ENV, "").strip()
    if not value:
        return store
    if value.startswith("@"):
        return ReloadingFaultyStore(store, Path(value[1:]))
    return FaultyStore(store, plan_from_json(value))
