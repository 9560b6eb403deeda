"""`KeyFeed`: the keys under a prefix kept current by one long watch, against a real etcd
and the in-memory key space: a waiter sees the state at once, then every write with its
value; a delete is taken in by reading the prefix again; a feed outlives etcd's restart;
its watch is renewed without losing a write made meanwhile."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from relight.elastic.etcd_client import EtcdClient, EtcdSettings, OpDelete
from relight.elastic.key_feed import KeyFeed
from relight.elastic.kv import KeyValueClient
from relight.elastic.memory_kv import MemoryEtcd

pytestmark = [pytest.mark.etcd]

_WAIT_S = 30.0
"""Bound on each wait for a write to reach the feed (milliseconds when the machine is
idle): only a feed that never delivers runs into it."""


@pytest.fixture(params=["etcd", "memory"])
def kv(request) -> KeyValueClient:
    if request.param == "memory":
        return MemoryEtcd().client(prefix="/feed-test")
    server = request.getfixturevalue("etcd_server")
    return EtcdClient(EtcdSettings(endpoints=(server.endpoint,), prefix="/feed-test"))


def _value(key: str):  # noqa: ANN202 - a pick for `KeyFeed.wait`
    return lambda keys: keys[key].value if key in keys else None


def test_feed_shows_the_state_then_every_write(kv) -> None:
    root = f"/feed-test/{uuid.uuid4().hex[:8]}/"
    kv.put(root + "a", "1")
    feed = KeyFeed(kv, root, renew_s=30.0, name="feed-test").start()
    try:
        assert feed.wait(_value(root + "a"), _WAIT_S) == b"1"
        got: list[bytes | None] = []
        waiter = threading.Thread(target=lambda: got.append(feed.wait(
            lambda keys: keys[root + "b"].value if root + "b" in keys else None, _WAIT_S)))
        waiter.start()
        time.sleep(0.05)
        rev = kv.put(root + "b", "2")
        waiter.join(_WAIT_S + 5)
        assert got == [b"2"]
        assert feed.revision >= rev
        # A pick that never holds returns None at its timeout.
        assert feed.wait(_value(root + "never"), 0.05) is None
        # A delete names no key in its event: the feed reads the prefix again.
        kv.txn([], [OpDelete(root + "a")])
        assert feed.wait(lambda keys: True if root + "a" not in keys else None, _WAIT_S)
        assert feed.wait(_value(root + "b"), _WAIT_S) == b"2"
    finally:
        feed.stop()
    assert feed.wait(_value(root + "missing"), _WAIT_S) is None  # stopped: at once
    assert not feed.running


def test_feed_renews_its_watch_without_losing_a_write(kv) -> None:
    """A renewal resumes from the newest revision the feed saw: a write landing while no
    stream is open still arrives."""
    root = f"/feed-test/{uuid.uuid4().hex[:8]}/"
    feed = KeyFeed(kv, root, renew_s=0.2, name="feed-test").start()
    try:
        for i in range(5):
            kv.put(root + "k", str(i))
            assert feed.wait(lambda keys, i=i: True if root + "k" in keys
                             and keys[root + "k"].value == str(i).encode() else None,
                             _WAIT_S)
            time.sleep(0.15)  # across a renewal, now and then
        assert feed.requests >= 3  # the first read, then renewals of the watch
    finally:
        feed.stop()


def test_feed_reads_again_after_etcd_restarts(etcd_restartable) -> None:
    """A broken stream (etcd gone) is followed by reads of the prefix, backed off, until
    etcd answers again; writes made after it came back arrive."""
    kv = EtcdClient(EtcdSettings(endpoints=(etcd_restartable.endpoint,), prefix="/feed-test",
                                 timeout=5.0))
    root = "/feed-test/restart/"
    kv.put(root + "k", "before")
    feed = KeyFeed(kv, root, renew_s=30.0, name="feed-test").start()
    try:
        assert feed.wait(_value(root + "k"), _WAIT_S) == b"before"
        etcd_restartable.restart()
        kv.put(root + "k", "after")
        assert feed.wait(lambda keys: True if keys.get(root + "k") is not None
                         and keys[root + "k"].value == b"after" else None, 60.0)
    finally:
        feed.stop()

