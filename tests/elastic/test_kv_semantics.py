"""The etcd v3 semantics the quorum protocol relies on, checked on a real etcd and on
`MemoryEtcd` alike: the in-memory key space is only a stand-in while it answers every
case here as etcd does."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from relight.elastic.etcd_client import (
    Compare,
    EtcdClient,
    EtcdLeaseLostError,
    EtcdSettings,
    EtcdUnavailableError,
    OpDelete,
    OpPut,
    OpRange,
)
from relight.elastic.kv import KeyValueClient
from relight.elastic.memory_kv import MemoryEtcd

pytestmark = [pytest.mark.etcd]


@pytest.fixture(params=["etcd", "memory"])
def kv(request) -> KeyValueClient:
    if request.param == "memory":
        return MemoryEtcd().client(prefix="/kv-test")
    endpoint = request.getfixturevalue("etcd_server").endpoint
    return EtcdClient(EtcdSettings(endpoints=(endpoint,), prefix="/kv-test"))


@pytest.fixture
def root() -> str:
    return f"/kv-test/{uuid.uuid4().hex[:8]}/"


def test_both_backends_speak_the_protocol(kv: KeyValueClient) -> None:
    assert isinstance(kv, KeyValueClient)


def test_a_write_moves_the_revision_by_one_and_a_key_counts_its_versions(
        kv: KeyValueClient, root: str) -> None:
    r1 = kv.put(root + "a", "1")
    r2 = kv.put(root + "a", "2")
    assert r2 == r1 + 1
    got = kv.get(root + "a")
    assert got is not None and got.value == b"2"
    assert (got.create_revision, got.mod_revision, got.version) == (r1, r2, 2)
    # A transaction writing two keys moves the revision once.
    res = kv.txn([], [OpPut(root + "b", "x"), OpPut(root + "c", "y")])
    assert res.succeeded and res.revision == r2 + 1
    kvs, rev = kv.get_prefix(root)
    assert [k.key for k in kvs] == [root + "a", root + "b", root + "c"] and rev == r2 + 1


def test_compares_see_an_absent_key_as_zeros_and_pick_the_branch(
        kv: KeyValueClient, root: str) -> None:
    absent = root + "nothing"
    assert kv.txn([Compare(absent, "mod", "==", 0), Compare(absent, "version", "==", 0)]
                  ).succeeded
    assert not kv.txn([Compare(absent, "value", "==", b"")]).succeeded
    rev = kv.put(root + "k", "v")
    assert kv.cas(root + "k", rev, "w")
    assert not kv.cas(root + "k", rev, "stale")  # fenced: its mod revision moved
    res = kv.txn([Compare(root + "k", "value", "==", "w")],
                 [OpDelete(root + "k"), OpRange(root)], [OpPut(root + "lost", "1")])
    assert res.succeeded and res.ranges == ((),)  # the range sees the delete before it
    assert kv.get(root + "lost") is None and kv.get(root + "k") is None
    res = kv.txn([Compare(root + "k", "version", ">", 0)], [], [OpPut(root + "f", "1")])
    assert not res.succeeded and kv.get(root + "f") is not None


def test_a_lease_takes_its_keys_with_it_and_a_put_on_it_then_fails(
        kv: KeyValueClient, root: str) -> None:
    lease = kv.lease_grant(30)
    kv.put(root + "held", "1", lease=lease)
    assert kv.lease_keepalive(lease) > 0
    _, rev = kv.get_prefix(root)
    kv.lease_revoke(lease)
    assert kv.get(root + "held") is None
    assert kv.wait_for_change(root, rev, 5.0), "the revoke's delete is a change"
    with pytest.raises(EtcdLeaseLostError):
        kv.put(root + "again", "1", lease=lease)
    with pytest.raises(EtcdLeaseLostError):
        kv.lease_keepalive(lease)


def test_a_lease_not_kept_alive_expires_and_wakes_a_watcher(
        kv: KeyValueClient, root: str) -> None:
    lease = kv.lease_grant(1)
    kv.put(root + "member", "1", lease=lease)
    _, rev = kv.get_prefix(root)
    t0 = time.monotonic()
    # etcd expires a lease within about a second of its TTL; 30 s bounds a loaded machine.
    assert kv.wait_for_change(root, rev, 30.0)
    assert time.monotonic() - t0 >= 0.5
    assert kv.get(root + "member") is None


def test_a_watch_returns_at_a_change_after_its_revision_and_not_before(
        kv: KeyValueClient, root: str) -> None:
    rev = kv.put(root + "x", "1")
    assert kv.wait_for_change(root, rev - 1, 5.0), "a change after rev - 1 exists already"
    assert not kv.wait_for_change(root, rev, 0.2), "nothing changed after rev"
    threading.Timer(0.2, lambda: kv.put(root + "y", "2")).start()
    assert kv.wait_for_change(root, rev, 10.0)
    # wait_for_event skips the changes its filter rejects, on one watch.
    threading.Timer(0.1, lambda: [kv.put(root + "z", str(i)) for i in range(3)]).start()
    hit, got = kv.wait_for_event(root + "z", rev + 1, 10.0,
                                 lambda kv_: kv_ is not None and kv_.value == b"2")
    assert hit and got is not None and got.value == b"2"


def test_a_watch_from_now_skips_what_its_read_saw(kv: KeyValueClient, root: str) -> None:
    """A watch from now runs `then` (the caller's read) once it is in place: a change
    made before that read is in it and skipped, one made after arrives at once."""
    seen: list[str] = []

    def then() -> int:
        kv.put(root + "a", "1")  # made while the caller reads: the read has it
        _, revision = kv.get_prefix(root)
        threading.Timer(0.05, lambda: kv.put(root + "b", "2")).start()
        return revision

    t0 = time.monotonic()
    assert kv.wait_for_change(root, None, 30.0, until=lambda e: seen.append(
        e.key if e is not None else "?") is None, then=then)
    assert seen == [root + "b"] and time.monotonic() - t0 < 25.0


def test_a_watch_with_an_idle_limit_ends_at_a_lull_not_while_changes_flow(
        kv: KeyValueClient, root: str) -> None:
    """Changes 0.1 s apart for 3 s keep a watch with a 2 s idle limit open (a margin of
    20 for a loaded machine's pauses); it ends at the lull after them, long before its
    timeout."""
    rev = kv.put(root + "start", "0")
    done = threading.Event()

    def writes() -> None:
        for i in range(30):
            kv.put(root + "w", str(i))
            time.sleep(0.1)
        done.set()

    seen: list[int] = []
    threading.Thread(target=writes, daemon=True).start()
    t0 = time.monotonic()
    assert not kv.wait_for_change(root, rev, 60.0,
                                  until=lambda e: seen.append(1) is None and False,
                                  idle_s=2.0)
    assert done.is_set() and len(seen) == 30 and time.monotonic() - t0 < 50.0


def test_a_stopped_memory_etcd_is_unavailable_until_started() -> None:
    server = MemoryEtcd()
    kv = server.client()
    lease = kv.lease_grant(5)
    server.stop()
    with pytest.raises(EtcdUnavailableError):
        kv.put("/relight/x", "1")
    server.start()
    assert kv.lease_keepalive(lease) == 5  # a restarted etcd renews what it holds
