"""`TieredStore`: the persistent store, with reads of the newest committed checkpoint's
data objects served from the node-local tier or a peer when they may be.

Writes go to the persistent store (the source of truth) first; once a put of a data object
(`ckpt.root_layout.step_of_data_key`) has returned, it is queued for the local tier
(`ckpt.local_tier`: write-behind copy, budget, eviction, and the rules a copy must pass to
be read) and its peers (`ckpt.peer`). Listing, markers, records, manifests and indexes are
always the persistent store's.

A read of a data object tries the tiers in `RESTORE_ORDER`, and the first that serves it
wins:

1. `local`: this node's own copy;
2. `peer`: first the replicas this node holds for the others (its server's directory,
   `REPLICA_DIR`: after a node's death the survivors read its objects there, without a
   request), then the other nodes' servers (`attach_peers`), each answer checked for URL,
   key, crc32c and newest-committed step;
3. `persistent`: the persistent store.

(Above all three, a replica group that heals receives a live group's memory and reads no
checkpoint at all: `elastic.heal`.) `open_checkpoint_root` (`ckpt.tiers`) builds this
store for a run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from typing import Any

from relight.ckpt import peer
from relight.ckpt.local_tier import LocalTier, TierStats
from relight.ckpt.root_layout import step_of_data_key
from relight.storage.base import ForwardedPrimitives, Store

__all__ = ["RESTORE_ORDER", "TieredStore"]

RESTORE_ORDER = ("local", "peer", "persistent")
"""The tiers a read of a checkpoint data object tries, in order (`TierStats.served`)."""


class TieredStore(ForwardedPrimitives, Store):
    """The persistent store, with reads of the newest committed checkpoint's data objects
    served from a node-local copy (or a peer's) when it matches (see the module docstring).

    Every call but `get` of a data object goes to the persistent store; `stats` is the
    persistent store's (so tensorstore bytes the engine records land there too) and
    `tier_stats` counts what each tier served. Make one per process; children share it.
    """

    def __init__(self, persistent: Store, local_dir: str, budget_bytes: int, *,
                 writer: int = 0, _tier: LocalTier | None = None, _prefix: str = "") -> None:
        super().__init__(persistent.location, persistent.retry, persistent.stats)
        if budget_bytes < 0:
            raise ValueError(f"local tier budget must be >= 0 bytes, got {budget_bytes}")
        self.persistent = persistent
        self._wrapped = persistent
        self._tier = _tier or LocalTier(persistent, local_dir, budget_bytes, writer)
        self._prefix = _prefix

    @property
    def tier_stats(self) -> TierStats:
        return self._tier.stats

    @property
    def local_dir(self) -> str:
        return self._tier.local_dir

    def flush(self) -> None:
        """Wait until the write-behind copies queued so far are in the local tier."""
        self._tier.flush()

    def attach_peers(self, push_to: list[str], fetch_from: list[str],
                     token: str | None = None) -> None:
        """Copy data objects to the peer servers `push_to` too, and ask `fetch_from` for
        objects the local tier lacks (`ip:port` of `ckpt.peer.PeerServer`s, which
        answer only requests carrying their `token` when they have one)."""
        self._tier.push_to = list(push_to)
        self._tier.fetch_from = list(fetch_from)
        self._tier.peer_token = token

    def drop_local(self) -> None:
        """Delete this node's local tier (the job is over). Every rank of the node calls it
        after the others have flushed (a barrier), so no copy lands after the delete."""
        self._tier.flush()
        shutil.rmtree(self._tier.local_dir, ignore_errors=True)
        with contextlib.suppress(OSError):  # the job's directory, once its last node is gone
            os.rmdir(os.path.dirname(self._tier.local_dir))
        self._tier.held.clear()

    # -- the Store surface -------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        payload = bytes(data) if not isinstance(data, bytes) else data
        self.persistent.put(key, payload)
        rel = self._prefix + key
        step = step_of_data_key(rel)
        if step is not None and self._tier.budget > 0:
            self._tier.enqueue(rel, step, payload)

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        return self.persistent.put_if_absent(key, data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        rel = self._prefix + key
        if step_of_data_key(rel) is None:
            return self.persistent.get(key, start, end)
        got = self._read_tiers(rel, start, end)
        if got is not None and (end is None or len(got[1]) == end - (start or 0)):
            self._tier.stats.serve(got[0], len(got[1]))
            return got[1]
        if got is not None:
            self._tier.stats.miss("short_range")
        data = self.persistent.get(key, start, end)
        self._tier.stats.serve("persistent", len(data))
        return data

    def _read_tiers(self, rel_key: str, start: int | None, end: int | None
                    ) -> tuple[str, bytes] | None:
        """(tier, bytes [start, end)) from the first tier of `RESTORE_ORDER` before the
        persistent store that may serve `rel_key`; None (counted) when none may."""
        tier = self._tier
        data = tier.read_local(rel_key, start, end)
        if data is not None:
            return "local", data
        data = tier.read_copy(tier.replicas, rel_key, start, end, count_misses=False)
        if data is not None:
            return "peer", data
        if not tier.fetch_from:
            return None
        step = step_of_data_key(rel_key)
        if step is None or not tier.is_newest_committed(step):
            return None
        url = tier.persistent.url_of(rel_key)
        for addr in tier.fetch_from:
            rep = peer.fetch(addr, rel_key, tier.peer_token)
            if rep is None or rep["url"] != url:
                continue
            whole = rep["data"]
            return "peer", whole if start is None and end is None else whole[start or 0: end]
        tier.stats.miss("peer_absent")
        return None

    def size(self, key: str) -> int:
        return self.persistent.size(key)

    def exists(self, key: str) -> bool:
        return self.persistent.exists(key)

    def list(self, prefix: str = "") -> list[str]:
        return self.persistent.list(prefix)

    def delete(self, key: str) -> None:
        self.persistent.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.persistent.delete_prefix(prefix)

    def deferred(self) -> Store:
        """The same tiered view over the persistent store's deferred view: puts still
        queue their tier copies (served only once the step commits, see above)."""
        return TieredStore(self.persistent.deferred(), self._tier.local_dir, self._tier.budget,
                           _tier=self._tier, _prefix=self._prefix)

    def sync(self) -> None:
        self.persistent.sync()

    def child(self, sub: str) -> Store:
        sub = sub.strip("/")
        if not sub:
            return self
        return TieredStore(self.persistent.child(sub), self._tier.local_dir, self._tier.budget,
                           _tier=self._tier, _prefix=f"{self._prefix}{sub}/")

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        return self.persistent.kvstore_spec(sub)

    def ts_context(self) -> Any:
        return self.persistent.ts_context()

    # Every other primitive is the persistent store's (ForwardedPrimitives), for anything
    # that calls one directly; the public methods above never reach them.

    def _with_location(self, location: Any) -> Store:
        return self.persistent._with_location(location)
