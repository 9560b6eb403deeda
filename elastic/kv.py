"""What the quorum protocol needs of its coordinator: an etcd v3 key space.

`QuorumClient` (and through it `ReplicaManager`) runs its rules against any object with
these calls. Two implement it: `EtcdClient` (a real etcd cluster, what jobs use) and
`MemoryEtcd`'s client (`elastic.memory_kv`: the same semantics in one process, for unit
tests of the rules in milliseconds and for simulating thousands of groups without a
network). The semantics are etcd's: one revision counter for the whole key space, a
write moves it by one (a transaction by one however many keys it writes), keys bound to
leases vanish when the lease expires or is revoked, and a watch from revision `r`
delivers every change after `r`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from relight.elastic.etcd_client import (
    Compare,
    EtcdSettings,
    KeyValue,
    OpDelete,
    OpPut,
    OpRange,
    TxnResult,
)

__all__ = ["KeyValueClient"]


@runtime_checkable
class KeyValueClient(Protocol):
    """The etcd v3 calls the quorum protocol makes (see `EtcdClient` for each one's
    contract; errors are the `EtcdError` family)."""

    settings: EtcdSettings
    """`prefix` roots the job's keys; `timeout` bounds each call."""

    def sibling(self, *, timeout: float,
                attempt_timeout: float | None = None) -> KeyValueClient: ...

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str, *,
                   keys_only: bool = False) -> tuple[list[KeyValue], int]: ...

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> int: ...

    def txn(self, compare: Sequence[Compare],
            success: Sequence[OpPut | OpDelete | OpRange] = (),
            failure: Sequence[OpPut | OpDelete | OpRange] = ()) -> TxnResult: ...

    def cas(self, key: str, mod_revision: int, value: bytes | str, *,
            lease: int = 0) -> bool: ...

    def lease_grant(self, ttl: int) -> int: ...

    def lease_keepalive(self, lease_id: int) -> int: ...

    def lease_revoke(self, lease_id: int) -> None: ...

    def wait_for_change(self, prefix: str, after_revision: int | None, timeout: float,
                        until: Callable[[KeyValue | None], bool] | None = None, *,
                        then: Callable[[], int | None] | None = None,
                        idle_s: float | None = None) -> bool: ...

    def wait_for_event(self, key: str, after_revision: int, timeout: float,
                       until: Callable[[KeyValue | None], bool],
                       ) -> tuple[bool, KeyValue | None]: ...

    def close(self) -> None: ...
