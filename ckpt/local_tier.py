"""The node-local tier: a copy of this node's shards of the newest committed checkpoint in
node memory, written behind the persistent store's puts.

Once a put of a checkpoint data object (`ckpt.root_layout.step_of_data_key`) has
returned, `ckpt.tiered.TieredStore` queues the object here; a background thread
(write-behind) writes it, with a JSON sidecar (persistent URL, key, size, whole-object
crc32c, writer rank), to a directory in node memory (`/dev/shm/relight/<job>/<node>`),
which survives a worker restart but not a reboot, and pushes it to the replica servers
of k other nodes (`ckpt.peer`). Below that directory, `REPLICA_DIR` holds the replicas
other nodes pushed to this node's server.

A copy (this node's own, or a replica held for another node) is used for a read only
when all of these hold, and the reason is counted otherwise (`TierStats.misses`):

- its sidecar names the same persistent URL and key (keys carry the save attempt, so an
  object is never rewritten under the same key by another save);
- its size matches and the crc32c of the whole object, recorded when it was written, is
  right (checked on the first read of the object in this process; the engine's per-chunk
  crc32c is checked on every read on top of that);
- its step is the newest step committed in the persistent store
  (`ckpt.root_layout.is_newest_committed`), checked once per step and process with one
  listing and existence checks, no object bytes.

Memory: the tier keeps the newest committed step plus the step being written; an older
step is dropped as soon as a newer one's COMMIT is seen (polled by the write-behind
thread while it holds two steps). `budget_bytes` bounds what this process copies; when
a new object does not fit, older steps are dropped first, then the object is skipped
(`TierStats.skipped_budget`), and reads of it go to the persistent store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

from relight.ckpt import peer
from relight.ckpt.root_layout import is_committed, is_newest_committed, step_dir, step_of_data_key
from relight.storage.base import Store
from relight.storage.checksum import crc32c
from relight.storage.errors import ObjectNotFoundError, StorageError
from relight.storage.fsspec_store import LocalStore
from relight.storage.url import parse_url

logger = logging.getLogger(__name__)

__all__ = ["POLL_S", "REPLICA_DIR", "TIER_NODE_ENV", "LocalTier", "TierStats",
           "local_tier_dir", "tier_node"]

_META = ".meta"
REPLICA_DIR = "replicas"
"""Below a node's local tier: the replicas other nodes pushed to this node's peer server."""
POLL_S = 1.0
"""How often the write-behind thread, holding two steps, asks whether the newer one has
committed (one existence check on the persistent store)."""


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
    copied_bytes: int = 0
    """Bytes this process copied into the local tier."""
    skipped_budget: int = 0
    """Objects not copied because they did not fit the budget."""
    evicted_steps: int = 0
    """Steps dropped from the local tier."""
    copy_errors: int = 0
    """Copies into the local tier that failed (each costs a tier miss only)."""
    misses: dict[str, int] = field(default_factory=dict)
    """Data object reads the local tier could not serve, by reason."""
    peer_copied_bytes: int = 0
    """Bytes pushed to peers' replica servers."""
    peer_copy_errors: int = 0
    """Pushes to a peer that failed or were refused."""
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


class LocalTier:
    """The state a tiered store shares with its children: the local directory, the
    write-behind queue and thread, what this process holds, the peers it copies to and
    asks, the counters."""

    def __init__(self, persistent: Store, local_dir: str, budget_bytes: int, writer: int) -> None:
        self.persistent = persistent
        # Node memory (tmpfs): its pages are the copy, so no direct I/O around them.
        self.local = LocalStore(parse_url(local_dir), fsync=False, direct_io=False)
        self.replicas = LocalStore(parse_url(os.path.join(local_dir, REPLICA_DIR)), fsync=False,
                                   direct_io=False)
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
        """Peer servers (`ckpt.peer`) this process copies its data objects to."""
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
            step = step_of_data_key(meta.get("key", ""))
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
        keep = next((s for s in older if is_committed(self.persistent, s)), None)
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
            if not is_committed(self.persistent, newest):
                return
        except StorageError:
            return
        for s in [s for s in self.held if s != newest]:
            self._evict(s)

    def _evict(self, step: int) -> None:
        d = step_dir(step)
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
            ok = is_newest_committed(self.persistent, step)
            self.newest_ok[step] = ok
        return ok

    def read_local(self, rel_key: str, start: int | None, end: int | None) -> bytes | None:
        """The local copy's bytes [start, end), or None (counted) when it may not be used."""
        return self.read_copy(self.local, rel_key, start, end, count_misses=True)

    def read_copy(self, copies: LocalStore, rel_key: str, start: int | None, end: int | None,
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
        step = step_of_data_key(rel_key)
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


