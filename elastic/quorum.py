"""Replica-group membership, per-step quorums and commit votes in etcd.

A job healing in place is a set of replica groups (along `dp_replicate`); each group is a
torchrun agent of its own with its own workers. This module is the agreement between the
groups, with etcd as the only coordinator (no lighthouse process: a 3-member etcd survives
the loss of any member). Keys, all under `{prefix}/{job}/replicas/`:

| key | value (JSON) | lifetime |
| --- | --- | --- |
| `groups/{group}` | `{"store": [host, port], "ready", "since", "at"}` | the group's lease |
| `quorum` | `{"id", "members"}`: the groups that train together now | the job |
| `quorum-entered` | `{"id", "absent"}`: how entering the newest quorum went | the job |
| `votes/{quorum id}/{step}/{group}` | `"ok"` or `"fail"` | two votes of the group |

**Quorum.** Before a step a group calls `agree()`: if the `quorum` key names exactly the
live, ready groups it is the quorum; otherwise the group proposes the next one (id + 1)
with a compare-and-swap on the key's `mod_revision`, and whoever loses re-reads. Every
group therefore trains step `s` in the same quorum. Before building a new quorum's
process group, each member enters it (`at` in its key) and waits for the others
(`confirm`; the quorum's host counts the entries and says the outcome in
`quorum-entered`): a quorum replaced meanwhile is dropped at once instead of after a
collective timeout. After a failed step a survivor's `fail` vote is its entry into the
successor (only one quorum can follow the failed one, and a survivor takes it whatever
changed meanwhile): when every member of the successor voted `fail`, the quorum document
says it is entered (`Quorum.entered`) and nobody writes an entry or counts. Cross-group
collectives of quorum `n` run on a process group built from a fresh store prefix
(`quorum/{n}/`), so a group that still holds quorum `n - 1` can never meet a newer
quorum's collectives (the fence on the data path).

**Steps.** In a standing quorum a step's outcome comes from its cross-group reduction
(`elastic.replica`): etcd sees no request between two steps. Each member watches the job's
keys in the background (`watch_membership`) and says in the reduction when they changed, so
every member comes back to `agree()` at the same step boundary.

**The failed step's vote.** A group whose reduction failed votes `fail` for `(quorum,
step)` in a transaction that requires its own group key to exist and the `quorum` key to
be unchanged (the fence on the control path: a group whose lease expired, or that belongs
to a replaced quorum, cannot vote). A member whose reduction completed where another's
failed applied the step; it fails at its next step's reduction (the failed member has
closed its side) and votes for that step. The survivors re-form with every member that
voted in the failed quorum, whatever the step, and the members whose vote names an
earlier step than another's are named healing (`Quorum.healing`): they take the state of
a member that applied more before anyone trains, so no two groups train from different
steps. `vote()` with `ok` and `decide()` (a step decided by votes alone, every member
voting after every step: `decide_votes` judges one snapshot) remain for callers that
commit through etcd.

Pure decisions (`Quorum.from_snapshot`, `decide_votes`) are separate from the I/O
(`QuorumClient`), so the protocol is testable without etcd.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import socket
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from relight.elastic.etcd_client import (
    Compare,
    EtcdLeaseLostError,
    KeyValue,
    LeaseKeeper,
    OpDelete,
    OpPut,
    OpRange,
)
from relight.elastic.key_feed import KeyFeed
from relight.elastic.kv import KeyValueClient
from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = ["Entry", "Quorum", "QuorumClient", "QuorumError", "Snapshot", "decide_votes"]


class QuorumError(RelightError, RuntimeError):
    """The replica groups could not agree (etcd unreachable past the deadline, this
    group's lease lost, or no quorum within the timeout)."""


_PLAIN_MEMBERS = 64
"""Up to this many members a quorum document lists them as JSON (readable with etcdctl);
beyond, compressed (`Quorum.to_json`)."""


@dataclass(frozen=True, slots=True)
class Quorum:
    """The groups that train together, and the etcd revision of the `quorum` key that
    fences every vote cast in it."""

    id: int
    members: tuple[str, ...]
    """Group ids, sorted: a group's cross-group rank is its index."""
    revision: int
    """`mod_revision` of the `quorum` key when this quorum was read."""
    healing: tuple[str, ...] = ()
    """Members that join without the current state: they receive it from a healthy
    member's memory before the quorum's first step (`elastic.heal`)."""
    out: tuple[tuple[str, int], ...] = ()
    """Live groups kept out, each with the revision its key had when it was: a group
    that was named in a quorum but never entered it. It is entitled again once it
    writes its key anew (it asks again), or never, if its key just expires."""
    host_store: tuple[str, int] | None = field(default=None, compare=False)
    """The address of the store `host` advertised when the quorum was decided: a
    follower reaches the quorum's process groups without reading the host's key."""
    entered: bool = field(default=False, compare=False)
    """Every member entered it with its `fail` vote in the quorum it follows
    (`QuorumClient.vote`): nobody writes an entry or waits for the host's count."""

    def rank(self, group: str) -> int:
        return self.members.index(group)

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def healthy(self) -> tuple[str, ...]:
        return tuple(m for m in self.members if m not in self.healing)

    def deciders(self, count: int) -> tuple[str, ...]:
        """The members that decide this quorum's successor (`QuorumClient.agree`): its
        first `count` members holding the state, then joiners if too few hold it."""
        return (*self.healthy, *self.healing)[:count]

    @property
    def host(self) -> str:
        """The member that hosts the store the quorum's process groups meet on: the
        first healthy one (a joiner has just started, and is the likeliest to fail
        before the quorum's first step)."""
        return (self.healthy or self.members)[0]

    def kept_out(self, snap: Snapshot, group: str) -> bool:
        """Whether `group` is kept out of quorums after this one: it did not enter
        this one and has not written its key since."""
        return any(g == group and snap.written.get(g) == rev for g, rev in self.out)

    def to_json(self) -> bytes:
        doc: dict[str, Any] = {"id": self.id, "healing": list(self.healing),
                               "out": {g: rev for g, rev in self.out}}
        if self.host_store is not None:
            doc["host_store"] = list(self.host_store)
        if self.entered:
            doc["entered"] = True
        if len(self.members) > _PLAIN_MEMBERS:
            # Every follower receives this document at every change: the names of a
            # large quorum, compressed, are a fifth of their JSON list.
            doc["members_z"] = base64.b64encode(
                zlib.compress("\n".join(self.members).encode(), 9)).decode()
        else:
            doc["members"] = list(self.members)
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, doc: dict[str, Any], revision: int) -> Quorum:
        """The quorum `to_json` wrote, read at `revision` (the key's `mod_revision`)."""
        if "members_z" in doc:
            members = tuple(zlib.decompress(base64.b64decode(doc["members_z"]))
                            .decode().split("\n"))
        else:
            members = tuple(str(m) for m in doc["members"])
        store = doc.get("host_store")
        return cls(int(doc["id"]), members, revision,
                   tuple(str(m) for m in doc.get("healing", [])),
                   tuple((str(g), int(r)) for g, r in doc.get("out", {}).items()),
                   None if store is None else (str(store[0]), int(store[1])),
                   bool(doc.get("entered", False)))


@dataclass(frozen=True, slots=True)
class Entry:
    """How entering a new quorum went (`QuorumClient.confirm`)."""

    replaced: bool = False
    """A newer quorum replaced it meanwhile: agree again."""
    absent: tuple[str, ...] = ()
    """Members that did not enter within the wait, or whose key is gone: agree again,
    without them."""

    @property
    def complete(self) -> bool:
        """Every member entered: build the quorum's process group."""
        return not self.replaced and not self.absent


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything under `replicas/` at one etcd revision."""

    groups: dict[str, dict[str, Any]]
    """Live groups (their keys exist) and what they published."""
    quorum: Quorum | None
    votes: dict[tuple[int, int], dict[str, str]]
    """`(quorum id, step)` -> `{group: "ok" | "fail"}`."""
    revision: int
    written: dict[str, int] = field(default_factory=dict)
    """Each live group's key: the revision it was last written at."""
    voted: dict[tuple[int, int], int] = field(default_factory=dict)
    """`(quorum id, step)` -> the revision of its last vote."""

    @property
    def ready(self) -> tuple[str, ...]:
        return tuple(sorted(g for g, doc in self.groups.items() if doc.get("ready")))

    @property
    def healing(self) -> tuple[str, ...]:
        """Live groups waiting to receive the state from a healthy one."""
        return tuple(sorted(g for g, doc in self.groups.items()
                            if not doc.get("ready") and doc.get("heal")))

    @classmethod
    def parse(cls, kvs: list[KeyValue], root: str, revision: int) -> Snapshot:
        groups: dict[str, dict[str, Any]] = {}
        quorum: Quorum | None = None
        votes: dict[tuple[int, int], dict[str, str]] = {}
        written: dict[str, int] = {}
        voted: dict[tuple[int, int], int] = {}
        for kv in kvs:
            rel = kv.key[len(root):]
            try:
                if rel.startswith("groups/"):
                    groups[rel[len("groups/"):]] = kv.json()
                    written[rel[len("groups/"):]] = kv.mod_revision
                elif rel == "quorum":
                    quorum = Quorum.from_json(kv.json(), kv.mod_revision)
                elif rel.startswith("votes/"):
                    qid, step, group = rel[len("votes/"):].split("/", 2)
                    votes.setdefault((int(qid), int(step)), {})[group] = kv.value.decode()
                    at = (int(qid), int(step))
                    voted[at] = max(voted.get(at, 0), kv.mod_revision)
            except (ValueError, KeyError, TypeError, zlib.error) as exc:
                raise QuorumError(f"replica key {kv.key} holds no valid value ({exc}); "
                                  f"delete it or use a new job id") from None
        return cls(groups, quorum, votes, revision, written, voted)


class _LiveSnapshot:
    """A `Snapshot` kept current from a watch's events, each of which carries its key and
    value: a reader that waits for many writes takes them in one stream instead of
    reading every key after each burst. A deleted key cannot be applied (its event names
    no key): the view is `stale` then, and the reader reads again."""

    def __init__(self, snap: Snapshot, root: str) -> None:
        self.root = root
        self.quorum = snap.quorum
        self.quorum_changed = False
        self.reset(snap)

    def reset(self, snap: Snapshot) -> None:
        """Start over from `snap`, a newer read of every key (`quorum_changed` if its
        quorum is not the one held)."""
        held = self.quorum
        self.groups, self.written = dict(snap.groups), dict(snap.written)
        self.votes = {at: dict(v) for at, v in snap.votes.items()}
        self.voted = dict(snap.voted)
        self.quorum, self.revision = snap.quorum, snap.revision
        self.stale = False
        self.quorum_changed = self.quorum_changed or (
            (held.revision if held else None) != (snap.quorum.revision if snap.quorum else None))

    def apply(self, kv: KeyValue | None, quorum_id: int) -> str | None:
        """Take one event in; the group whose vote in quorum `quorum_id` it is, if so."""
        if kv is None:
            self.stale = True
            return None
        self.revision = max(self.revision, kv.mod_revision)
        one = Snapshot.parse([kv], self.root, kv.mod_revision)
        self.groups.update(one.groups)
        self.written.update(one.written)
        if one.quorum is not None:
            self.quorum, self.quorum_changed = one.quorum, True
        for at, v in one.votes.items():
            self.votes.setdefault(at, {}).update(v)
            self.voted[at] = max(self.voted.get(at, 0), one.voted[at])
            if at[0] == quorum_id:
                return next(iter(v))
        return None

    def snapshot(self) -> Snapshot:
        return Snapshot(self.groups, self.quorum, self.votes, self.revision, self.written,
                        self.voted)


def decide_votes(snap: Snapshot, quorum: Quorum, step: int) -> bool | None:
    """Whether `step` of `quorum` commits (True), is abandoned (False), or is still open
    (None), judged on one snapshot."""
    votes = snap.votes.get((quorum.id, step), {})
    if all(votes.get(m) == "ok" for m in quorum.members):
        return True
    if any(v == "fail" for v in votes.values()):
        return False
    missing = [m for m in quorum.members if m not in votes]
    if any(m not in snap.groups for m in missing):
        return False  # a member died before voting: its vote can never arrive
    if snap.quorum is None or snap.quorum.revision != quorum.revision:
        return False  # replaced: a missing vote is now fenced out
    return None


def _voted_steps(snap: Snapshot, quorum: Quorum) -> dict[str, int]:
    """Each member's newest voted step in `quorum`."""
    steps: dict[str, int] = {}
    for (qid, step), votes in snap.votes.items():
        if qid == quorum.id:
            for m in votes:
                steps[m] = max(steps.get(m, step), step)
    return steps


def _behind(quorum: Quorum, members: tuple[str, ...], snap: Snapshot) -> tuple[str, ...]:
    """Members of the next quorum that applied fewer steps of the failed `quorum` than
    another: their newest vote in it names an earlier step than the newest vote of a
    member that held the state (a joiner's own step counter proves nothing). They must
    take the state of one that applied more before anyone trains again."""
    voted = _voted_steps(snap, quorum)
    asking = set(snap.healing)  # once: a property over every group
    holders = [voted[m] for m in members
               if m in voted and m not in quorum.healing and m not in asking]
    if not holders:
        return ()
    top = max(holders)
    return tuple(m for m in members if m in voted and voted[m] < top)


_VOTE_WAIT_BEFORE_PROBE_S = 0.5
"""How long `decide` waits for missing votes before it checks whether their voters are
gone: votes come within milliseconds of each other; a connection attempt per missing
voter is not worth making on every step."""

_ENTERED = "quorum-entered"
"""The key (under the root, beside `quorum`: one watch follows both) where a new
quorum's host says how entering it went: `{"id": quorum id, "absent": [groups that did
not enter]}`."""

_CHECKED = "quorum-checked"
"""The key (beside `quorum`) where a decider says that the quorum stood when it read every
group's key at a revision: `{"id": quorum id, "rev": revision}`."""

_FOLLOW_S = 5.0
"""How long a follower waits for the deciders' outcome before it decides itself: they
need a read of every group's key and a compare-and-swap (milliseconds to a second at a
thousand groups), and a wrong guess costs only a read of every key."""

_PROBE_S = 0.25
"""Longest wait for a peer's store to take a connection while deciding whether the peer
is gone: a refusal comes back at once; silence proves nothing and is not waited out."""

_REPROBE_S = 0.1
"""How often survivors waiting out the failover grace check again whether a silent
member is gone: a process that exits changes no key (its lease outlives it), so only a
new probe of its store sees it."""


_FEED_RENEW_TTLS = 3
"""The quorum feed's watch is renewed every this many lease TTLs: a request per group
every 30 s by default, on no step's path. What a renewal bounds (a stream gone silent
without breaking) every waiter on the feed bounds itself too: a follower decides alone
after `follow_s`, a member waiting for the host's report reads it when it checks the
host."""


_PROBE_FEW = 8
"""When this few members have yet to vote after a failed step, the survivors probe every
one of them (a dead one is then found as soon as the others voted), not only the first."""

_STREAM_S = 1.0
"""Longest a decider waiting for votes, or a host counting entries, keeps one watch open
while changes flow: the members still silent are probed at every lull of `_REPROBE_S`,
and at least this often whatever else the job's keys see."""


def _host_check_s(members: int) -> float:
    """How long a member waiting for the host's entry report lets the host say nothing
    before it checks that the host lives (its key, its store): `_REPROBE_S` for a few
    members, a millisecond per member beyond, so that the members' checks together cost
    etcd about a thousand requests a second at any size (at a thousand members, a check
    every `_REPROBE_S` was ten thousand a second while the host counted). A host that
    died costs that much more."""
    return max(_REPROBE_S, members * 1e-3)


def _membership_change(kv: KeyValue | None) -> bool:
    """Whether a change under the job's root is one the members must agree on: not a
    decider's or a host's report on the quorum (`quorum-checked`, `quorum-entered`),
    written while members already returned from the agreement it reports on."""
    return kv is None or kv.key.rsplit("/", 1)[-1] not in (_CHECKED, _ENTERED)


def _gather_s(members: int) -> float:
    """How long a reader that must see many members' writes lets them gather before it
    reads again: nothing for a few members, 50 ms at a thousand."""
    return min(0.05, members * 50e-6)


def _store_answers(addr: tuple[str, int], timeout: float) -> bool | None:
    """Whether a group's store at `addr` takes a connection (True), refuses it (False:
    nothing listens there, so the process hosting it is gone), or stays silent for
    `timeout` (None)."""
    try:
        socket.create_connection(addr, timeout=max(timeout, 0.001)).close()
        return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def _entered_by_vote(proposal: Quorum, current: Quorum, snap: Snapshot) -> bool:
    """Whether every member of `proposal`, the successor of `current`, entered it with a
    `fail` vote in `current` (`QuorumClient.vote`), as `snap` shows: then how entering
    went is known as the quorum is proposed."""
    failed = {m for (qid, _), votes in snap.votes.items() if qid == current.id
              for m, v in votes.items() if v == "fail"}
    return proposal.size > 1 and all(m in failed for m in proposal.members)


def _reports_on(report: KeyValue | None, quorum: Quorum) -> TypeGuard[KeyValue]:
    """Whether `report` (the `quorum-entered` key) is the host's report on `quorum`."""
    return report is not None and int(report.json()["id"]) == quorum.id


def _entry_said(report: KeyValue) -> Entry:
    """How entering went, as the host's `quorum-entered` report says."""
    return Entry(absent=tuple(str(m) for m in report.json()["absent"]))


class QuorumClient:
    """One replica group's side of the protocol.

    Call order: `join(store_addr)` once (and `set_ready(True)` once the group holds
    the current state), then per step `agree()` -> cross-group reduction -> `vote()` ->
    `decide()`; `leave()` at the end. Thread-safe for one caller at a time.
    """

    def __init__(self, client: KeyValueClient, job: str, group: str, *, lease_ttl: float = 10.0,
                 timeout: float = 60.0, failover_grace_s: float = 1.0,
                 deciders: int = 3, follow_s: float | None = None) -> None:
        if not group or "/" in group:
            raise ValueError(f"replica group id {group!r} must be non-empty without '/'")
        self.client = client
        self.group = group
        self.root = f"{client.settings.prefix}/{job}/replicas/"
        self.lease_ttl = lease_ttl
        self.timeout = timeout
        self.failover_grace_s = failover_grace_s
        if deciders < 1:
            raise ValueError(f"QuorumClient.deciders must be >= 1, got {deciders}")
        self.deciders = deciders
        """How many members of a quorum decide its successor by reading every group's key
        (its first members: `Quorum.deciders`); the others follow the `quorum` key. More
        than one, so that a lost decider costs the followers nothing."""
        if follow_s is not None and follow_s <= 0:
            raise ValueError(f"QuorumClient.follow_s must be > 0, got {follow_s}")
        self.follow_s = _FOLLOW_S if follow_s is None else follow_s
        """How long a follower waits for the deciders' outcome (`_FOLLOW_S`)."""
        self._known: Quorum | None = None
        """The quorum the last `agree` returned."""
        self._judged_at: int | None = None
        """The revision of the read of every key the last `agree` judged its quorum on,
        where this group wrote that quorum or decides its successor (else None):
        `watch_membership` checks what changed since."""
        self._wrote: int | None = None
        """The id of the last quorum this group's compare-and-swap wrote."""
        self._last_quorum: int | None = None
        self._admit_before: int | None = None
        """The revision of the last vote of the step this group last saw commit: groups
        that asked to join before it are taken in at the next step boundary, later ones
        one step later. Every member saw the same votes, so every member takes in the
        same joiners at the same boundary (no member runs the old quorum's step while
        another waits in the new one)."""
        self._lease: int | None = None
        self._keeper: LeaseKeeper | None = None
        self._doc: dict[str, Any] = {}
        self._my_votes: deque[str] = deque()
        self._entered_ahead: int | None = None
        """The quorum this group entered with its `fail` vote (`vote`): the failed
        quorum's successor, before anyone proposed it."""
        self._owes_change = False
        """The quorum `agree` returns was taken as entered with the vote while the read
        showed a change to act on: the membership watch says so at once."""
        self._after_vote: tuple[int, int, Snapshot] | None = None
        """`(quorum id, step, snapshot)`: everything under the root as this group's vote
        left it, read in the vote's own transaction; `decide` starts from it."""
        self._next: tuple[threading.Thread, list[Snapshot]] | None = None
        """The read `agree` starts from, begun as soon as the previous step committed:
        it runs while the training loop applies the step, off the step's path."""
        self.requests = 0
        """etcd requests made by the per-step calls (agree, vote, decide)."""
        self.watch_requests = 0
        """Watches the background membership watch opened (one per change it saw, and one
        per `lease_ttl` of quiet): not on any step's path."""
        self.membership_changed = threading.Event()
        """Set by the background watch (`watch_membership`) when a key under the job's
        root changed after the revision it was started at."""
        self._watch_stop: threading.Event | None = None
        self._feed: KeyFeed | None = None
        """The `quorum` prefix's keys as one long watch keeps them (`_quorum_feed`)."""
        self.last_revision = 0
        """The etcd revision of the newest snapshot this client read."""

    # -- membership --------------------------------------------------------------------

    def join(self, store: tuple[str, int], *, ready: bool, heal: bool = False) -> None:
        """Register this group (its key bound to a fresh lease kept alive in the
        background), advertising the address of the store it hosts. `heal`: it holds no
        current state and asks to receive it from a healthy group when it enters."""
        ttl = max(1, round(self.lease_ttl))
        self._lease = self.client.lease_grant(ttl)
        self._keeper = LeaseKeeper(
            self.client.sibling(timeout=max(0.5, ttl / 3)), self._lease, ttl,
            name=f"relight-replica-{self.group}").start()
        self._doc = {"store": list(store), "ready": ready, "since": -1, "heal": heal}
        if ready:
            self._doc["since"] = self._current_quorum_id()
        self._publish()

    def set_ready(self, ready: bool) -> None:
        """Mark this group ready to train (it holds the current state) or not. A group
        that becomes ready records the quorum it saw then: it may enter the next one, and
        it asks to heal no more (healed, or restored from storage)."""
        self._doc["ready"] = ready
        if ready:
            self._doc["since"] = self._current_quorum_id()
            self._doc["heal"] = False
        self._publish()

    def _current_quorum_id(self) -> int:
        kv = self.client.get(self.root + "quorum")
        return int(kv.json()["id"]) if kv is not None else -1

    def _publish(self) -> None:
        if self._lease is None:
            raise QuorumError(f"replica group {self.group}: join() first")
        self.client.put(self.root + "groups/" + self.group, json.dumps(self._doc),
                        lease=self._lease)

    def training_elsewhere(self, probe_s: float = 2.0) -> bool:
        """Whether other groups are training now: then this group must heal before it
        trains. True when a quorum exists and one of its members, not this group, is
        alive: its key is held and the store it advertises does not refuse a connection.
        A member killed under a lease that has not expired yet still holds its key, but
        its host refuses: it is no source to heal from. A store that does not answer
        within `probe_s` (a host gone, or slow) counts as alive: were this group to skip
        the heal of a live member, it would train with older state than the others; if
        the member is gone, its lease ends and the joiners restore from storage instead
        (`agree`)."""
        snap = self.snapshot()
        if snap.quorum is None:
            return False
        for m in snap.quorum.members:
            if m == self.group or m not in snap.groups:
                continue
            addr = self.store_of(snap, m)
            answers = _store_answers(addr, probe_s)
            if answers is False:
                logger.info("[replica %s] quorum %d member %s holds its key but its store "
                            "%s:%d refuses connections: its process is gone, not a "
                            "source to heal from", self.group, snap.quorum.id, m, *addr)
                continue
            if answers is None:
                logger.info("[replica %s] quorum %d member %s: its store %s:%d did not "
                            "answer within %.1fs; counted as alive", self.group,
                            snap.quorum.id, m, *addr, probe_s)
            return True
        return False

    def _gone(self, snap: Snapshot, quorum: Quorum, group: str, probe_s: float) -> bool:
        """Whether the process that speaks for `group` in `quorum` is gone for certain, so
        that waiting for it to vote or to enter can only end in a timeout: its key is
        gone; or it asks to heal while `quorum` names it healthy (its agent restarted it:
        the new process holds no state and never acts in that quorum); or its store
        refuses connections (the store lives in that process: it exited, as after a
        crash or a kill, under a lease not yet expired). A store that does not answer
        within `probe_s` (a host unreachable, a process frozen) proves nothing."""
        if group not in snap.groups:
            return True
        doc = snap.groups[group]
        if not doc.get("ready") and doc.get("heal") and group not in quorum.healing:
            return True  # asks to heal (`Snapshot.healing`), named healthy
        return _store_answers(self.store_of(snap, group), probe_s) is False

    def store_of(self, snap: Snapshot, group: str) -> tuple[str, int]:
        host, port = snap.groups[group]["store"]
        return str(host), int(port)

    def watch_membership(self, after_revision: int | None = None) -> None:
        """Watch the job's keys in the background from `after_revision` (default: the
        newest revision read), setting `membership_changed` at the first change: a group
        that registers (a joiner), leaves, is marked ready, or a new quorum. One watch
        request stays open (renewed every `lease_ttl`), off every step's path. A restart
        replaces the previous watch; an unreachable etcd counts as a change, so that the
        next `agree` meets the error itself.

        A group whose last `agree` read every key, and that wrote the quorum or decides
        its successor, first checks what changed since that read
        (`_changed_since_judged`): a group that registered after it, while the
        members entered the new quorum, is a change, and every revision read since is
        past those entries. A watch from that read itself would do the same, but etcd
        delivers a watch from a past revision only at its next catch-up round (every
        100 ms), late for a change that must ride the next step's reduction."""
        self.stop_watch()
        changed = self.membership_changed = threading.Event()
        stop = self._watch_stop = threading.Event()
        rev = self.last_revision if after_revision is None else after_revision
        judged = (self._judged_at, self._known) if after_revision is None else (None, None)
        client = self.client.sibling(timeout=self.lease_ttl + 5.0)
        quorum_key = self.root + "quorum"
        held = self._known.revision if self._known is not None else None

        def change(kv: KeyValue | None) -> bool:
            # The write of the quorum this group holds is no change to it.
            return _membership_change(kv) and not (
                kv is not None and kv.key == quorum_key and kv.mod_revision == held)

        def noticed(what: str, ask: Callable[[], bool]) -> bool:
            """One request; a change it saw (or its failure) set, unless stopped."""
            self.watch_requests += 1
            try:
                hit = ask()
            except Exception as exc:  # noqa: BLE001 - agree reports it
                logger.debug("[replica %s] membership %s failed: %s", self.group, what, exc)
                hit = True
            if hit and not stop.is_set():
                changed.set()
                return True
            return False

        def check_since_judged() -> bool:
            nonlocal rev
            assert judged[0] is not None and judged[1] is not None
            rev, hit = self._changed_since_judged(client, judged[0], judged[1])
            return hit

        def run() -> None:
            if (judged[0] is not None and judged[1] is not None
                    and noticed("check", check_since_judged)):
                return
            while not stop.is_set():
                if noticed("watch", lambda: client.wait_for_change(
                        self.root, rev, self.lease_ttl, until=change)):
                    return

        threading.Thread(target=run, daemon=True,
                         name=f"relight-quorum-watch-{self.group}").start()

    def _changed_since_judged(self, client: KeyValueClient, judged_at: int,
                              held: Quorum) -> tuple[int, bool]:
        """Whether the job's membership changed after revision `judged_at`, where this
        group judged `held` on a read of every key, and the revision this was read at
        (keys only): another quorum written, a member's key gone or created anew (its
        agent restarted it), or a key of a group outside `held` written (a joiner).
        Members' other writes since are their entries into `held`."""
        kvs, revision = client.get_prefix(self.root, keys_only=True)
        groups = self.root + "groups/"
        present = set()
        for kv in kvs:
            if kv.key == self.root + "quorum":
                if kv.mod_revision != held.revision:
                    return revision, True
            elif kv.key.startswith(groups):
                name = kv.key[len(groups):]
                present.add(name)
                if (kv.mod_revision if name not in held.members
                        else kv.create_revision) > judged_at:
                    return revision, True
        return revision, not present.issuperset(held.members)

    def stop_watch(self) -> None:
        """Stop the background watch (its open request ends within `lease_ttl`)."""
        if self._watch_stop is not None:
            self._watch_stop.set()
            self._watch_stop = None

    def detach(self) -> None:
        """Stop this group's background work (the membership watch, the quorum feed, the
        lease's keepalives) and leave its lease to expire: what a process that dies
        leaves behind in etcd (simulations and tests of a lost group)."""
        self.stop_watch()
        if self._feed is not None:
            self._feed.stop()
            self._feed = None
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None

    def leave(self) -> None:
        self._take_prefetched()
        self.detach()
        if self._lease is not None:
            self.client.lease_revoke(self._lease)
            self._lease = None

    def _check_lease(self) -> None:
        if self._keeper is not None and self._keeper.lost.is_set():
            raise QuorumError(f"replica group {self.group} lost its etcd lease "
                              f"({self._keeper.error}); it must heal from a live group "
                              "and join again")

    # -- per step ----------------------------------------------------------------------

    def snapshot(self, *, votes: bool = True) -> Snapshot:
        """Every key under the job's root at one revision; without the votes (the groups'
        keys and the quorum's, in one transaction of two ranges) for a reader that does
        not judge them: after a failed step a thousand groups' votes are half the keys."""
        self.requests += 1
        if votes:
            kvs, revision = self.client.get_prefix(self.root)
        else:
            result = self.client.txn([], [OpRange(self.root + "groups/"),
                                          OpRange(self.root + "quorum")])
            kvs, revision = [kv for r in result.ranges for kv in r], result.revision
        self.last_revision = max(self.last_revision, revision)
        return Snapshot.parse(kvs, self.root, revision)

    def _prefetch(self) -> None:
        """Start the read the next `agree` begins with. It is taken after this step's
        commit, as `agree`'s own first read would be, only earlier; anything that changes
        after it is fenced as ever (a proposal is a compare-and-swap on the quorum key's
        revision, a vote requires the quorum key unchanged)."""
        out: list[Snapshot] = []

        def read() -> None:
            try:
                out.append(self.snapshot())
            except Exception as exc:  # agree reads again, and meets the error itself
                logger.debug("[replica %s] prefetch of the next quorum read failed: %s",
                             self.group, exc)

        thread = threading.Thread(target=read, daemon=True,
                                  name=f"relight-quorum-prefetch-{self.group}")
        thread.start()
        self._next = (thread, out)

    def _take_prefetched(self) -> Snapshot | None:
        if self._next is None:
            return None
        thread, out = self._next
        self._next = None
        thread.join()
        return out[0] if out else None

    def agree(self, *, failed: tuple[Quorum, int] | None = None,
              absent: tuple[Quorum, tuple[str, ...]] | None = None,
              min_groups: int = 1, grace_s: float | None = None) -> tuple[Quorum, Snapshot]:
        """The quorum to train the next step in (the rules: `_agree_full`).

        At a membership change only the quorum's deciders (`Quorum.deciders`: its first
        few members) read every group's key and decide; the other members follow the
        `quorum` key: they take the successor the deciders proposed, or, when the
        deciders found that the quorum stands (a change that changed nothing, said in
        `quorum-checked`), the quorum itself. A follower that hears nothing within
        `follow_s` (after the failover grace, for a failed step), or finds itself left
        out, decides for itself as a decider does. A thousand groups then cost etcd a few
        reads of every key per change, not one per group."""
        try:
            known = failed[0] if failed is not None else self._known
            if absent is None and known is not None:
                followed = self._follow(known, failed is not None,
                                        self.failover_grace_s if grace_s is None else grace_s)
                if followed is not None:
                    self._known, self._judged_at = followed[0], None
                    return followed
            quorum, snap = self._agree_full(failed=failed, absent=absent, min_groups=min_groups,
                                            grace_s=grace_s)
            if (failed is None and known is not None and quorum.id == known.id
                    and quorum.size > self.deciders
                    and self.group in quorum.deciders(self.deciders)):
                self._say_checked(quorum, snap.revision)
            # The window between this read and the members' entries is checked by the
            # group that wrote the quorum (it read first) and its deciders, not by every
            # member: at the first quorum every group reads every key.
            checks = quorum.id == self._wrote or self.group in quorum.deciders(self.deciders)
            judged_at: int | None = snap.revision if checks else None
            if self._owes_change:
                # Taken as entered with the vote although the read shows a change (a joiner
                # that asked meanwhile): the membership watch says it at once (every key is
                # newer than revision 0), so the members take it in at the next boundary.
                judged_at, self._owes_change = 0, False
            self._known, self._judged_at = quorum, judged_at
            return quorum, snap
        finally:
            # A `fail` vote's entry holds for the agreement right after it, not later.
            self._entered_ahead = None

    def _follow(self, known: Quorum, failed: bool, grace_s: float
                ) -> tuple[Quorum, Snapshot] | None:
        """A follower's `agree`: wait on the `quorum` prefix (`_quorum_feed`: no request
        of its own) for the deciders' outcome on `known`: a successor, or
        `quorum-checked` naming `known` at a revision after the change this group's watch
        saw. None: decide for itself."""
        if self.group not in known.members or self.group in known.deciders(self.deciders):
            return None
        since = self.last_revision
        feed = self._quorum_feed()
        quorum_key, checked_key = self.root + "quorum", self.root + _CHECKED

        def outcome(keys: Mapping[str, KeyValue]) -> KeyValue | None:
            """The key that says the outcome, or None: nothing said yet. The feed may
            lag `known` itself: only a write after it is a successor (a quorum key
            deleted, as by a job's reset, is waited out to the deadline)."""
            said = keys.get(quorum_key)
            if said is not None and said.mod_revision > known.revision:
                return said
            report = keys.get(checked_key)
            if not failed and report is not None and report.mod_revision > since:
                return report
            return None

        deadline = time.monotonic() + (grace_s if failed else 0.0) + self.follow_s
        while True:
            self._check_lease()
            said = feed.wait(outcome, min(max(deadline - time.monotonic(), 0.0),
                                          self.lease_ttl))
            if said is None:
                if time.monotonic() < deadline and feed.running:
                    continue  # checks the lease again
                logger.info("[replica %s] quorum %d: its deciders %s said nothing "
                            "within %.1fs; deciding alone", self.group, known.id,
                            list(known.deciders(self.deciders)), self.follow_s)
                return None
            self.last_revision = max(self.last_revision, said.mod_revision)
            revision = max(feed.revision, said.mod_revision)
            if said.key == quorum_key:
                current = Snapshot.parse([said], self.root, said.mod_revision).quorum
                if current is None or current.id <= known.id:
                    return None
                if self.group not in current.members:
                    return None  # left out: the full rules say why, or take it in
                self._last_quorum = current.id
                return current, self._with_host(current, revision)
            doc = said.json()
            if int(doc["id"]) == known.id and int(doc["rev"]) >= since:
                return known, self._with_host(known, revision)
            # A report on an earlier change: wait for one after it.
            since = max(since, said.mod_revision)

    def _quorum_feed(self) -> KeyFeed:
        """The `quorum` prefix's keys (the quorum, the deciders' and the host's reports)
        followed by one long watch, started at this group's first wait on them: a
        follower then waits on a change of membership without a request of its own."""
        if self._feed is None or not self._feed.running:
            self._feed = KeyFeed(self.client, self.root + "quorum",
                                 renew_s=_FEED_RENEW_TTLS * self.lease_ttl,
                                 name=f"relight-quorum-feed-{self.group}").start()
        return self._feed

    def _with_host(self, quorum: Quorum, revision: int) -> Snapshot:
        """A snapshot of `quorum` and its host's key alone: what a follower needs to
        reach the store the quorum's process groups meet on. The quorum document names
        that store (`Quorum.host_store`): then no request (the host's liveness is
        checked as the members enter)."""
        if quorum.host_store is not None:
            return Snapshot({quorum.host: {"store": list(quorum.host_store)}}, quorum, {},
                            revision, {})
        self.requests += 1
        kv = self.client.get(self.root + "groups/" + quorum.host)
        groups = {} if kv is None else {quorum.host: kv.json()}
        written = {} if kv is None else {quorum.host: kv.mod_revision}
        return Snapshot(groups, quorum, {}, revision, written)

    def _say_checked(self, quorum: Quorum, revision: int) -> None:
        """A decider found that `quorum` stands at `revision`: say so to the followers
        (only while the quorum key is unchanged)."""
        self.requests += 1
        result = self.client.txn(
            [Compare(self.root + "quorum", "mod", "==", quorum.revision)],
            [OpPut(self.root + _CHECKED, json.dumps({"id": quorum.id, "rev": revision}))])
        self.last_revision = max(self.last_revision, result.revision)

    def _agree_full(self, *, failed: tuple[Quorum, int] | None = None,
                    absent: tuple[Quorum, tuple[str, ...]] | None = None,
                    min_groups: int = 1, grace_s: float | None = None
                    ) -> tuple[Quorum, Snapshot]:
        """The quorum to train the next step in, decided from every group's key.

        Normally the current one, when it names exactly the groups entitled to train:
        its members that are still alive, plus ready groups that joined after it formed.
        After `failed = (quorum, step)` was abandoned, the survivors wait up to
        `grace_s` (default `failover_grace_s`) for every member's vote in that quorum
        (on that step, or, for a member that applied it, on its next) and re-form with
        the groups that voted: a member that did not (dead, or frozen past the grace) is
        out, and can come back only by healing and joining again. Members whose vote
        names an earlier step than another's are named healing in the new quorum. After `absent =
        (quorum, groups)`, groups that were named in a new quorum but did not enter it
        (`confirm`), the others re-form without them; those stay out until they write
        their key again. The first quorum waits for `min_groups` ready groups.

        When every group holding the state is gone (keys expired or revoked), joiners
        re-form alone: a quorum without a healthy member. It is returned to its first
        live member only, which must restore the state from storage and `set_ready`;
        its next `agree` then proposes a quorum that names it healthy, and the other
        joiners, which waited, heal from it.

        """
        deadline = time.monotonic() + self.timeout
        prefetched = self._take_prefetched()
        judged_here = False  # `prefetched` is this group's last read, with its own write
        while True:
            self._check_lease()
            snap, prefetched = prefetched or self.snapshot(), None
            current = snap.quorum
            if self.group not in snap.ready and self.group not in snap.healing:
                raise QuorumError(f"replica group {self.group} is not registered as ready "
                                  f"under {self.root}groups/ (lease lost, or not healed)")
            if (current is not None and self.group not in current.members
                    and self._last_quorum is not None and self.group not in snap.healing
                    and snap.groups[self.group].get("since", -1) < current.id):
                raise QuorumError(
                    f"replica group {self.group} was left out of quorum {current.id} "
                    f"(it did not vote in time after a failed step): its state may be "
                    "behind the others'; it must heal from a live group and join again")
            if (current is not None and self.group not in current.members
                    and any(m in snap.groups for m in current.members)):
                if current.kept_out(snap, self.group):
                    # Named in a quorum it did not enter in time (it was still starting):
                    # ask again, to be taken in at the members' next step boundary.
                    self._publish()
                    continue
                # A joiner waits for the members to take it in at their next step
                # boundary: replacing the quorum now would fence out the step they are
                # in the middle of. Any change wakes it, a member's key expiring too: once
                # the last member is gone it re-forms without waiting out a watch.
                self._wait_or_give_up("", snap, deadline, "not taken into a quorum")
                continue
            if failed is not None and current is not None and current.id == failed[0].id:
                members, snap = self._survivors(failed[0], failed[1], snap, grace_s)
                holders = [m for m in failed[0].healthy if m in snap.groups]
                if holders and not set(members) & set(failed[0].healthy):
                    # Only groups without the state voted in time. They cannot go on
                    # alone while a group that holds it lives (it is slow, not dead):
                    # wait for it to re-form the quorum, or for its lease to expire.
                    self._wait_or_give_up("quorum", snap, deadline,
                                          f"groups holding the state {holders} formed no quorum")
                    continue
                proposal = self._proposal(current.id + 1, members, snap, current,
                                          behind=_behind(failed[0], members, snap))
            elif absent is not None and current is not None and current.id == absent[0].id:
                members = tuple(m for m in current.members
                                if m not in absent[1] and m in snap.groups)
                absent_now = absent
                absent = None
                holders = [m for m in current.healthy if m in snap.groups]
                if holders and not any(m not in current.healing for m in members):
                    # Only joiners entered; a group holding the state is named but silent.
                    # They cannot go on without it: wait for its key to change or expire.
                    # Once every holder's key is gone they re-form alone (and restore).
                    self._wait_or_give_up("groups/", snap, deadline,
                                          f"groups holding the state {holders} did not enter "
                                          f"quorum {current.id}")
                    continue
                proposal = self._proposal(current.id + 1, members, snap, current,
                                          absent_now[1])
            else:
                if (current is not None and self.group in snap.healing
                        and self.group in current.healing):
                    live = [m for m in current.members if m in snap.groups]
                    if any(m in current.healthy for m in live):
                        return current, snap  # the members took this joiner in
                    if not current.healthy:
                        # Joiners only: no live group holds the state. The first live one
                        # restores it from storage (as a job with no live replica does)
                        # and proposes the next quorum; the others then heal from it.
                        if live[0] == self.group:
                            return current, snap
                        self._wait_or_give_up("", snap, deadline,
                                              f"{live[0]} restored no state from storage")
                        continue
                    # Every member that holds the state is gone: re-form without them.
                if (current is not None and current.id == self._entered_ahead
                        and self.group in current.members and current.healthy):
                    # This group entered `current` with its vote: the quorum may say so
                    # (`Quorum.entered`), and the others then build its process group
                    # with this group. A change seen now waits for the next step
                    # boundary; a member gone fails the build, and the next quorum
                    # forms without it.
                    self._last_quorum = current.id
                    self._owes_change = self._entitled(current, snap,
                                                       self._admit_before) != current.members
                    return current, snap
                entitled = self._entitled(current, snap, self._admit_before)
                # A group asking to heal enters only a quorum that names it as healing: a
                # restarted group still listed in the quorum it fell out of holds no state.
                # A quorum of joiners only is left once one of them holds the state
                # (restored from storage): the next one names it healthy.
                asking = set(snap.healing)
                if current is not None and current.members == entitled and all(
                        g in current.healing for g in entitled if g in asking) and (
                        current.healthy or all(g in asking for g in entitled)):
                    self._last_quorum = current.id
                    return current, snap
                if current is None and len(entitled) < min_groups:
                    self._wait_or_give_up("groups/", snap, deadline,
                                          f"only {len(entitled)} of {min_groups} groups ready")
                    continue
                proposal = self._proposal(current.id + 1 if current else 0, entitled, snap,
                                          current)
            self.requests += 1
            quorum_key = self.root + "quorum"
            if current is not None and _entered_by_vote(proposal, current, snap):
                # Every member entered this successor with its vote: the quorum says so,
                # and nobody writes an entry or waits for a count.
                proposal = dataclasses.replace(proposal, entered=True)
            result = self.client.txn(
                [Compare(quorum_key, "mod", "==", current.revision if current else 0)],
                [OpPut(quorum_key, proposal.to_json())], [OpRange(quorum_key)])
            failed = None  # the failed quorum is replaced, by this group or another
            if result.succeeded:
                logger.info("[replica %s] quorum %d: %s", self.group, proposal.id,
                            list(proposal.members))
                self._wrote = proposal.id
                if not judged_here:
                    # Judge the quorum just written on the snapshot it was decided from,
                    # not on a read of every key again: what changed since that read is
                    # said by the membership watch, which starts from it.
                    judged_here = True
                    prefetched = dataclasses.replace(
                        snap, quorum=dataclasses.replace(proposal, revision=result.revision))
                    continue
            else:
                winner = next((Snapshot.parse([kv], self.root, result.revision).quorum
                               for kv in result.ranges[0] if kv.key == quorum_key), None)
                if (winner is not None and winner.id == proposal.id
                        and self._takes(winner, snap)):
                    # Another decider won with the same snapshot's rules: take its
                    # quorum as a follower does, without reading every key again.
                    self._last_quorum = winner.id
                    self.last_revision = max(self.last_revision, result.revision)
                    return winner, self._with_host(winner, result.revision)
            judged_here = False
            if time.monotonic() > deadline:
                raise QuorumError(f"replica group {self.group}: no quorum within "
                                  f"{self.timeout:.0f}s under {self.root}")

    def _takes(self, quorum: Quorum, snap: Snapshot) -> bool:
        """Whether this group may take `quorum`, written by another, without judging it
        on a read of every key (as a follower takes its deciders'): it names this group,
        as healing if the group asks to heal (`snap`), and has a member holding the
        state (a quorum of joiners alone is left to the full rules: only its first live
        member restores)."""
        return (self.group in quorum.members and bool(quorum.healthy)
                and (self.group not in snap.healing or self.group in quorum.healing))

    def _wait_or_give_up(self, key: str, snap: Snapshot, deadline: float, what: str) -> None:
        """One wait of `agree` for a change under `key` (relative to the root; "": any),
        at most a lease TTL; QuorumError saying `what` did not happen once the agree
        deadline has passed."""
        self.client.wait_for_change(self.root + key, snap.revision, self.lease_ttl)
        if time.monotonic() > deadline:
            raise QuorumError(f"replica group {self.group}: {what} within "
                              f"{self.timeout:.0f}s under {self.root}")

    @staticmethod
    def _entitled(current: Quorum | None, snap: Snapshot,
                  admit_before: int | None = None) -> tuple[str, ...]:
        """Who may train next: every ready group at the start; later the current
        members still alive and ready, and the groups that ask to come in (ready ones
        that joined after it formed, ones asking to heal) if they asked before
        revision `admit_before` (None: whenever)."""
        if current is None:
            return snap.ready

        def asked_in_time(g: str) -> bool:
            return not current.kept_out(snap, g) and (
                admit_before is None or snap.written.get(g, 0) < admit_before)

        members = set(current.members)  # a tuple: a thousand lookups in it add up
        ready = [g for g in snap.ready if g in members
                 or (snap.groups[g].get("since", -1) >= current.id and asked_in_time(g))]
        joiners = [g for g in snap.healing if g in members or asked_in_time(g)]
        return tuple(sorted({*ready, *joiners}))

    @staticmethod
    def _proposal(qid: int, members: tuple[str, ...], snap: Snapshot,
                  current: Quorum | None, absent: tuple[str, ...] = (),
                  behind: tuple[str, ...] = ()) -> Quorum:
        asking, behind_set = set(snap.healing), set(behind)
        healing = tuple(m for m in members if m in asking or m in behind_set)
        # Who stays out: the current quorum's list, less groups that asked again or are
        # gone, plus the newly absent (at their key's revision now).
        out = {g: rev for g, rev in (current.out if current else ())
               if snap.written.get(g) == rev}
        out.update({g: snap.written[g] for g in absent if g in snap.written})
        quorum = Quorum(qid, tuple(sorted(members)), 0, healing, tuple(sorted(out.items())))
        store = snap.groups.get(quorum.host, {}).get("store") if members else None
        return quorum if store is None else dataclasses.replace(
            quorum, host_store=(str(store[0]), int(store[1])))

    def _survivors(self, quorum: Quorum, step: int, snap: Snapshot,
                   grace_s: float | None = None) -> tuple[tuple[str, ...], Snapshot]:
        """Members of `quorum` that voted in it within the grace (on `step`, or on the
        step after it: a member whose reduction of `step` completed applied it, and fails
        at its next), and are alive; and the snapshot they were found in (`snap` with
        every change since, the votes waited for among them: whose vote names an earlier
        step is judged on it). The wait ends early once every member that has not voted
        is gone for certain (`_gone`): a crashed or killed group costs its peers no
        grace, also when its process dies or its agent restarts it while they wait
        (checked at every `_REPROBE_S` without a vote). It ends at once when another
        survivor has already replaced `quorum`: the caller's proposal then loses its CAS
        and it takes the quorum that won.

        The votes after `snap` are taken from a watch's events (each carries the key):
        at a thousand groups a read of every key per burst of votes cost a decider more
        than the votes themselves. A deleted key is read again (an event names no key
        then)."""
        grace_end = time.monotonic() + (self.failover_grace_s if grace_s is None else grace_s)
        gone: set[str] = set()
        """Silent members found gone (a process that is gone does not come back to vote
        in this quorum: a restarted one asks to heal)."""
        live = _LiveSnapshot(snap, self.root)
        read_first = True
        while True:
            snap = live.snapshot()
            voted = _voted_steps(snap, quorum)
            voters = {m for m in quorum.members if m in voted and m in snap.groups}
            remaining = grace_end - time.monotonic()
            silent = [m for m in quorum.members if m not in voters and m != self.group]
            # Probed in order until one may live (the others at the next wake); every
            # one of the last few, so that a dead member among them is found at once.
            few = sum(m not in gone for m in silent) <= _PROBE_FEW
            for m in silent:
                if m in gone:
                    continue
                if not self._gone(snap, quorum, m, min(_PROBE_S, max(remaining, 0.0))):
                    if few:
                        continue
                    break
                gone.add(m)
            if (snap.quorum is None or snap.quorum.id != quorum.id or remaining <= 0
                    or all(m in gone for m in silent)):
                return tuple(sorted({*voters, self.group})), snap
            waiting = set(silent) - gone

            def enough(waiting: set[str] = waiting, live: _LiveSnapshot = live,
                       few: bool = few) -> bool:
                """Wake: the quorum changed, a key was deleted, every silent member not
                known gone voted, or those left are few and not all probed yet."""
                return (live.stale or live.quorum_changed or not waiting
                        or (not few and len(waiting) <= _PROBE_FEW))

            def wakes(kv: KeyValue | None, waiting: set[str] = waiting,
                      live: _LiveSnapshot = live) -> bool:
                voter = live.apply(kv, quorum.id)
                waiting.discard(voter or "")
                return enough()

            def read_again(waiting: set[str] = waiting, live: _LiveSnapshot = live
                           ) -> int | None:
                """A read of every key once the wait's watch is in place: the votes cast
                since the last read come in it, and the later ones at once, not at
                etcd's next catch-up round of watches from a past revision. None: wake
                at once."""
                now = self.snapshot()
                live.reset(now)
                waiting.difference_update(_voted_steps(now, quorum))
                return None if enough() else now.revision

            # One stream while votes flow; it ends at a lull of `_REPROBE_S`, when the
            # members still silent are probed again (and every `_STREAM_S` at most).
            # After a wake by a vote the next stream starts from now, with a read.
            woke = self.client.wait_for_change(
                self.root, None if read_first else live.revision,
                min(max(remaining, 0.0), _STREAM_S), until=wakes,
                then=read_again if read_first else None, idle_s=_REPROBE_S)
            read_first = woke and not live.stale
            if live.stale:
                live = _LiveSnapshot(self.snapshot(), self.root)

    def confirm(self, quorum: Quorum, timeout: float) -> Entry:
        """Enter `quorum` (a new one) and wait, up to `timeout`, until every member has
        entered it too, before anyone builds its process group.

        Replaced: two groups may propose one after the other (the second saw a joiner
        the first did not), and a group that built the first would wait out the
        collective timeout on peers that went on to the second. Absent: a member whose
        key is gone, or one still alive that did not enter within `timeout` (a joiner
        that registered but is still starting, a process that died under a lease not
        yet expired); building with it would cost the whole collective timeout, and
        then the same again with the next quorum that still names it. A member gone for
        certain (`_gone`) is absent at once.

        One member counts the entries: the quorum's host (`Quorum.host`). It follows
        every member's key and writes the outcome to the `entered` key; the others
        follow that one key (and the `quorum` key, for a replacement), so a change of
        membership costs each of them a constant number of small requests, not a read
        of every group's key per entry. A host that is gone (its key deleted or its
        store refusing) or silent past the timeout is absent itself, decided by each
        member alike.

        A quorum whose members all entered it with their `fail` votes
        (`Quorum.entered`) is complete at once, with no request: a member that died
        after its vote fails the process group's build instead (`collective_timeout_s`),
        and the next quorum forms without it."""
        self._doc["at"] = quorum.id
        if quorum.entered:
            return Entry()  # every member entered with its vote
        if quorum.host == self.group:
            self._publish()
            entry = self._count_entries(quorum, timeout)
            if not entry.replaced:
                outcome = json.dumps({"id": quorum.id, "absent": list(entry.absent)})
                self.requests += 1
                result = self.client.txn([Compare(self.root + "quorum", "mod", "==",
                                                  quorum.revision)],
                                         [OpPut(self.root + _ENTERED, outcome)])
                self.last_revision = max(self.last_revision, result.revision)
                if not result.succeeded:
                    return Entry(replaced=True)
            return entry
        return self._await_host(quorum, timeout)

    def _count_entries(self, quorum: Quorum, timeout: float) -> Entry:
        """The host's part of `confirm`: wait until every member entered, one is gone,
        or `timeout`. One read of every group's key, made once a watch from now is in
        place (entries made meanwhile then come at once, not at etcd's next catch-up
        round), then the entries are counted from the watch's events (each carries the
        member's document): at a thousand members a read of every key per burst of
        entries cost the host more than the entries themselves. Members still waiting
        are probed (`_gone`) when no entry came for `_REPROBE_S`, not while entries
        stream in (`_probe_some`)."""
        deadline = time.monotonic() + timeout
        quorum_key = self.root + "quorum"
        groups = self.root + "groups/"
        waiting: set[str] = set()
        probed: set[str] = set()
        snap: Snapshot | None = None
        gone: tuple[str, ...] = ()
        seen = 0
        reread = True  # read every group's key at the next wait

        def read() -> int | None:
            """The read the counting starts from; None: no need to wait."""
            nonlocal snap, gone, seen
            snap = self.snapshot(votes=False)
            waiting.clear()
            waiting.update(m for m in quorum.members
                           if m in snap.groups and snap.groups[m].get("at") != quorum.id)
            gone = tuple(m for m in quorum.members if m not in snap.groups)
            probed.clear()
            seen = snap.revision
            stands = snap.quorum is not None and snap.quorum.revision == quorum.revision
            return snap.revision if stands and waiting and not gone else None

        def entered(kv: KeyValue | None) -> bool:
            """Count one event; True when the wait ends: all in, or a change that
            needs a read (the quorum replaced, a key deleted, a member's key written
            without its entry: a restart)."""
            nonlocal seen, reread
            if kv is None:
                reread = True
                return True
            seen = max(seen, kv.mod_revision)
            if kv.key == quorum_key:
                reread = True
                return True
            name = kv.key[len(groups):] if kv.key.startswith(groups) else None
            if name in waiting:
                try:
                    at = json.loads(kv.value).get("at")
                except (ValueError, AttributeError):
                    at = None
                if at != quorum.id:
                    reread = True
                    return True
                waiting.discard(name)
            return not waiting

        while True:
            remaining = deadline - time.monotonic()
            if reread and remaining <= 0:
                read()  # a last look before giving up
                reread = False
            if not reread and snap is not None:
                if snap.quorum is None or snap.quorum.revision != quorum.revision:
                    return Entry(replaced=True)
                if not gone and not waiting:
                    return Entry()
                if gone or remaining <= 0:
                    absent = gone or tuple(sorted(waiting))
                    logger.warning("[replica %s] quorum %d: %s did not enter it (%s)",
                                   self.group, quorum.id, list(absent),
                                   "gone" if gone else f"not within {timeout:.0f}s")
                    return Entry(absent=absent)
            fresh, reread = reread, False
            # One stream while entries flow; it ends at a lull of `_REPROBE_S` (and
            # every `_STREAM_S` at most).
            woke = self.client.wait_for_change(
                self.root, None if fresh else seen, min(remaining, _STREAM_S),
                until=entered, then=read if fresh else None, idle_s=_REPROBE_S)
            if fresh and snap is None:
                reread = True  # the watch broke before its read: again
            elif not woke and snap is not None and waiting:
                # A lull: the members still waiting are slow, or gone.
                gone = self._probe_some(snap, quorum, waiting, probed, deadline)
            elif woke and not reread and waiting and not fresh:
                reread = True  # a broken watch: read again

    def _probe_some(self, snap: Snapshot, quorum: Quorum, waiting: set[str],
                    probed: set[str], deadline: float) -> tuple[str, ...]:
        """The host's probes in a lull of the entries: the waiting members gone for
        certain, among those probed within `_REPROBE_S` of wall time, the ones not
        probed yet first (`probed`, updated). A round of a thousand probes on loaded
        cores kept the host from the entries for seconds; in budgeted rounds the usual
        case (one member missing at the end) is still found at the first lull."""
        if waiting <= probed:
            probed.clear()
        order = sorted(waiting - probed)
        stop = time.monotonic() + _REPROBE_S
        gone = []
        for m in order:
            now = time.monotonic()
            if now >= stop:
                break
            probed.add(m)
            if self._gone(snap, quorum, m, min(_PROBE_S, max(deadline - now, 0.0))):
                gone.append(m)
        return tuple(gone)

    def _await_host(self, quorum: Quorum, timeout: float) -> Entry:
        """A member's part of `confirm`: enter (this group's key, written only while the
        quorum stands), then follow the `quorum` and `entered` keys (`_quorum_feed`: no
        request of its own) until the host says how entering went, or the quorum is
        replaced. The host's liveness (its key, its store) is checked when it said
        nothing for `_host_check_s`; past `timeout` and a margin for its own wait, a
        host that said nothing is absent."""
        host_key = self.root + "groups/" + quorum.host
        quorum_key = self.root + "quorum"
        entered_key = self.root + _ENTERED
        deadline = time.monotonic() + timeout + 2 * _REPROBE_S + _PROBE_S
        check_s = _host_check_s(quorum.size)
        if self._lease is None:
            raise QuorumError(f"replica group {self.group}: join() first")
        feed = self._quorum_feed()

        def reported(keys: Mapping[str, KeyValue]) -> KeyValue | None:
            """The host's report on `quorum`, or the quorum key written after it."""
            said = keys.get(entered_key)
            if _reports_on(said, quorum):
                return said
            current = keys.get(quorum_key)
            if current is not None and current.mod_revision > quorum.revision:
                return current
            return None

        def read(ops: list[OpPut]) -> Entry | tuple[str, int]:
            """One transaction, only while the quorum stands: `ops`, then the host's
            report and its key (small keys, not the quorum document). How entering went
            if that is known already, else the host's store."""
            self.requests += 1
            result = self.client.txn([Compare(quorum_key, "mod", "==", quorum.revision)],
                                     [*ops, OpRange(entered_key), OpRange(host_key)])
            self.last_revision = max(self.last_revision, result.revision)
            if not result.succeeded:
                return Entry(replaced=True)
            # A range is a prefix: group "g1"'s range holds "g10"'s key too.
            said, host = (next((kv for kv in r if kv.key == key), None)
                          for r, key in zip(result.ranges, (entered_key, host_key),
                                            strict=True))
            if _reports_on(said, quorum):
                return _entry_said(said)
            if host is None:
                return self._host_gone(quorum, "is gone")
            store = host.json()["store"]
            return str(store[0]), int(store[1])

        # This member's entry goes in the first read's transaction: one request.
        found = read([OpPut(self.root + "groups/" + self.group, json.dumps(self._doc),
                            self._lease)])
        while not isinstance(found, Entry):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._host_gone(quorum, "said nothing within the entry timeout")
            got = feed.wait(reported, min(remaining, check_s))
            if got is not None and got.key == entered_key:
                self.last_revision = max(self.last_revision, got.mod_revision)
                return _entry_said(got)
            if got is None:
                # The host said nothing for `check_s`: does it live? The read that
                # follows also takes a report the feed missed (its stream gone silent
                # with its etcd member).
                feed = self._quorum_feed()  # a new one, if the old one stopped
                if _store_answers(found, _PROBE_S) is False:
                    return self._host_gone(quorum, "is gone")
            found = read([])  # or the quorum was replaced: the transaction says so
        return found

    def _host_gone(self, quorum: Quorum, why: str) -> Entry:
        logger.warning("[replica %s] quorum %d: its host %s %s", self.group, quorum.id,
                       quorum.host, why)
        return Entry(absent=(quorum.host,))

    def vote(self, quorum: Quorum, step: int, ok: bool) -> bool:
        """Cast this group's vote for `(quorum, step)`. False: fenced out (this group's
        key is gone or the quorum was replaced), so the step must be abandoned here.

        A `fail` vote also enters this group into `quorum`'s successor, before anyone
        proposed it: the group must `agree(failed=...)` next, and takes that successor
        if it names it (a change seen meanwhile is taken at the next step boundary)."""
        key = f"{self.root}votes/{quorum.id}/{step}/{self.group}"
        cond = [Compare(self.root + "groups/" + self.group, "version", ">", 0),
                Compare(self.root + "quorum", "mod", "==", quorum.revision)]
        ops: list[OpPut | OpDelete | OpRange] = [OpPut(key, "ok" if ok else "fail")]
        # Two steps back is safe to delete: every member finished deciding it before the
        # reduction of the step after it could complete.
        while len(self._my_votes) >= 2:
            ops.append(OpDelete(self._my_votes.popleft()))
        if ok:
            # The snapshot `decide` starts from, in the same round trip: when this vote is
            # the last one in, the step is decided without another read. A failed step
            # is not decided (the voter agrees again), and at a thousand groups that
            # read would be the largest part of the failover's bytes.
            ops.append(OpRange(self.root))
        self.requests += 1
        self._after_vote = None
        try:
            result = self.client.txn(cond, ops)
        except EtcdLeaseLostError:
            return False
        if result.succeeded:
            self._my_votes.append(key)
            if ok:
                self._after_vote = (quorum.id, step,
                                    Snapshot.parse(list(result.ranges[0]), self.root,
                                                   result.revision))
            else:
                self._entered_ahead = quorum.id + 1
        return result.succeeded

    def decide(self, quorum: Quorum, step: int) -> bool:
        """Wait until `step` of `quorum` commits (True) or is abandoned (False).

        A member that dies between the reduction (which it finished) and its vote holds
        its key until its lease expires: the step would wait out the lease TTL. Once
        votes are missing for `_VOTE_WAIT_BEFORE_PROBE_S`, members whose process is gone
        for certain (their store refuses connections) are fenced out (`_fence_dead`),
        which abandons the step at once on every member."""
        deadline = time.monotonic() + self.timeout
        probe_at = time.monotonic() + _VOTE_WAIT_BEFORE_PROBE_S
        after_vote, self._after_vote = self._after_vote, None
        while True:
            from_vote = after_vote is not None and after_vote[:2] == (quorum.id, step)
            snap = after_vote[2] if from_vote else self.snapshot()
            after_vote = None
            verdict = decide_votes(snap, quorum, step)
            if verdict is not None:
                self._admit_before = snap.voted.get((quorum.id, step)) if verdict else None
                if verdict:
                    self._prefetch()
                return verdict
            if from_vote:
                # Votes still missing as this one went in: read again before setting up a
                # watch (a watch costs more than a read, and the others vote within ms).
                continue
            now = time.monotonic()
            if now >= probe_at:
                probe_at = now + _VOTE_WAIT_BEFORE_PROBE_S
                if self._fence_dead(snap, quorum, step):
                    continue
            remaining = deadline - now
            if remaining <= 0:
                raise QuorumError(f"replica group {self.group}: step {step} of quorum "
                                  f"{quorum.id} undecided after {self.timeout:.0f}s")
            self.client.wait_for_change(self.root, snap.revision,
                                        min(remaining, self.lease_ttl,
                                            max(probe_at - now, 0.001)))

    def _fence_dead(self, snap: Snapshot, quorum: Quorum, step: int) -> bool:
        """Delete the key of each member of `quorum` that has not voted on `step` and
        whose store refuses connections (its process is gone), as its lease's expiry
        would: its vote (one still in flight included) can then never land, since a vote
        requires the voter's key, and every member decides the step abandoned. Each
        delete is conditional: on the vote being absent and the key unchanged (a
        restarted process that registered again is not touched). True if a key went."""
        votes = snap.votes.get((quorum.id, step), {})
        fenced = []
        for m in quorum.members:
            if m == self.group or m in votes or m not in snap.groups:
                continue
            if _store_answers(self.store_of(snap, m), _PROBE_S) is not False:
                continue
            key = self.root + "groups/" + m
            self.requests += 1
            if self.client.txn([Compare(f"{self.root}votes/{quorum.id}/{step}/{m}", "mod",
                                        "==", 0),
                                Compare(key, "mod", "==", snap.written[m])],
                               [OpDelete(key)]).succeeded:
                fenced.append(m)
        if fenced:
            logger.warning("[replica %s] quorum %d step %d: %s did not vote and its process "
                           "is gone (its store refuses connections): fenced out",
                           self.group, quorum.id, step, fenced)
        return bool(fenced)
