"""`TieredStore`: the persistent store, fronted by a node-local copy of the newest checkpoint.

Writes go to the persistent store (the source of truth) first; once a put has returned,
the object is also copied, in a background thread (write-behind), to a local tier: a
directory in node memory (`/dev/shm/relight/<job>/<node>`), which survives a worker
restart but not a reboot. Only checkpoint data objects are copied (keys of the form
`step-<N>/data/...` below the manager's root, the layout of `ckpt.manager.step_dir` and
`ckpt.format.DATA_PREFIX`: the store derives the step of a key from it, the engine has no
hook for that). Listing, markers, records and manifests are always read from the
persistent store.

A read of a data object is served from the local tier only when all of these hold, and
falls back to the persistent store otherwise, counting why (`TierStats.misses`):

- the local object's metadata names the same persistent URL and key (keys carry the save
  attempt, so an object is never rewritten under the same key by another save);
- its size matches and the crc32c of the whole object, recorded when it was written, is
  right (checked on the first read of the object in this process; the engine's per-chunk
  crc32c is checked on every read on top of that);
- its step is the newest step committed in the persistent store (COMMIT marker and
  record), checked once per step and process with one listing and existence checks,
  no object bytes.

Peers (optional, `attach_peers`): the copy thread also pushes each object to the replica
servers of k other nodes (`storage.peer`), and a read the local tier cannot serve is
tried, before the persistent store, on the replicas this node holds for the others (its
server's directory, `REPLICA_DIR`: after a node's death the survivors read its objects
there, without a request), then on the other nodes' servers; always under the same
URL/key, crc32c and newest-committed checks (both counted as served by "peer").

Memory: the tier keeps the newest committed step plus the step being written; an older
step is dropped as soon as a newer one's COMMIT is seen (polled by the write-behind
thread while it holds two steps). `budget_bytes` bounds what this process copies; when
a new object does not fit, older steps are dropped first, then the object is skipped
(`TierStats.skipped_budget`), and reads of it go to the persistent store.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from storage import peer
from storage.base import ForwardedPrimitives, Store
from storage.checksum import crc32c
from storage.errors import ObjectNotFoundError, StorageError
from storage.fsspec_store import LocalStore
from storage.url import parse_url

logger = logging.getLogger(__name__)

__all__ = ["REPLICA_DIR", "TIER_NODE_ENV", "TierStats", "TieredStore", "local_tier_dir",
           "step_of_key", "tier_node"]

_DATA_KEY = re.compile(r"^step-(\d+)/data/")
"""`ckpt.manager.step_dir(step)` + "/" + `ckpt.format.DATA_PREFIX` (storage must not
import ckpt, so the layout is spelled out here; tests/tiers checks it against ckpt)."""
_META = ".meta"
REPLICA_DIR = "replicas"
"""Below a node's local tier: the replicas other nodes pushed to this node's peer server."""
_RECORDS = "steps/"
_COMMIT = "COMMIT"
POLL_S = 1.0
"""How often the write-behind thread, holding two steps, asks whether the newer one has
committed (one existence check on the persistent store)."""


def step_of_key(rel_key: str) -> int | None:
    """The step of a checkpoint data object key (relative to the manager's root), or None
    for every other key (manifests, markers, records, indexes)."""
    m = _DATA_KEY.match(rel_key)
    return int(m.group(1)) if m else None


def _step_dir(step: int) -> str:
    return f"step-{step:012d}"


TIER_NODE_ENV = "RELIGHT_LOCAL_TIER_NODE"
"""A node's name for the tiers when none is configured (one per simulated node when several
share a host, as in the chaos harness); unset: the host name."""


def tier_node(configured: str = "") -> str:
    """The node's name in the tier's directory and among peers."""
    return configured or os.environ.get(TIER_NODE_ENV) or socket.gethostname()


def local_tier_dir(base: str, persistent_url: str, node: str | None = None) -> str:
    """`base/<job>/<node>`: the job is named by a hash of the persistent root URL (two runs
    never share a tier), the node by `tier_node()` unless given."""
    job = hashlib.sha1(persistent_url.encode()).hexdigest()[:12]
    return os.path.join(base, job, node or tier_node())


@dataclass
class TierStats:
    """What the tiers served. Thread-safe; shared by a tiered store and its children."""

    served: dict[str, int] = field(default_factory=lambda: {"local": 0, "peer": 0,
                                                                  "persistent": 0})
    """Bytes of data objects served per tier."""
    misses: dict[str, int] = field(default_factory=dict)
    """Data object reads the local tier could not serve, by reason."""
    copied_bytes: int = 0
    skipped_budget: int = 0
    evicted_steps: int = 0
    copy_errors: int = 0
    peer_copied_bytes: int = 0
    peer_copy_errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def serve(self, tier: str, nbytes: int) -> None:
        with self._lock:
            self.served[tier] = self.served.get(tier, 0) + nbytes

    def miss(self, reason: str) -> None:
        with self._lock:
            self.misses[reason] = self.misses.get(reason, 0) + 1

    def add(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"served": dict(self.served), "misses": dict(self.misses),
                    "copied_bytes": self.copied_bytes, "skipped_budget": self.skipped_budget,
                    "evicted_steps": self.evicted_steps, "copy_errors": self.copy_errors,
                    "peer_copied_bytes": self.peer_copied_bytes,
                    "peer_copy_errors": self.peer_copy_errors}


class _Tier:
    """The state a tiered store shares with its children: the local directory, the
    write-behind queue and thread, what this process holds, the counters."""

    def __init__(self, persistent: Store, local_dir: str, budget_bytes: int, writer: int) -> None:
        self.persistent = persistent
        self.local = LocalStore(parse_url(local_dir), fsync=False)
        self.replicas = LocalStore(parse_url(os.path.join(local_dir, REPLICA_DIR)), fsync=False)
        """What this node holds for other nodes: when one of them dies, its objects are
        read here (no network), as the peer tier."""
        self.local_dir = local_dir
        self.budget = budget_bytes
        self.writer = writer
        self.stats = TierStats()
        self.held: dict[int, int] = self._scan()
        """step -> bytes this writer holds in the local tier."""
        self.newest_ok: dict[int, bool] = {}
        self.verified: set[tuple[str, str]] = set()
        self.queue: queue.Queue[tuple[str, int, bytes] | None] = queue.Queue()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.push_to: list[str] = []
        """Peer servers (`storage.peer`) this process copies its data objects to."""
        self.fetch_from: list[str] = []
        self.peer_token: str | None = None
        """Peer servers asked for an object the local tier lacks."""

    def _scan(self) -> dict[int, int]:
        held: dict[int, int] = {}
        try:
            keys = self.local.list(_META + "/")
        except StorageError:
            return held
        for k in keys:
            try:
                meta = json.loads(self.local.get(k))
            except (StorageError, ValueError):
                continue
            step = step_of_key(meta.get("key", ""))
            if step is not None and meta.get("writer") == self.writer:
                held[step] = held.get(step, 0) + int(meta.get("size", 0))
        return held

    # -- write-behind -----------------------------------------------------------------------

    def enqueue(self, rel_key: str, step: int, data: bytes) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="relight-tier-copy",
                                               daemon=True)
                self.thread.start()
        self.queue.put((rel_key, step, data))

    def flush(self) -> None:
        """Block until every copy queued so far is written (or skipped)."""
        self.queue.join()

    def _run(self) -> None:
        while True:
            try:
                item = self.queue.get(timeout=POLL_S)
            except queue.Empty:
                self._prune_if_committed()
                continue
            try:
                if item is None:
                    return
                self._copy(*item)
            except Exception as e:  # noqa: BLE001 - a failed copy only costs a tier miss
                self.stats.add("copy_errors")
                self.error = e
                logger.warning("local tier %s: copy of %s failed: %s", self.local_dir,
                               item[0] if item else "?", e)
            finally:
                self.queue.task_done()

    def _copy(self, rel_key: str, step: int, data: bytes) -> None:
        if step not in self.held:
            self._start_step(step)
        if sum(self.held.values()) + len(data) > self.budget:
            for old in sorted(s for s in self.held if s != step):
                self._evict(old)
                if sum(self.held.values()) + len(data) <= self.budget:
                    break
        if sum(self.held.values()) + len(data) > self.budget:
            self.stats.add("skipped_budget")
            return
        crc = crc32c(data)
        self.local.put(rel_key, data)
        self.local.put(f"{_META}/{rel_key}.json", json.dumps({
            "url": self.persistent.url_of(rel_key), "key": rel_key, "size": len(data),
            "crc32c": crc, "writer": self.writer}).encode())
        self.held[step] = self.held.get(step, 0) + len(data)
        self.stats.add("copied_bytes", len(data))
        for addr in self.push_to:
            try:
                peer.push(addr, rel_key, self.persistent.url_of(rel_key), data, crc,
                          self.peer_token)
                self.stats.add("peer_copied_bytes", len(data))
            except OSError as e:
                self.stats.add("peer_copy_errors")
                logger.warning("local tier %s: replica of %s to peer %s failed: %s",
                               self.local_dir, rel_key, addr, e)

    def _start_step(self, step: int) -> None:
        """A new step begins: keep only the newest committed older step."""
        self.held[step] = 0
        older = sorted((s for s in self.held if s < step), reverse=True)
        keep = next((s for s in older if self._committed(s)), None)
        for s in older:
            if s != keep:
                self._evict(s)
        for s in [s for s in self.held if s > step]:  # a rollback: newer steps are stale
            self._evict(s)

    def _prune_if_committed(self) -> None:
        if len(self.held) < 2:
            return
        newest = max(self.held)
        try:
            if not self._committed(newest):
                return
        except StorageError:
            return
        for s in [s for s in self.held if s != newest]:
            self._evict(s)

    def _committed(self, step: int) -> bool:
        return self.persistent.exists(f"{_step_dir(step)}/{_COMMIT}")

    def _evict(self, step: int) -> None:
        d = _step_dir(step)
        for path in (os.path.join(self.local_dir, d), os.path.join(self.local_dir, _META, d)):
            shutil.rmtree(path, ignore_errors=True)
        if self.held.pop(step, None) is not None:
            self.stats.add("evicted_steps")
        self.newest_ok.pop(step, None)
        logger.info("local tier %s: dropped step %d", self.local_dir, step)

    # -- reads ----------------------------------------------------------------------------

    def is_newest_committed(self, step: int) -> bool:
        """Whether `step` is the newest step committed in the persistent store (cached per
        step: a restore asks once; no object bytes are read)."""
        ok = self.newest_ok.get(step)
        if ok is None:
            # The marker check and the listing are independent round trips: side by side.
            with ThreadPoolExecutor(1, thread_name_prefix="relight-tier-check") as pool:
                own = pool.submit(self._committed, step)
                newer = set()
                for k in self.persistent.list(_RECORDS):
                    stem, _, ext = k[len(_RECORDS):].partition(".")
                    if ext == "json" and stem.isdigit() and int(stem) > step:
                        newer.add(int(stem))
                ok = own.result() and not any(self._committed(s) for s in newer)
            self.newest_ok[step] = ok
        return ok

    def read(self, rel_key: str, start: int | None, end: int | None
             ) -> tuple[str, bytes] | None:
        """(tier, bytes [start, end)) from the local tier, else from a peer; None (counted)
        when neither may be used."""
        data = self.read_local(rel_key, start, end)
        if data is not None:
            return "local", data
        data = self._read_copy(self.replicas, rel_key, start, end, count_misses=False)
        if data is not None:
            return "peer", data
        if not self.fetch_from:
            return None
        step = step_of_key(rel_key)
        if step is None or not self.is_newest_committed(step):
            return None
        url = self.persistent.url_of(rel_key)
        for addr in self.fetch_from:
            rep = peer.fetch(addr, rel_key, self.peer_token)
            if rep is None or rep["url"] != url:
                continue
            whole = rep["data"]
            return "peer", whole if start is None and end is None else whole[start or 0: end]
        self.stats.miss("peer_absent")
        return None

    def read_local(self, rel_key: str, start: int | None, end: int | None) -> bytes | None:
        """The local copy's bytes [start, end), or None (counted) when it may not be used."""
        return self._read_copy(self.local, rel_key, start, end, count_misses=True)

    def _read_copy(self, copies: LocalStore, rel_key: str, start: int | None, end: int | None,
                   *, count_misses: bool) -> bytes | None:
        """Bytes [start, end) of the copy of `rel_key` in `copies` (this node's own, or
        the replicas it holds for others), or None when it may not be used."""

        def miss(reason: str) -> None:
            if count_misses:
                self.stats.miss(reason)

        try:
            meta = json.loads(copies.get(f"{_META}/{rel_key}.json"))
        except ObjectNotFoundError:
            miss("absent")
            return None
        except (StorageError, ValueError):
            miss("bad_metadata")
            return None
        if meta.get("key") != rel_key or meta.get("url") != self.persistent.url_of(rel_key):
            miss("other_key")
            return None
        step = step_of_key(rel_key)
        if step is None or not self.is_newest_committed(step):
            miss("not_newest_committed")
            return None
        checked = (copies.url, rel_key)
        try:
            if checked not in self.verified:
                whole = copies.get(rel_key)
                if len(whole) != meta.get("size") or crc32c(whole) != meta.get(
                        "crc32c"):
                    self.stats.miss("checksum")
                    logger.warning("local tier %s: %s fails its crc32c; trying the next tier",
                                   copies.url, rel_key)
                    return None
                self.verified.add(checked)
                if start is None and end is None:
                    return whole
                return whole[start or 0: end]
            return copies.get(rel_key, start, end)
        except StorageError:
            miss("unreadable")
            return None


class TieredStore(ForwardedPrimitives, Store):
    """The persistent store, with reads of the newest committed checkpoint's data objects
    served from a node-local copy (or a peer's) when it matches (see the module docstring).

    Every call but `get` of a data object goes to the persistent store; `stats` is the
    persistent store's (so tensorstore bytes the engine records land there too) and
    `tier_stats` counts what each tier served. Make one per process; children share it.
    """

    def __init__(self, persistent: Store, local_dir: str, budget_bytes: int, *,
                 writer: int = 0, _tier: _Tier | None = None, _prefix: str = "") -> None:
        super().__init__(persistent.location, persistent.retry, persistent.stats)
        if budget_bytes < 0:
            raise ValueError(f"local tier budget must be >= 0 bytes, got {budget_bytes}")
        self.persistent = persistent
        self._wrapped = persistent
        self._tier = _tier or _Tier(persistent, local_dir, budget_bytes, writer)
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
        objects the local tier lacks (`ip:port` of `storage.peer.PeerServer`s, which
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
        step = step_of_key(rel)
        if step is not None and self._tier.budget > 0:
            self._tier.enqueue(rel, step, payload)

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        return self.persistent.put_if_absent(key, data)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        rel = self._prefix + key
        if step_of_key(rel) is None:
            return self.persistent.get(key, start, end)
        got = self._tier.read(rel, start, end)
        if got is not None and (end is None or len(got[1]) == end - (start or 0)):
            self._tier.stats.serve(got[0], len(got[1]))
            return got[1]
        if got is not None:
            self._tier.stats.miss("short_range")
        data = self.persistent.get(key, start, end)
        self._tier.stats.serve("persistent", len(data))
        return data

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
