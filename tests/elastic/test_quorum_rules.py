"""Rules of the quorum protocol, each against a real etcd and against the in-memory key space
with etcd's semantics (`MemoryEtcd`, the same rules in milliseconds): a group that
restarted and asks to heal never trains in the quorum it fell out of; groups that hold no
state never form a quorum on their own while a group that holds it lives; a member
replaced before everyone entered is dropped at once; a joiner that registered but does not
enter is kept out until it asks again; a newcomer heals only from a member that answers,
and joiners whose last source of the state is lost restore it from storage (the first of
them; the others heal from it) and are no longer named healing; a member whose process is
gone (its store refuses connections, or its agent restarted it) costs no failover grace
and no entry wait, while a silent one that lives is waited for.

A live group's store is a listening socket (`_live_store`): the protocol probes stores to
tell a dead group from a slow one."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import torch

from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from relight.elastic.kv import KeyValueClient
from relight.elastic.memory_kv import MemoryEtcd
from relight.elastic.quorum import Quorum, QuorumClient, QuorumError
from relight.elastic.replica import ReplicaManager, ReplicaSettings, ReplicaSettingsError

pytestmark = [pytest.mark.etcd]


class _Backend:
    """Where a test's groups agree: a real etcd (`endpoint`) or one `MemoryEtcd`."""

    def __init__(self, endpoint: str | None) -> None:
        self.endpoint = endpoint
        self.memory = MemoryEtcd() if endpoint is None else None

    def connect(self) -> KeyValueClient:
        if self.memory is not None:
            return self.memory.client(prefix="/relight-test")
        assert self.endpoint is not None
        return EtcdClient(EtcdSettings(endpoints=(self.endpoint,), prefix="/relight-test"))

    def etcd_settings(self) -> EtcdSettings:
        return EtcdSettings(endpoints=(self.endpoint or "127.0.0.1:1",), prefix="/relight-test")

    def manager(self, settings: ReplicaSettings, **kwargs) -> ReplicaManager:
        return ReplicaManager(settings, kv=self.connect(), **kwargs)


@pytest.fixture(params=["etcd", "memory"])
def kv(request) -> _Backend:
    if request.param == "memory":
        return _Backend(None)
    return _Backend(request.getfixturevalue("etcd_server").endpoint)


def _client(kv: _Backend, job: str, group: str, *,
            failover_grace_s: float = 0.5) -> QuorumClient:
    # A long lease: the test decides who is alive, not a lease expiry on a loaded machine.
    return QuorumClient(kv.connect(), job, group, lease_ttl=30.0, timeout=60.0,
                        failover_grace_s=failover_grace_s)


_LISTENERS: list[socket.socket] = []


@pytest.fixture(autouse=True, scope="module")
def _close_listeners():
    yield
    while _LISTENERS:
        _LISTENERS.pop().close()


def _live_store() -> tuple[str, int]:
    """The address of a store that takes connections: a group whose process lives."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    _LISTENERS.append(listener)
    return listener.getsockname()


def _run(fn, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t


def _two_groups(kv: _Backend) -> tuple[str, QuorumClient, QuorumClient, Quorum]:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    a, b = _client(kv, job, "a"), _client(kv, job, "b")
    a.join(_live_store(), ready=True)
    b.join(_live_store(), ready=True)
    got: list = []
    t = _run(lambda: b.agree(min_groups=2)[0], got)
    q0, _ = a.agree(min_groups=2)
    t.join(60)
    assert got == [q0] and q0.members == ("a", "b")
    return job, a, b, q0


def _restarted(kv: _Backend, job: str, b: QuorumClient) -> QuorumClient:
    """b's workers die and its agent starts new ones: the same group id registers again,
    this time asking to heal, while the quorum key still names it as a member."""
    b.leave()
    b2 = _client(kv, job, "b")
    b2.join(_live_store(), ready=False, heal=True)
    return b2


def test_a_restarted_group_heals_in_a_new_quorum_not_the_one_it_fell_out_of(
        kv) -> None:
    job, a, b, q0 = _two_groups(kv)
    b2 = _restarted(kv, job, b)
    q, _ = b2.agree()
    assert q.id > q0.id, "the restarted group took the quorum it fell out of"
    assert q.members == ("a", "b") and q.healing == ("b",) and q.host == "a"
    for c in (a, b2):
        c.leave()


def test_groups_without_the_state_wait_for_a_slow_holder(kv) -> None:
    job, a, b, q0 = _two_groups(kv)
    b2 = _restarted(kv, job, b)
    q1, _ = b2.agree()
    assert q1.healing == ("b",)
    # The heal of q1's first step fails: b votes fail at once and re-forms; a, which
    # holds the state, is slow (it has not voted yet), not dead.
    assert b2.vote(q1, 0, ok=False)
    got: list = []
    t = _run(lambda: b2.agree(failed=(q1, 0))[0], got)
    t.join(3.0)  # six failover graces
    assert t.is_alive() and not got, f"b formed {got} without the group holding the state"
    assert b2.snapshot().quorum.id == q1.id
    # a votes (its side failed too) and re-forms with everyone who voted.
    assert a.vote(q1, 0, ok=False)
    q2, _ = a.agree(failed=(q1, 0))
    t.join(60)
    assert got == [q2] and q2.members == ("a", "b") and q2.healing == ("b",)
    for c in (a, b2):
        c.leave()


def test_a_member_drops_a_quorum_replaced_before_everyone_entered(kv) -> None:
    job, a, b, q0 = _two_groups(kv)
    # b's group restarts and asks to heal: b2's agree proposes q1 (a, b healing).
    b2 = _restarted(kv, job, b)
    q1, _ = b2.agree()
    # A third group asks to heal before `a` read q1: at its step boundary `a` sees both
    # joiners and proposes q2 right after.
    c = _client(kv, job, "c")
    c.join(_live_store(), ready=False, heal=True)
    q2, _ = a.agree()
    assert q2.id == q1.id + 1 and q2.members == ("a", "b", "c")
    # b2 entered q1 and waits for a: the replacement shows at once, not after the timeout.
    assert b2.confirm(q1, timeout=30.0).replaced
    assert b2.agree()[0] == q2 and c.agree()[0] == q2
    # Everyone enters q2: each member's confirm returns once all three are in.
    got: list = []
    threads = [_run(lambda x=x: x.confirm(q2, timeout=30.0), got) for x in (b2, c)]
    assert a.confirm(q2, timeout=30.0).complete
    for t in threads:
        t.join(30)
    assert [e.complete for e in got] == [True, True]
    for x in (a, b2, c):
        x.leave()


def _commit_step(q: Quorum, step: int, *groups: QuorumClient) -> None:
    for g in groups:
        assert g.vote(q, step, ok=True)
    assert all(g.decide(q, step) for g in groups)


def test_a_joiner_that_does_not_enter_is_kept_out_until_it_asks_again(kv) -> None:
    job, a, b, q0 = _two_groups(kv)
    # c registers to heal, then does not come to its first step boundary (still
    # starting: its process lives).
    c = _client(kv, job, "c")
    c.join(_live_store(), ready=False, heal=True)
    q1, _ = a.agree()
    assert b.agree()[0] == q1 and q1.healing == ("c",)
    got: list = []
    t = _run(lambda: b.confirm(q1, timeout=1.0), got)
    entry = a.confirm(q1, timeout=1.0)
    t.join(30)
    assert entry.absent == ("c",) and got[0].absent == ("c",)
    # Both re-form without c, and its live key does not bring it back at the next step.
    q2, _ = a.agree(absent=(q1, entry.absent))
    assert b.agree(absent=(q1, got[0].absent))[0] == q2
    assert q2.members == ("a", "b") and [g for g, _ in q2.out] == ["c"]
    _commit_step(q2, 0, a, b)
    assert a.agree()[0] == q2 and b.agree()[0] == q2, "c's old request was taken again"
    # c comes to its boundary: it sees it was kept out and asks again ...
    before = c.snapshot().written["c"]
    joined: list = []
    tc = _run(lambda: c.agree()[0], joined)
    for _ in range(600):
        if c.snapshot().written["c"] > before:
            break
        threading.Event().wait(0.05)
    assert c.snapshot().written["c"] > before, "c did not ask again"
    # ... and the members take it in at the step boundary after the next commit.
    _commit_step(q2, 1, a, b)
    q3, _ = a.agree()
    tc.join(60)
    assert q3.members == ("a", "b", "c") and q3.healing == ("c",) and q3.out == ()
    assert joined == [q3] and b.agree()[0] == q3
    for x in (a, b, c):
        x.leave()


# -- the last group holding the state is lost while a newcomer joins ----------------------

def _settings(kv: _Backend, job: str, group: str) -> ReplicaSettings:
    return ReplicaSettings(job=job, group=group, etcd=kv.etcd_settings(),
                           lease_ttl=30.0, collective_timeout_s=5.0, quorum_timeout_s=30.0,
                           failover_grace_s=0.5, probe_timeout_s=2.0)


def _closed_address() -> tuple[str, int]:
    """An address nothing listens on: the store of a group killed under a live lease."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        host, port = s.getsockname()
    return host, port


def _alone(kv: _Backend, job: str, store: tuple[str, int]) -> tuple[QuorumClient, Quorum]:
    a = _client(kv, job, "a")
    a.join(store, ready=True)
    q0, _ = a.agree()
    assert q0.members == ("a",)
    return a, q0


class _Storage:
    """What the newcomer restores when no live group holds the state."""

    def __init__(self) -> None:
        self.weight = torch.zeros(4)
        self.restores = 0

    def state(self) -> dict:
        return {"w": self.weight}

    def restore(self) -> None:
        self.restores += 1
        self.weight.fill_(11.0)  # the newest committed checkpoint's value


def _start_step(mgr: ReplicaManager) -> tuple[threading.Thread, list]:
    out: list = []

    def run() -> None:
        try:
            out.append(mgr.start_step())
        except Exception as exc:  # the test asserts on it
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_newcomer_does_not_heal_from_a_member_killed_under_a_live_lease(
        kv) -> None:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    # a is the last group training; its process is killed: its key (lease) lives on,
    # its store answers nothing.
    a, q0 = _alone(kv, job, _closed_address())
    disk = _Storage()
    r = kv.manager(_settings(kv, job, "r"), state=disk.state, restore=disk.restore)
    try:
        assert not r.healing, "the newcomer chose to heal from a group that answers nothing"
        t, out = _start_step(r)
        a.leave()  # a's lease goes (revoked here: as it expires)
        t.join(30)
        assert out and not isinstance(out[0], Exception), f"the newcomer failed: {out}"
        q = out[0]
        assert q.members == ("r",) and q.healing == () and q.id > q0.id
        assert r.should_commit(0), "the newcomer's own quorum does not train"
        assert disk.restores == 0  # it restores at start, as a job with no live group
    finally:
        r.close()


def test_a_joiner_whose_last_source_is_lost_restores_from_storage_and_trains(
        kv) -> None:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        a, q0 = _alone(kv, job, listener.getsockname())
        disk = _Storage()
        r = kv.manager(_settings(kv, job, "r"), state=disk.state, restore=disk.restore)
    try:
        assert r.healing, "a live member answers: the newcomer heals from it"
        a.leave()  # ... and then the last holder is lost before the heal
        t, out = _start_step(r)
        t.join(30)
        assert out and not isinstance(out[0], Exception), f"the joiner failed: {out}"
        q = out[0]
        assert disk.restores == 1 and torch.equal(disk.weight, torch.full((4,), 11.0))
        assert q.members == ("r",) and q.healing == () and not r.healing
        assert r.should_commit(0)
        # The mark is gone: the next step stays in the same quorum, nothing to heal.
        assert r.start_step() == q and disk.restores == 1
    finally:
        r.close()


def test_a_group_that_restored_is_not_named_healing_again(kv) -> None:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    a, q0 = _alone(kv, job, _closed_address())
    r = _client(kv, job, "r")
    r.join(_live_store(), ready=False, heal=True)
    a.leave()
    q1, _ = r.agree()
    assert q1.members == ("r",) and q1.healing == ("r",)  # nobody to heal it: restore
    # Its process restarts, restores from storage and registers as holding the state.
    r.leave()
    r2 = _client(kv, job, "r")
    r2.join(_live_store(), ready=True)
    q2, _ = r2.agree()
    assert q2.id == q1.id + 1 and q2.members == ("r",) and q2.healing == (), (
        f"the restored group was still named healing: {q2}")
    r2.leave()


def test_joiners_without_a_source_heal_from_the_first_that_restored(kv) -> None:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    a, q0 = _alone(kv, job, _closed_address())
    r1, r2 = _client(kv, job, "r1"), _client(kv, job, "r2")
    r1.join(_live_store(), ready=False, heal=True)
    r2.join(_live_store(), ready=False, heal=True)
    a.leave()
    q1, _ = r1.agree()
    assert q1.members == ("r1", "r2") and q1.healthy == ()
    # r2 is not the first: it waits for r1 to restore instead of restoring too.
    got: list = []
    t = _run(lambda: r2.agree()[0], got)
    t.join(1.0)
    assert t.is_alive() and not got, f"r2 took {got} with nobody holding the state"
    r1.set_ready(True)  # r1 restored from storage
    q2, _ = r1.agree()
    t.join(30)
    assert q2.members == ("r1", "r2") and q2.healing == ("r2",) and q2.host == "r1"
    assert got == [q2]
    for x in (r1, r2):
        x.leave()


def test_a_joiner_whose_source_is_lost_after_taking_it_in_re_forms_alone(
        kv) -> None:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    a, q0 = _alone(kv, job, _closed_address())
    r = _client(kv, job, "r")
    r.join(_live_store(), ready=False, heal=True)
    q1, _ = a.agree()  # a takes r in at its step boundary ...
    assert q1.members == ("a", "r") and q1.healing == ("r",)
    a.leave()  # ... and is lost before the heal
    q2, _ = r.agree()
    assert q2.id == q1.id + 1 and q2.members == ("r",) and q2.healthy == (), (
        f"the joiner entered {q2}, whose only source of the state is gone")
    r.leave()


# -- a member whose process is gone is not waited for ---------------------------------------

def _three_groups(kv: _Backend, *, grace: float, c_store: tuple[str, int]
                  ) -> tuple[str, QuorumClient, QuorumClient, QuorumClient, Quorum]:
    job = f"rules-{uuid.uuid4().hex[:8]}"
    a, b, c = (_client(kv, job, g, failover_grace_s=grace) for g in "abc")
    a.join(_live_store(), ready=True)
    b.join(_live_store(), ready=True)
    c.join(c_store, ready=True)
    got: list = []
    threads = [_run(lambda x=x: x.agree(min_groups=3)[0], got) for x in (b, c)]
    q0, _ = a.agree(min_groups=3)
    for t in threads:
        t.join(60)
    assert got == [q0, q0] and q0.members == ("a", "b", "c")
    return job, a, b, c, q0


def _fail_step(q: Quorum, *voters: QuorumClient) -> None:
    for g in voters:
        assert g.vote(q, 0, ok=False)


def test_a_survivor_whose_vote_comes_late_and_names_an_earlier_step_heals(kv) -> None:
    """a and c applied step 0 and failed at step 1; b failed at step 0 and votes after a
    began deciding. a's proposal names b healing: it is judged on the votes a waited
    for, not on the read it began with."""
    _, a, b, c, q0 = _three_groups(kv, grace=600.0, c_store=_live_store())
    assert a.vote(q0, 1, ok=False) and c.vote(q0, 1, ok=False)
    first_read = threading.Event()
    read = a.snapshot

    def snapshot(**kw):
        snap = read(**kw)
        first_read.set()
        return snap

    a.snapshot = snapshot  # type: ignore[method-assign]
    got: list = []
    t = _run(lambda: a.agree(failed=(q0, 1))[0], got)
    assert first_read.wait(60)
    assert b.vote(q0, 0, ok=False)
    t.join(60)
    assert got and got[0].members == ("a", "b", "c"), got
    assert got[0].healing == ("b",), got


def test_a_joiner_that_registers_while_the_members_enter_is_seen_by_a_watch(kv) -> None:
    """j registers after the decider read every key to take c in and before the members
    entered the new quorum: the membership watch the decider starts after entering says
    so (it starts from the agreement's read, not from after the entries), so j is taken
    in at the next step boundary instead of waiting for an unrelated change."""
    job, (a, b), q0 = _followers(kv, 2)
    c = _client(kv, job, "c")
    c.join(_live_store(), ready=False, heal=True)
    j = _client(kv, job, "j")
    read = a.snapshot

    def snapshot(**kw):
        snap = read(**kw)
        if j._lease is None:
            j.join(_live_store(), ready=False, heal=True)
        return snap

    a.snapshot = snapshot  # type: ignore[method-assign]
    got: list = []
    t = _run(lambda: b.agree()[0], got)
    q1, _ = a.agree()
    t.join(60)
    assert q1.members == ("c", "g0", "g1") and got == [q1], (q1, got)
    assert not q1.entered  # the joiner did not vote: every member enters and is counted
    entered: list = []
    threads = [_run(lambda x=x: x.confirm(q1, timeout=30.0), entered) for x in (a, b, c)]
    for t in threads:
        t.join(60)
    assert [e.complete for e in entered] == [True] * 3
    for x in (a, b):
        x.watch_membership()
    try:
        assert a.membership_changed.wait(10) or b.membership_changed.is_set()
    finally:
        for x in (a, b, c, j):
            x.leave()


def test_survivors_skip_the_grace_for_a_member_whose_process_is_gone(kv) -> None:
    # c is killed during step 0: its key lives on under its lease, its store refuses.
    # The grace is longer than this test may run: a survivor that waited it fails here.
    _, a, b, c, q0 = _three_groups(kv, grace=600.0,
                                   c_store=_closed_address())
    _fail_step(q0, a, b)
    got: list = []
    threads = [_run(lambda x=x: x.agree(failed=(q0, 0))[0], got) for x in (a, b)]
    for t in threads:
        t.join(60)
    assert len(got) == 2, "a survivor waited the failover grace for a dead member's vote"
    assert got[0] == got[1] and got[0].members == ("a", "b") and got[0].id == q0.id + 1
    for x in (a, b, c):
        x.leave()


def test_survivors_wait_the_grace_for_a_silent_member_that_lives(kv) -> None:
    # c is alive (its store takes connections) but does not vote: frozen, or slow.
    _, a, b, c, q0 = _three_groups(kv, grace=1.0, c_store=_live_store())
    _fail_step(q0, a, b)
    t0 = time.monotonic()
    q1, _ = a.agree(failed=(q0, 0))
    waited = time.monotonic() - t0
    assert waited >= 1.0, f"a gave up on a live member after {waited:.2f}s, not the grace"
    assert q1.members == ("a", "b")
    for x in (a, b, c):
        x.leave()


def test_survivors_skip_the_grace_for_a_member_its_agent_restarted(kv) -> None:
    # c's workers die in step 0 and its agent starts new ones at once: the same group id
    # registers again, asking to heal. The old process never votes; the new one never
    # acts in q0.
    job, a, b, c, q0 = _three_groups(kv, grace=600.0,
                                     c_store=_live_store())
    _fail_step(q0, a, b)
    c.leave()
    c2 = _client(kv, job, "c")
    c2.join(_live_store(), ready=False, heal=True)
    got: list = []
    t = _run(lambda: a.agree(failed=(q0, 0))[0], got)
    t.join(60)
    assert got, "a survivor waited the failover grace for a restarted member's vote"
    assert "c" not in got[0].healthy
    for x in (a, b, c2):
        x.leave()


def _store_seen_by_a_probe() -> tuple[tuple[str, int], socket.socket, threading.Event]:
    """A live group's store that tells when a peer first probed it: the listener, and an
    event set at the first connection it takes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    probed = threading.Event()

    def accept() -> None:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.close()
        probed.set()

    threading.Thread(target=accept, daemon=True).start()
    return listener.getsockname(), listener, probed


def _a_waiting_out_the_grace(kv: _Backend):
    """Three groups in a quorum whose step 0 a and b voted failed; c, alive (its store
    takes connections), has not voted. a waits out a 600 s grace for c in a thread (its
    quorum goes to `got`); returned once a has probed c's store."""
    store, listener, probed = _store_seen_by_a_probe()
    _, a, b, c, q0 = _three_groups(kv, grace=600.0, c_store=store)
    _fail_step(q0, a, b)
    got: list = []
    t = _run(lambda: a.agree(failed=(q0, 0))[0], got)
    assert probed.wait(60), "the survivor never probed the silent member's store"
    return listener, a, b, c, q0, got, t


def test_survivors_stop_waiting_for_a_member_that_dies_during_the_grace(kv) -> None:
    # c's process exits while a waits: its key lives on under its lease, and no key
    # changes. The grace is longer than this test may run: only probing c again ends
    # the wait in time.
    listener, a, b, c, q0, got, t = _a_waiting_out_the_grace(kv)
    listener.close()  # c exits
    t.join(60)
    assert got, "a survivor waited out the grace for a member that died during it"
    assert got[0].members == ("a", "b") and got[0].id == q0.id + 1
    for x in (a, b, c):
        x.leave()


def test_survivors_take_the_quorum_another_survivor_formed_during_their_grace(
        kv) -> None:
    # c lives but does not vote. b has already given up on c (its grace was shorter, or
    # c's store refused it) and formed the next quorum: a, still in its grace, takes it
    # at once.
    _, a, b, c, q0, got, t = _a_waiting_out_the_grace(kv)
    b.failover_grace_s = 0.0
    q1, _ = b.agree(failed=(q0, 0))
    assert q1.members == ("a", "b")
    t.join(60)
    assert got == [q1], "a survivor waited out its grace after another formed a quorum"
    for x in (a, b, c):
        x.leave()


def _c_silent_after_the_reduction(kv: _Backend, c_store: tuple[str, int]):
    """Three groups in a quorum; a and b voted ok on step 0 and decide it in threads
    (their verdicts go to `got`); c has not voted."""
    _, a, b, c, q0 = _three_groups(kv, grace=600.0, c_store=c_store)
    assert a.vote(q0, 0, ok=True) and b.vote(q0, 0, ok=True)
    got: list = []
    threads = [_run(lambda x=x: x.decide(q0, 0), got) for x in (a, b)]
    return a, b, c, q0, got, threads


def test_a_member_killed_before_its_vote_costs_the_step_no_lease_ttl(kv) -> None:
    # c finished the reduction of step 0 and was killed before it voted: its key lives
    # on under its 30 s lease, its store refuses. The step is abandoned on the survivors
    # well before the lease could expire, and c's vote, had it still been in flight,
    # can no longer land.
    a, b, c, q0, got, threads = _c_silent_after_the_reduction(kv,
                                                              _closed_address())
    for t in threads:
        t.join(20)  # well under the 30 s lease: only fencing c ends the wait in time
    assert got == [False, False], "the survivors waited for a dead member's vote"
    assert not c.vote(q0, 0, ok=True), "the dead member's vote landed after the fence"
    q1, _ = a.agree(failed=(q0, 0))
    assert q1.members == ("a", "b")
    for x in (a, b):
        x.leave()


def test_a_slow_voter_that_lives_is_waited_for(kv) -> None:
    # c's store takes connections: it is slow, not dead. Its vote, a second late, still
    # commits the step on everyone.
    a, b, c, q0, got, threads = _c_silent_after_the_reduction(kv,
                                                              _live_store())
    time.sleep(1.2)  # past the first probe of the missing voter
    assert c.vote(q0, 0, ok=True), "a live member was fenced out for voting late"
    for t in threads:
        t.join(60)
    assert got == [True, True] and c.decide(q0, 0)
    for x in (a, b, c):
        x.leave()


def test_a_member_whose_process_is_gone_is_absent_from_a_new_quorum_at_once(
        kv) -> None:
    job, a, b, q0 = _two_groups(kv)
    # c asks to heal, is taken in, and is killed before it enters (its lease lives on).
    c = _client(kv, job, "c")
    c.join(_closed_address(), ready=False, heal=True)
    q1, _ = a.agree()
    assert q1.healing == ("c",)
    got: list = []
    threads = [_run(lambda x=x: x.confirm(q1, timeout=600.0), got) for x in (a, b)]
    for t in threads:
        t.join(60)
    assert len(got) == 2, "a member waited for a dead member to enter the quorum"
    assert [e.absent for e in got] == [("c",), ("c",)]
    for x in (a, b, c):
        x.leave()


def test_a_step_in_an_unchanged_quorum_costs_two_requests_off_its_path(kv) -> None:
    """The last vote's transaction also reads the votes (the step is decided without a
    second read), and the next quorum read starts as soon as the step committed."""
    job, a, b, q0 = _two_groups(kv)
    for step in range(3):
        assert a.vote(q0, step, ok=True)
        before = b.requests
        assert b.vote(q0, step, ok=True) and b.decide(q0, step)
        assert b.agree()[0] == q0
        # The vote's transaction, and the read agree took from its prefetch: no read to
        # decide, none more to agree.
        assert b.requests - before == 2, f"{b.requests - before} requests for one step"
        assert a.decide(q0, step) and a.agree()[0] == q0
    for x in (a, b):
        x.leave()


# -- a member still reducing in the old quorum while another enters a new one -------------

def test_a_member_whose_key_goes_is_dropped_by_every_member_at_one_boundary(
        kv) -> None:
    """d's key goes while the three groups train in a standing quorum (its lease revoked,
    as a preempted node's agent does, while its worker still steps). No step asks etcd:
    a's and b's watches see the key go, say so in a reduction, and both re-form without
    d at the same step boundary; d, whose key is gone, is refused there. a and b commit
    every step, in the same quorum, with equal sums."""
    job = f"rules-{uuid.uuid4().hex[:8]}"

    def manager(group: str) -> ReplicaManager:
        settings = ReplicaSettings(job=job, group=group,
                                   etcd=kv.etcd_settings(),
                                   lease_ttl=30.0, collective_timeout_s=30.0,
                                   quorum_timeout_s=60.0, failover_grace_s=0.5,
                                   probe_timeout_s=2.0, min_groups=3)
        return kv.manager(settings, heal=False)

    a, b, d = manager("a"), manager("b"), manager("d")
    steps = 8
    log: dict[str, list] = {"a": [], "b": [], "d": []}
    revoked = threading.Event()

    def train(mgr: ReplicaManager) -> object:
        try:
            for n in range(steps):
                q = mgr.start_step()
                grads = torch.full((4,), float(n + 1))
                mgr.allreduce([grads])
                committed = mgr.should_commit(n)
                log[mgr.group].append((n, q.id, q.members, committed, grads.tolist(),
                                       mgr.stats.etcd_requests))
                if n == 1 and mgr.group == "d":
                    # Revoked right after step 1, before d's next step: every member is
                    # then in step 2 or before, so the change is said in a reduction
                    # from step 2 on.
                    assert mgr.quorum_client is not None
                    mgr.quorum_client.leave()
                    revoked.set()
                if n == 1:
                    revoked.wait(60)  # bounds a test bug: d revokes within milliseconds
            return True
        except QuorumError as exc:  # d: its key is gone, it may not train on
            return exc

    try:
        out: dict[str, list] = {g: [] for g in log}
        threads = [_run(lambda m=m: train(m), out[m.group]) for m in (a, b, d)]
        for t in threads:
            t.join(180)
        assert out["a"] == [True] and out["b"] == [True], (out, log)
        assert isinstance(out["d"][0], QuorumError), (out["d"], log["d"])
        for g in ("a", "b"):
            assert [n for n, *_ in log[g]] == list(range(steps)), log[g]
            assert all(committed for *_, committed, _, _ in log[g]), log[g]
        # Same quorum at every step on a and b, and it changes once, to (a, b).
        assert [r[1:3] for r in log["a"]] == [r[1:3] for r in log["b"]], log
        quorums = sorted({(qid, members) for _, qid, members, *_ in log["a"]})
        assert len(quorums) == 2 and quorums[1][1] == ("a", "b"), quorums
        # Equal reduced gradients on a and b at every step (the replicas stay identical).
        assert [r[4] for r in log["a"]] == [r[4] for r in log["b"]], log
        # Steps in a standing quorum ask etcd nothing; the steps that agreed asked.
        first_q1 = next(i for i, r in enumerate(log["a"]) if r[1] == quorums[1][0])
        for g in ("a", "b"):
            standing = [r[5] for i, r in enumerate(log[g]) if i not in (0, first_q1)]
            assert standing == [0] * len(standing), log[g]
            assert log[g][first_q1][5] > 0, log[g]
    finally:
        for m in (a, b, d):
            m.close()


# -- deciders and followers: at a membership change only a quorum's first members read ----

def _followers(kv: _Backend, n: int, stores: list[tuple[str, int]] | None = None,
               follow_s: float = 30.0) -> tuple[str, list[QuorumClient], Quorum]:
    """`n` groups in a quorum, one decider (the first); the others follow."""
    job = f"rules-{uuid.uuid4().hex[:8]}"
    groups = [QuorumClient(kv.connect(), job, f"g{i}", lease_ttl=30.0, timeout=60.0,
                           failover_grace_s=0.5, deciders=1, follow_s=follow_s)
              for i in range(n)]
    for i, g in enumerate(groups):
        g.join(stores[i] if stores else _live_store(), ready=True)
    got: list = []
    threads = [_run(lambda g=g: g.agree(min_groups=n)[0], got) for g in groups]
    for t in threads:
        t.join(60)
    assert len(got) == n and len(set(got)) == 1
    return job, groups, got[0]


def _reads_no_group_key(g: QuorumClient) -> None:
    def refuse(**_kw) -> None:
        raise AssertionError(f"follower {g.group} read every group's key")
    g.snapshot = refuse  # type: ignore[method-assign]


def test_followers_take_a_joiner_in_from_the_deciders_quorum(kv) -> None:
    job, (a, b, c), q0 = _followers(kv, 3)
    for g in (b, c):
        _reads_no_group_key(g)
    d = _client(kv, job, "d")
    d.join(_live_store(), ready=False, heal=True)
    got: dict[str, Quorum] = {}
    threads = [_run(lambda g=g: got.setdefault(g.group, g.agree()[0]), [])
               for g in (a, b, c, d)]
    for t in threads:
        t.join(60)
    assert set(got) == {"g0", "g1", "g2", "d"}, got
    q1 = got["g0"]
    assert q1.id == q0.id + 1 and q1.members == ("d", "g0", "g1", "g2")
    assert q1.healing == ("d",) and all(q == q1 for q in got.values())
    # Each follower: one read of the quorum keys per wake, one of the host's key.
    assert b.requests < 20 and c.requests < 20


def test_followers_keep_a_standing_quorum_the_deciders_checked(kv) -> None:
    _, (a, b, c), q0 = _followers(kv, 3)
    for g in (b, c):
        _reads_no_group_key(g)
        g.watch_membership()
    got: list = []
    threads = [_run(lambda g=g: g.agree()[0], got) for g in (b, c)]
    time.sleep(0.2)  # the followers wait: nothing said yet
    assert not got
    q, _ = a.agree()  # the decider finds nothing changed, and says so
    for t in threads:
        t.join(60)
    assert q == q0 and got == [q0, q0]
    # The decider's report is no membership change: the followers' watches stay quiet.
    time.sleep(0.3)
    assert not b.membership_changed.is_set() and not c.membership_changed.is_set()
    for g in (b, c):
        g.stop_watch()


def test_followers_take_the_survivors_quorum_after_a_failed_step(kv) -> None:
    stores = [_live_store(), _live_store(), _closed_address()]  # g2 is killed
    _, (a, b, c), q0 = _followers(kv, 3, stores)
    _reads_no_group_key(b)
    _fail_step(q0, a, b)
    got: dict[str, Quorum] = {}
    threads = [_run(lambda g=g: got.setdefault(g.group, g.agree(failed=(q0, 0))[0]), [])
               for g in (a, b)]
    for t in threads:
        t.join(60)
    assert got["g0"] == got["g1"] and got["g0"].members == ("g0", "g1")


def test_survivors_enter_the_successor_with_their_votes(kv) -> None:
    """Every survivor's `fail` vote enters it into the failed quorum's successor: the
    decider writes that quorum saying so, and no member writes an entry or waits for
    the host to count (at a thousand groups, a raft write and a watch event per member)."""
    stores = [_live_store(), _live_store(), _live_store(), _closed_address()]  # g3 killed
    _, groups, q0 = _followers(kv, 4, stores)
    survivors = groups[:3]
    _fail_step(q0, *survivors)
    got: dict[str, Quorum] = {}
    threads = [_run(lambda g=g: got.setdefault(g.group, g.agree(failed=(q0, 0))[0]), [])
               for g in survivors]
    for t in threads:
        t.join(60)
    q1 = got["g0"]
    assert got["g1"] == q1 == got["g2"] and q1.members == ("g0", "g1", "g2") and q1.entered
    reader = kv.connect()
    root = survivors[0].root
    keys_before = {kv.key: kv.mod_revision for kv in reader.get_prefix(root)[0]}
    requests_before = [g.requests for g in survivors]
    # One after the other: were any member to wait for another's entry, this would hang.
    assert all(g.confirm(q1, timeout=30.0).complete for g in survivors)
    assert [g.requests for g in survivors] == requests_before
    assert {kv.key: kv.mod_revision for kv in reader.get_prefix(root)[0]} == keys_before
    for g in groups:
        g.leave()


def test_a_survivor_takes_the_successor_it_entered_though_a_joiner_came(kv) -> None:
    """b entered the successor with its vote; a joiner registers before b agrees. b takes
    the successor a wrote instead of replacing it (a and the host count on b), and its
    membership watch says the joiner at once, so the joiner comes in at the next step
    boundary."""
    job, a, b, c, q0 = _three_groups(kv, grace=600.0, c_store=_closed_address())
    _fail_step(q0, a, b)
    q1, _ = a.agree(failed=(q0, 0))
    assert q1.members == ("a", "b") and q1.entered
    j = _client(kv, job, "j")
    j.join(_live_store(), ready=False, heal=True)
    taken, _ = b.agree(failed=(q0, 0))
    assert taken == q1, f"b replaced the quorum it entered with its vote: {taken}"
    assert a.confirm(q1, timeout=30.0).complete and b.confirm(q1, timeout=30.0).complete
    b.watch_membership()
    try:
        assert b.membership_changed.wait(30), "the joiner waits for an unrelated change"
        got: dict[str, Quorum] = {}
        threads = [_run(lambda g=g: got.setdefault(g.group, g.agree()[0]), [])
                   for g in (a, b, j)]
        for t in threads:
            t.join(60)
        assert len(got) == 3 and len(set(got.values())) == 1, got
        q2 = got["j"]
        assert q2.members == ("a", "b", "j") and q2.healing == ("j",) and not q2.entered
    finally:
        for x in (a, b, c, j):
            x.leave()


def test_a_vote_enters_only_the_quorum_right_after_it(kv) -> None:
    """a survives alone (a quorum of one is never entered); a joiner that registers
    later is taken in at a's next agreement: the vote's entry held only for the
    agreement right after the vote."""
    job, a, b, c, q0 = _three_groups(kv, grace=600.0, c_store=_closed_address())
    b.detach()
    b.client.delete(b.root + "groups/b")  # b's lease ended: only a is left
    _fail_step(q0, a)
    q1, _ = a.agree(failed=(q0, 0))
    assert q1.members == ("a",) and not q1.entered
    j = _client(kv, job, "j")
    j.join(_live_store(), ready=False, heal=True)
    try:
        got: list = []
        t = _run(lambda: j.agree()[0], got)
        q2, _ = a.agree()
        t.join(60)
        assert q2.members == ("a", "j") and q2.healing == ("j",), q2
        assert got == [q2]
    finally:
        for x in (a, c, j):
            x.leave()


def test_followers_decide_alone_when_every_decider_is_lost(kv) -> None:
    stores = [_closed_address(), _live_store(), _live_store()]  # g0, the decider, is killed
    _, (a, b, c), q0 = _followers(kv, 3, stores, follow_s=0.5)
    _fail_step(q0, b, c)
    got: dict[str, Quorum] = {}
    t0 = time.monotonic()
    threads = [_run(lambda g=g: got.setdefault(g.group, g.agree(failed=(q0, 0))[0]), [])
               for g in (b, c)]
    for t in threads:
        t.join(60)
    assert got["g1"] == got["g2"] and got["g1"].members == ("g1", "g2")
    # They waited the grace and the follow wait once, not a lease or a quorum timeout.
    assert time.monotonic() - t0 < 30


def test_replica_settings_choose_the_deciders_and_the_follow_timeout() -> None:
    settings = ReplicaSettings(job=f"rules-{uuid.uuid4().hex[:8]}", group="a",
                               quorum_deciders=5, follow_timeout_s=2.5)
    mgr = _Backend(None).manager(settings, heal=False)
    try:
        assert mgr.quorum_client is not None
        assert (mgr.quorum_client.deciders, mgr.quorum_client.follow_s) == (5, 2.5)
    finally:
        mgr.close()
    for bad in ({"quorum_deciders": 0}, {"quorum_deciders": 1.5},
                {"follow_timeout_s": 0.0}, {"follow_timeout_s": -1.0}):
        with pytest.raises(ReplicaSettingsError, match=next(iter(bad))):
            ReplicaSettings(job="j", group="a", **bad)


def test_a_large_quorum_document_is_compact_and_reads_back(kv) -> None:
    """The quorum document every follower receives: the names compressed beyond 64
    members, and the host's store, which a follower then need not read."""
    from relight.elastic.quorum import Snapshot

    client = kv.connect()
    root = f"{client.settings.prefix}/rules-{uuid.uuid4().hex[:8]}/replicas/"
    for n in (3, 1024):
        q = Quorum(4, tuple(f"g{i:05d}" for i in range(n)), 0, ("g00001",), (("x", 5),),
                   ("10.0.0.7", 29500), entered=n > 3)
        client.put(root + "quorum", q.to_json())
        kvs, revision = client.get_prefix(root)
        read = Snapshot.parse(kvs, root, revision).quorum
        assert read is not None
        assert (read.id, read.members, read.healing, read.out, read.host_store,
                read.entered) == (q.id, q.members, q.healing, q.out, q.host_store, q.entered)
        # Every follower receives this document: about 2.5 bytes a member at 1,024.
        assert len(q.to_json()) < (200 if n == 3 else 3 * n)


def test_survivors_find_every_dead_member_among_many_silent_ones(kv) -> None:
    """Of 12 members, 3 are killed (their stores refuse) and the others vote one by one
    after the decider began deciding, with a grace no test waits out: the decider finds
    the dead ones by probing (in order while many are silent, every one once few are)
    and re-forms with the nine that voted."""
    stores = [_live_store() for _ in range(9)] + [_closed_address() for _ in range(3)]
    _, groups, q0 = _followers(kv, 12, stores)
    _fail_step(q0, groups[0])
    got: list = []
    t = _run(lambda: groups[0].agree(failed=(q0, 0), grace_s=600.0)[0], got)
    for g in groups[1:9]:
        time.sleep(0.02)
        _fail_step(q0, g)
    t.join(60)
    assert got and got[0].members == tuple(f"g{i}" for i in range(9)), got
