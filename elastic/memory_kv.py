"""An etcd v3 key space in one process, with etcd's semantics.

`MemoryEtcd` is what the quorum protocol's unit tests run the same rules against in
milliseconds (`QuorumClient(MemoryEtcd().client(), ...)`, `ReplicaManager(...,
kv=...)`), and what a simulation of thousands of replica groups uses when it wants
the protocol's own cost without a network. It is not a server: every caller must live in
the same process. The semantics that the protocol relies on are etcd's:

- one revision for the whole key space, starting at 1; a put, a delete that removed
  something, a transaction whose branch wrote, and a lease expiry or revoke that removed
  keys each move it by one;
- each key carries `create_revision`, `mod_revision`, `version` and its lease; a
  comparison against an absent key sees zeros (and a value comparison fails);
- a key bound to a lease is deleted when the lease is revoked or not kept alive for its
  TTL; a put naming a lease that is gone fails with `EtcdLeaseLostError`;
- a watch from revision `r` sees every change after `r`; history older than the last
  `history` changes is compacted, and a watch from before it returns at once (the
  caller re-reads), as a watch on a compacted revision is cancelled by etcd.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from relight.elastic.etcd_client import (
    Compare,
    EtcdLeaseLostError,
    EtcdSettings,
    EtcdUnavailableError,
    KeyValue,
    OpDelete,
    OpPut,
    OpRange,
    TxnResult,
)

__all__ = ["MemoryEtcd", "MemoryEtcdClient"]


@dataclass(slots=True)
class _Lease:
    ttl: int
    deadline: float
    keys: set[str]


class MemoryEtcd:
    """The key space, its leases and its change history; `client()` opens a client."""

    def __init__(self, *, history: int = 100_000) -> None:
        self._cond = threading.Condition()
        self._kvs: dict[str, KeyValue] = {}
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x1000)
        self.revision = 1
        self._history = history
        self._event_revs: list[int] = []
        self._events: list[tuple[str, KeyValue | None]] = []
        self._compacted = 0
        """Changes up to this revision are gone from the history."""
        self._down = False
        self.requests: Counter[str] = Counter()
        """Calls served, by kind (`range`, `put`, `txn`, `lease_keepalive`, `watch`, ...)."""

    def client(self, prefix: str = "/relight", timeout: float = 10.0) -> MemoryEtcdClient:
        return MemoryEtcdClient(self, EtcdSettings(prefix=prefix, timeout=timeout))

    # -- faults -------------------------------------------------------------------------

    def stop(self) -> None:
        """Every call fails with `EtcdUnavailableError` until `start()` (leases keep
        their deadlines: a restarted etcd renews what it still holds)."""
        with self._cond:
            self._down = True
            self._cond.notify_all()

    def start(self) -> None:
        with self._cond:
            self._down = False
            now = time.monotonic()
            for lease in self._leases.values():
                lease.deadline = max(lease.deadline, now + lease.ttl)

    # -- under the lock -----------------------------------------------------------------

    def _enter(self, kind: str) -> None:
        if self._down:
            raise EtcdUnavailableError(f"in-memory etcd is stopped ({kind})")
        self.requests[kind] += 1
        self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in gone:
            self._drop_lease(lid)

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id)
        keys = sorted(k for k in lease.keys if k in self._kvs)
        if keys:
            self.revision += 1
            for k in keys:
                self._delete(k)

    def _record(self, key: str, kv: KeyValue | None) -> None:
        self._event_revs.append(self.revision)
        self._events.append((key, kv))
        if len(self._events) > 2 * self._history:
            del self._event_revs[:-self._history]
            del self._events[:-self._history]
            self._compacted = self._event_revs[0] - 1
        self._cond.notify_all()

    def _put(self, key: str, value: bytes, lease: int) -> None:
        if lease and lease not in self._leases:
            raise EtcdLeaseLostError(f"put {key}: lease not found (in-memory etcd)")
        old = self._kvs.get(key)
        if old is not None and old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        kv = KeyValue(key, value, old.create_revision if old else self.revision,
                      self.revision, old.version + 1 if old else 1, lease)
        self._kvs[key] = kv
        if lease:
            self._leases[lease].keys.add(key)
        self._record(key, kv)

    def _delete(self, key: str) -> None:
        old = self._kvs.pop(key)
        if old.lease and old.lease in self._leases:
            self._leases[old.lease].keys.discard(key)
        self._record(key, None)

    def _range(self, prefix: str) -> list[KeyValue]:
        return sorted((kv for k, kv in self._kvs.items() if k.startswith(prefix)),
                      key=lambda kv: kv.key)

    def _holds(self, c: Compare) -> bool:
        kv = self._kvs.get(c.key)
        if c.target == "value":
            if kv is None:
                return False
            want = c.value if isinstance(c.value, bytes) else str(c.value).encode()
            have: int | bytes = kv.value
        else:
            want = int(c.value)
            have = 0 if kv is None else {"mod": kv.mod_revision, "create": kv.create_revision,
                                         "version": kv.version, "lease": kv.lease}[c.target]
        if c.op == "==":
            return have == want
        if c.op == "!=":
            return have != want
        return have < want if c.op == "<" else have > want  # type: ignore[operator]

    def _changed_since(self, after: int, match: Callable[[str], bool]
                       ) -> tuple[bool, list[tuple[str, KeyValue | None]]]:
        """`(compacted, changes)`: the changes after revision `after` whose key matches."""
        if after < self._compacted:
            return True, []
        i = bisect.bisect_right(self._event_revs, after)
        return False, [e for e in self._events[i:] if match(e[0])]

    def _wait(self, deadline: float) -> None:
        now = time.monotonic()
        wake = min([deadline] + [lease.deadline for lease in self._leases.values()])
        self._cond.wait(max(0.0, wake - now) + 0.001)
        self._expire(time.monotonic())


class MemoryEtcdClient:
    """A client of a `MemoryEtcd` (the calls of `elastic.kv.KeyValueClient`)."""

    def __init__(self, server: MemoryEtcd, settings: EtcdSettings) -> None:
        self.server = server
        self.settings = settings

    def sibling(self, *, timeout: float,
                attempt_timeout: float | None = None) -> MemoryEtcdClient:
        return MemoryEtcdClient(self.server, dataclasses.replace(self.settings,
                                                                 timeout=timeout))

    @property
    def endpoint(self) -> str:
        return "memory://"

    def get(self, key: str) -> KeyValue | None:
        s = self.server
        with s._cond:
            s._enter("range")
            return s._kvs.get(key)

    def read(self, key: str) -> tuple[KeyValue | None, int]:
        s = self.server
        with s._cond:
            s._enter("range")
            return s._kvs.get(key), s.revision

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        s = self.server
        with s._cond:
            s._enter("range")
            kvs = s._range(prefix)
            if keys_only:
                kvs = [dataclasses.replace(kv, value=b"") for kv in kvs]
            return kvs, s.revision

    def revision(self) -> int:
        s = self.server
        with s._cond:
            s._enter("range")
            return s.revision

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> int:
        s = self.server
        with s._cond:
            s._enter("put")
            if lease and lease not in s._leases:
                raise EtcdLeaseLostError(f"put {key}: lease not found (in-memory etcd)")
            s.revision += 1
            s._put(key, value.encode() if isinstance(value, str) else value, lease)
            return s.revision

    def delete(self, key: str) -> int:
        s = self.server
        with s._cond:
            s._enter("delete")
            if key not in s._kvs:
                return 0
            s.revision += 1
            s._delete(key)
            return 1

    def delete_prefix(self, prefix: str) -> int:
        s = self.server
        with s._cond:
            s._enter("delete")
            keys = [kv.key for kv in s._range(prefix)]
            if keys:
                s.revision += 1
                for k in keys:
                    s._delete(k)
            return len(keys)

    def txn(self, compare: Sequence[Compare],
            success: Sequence[OpPut | OpDelete | OpRange] = (),
            failure: Sequence[OpPut | OpDelete | OpRange] = ()) -> TxnResult:
        s = self.server
        with s._cond:
            s._enter("txn")
            ok = all(s._holds(c) for c in compare)
            ops = success if ok else failure
            for op in ops:
                if isinstance(op, OpPut) and op.lease and op.lease not in s._leases:
                    raise EtcdLeaseLostError(f"txn put {op.key}: lease not found "
                                             "(in-memory etcd)")
            writes = any(isinstance(op, OpPut) or (isinstance(op, OpDelete) and (
                s._range(op.key) if op.prefix else op.key in s._kvs)) for op in ops)
            if writes:
                s.revision += 1
            ranges: list[tuple[KeyValue, ...]] = []
            for op in ops:
                if isinstance(op, OpPut):
                    value = op.value.encode() if isinstance(op.value, str) else op.value
                    s._put(op.key, value, op.lease)
                elif isinstance(op, OpDelete):
                    for k in ([kv.key for kv in s._range(op.key)] if op.prefix
                              else [op.key] if op.key in s._kvs else []):
                        s._delete(k)
                else:
                    ranges.append(tuple(s._range(op.prefix)))
            return TxnResult(ok, s.revision, tuple(ranges))

    def cas(self, key: str, mod_revision: int, value: bytes | str, *, lease: int = 0) -> bool:
        return self.txn([Compare(key, "mod", "==", mod_revision)],
                        [OpPut(key, value, lease)]).succeeded

    def lease_grant(self, ttl: int) -> int:
        s = self.server
        with s._cond:
            s._enter("lease_grant")
            lid = next(s._lease_ids)
            s._leases[lid] = _Lease(int(ttl), time.monotonic() + ttl, set())
            return lid

    def lease_keepalive(self, lease_id: int) -> int:
        s = self.server
        with s._cond:
            s._enter("lease_keepalive")
            lease = s._leases.get(lease_id)
            if lease is None:
                raise EtcdLeaseLostError(f"lease {lease_id:x} expired or was revoked "
                                         "(in-memory etcd): the keys it held are gone")
            lease.deadline = time.monotonic() + lease.ttl
            return lease.ttl

    def lease_revoke(self, lease_id: int) -> None:
        s = self.server
        with s._cond:
            s._enter("lease_revoke")
            if lease_id in s._leases:
                s._drop_lease(lease_id)

    def expire_lease(self, lease_id: int) -> None:
        """Let the lease lapse now, as a TTL running out does (a test's fault)."""
        s = self.server
        with s._cond:
            if lease_id in s._leases:
                s._drop_lease(lease_id)

    def wait_for_change(self, prefix: str, after_revision: int | None, timeout: float,
                        until: Callable[[KeyValue | None], bool] | None = None, *,
                        then: Callable[[], int | None] | None = None,
                        idle_s: float | None = None) -> bool:
        return self._watch(lambda k: k.startswith(prefix), after_revision, timeout,
                           until or (lambda _kv: True), then, idle_s)[0]

    def wait_for_event(self, key: str, after_revision: int, timeout: float,
                       until: Callable[[KeyValue | None], bool],
                       ) -> tuple[bool, KeyValue | None]:
        return self._watch(lambda k: k == key, after_revision, timeout, until)

    def _watch(self, match: Callable[[str], bool], after: int | None, timeout: float,
               until: Callable[[KeyValue | None], bool],
               then: Callable[[], int | None] | None = None, idle_s: float | None = None,
               ) -> tuple[bool, KeyValue | None]:
        if timeout <= 0:
            return False, None
        s = self.server
        deadline = time.monotonic() + timeout
        with s._cond:
            s._enter("watch")
            if after is None:  # from now; `then` runs under the lock: nothing between
                after = s.revision
                if then is not None:
                    read_at = then()
                    if read_at is None:
                        return True, None
                    after = max(after, read_at)
            quiet_until = None if idle_s is None else time.monotonic() + idle_s
            while True:
                compacted, changes = s._changed_since(after, match)
                if compacted:
                    return True, None  # as a cancelled watch: the caller re-reads
                for _key, kv in changes:
                    if until(kv):
                        return True, kv
                if changes:
                    after = s.revision
                    if idle_s is not None:
                        quiet_until = time.monotonic() + idle_s
                if s._down:
                    return True, None  # a broken stream: the caller re-reads and errs
                end = deadline if quiet_until is None else min(deadline, quiet_until)
                if time.monotonic() >= end:
                    return False, None
                s._wait(end)

    def close(self) -> None:
        pass
