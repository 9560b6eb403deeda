"""The keys under one etcd prefix, kept current in memory by one long watch.

A replica group waits on the same few keys at every membership change (the `quorum`
document, the deciders' and the host's reports): a read of them and a new watch per wait
cost each of a thousand groups two requests per wait, and a watch started from a revision
already past is delivered only at etcd's next catch-up round. `KeyFeed` holds one watch
open instead (renewed every `renew_s`, resumed from the newest revision it saw) and wakes
waiters as events arrive; a broken stream or a deleted key makes it read the prefix
again, once a new watch from that moment is in place. What it shows is never ahead of
etcd and may lag it by the stream's delay: callers wait on it for a change, and fence
what they write with a compare in etcd, as ever.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

from relight.elastic.etcd_client import KeyValue
from relight.elastic.kv import KeyValueClient

logger = logging.getLogger(__name__)

__all__ = ["KeyFeed"]

T = TypeVar("T")

_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 2.0
"""Back-off between reads of the prefix while etcd does not answer."""


class KeyFeed:
    """Every key under `prefix` (key -> `KeyValue`), current as of the newest event seen.

    `wait(pick, timeout)` returns the first non-None `pick(keys)`, checked on the keys as
    they are now and again whenever they change (changes that arrive together are seen
    together: a waiter sees the newest state, not every state in between). Start with
    `start()`; `stop()` ends the thread (its open request ends within `renew_s`)."""

    def __init__(self, client: KeyValueClient, prefix: str, *, renew_s: float,
                 name: str) -> None:
        self.prefix = prefix
        self.renew_s = renew_s
        self._client = client.sibling(timeout=renew_s + 5.0)
        self._name = name
        self._cond = threading.Condition()
        self._keys: dict[str, KeyValue] = {}
        self._synced = False
        self._revision = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0
        """Reads and watches this feed made (background: on no caller's path)."""

    @property
    def revision(self) -> int:
        """The newest revision the feed's keys are known current at."""
        with self._cond:
            return self._revision

    def start(self) -> KeyFeed:
        self._thread = threading.Thread(target=self._run, daemon=True, name=self._name)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    def wait(self, pick: Callable[[Mapping[str, KeyValue]], T | None],
             timeout: float) -> T | None:
        """The first non-None `pick(keys)`, checked now and at every change, or None once
        `timeout` passed (or the feed stopped). `pick` runs under the feed's lock: keep it
        cheap, and do not keep the mapping."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._synced:
                    got = pick(self._keys)
                    if got is not None:
                        return got
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stop.is_set():
                    return None
                self._cond.wait(remaining)

    def _run(self) -> None:
        retry_s = _RETRY_FIRST_S
        resync = True
        while not self._stop.is_set():
            self.requests += 1
            try:
                # True: a broken stream, or a delete (its event names no key): read the
                # prefix again. A (re)read runs once a watch from now is in place, so a
                # change made while reading comes at once, not at etcd's next catch-up
                # round; a renewal resumes from the newest revision seen.
                broke = self._client.wait_for_change(
                    self.prefix, None if resync else self._revision, self.renew_s,
                    until=self._apply, then=self._read if resync else None)
                resync = broke or not self._synced
            except Exception as exc:  # noqa: BLE001 - waiters time out and read themselves
                logger.debug("%s: read of %s failed (%s); again in %.2fs", self._name,
                             self.prefix, exc, retry_s)
                self._stop.wait(retry_s)
                retry_s = min(2 * retry_s, _RETRY_MAX_S)
                resync = True
                continue
            retry_s = _RETRY_FIRST_S
        try:
            self._client.close()
        except Exception:  # noqa: BLE001 - closing a connection of a stopped feed
            pass

    def _read(self) -> int:
        """Read every key under the prefix into the feed; the revision read at."""
        self.requests += 1
        kvs, revision = self._client.get_prefix(self.prefix)
        with self._cond:
            self._keys = {kv.key: kv for kv in kvs}
            self._revision = revision
            self._synced = True
            self._cond.notify_all()
        return revision

    def _apply(self, kv: KeyValue | None) -> bool:
        if kv is None:
            return True
        with self._cond:
            self._keys[kv.key] = kv
            self._revision = max(self._revision, kv.mod_revision)
            self._cond.notify_all()
        return self._stop.is_set()
