"""A fault-injecting store for tests and chaos: fail the Nth operation or a
fraction of them, add latency, corrupt or truncate bytes on write or read.

Every decision is a pure function of (seed, operation index), so a run with the
same seed and the same sequence of operations fails at exactly the same places.
Array I/O that tensorstore does through `kvstore_spec()` bypasses this wrapper;
corrupt chunks on purpose with `corrupt_object()` instead.
"""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from relight.storage.base import Store
from relight.storage.errors import InjectedFaultError
from relight.storage.url import StorageLocation

__all__ = ["DEFAULT_OPS", "FaultLog", "FaultPlan", "FaultyStore", "OPERATIONS", "corrupt_object"]

OPERATIONS = ("put", "get", "size", "exists", "list", "delete", "sync")
DEFAULT_OPS = OPERATIONS[:-1]
"""What a plan counts unless it names `ops`: "sync" (the flush of a deferred batch,
`Store.deferred`) is opt-in, so indices and fractions of older plans keep their meaning;
a failed sync is never retried, so a plan meant to be survived by retries leaves it out."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What to break. Operation indices count from 0 over the operations in `ops`."""

    seed: int = 0
    fail_at: frozenset[int] = frozenset()
    """Indices of operations that raise `InjectedFaultError` (before touching storage)."""
    fail_fraction: float = 0.0
    """Probability that any other matching operation fails."""
    fail_times: int = 1
    """How many consecutive tries of a failing operation fail (retries then succeed);
    a large value makes the failure outlast the retry budget."""
    ops: tuple[str, ...] = DEFAULT_OPS
    """Operations the plan counts and may break (any of `OPERATIONS`)."""
    key_contains: str = ""
    """Only operations on keys containing this substring count (empty: all)."""
    latency_s: float = 0.0
    """Sleep added before every matching operation."""
    corrupt_writes: float = 0.0
    """Probability that a put stores the data with one bit flipped."""
    truncate_writes: float = 0.0
    """Probability that a put stores only the first half of the data."""
    corrupt_reads: float = 0.0
    """Probability that a get returns the data with one bit flipped."""

    def __post_init__(self) -> None:
        for name in ("fail_fraction", "corrupt_writes", "truncate_writes", "corrupt_reads"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"FaultPlan.{name} must be in [0, 1], got {value}")
        unknown = set(self.ops) - set(OPERATIONS)
        if unknown:
            raise ValueError(f"FaultPlan.ops has unknown operations {sorted(unknown)}")


@dataclass
class FaultLog:
    """What the wrapper did, for assertions: op index -> (operation, key, fault)."""

    events: list[tuple[int, str, str, str]] = field(default_factory=list)
    count: int = 0


class FaultyStore(Store):
    """Wraps any store; same URL, same counters, same tensorstore spec."""

    def __init__(self, inner: Store, plan: FaultPlan, log: FaultLog | None = None) -> None:
        super().__init__(inner.location, inner.retry, inner.stats)
        self.inner = inner
        self.plan = plan
        self.log = log or FaultLog()
        self._lock = threading.Lock()
        self._failing: dict[tuple[str, str], tuple[int, int]] = {}

    # Decisions -------------------------------------------------------------------------

    def _draw(self, index: int, salt: str) -> float:
        digest = hashlib.blake2b(f"{self.plan.seed}:{index}:{salt}".encode(), digest_size=8)
        return int.from_bytes(digest.digest(), "little") / 2**64

    def _enter(self, op: str, path: str) -> int | None:
        """Count the operation; raise if the plan says it fails. Returns its index."""
        plan = self.plan
        if op not in plan.ops or (plan.key_contains and plan.key_contains not in path):
            return None
        if plan.latency_s:
            time.sleep(plan.latency_s)
        with self._lock:
            # Retries of a failing operation keep its index, so `fail_times` is exact.
            pending = self._failing.get((op, path))
            if pending is not None:
                index, left = pending
                if left > 1:
                    self._failing[(op, path)] = (index, left - 1)
                else:
                    del self._failing[(op, path)]
                self.log.events.append((index, op, path, "error-repeat"))
                raise InjectedFaultError(f"injected fault on {op} {path} (repeat)", url=path)
            index = self.log.count
            self.log.count += 1
            fails = index in plan.fail_at or (
                plan.fail_fraction and self._draw(index, "fail") < plan.fail_fraction
            )
            if fails:
                if plan.fail_times > 1:
                    self._failing[(op, path)] = (index, plan.fail_times - 1)
                self.log.events.append((index, op, path, "error"))
                raise InjectedFaultError(f"injected fault #{index} on {op} {path}", url=path)
        return index

    def _flip(self, data: bytes, index: int) -> bytes:
        if not data:
            return data
        pos = int(self._draw(index, "pos") * len(data)) % len(data)
        return data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :]

    # Primitives: delegate to the inner store's primitives (its retries stay ours) ----

    def _root_path(self) -> str:
        return self.inner._root_path()

    def _with_location(self, location: StorageLocation) -> Store:
        child = FaultyStore(self.inner._with_location(location), self.plan, self.log)
        child.retry = self.retry  # a retry policy set on the wrapper holds for its children
        return child

    def _faulted_put(self, path: str, data: bytes) -> bytes:
        """Count a put; raise, or return the bytes to store (maybe damaged)."""
        index = self._enter("put", path)
        if index is not None:
            if self.plan.truncate_writes and self._draw(index, "trunc") < self.plan.truncate_writes:
                self.log.events.append((index, "put", path, "truncated"))
                data = data[: len(data) // 2]
            elif self.plan.corrupt_writes and self._draw(index, "flip") < self.plan.corrupt_writes:
                self.log.events.append((index, "put", path, "corrupted"))
                data = self._flip(data, index)
        return data

    def _put(self, path: str, data: bytes) -> None:
        self.inner._put(path, self._faulted_put(path, data))

    def _put_unsynced(self, path: str, data: bytes) -> tuple[str, ...]:
        return self.inner._put_unsynced(path, self._faulted_put(path, data))

    def _sync_paths(self, paths: list[str]) -> None:
        # One operation for the whole flush; `key_contains` matches any path it covers.
        want = self.plan.key_contains
        self._enter("sync", next((p for p in paths if want in p), self._root_path()))
        self.inner._sync_paths(paths)

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        # Counted (and failed, delayed) as a put; never corrupted: it publishes markers.
        self._enter("put", path)
        return self.inner._put_if_absent(path, data)

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        index = self._enter("get", path)
        data = self.inner._get(path, start, end)
        if index is not None and self.plan.corrupt_reads:
            if self._draw(index, "rflip") < self.plan.corrupt_reads:
                self.log.events.append((index, "get", path, "corrupted"))
                data = self._flip(data, index)
        return data

    def _size(self, path: str) -> int:
        self._enter("size", path)
        return self.inner._size(path)

    def _exists(self, path: str) -> bool:
        self._enter("exists", path)
        return self.inner._exists(path)

    def _list(self, path: str) -> list[str]:
        self._enter("list", path)
        return self.inner._list(path)

    def _delete(self, path: str) -> None:
        self._enter("delete", path)
        self.inner._delete(path)

    def _drop_cached(self, path: str) -> None:  # a hint, never faulted
        self.inner._drop_cached(path)

    def sync(self) -> None:
        self.inner.sync()  # a wrapped deferred view keeps its batch

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        return self.inner.kvstore_spec(sub)

    def ts_context(self) -> Any:
        return self.inner.ts_context()


def corrupt_object(store: Store, key: str, mode: str = "flip", seed: int = 0) -> None:
    """Damage one stored object in place: `flip` one bit, `truncate` to half, or `empty`."""
    data = store.get(key)
    if mode == "flip":
        pos = (seed * 2654435761) % max(len(data), 1)
        data = data[:pos] + bytes([data[pos] ^ 0x01]) + data[pos + 1 :] if data else data
    elif mode == "truncate":
        data = data[: len(data) // 2]
    elif mode == "empty":
        data = b""
    else:
        raise ValueError(f"corrupt_object mode must be flip, truncate or empty, got {mode!r}")
    store.put(key, data)


