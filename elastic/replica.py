"""Data parallelism across replica groups that survives the loss of groups.

`ReplicaManager` is what a training loop (Relight's, or a user's own, as torchft's
Manager wraps one) calls around its cross-group gradient reduction:

    mgr = ReplicaManager(ReplicaSettings(job="run-1", group="g0", etcd=EtcdSettings(...)))
    while step < steps:
        quorum = mgr.start_step()               # who trains this step
        grads = local_gradients(samples_for(step, quorum.rank(mgr.group), quorum.size))
        mgr.allreduce(grads)                    # sum across groups, time-bounded
        if mgr.should_commit(step):             # the reduction completed: apply
            optimizer_step(grads); step += 1
        # else: not applied here; the same step is redone in the new quorum

Membership and quorums live in etcd (`elastic.quorum`); steps do not. In a standing
quorum a step commits when its cross-group reduction completes: every member's
contribution arrived, with a flag that says whether its membership watch saw a change
(then every member agrees in etcd at the next step boundary, the same one for all).
There is no etcd request between two steps. A group whose reduction failed or timed out
does not apply the step, closes its side (the others fail at their next collective, at
once) and votes the failure in etcd: the survivors re-form, and a member that applied
fewer steps than another heals from it before anyone trains (docs/design/
healing-step-protocol.md states why no two groups can train from different steps). The
cross-group process group is rebuilt for every new quorum on a fresh store prefix (gloo
on CPU), from the store the quorum's first healthy member hosts; every collective on it
is bounded by `collective_timeout_s`, so a dead or frozen peer fails the step within a
stated time instead of hanging it. Survivors never restart: a lost group costs the step
in flight.

**Groups of several ranks.** A group is a torch.distributed world of its own (one
torchrun agent, any layout inside). Its first rank is the group's voice: it alone talks
to etcd and hosts the group's store. Every step it shares the quorum with its peers over
the group's own process group, each local rank `r` reduces with rank `r` of every other
group (one cross-group process group per local rank, `quorum/{id}/rank{r}/`), the
ranks' outcomes are combined inside the group before its one vote, and the verdict is
shared back, so every rank of every group applies the same steps.

**Groups of different layouts.** When a new quorum's groups differ in size, or some
rank's layout of the state differs from the same rank's in another group (a group that
came back on fewer nodes, another split of the same model), the quorum is *mixed*: one
process group spans every rank of every member (`quorum/{id}/all/`), a heal moves each
box of the state from the source rank holding it to the joiner rank that needs it, and the
reduction sums each box across groups by routing (`elastic.regions`; tensors passed to
`allreduce` must then be DTensors, or plain tensors equal on every rank of a group). A
quorum whose layouts match uses the per-local-rank groups above.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relight.ckpt.state_layout import (
    FlatState,
    Piece,
    RankLayout,
    TensorRef,
    describe_placements,
    flatten_state,
    layout_digest,
    materialize_optimizer_states,
    rank_layout,
)
from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from relight.elastic.heal import (
    HealError,
    HealMismatchError,
    HealStats,
    reshard_state,
    transfer_state,
)
from relight.elastic.kv import KeyValueClient
from relight.elastic.process_groups import GlooGroups, ProcessGroupFactory, default_factory
from relight.elastic.quorum import Quorum, QuorumClient, QuorumError
from relight.elastic.regions import (
    RegionMismatchError,
    Transfer,
    plan_copy,
    plan_sum,
    sum_regions,
)
from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = ["ReplicaManager", "ReplicaSettings", "ReplicaSettingsError", "StepStats"]


class ReplicaSettingsError(RelightError, ValueError):
    """A `ReplicaSettings` field out of its range (the message names the field and what
    it must be)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplicaSettings:
    """One replica group's place in a job that heals in place."""

    job: str
    """Job id shared by every group (keys live under `{prefix}/{job}/replicas/`)."""
    group: str
    """This group's id, unique in the job (e.g. the group's torchrun `--rdzv-id`)."""
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    """How to reach etcd (all members of the cluster)."""
    lease_ttl: float = 10.0
    """Seconds after which a silent group is out of the quorum."""
    collective_timeout_s: float = 10.0
    """Bound on every cross-group collective (and on building the process group)."""
    quorum_timeout_s: float = 120.0
    """Longest wait for a quorum or a commit decision before QuorumError."""
    host: str = "127.0.0.1"
    """Address other groups reach this group's store and gloo sockets on."""
    min_groups: int = 1
    """Groups that must be ready before the first quorum forms (the job's start)."""
    failover_grace_s: float = 1.0
    """After a failed step, how long survivors wait for the vote of a silent member that
    may be alive (its store still takes connections) before re-forming without it. A
    member whose process is gone is not waited for: the survivors' pause per lost group
    is then rebuilding the process group and redoing the step."""
    max_heal_tries: int = 3
    """A joiner whose heal failed this many times (damaged bytes, a member lost during it)
    leaves the job and raises HealError in its loop: each try costs the live groups a
    step. A state that cannot take the heal at all (another structure than the
    source's) leaves at the first try (HealMismatchError)."""
    device: str | None = None
    """Where the cross-group reduction runs: `"cpu"` (gloo), `"cuda"` / `"cuda:N"` (NCCL,
    gradients reduced on the device). None: the device of the state's first tensor
    (`state=`), else the CPU."""
    probe_timeout_s: float = 2.0
    """At start, the longest wait for a quorum member's store to take a connection. A store
    that refuses means a member gone (killed under a lease not yet expired): no source
    to heal from. One that does not answer in time counts as alive (the group heals;
    if the member is gone, its lease ends and the group restores from storage)."""

    quorum_deciders: int = 3
    """At a membership change, how many of a quorum's members (its first ones holding the
    state) read every group's key and decide the next quorum; the others follow what
    they write (docs/design/heal-membership-at-scale.md). More than one, so that a lost
    decider costs the followers nothing; a quorum of this many groups or fewer has no
    followers."""
    follow_timeout_s: float = 5.0
    """How long a follower waits for the deciders' outcome (after the failover grace, for
    a failed step) before it reads every group's key and decides itself: the deciders
    need a read of every key and a compare-and-swap (a second at a thousand groups on a
    loaded etcd); a wait that ends too early costs that read on every follower."""

    def __post_init__(self) -> None:
        for name in ("min_groups", "max_heal_tries", "quorum_deciders"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ReplicaSettingsError(
                    f"ReplicaSettings.{name} must be an integer >= 1, got {value!r}")
        for name in ("lease_ttl", "collective_timeout_s", "quorum_timeout_s",
                     "failover_grace_s", "probe_timeout_s", "follow_timeout_s"):
            if getattr(self, name) <= 0:
                raise ReplicaSettingsError(
                    f"ReplicaSettings.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(slots=True)
class StepStats:
    """What the last step cost: time in the quorum protocol, the reduction, the vote."""

    quorum_s: float = 0.0
    rebuild_s: float = 0.0
    """Building a new quorum's process group, and the heal of its joiners."""
    allreduce_s: float = 0.0
    commit_s: float = 0.0
    rebuilt: bool = False
    etcd_requests: int = 0
    """etcd requests this group's first rank made for the step (0 on the happy path)."""


class _GroupLink:
    """Control messages inside one replica group: the first rank's JSON documents to
    every rank, and the AND of every rank's outcome. On a gloo group of its own whose
    timeout covers the longest quorum wait (the other ranks wait while the first one
    waits in etcd, e.g. for the job's first groups). A single-process group needs none."""

    def __init__(self, group_pg: dist.ProcessGroup | None, timeout_s: float) -> None:
        self.pg: dist.ProcessGroup | None = None
        self.rank, self.size = 0, 1
        if group_pg is not None and dist.get_world_size(group_pg) > 1:
            self.pg = dist.new_group(dist.get_process_group_ranks(group_pg), backend="gloo",
                                     timeout=timedelta(seconds=timeout_s))
            self.rank, self.size = dist.get_rank(self.pg), dist.get_world_size(self.pg)

    def share(self, doc: dict[str, Any] | None) -> dict[str, Any]:
        """The first rank's `doc`, on every rank (JSON bytes, never pickled)."""
        if self.size == 1:
            assert doc is not None
            return doc
        raw = json.dumps(doc).encode() if self.rank == 0 else b""
        n = torch.tensor([len(raw)], dtype=torch.int64)
        dist.broadcast(n, group_src=0, group=self.pg)
        buf = (torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0
               else torch.empty(int(n.item()), dtype=torch.uint8))
        dist.broadcast(buf, group_src=0, group=self.pg)
        return doc if self.rank == 0 else json.loads(buf.numpy().tobytes())

    def all_ok(self, ok: bool) -> bool:
        """Whether every rank of the group says `ok`."""
        return self.combine(ok, False)[0]

    def combine(self, ok: bool, flag: bool) -> tuple[bool, bool]:
        """Whether every rank of the group says `ok`, and whether any raises `flag`, in
        one collective."""
        if self.size == 1:
            return ok, flag
        t = torch.tensor([1 if ok else 0, 0 if flag else 1], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(t[0].item()), not bool(t[1].item())


@dataclass(slots=True)
class _MixedQuorum:
    """A quorum whose groups' layouts differ: every rank of every member in one process
    group, numbered group after group in quorum order."""

    groups: list[list[int]]
    """The process group's ranks of each member, in quorum order."""
    me: int
    store: dist.Store
    grad_plan: tuple[tuple, Transfer, dict[str, list[Piece]]] | None = None
    """The reduction's routing for the tensors `allreduce` was last given (their names,
    shapes, dtypes and placements), made at the first call in the quorum and when the
    tensors change."""
    grad_rounds: int = 0

    @property
    def group_of(self) -> list[int]:
        return [g for g, ranks in enumerate(self.groups) for _ in ranks]

    def layouts(self, key: str, mine: RankLayout) -> list[RankLayout]:
        """Every rank's layout, through the quorum's store (`key`: this exchange's)."""
        self.store.set(f"{key}/{self.me}", json.dumps(mine.to_json()))
        total = sum(len(g) for g in self.groups)
        docs = self.store.multi_get([f"{key}/{r}" for r in range(total)])
        return [RankLayout.from_json(json.loads(d)) for d in docs]


_Layout = tuple[RankLayout, dict[str, list[Piece]], str]


def _layout_of(flat: FlatState, rank: int) -> _Layout:
    """This rank's layout, its local pieces, and a digest of the layout alone (not of
    the rank's number)."""
    lay, pieces = rank_layout(flat, rank)
    return lay, pieces, layout_digest(RankLayout(0, lay.tensors, lay.values))


def _said(exc: BaseException) -> str:
    """An exception as text for a log line: a record that kept the exception itself (a
    test's log capture does) would keep its traceback's frames, and through them a
    failed process group that must close now."""
    return f"{type(exc).__name__}: {exc}"


def _state_device(flat: FlatState | None) -> torch.device | None:
    """The device of the first tensor of the flattened state (None without one)."""
    if flat is None:
        return None
    first = next(iter(flat.tensors.values()), None)
    if first is None:
        return None
    t = first.tensor
    return (t.to_local() if hasattr(t, "to_local") else t).device


def _quorum_doc(quorum: Quorum, store: tuple[str, int] | None) -> dict[str, Any]:
    return {"id": quorum.id, "members": list(quorum.members), "revision": quorum.revision,
            "healing": list(quorum.healing), "store": list(store) if store else None}


def _quorum_of(doc: dict[str, Any]) -> Quorum:
    return Quorum(int(doc["id"]), tuple(doc["members"]), int(doc["revision"]),
                  tuple(doc["healing"]))


class ReplicaManager:
    """One replica group's cross-group reduction and commit (see the module docstring).

    Call order per step, on every rank of the group: `start_step()` -> `allreduce(...)`
    (any number) -> `should_commit(step)`. `close()` at the end. Used by one thread.
    """

    def __init__(self, settings: ReplicaSettings, *,
                 state: Callable[[], Mapping[str, Any]] | None = None,
                 load: Callable[[Mapping[str, Any]], None] | None = None,
                 heal: bool | None = None,
                 restore: Callable[[], None] | None = None,
                 group_pg: dist.ProcessGroup | None = None,
                 kv: KeyValueClient | None = None,
                 process_groups: ProcessGroupFactory | None = None) -> None:
        """`state()` returns this rank's live state dict (tensors, stateful objects and
        JSON values, as for `ckpt.save`): what it sends to a healing group, or, when this
        group heals (a replacement, a restarted group, a spare), where what it receives
        lands before its first step; `load(state_dict)` is then called with it. `heal=None`
        decides at start: heal when other groups are already training (a quorum with a
        live member exists: its key held and its store not refusing connections).
        `restore()`: called on every rank when this group was to heal but every group
        holding the state is gone: it loads the newest committed storage checkpoint into
        the live state (or leaves the initial state, step 0, when there is none), as a job
        with no live replica does; the group then trains as the holder of the state
        (without `restore`, QuorumError). `group_pg`: the group's own
        process group when the group has several ranks (default: the default group,
        when one is initialised). `kv`: the coordinator the group's first rank runs the
        quorum protocol against (default: an `EtcdClient` on `settings.etcd`; an
        `elastic.memory_kv.MemoryEtcd` client runs the same rules in one process).
        `process_groups`: what builds each quorum's cross-group process group (default:
        `default_factory` for `settings.device`: NCCL for CUDA state, gloo otherwise)."""
        self.settings = settings
        self.group = settings.group
        self._state = state
        self._load = load
        self._restore = restore
        if group_pg is None and dist.is_initialized() and dist.get_world_size() > 1:
            group_pg = dist.group.WORLD
        # Covers the first rank's longest wait in etcd: a quorum, then a commit decision.
        self._link = _GroupLink(group_pg, 2 * settings.quorum_timeout_s
                                + settings.failover_grace_s + settings.collective_timeout_s)
        self.local_rank = self._link.rank
        self.quorum_client: QuorumClient | None = None
        self._store: dist.TCPStore | None = None
        timeout = timedelta(seconds=settings.collective_timeout_s)
        if self.local_rank == 0:
            self.quorum_client = QuorumClient(kv if kv is not None
                                              else EtcdClient(settings.etcd), settings.job,
                                              settings.group,
                                              lease_ttl=settings.lease_ttl,
                                              timeout=settings.quorum_timeout_s,
                                              failover_grace_s=settings.failover_grace_s,
                                              deciders=settings.quorum_deciders,
                                              follow_s=settings.follow_timeout_s)
            if heal is None:
                heal = self.quorum_client.training_elsewhere(settings.probe_timeout_s)
        heal = bool(self._link.share({"heal": heal} if self.local_rank == 0 else None)["heal"])
        if heal and state is None:
            raise ValueError("ReplicaManager: joining a job that is training needs state=: "
                             "where the state healed from a live group lands")
        self.healing = heal
        self.heal_stats: HealStats | None = None
        self._joined = False
        if self.quorum_client is not None:
            self._store = dist.TCPStore(settings.host, 0, is_master=True,
                                        wait_for_workers=False, timeout=timeout)
            if not heal:
                self._join()
        self.quorum: Quorum | None = None
        self._groups: ProcessGroupFactory = process_groups or GlooGroups(settings.host)
        """What builds the quorums' process groups; without `process_groups=`, chosen at
        the first quorum from `settings.device` or the state's device (the state may not
        exist yet while the manager is built: a user's loop builds its optimizer after)."""
        self._groups_chosen = process_groups is not None
        self._timeout = timeout
        self._pg: dist.ProcessGroup | None = None
        self._pg_quorum = -1
        self._mixed: _MixedQuorum | None = None
        """Set while the quorum's layouts differ (see the module docstring)."""
        self._failed: tuple[Quorum, int] | None = None
        self._absent: tuple[Quorum, tuple[str, ...]] | None = None
        """Members of a new quorum that did not enter it: the next `agree` leaves them
        out."""
        self._ok = True
        self.stats = StepStats()
        self._agree_first = False
        """The next step agrees in etcd before computing: some member's watch saw the
        job's keys change (a joiner, a leaver), said so in the last step's reduction."""
        self._flags: tuple[float, float] | None = None
        """This step's reduced flags `(members that contributed, members whose watch saw
        a change)`, once its first reduction carried them."""
        self._step_began = time.monotonic()
        self._step_s = 0.0
        """The last committed step's duration (start to commit): after a failure, a
        member that applied the step needs about that long to reach its next reduction
        and fail there, so the survivors wait that much beyond the failover grace."""
        self._heal_refused: str | None = None
        """Why this group gives up healing (set on the joiner): raised to its loop once
        the group has left the job."""
        self._heal_error: type[HealError] = HealMismatchError
        self._heal_failures = 0

    def _join(self) -> None:
        """Register the group. A group that heals registers at its first `start_step`,
        not before: its key asks the members to take it in at their next step boundary,
        and it must then be there to enter (the trainer builds its pipeline and opens
        its checkpoints in between); a group that holds the state registers at once."""
        assert self.quorum_client is not None and self._store is not None
        self.quorum_client.join((self.settings.host, self._store.port),
                                ready=not self.healing, heal=self.healing)
        self._joined = True

    @property
    def layouts_differ(self) -> bool:
        """Whether the current quorum is mixed: its groups' layouts differ, and the heal
        and the reduction route by global region."""
        return self._mixed is not None

    @property
    def requests(self) -> int:
        """etcd requests this group's per-step calls made (0 on ranks other than the first)."""
        return 0 if self.quorum_client is None else self.quorum_client.requests

    def start_step(self) -> Quorum:
        """This step's quorum. While it stands (the last step committed and no member's
        watch saw the job's keys change) it is returned at once, with no etcd request.
        Otherwise (the first step, a failed step, a membership change said in the last
        reduction) the groups agree in etcd, and a new quorum's process group is built
        (its first step begins with the heal of its joiners and of members behind)."""
        q = self.quorum
        self._flags, self._step_began = None, time.monotonic()
        if (q is not None and self._pg_quorum == q.id and self._ok and self._failed is None
                and self._absent is None and not self.healing and not self._agree_first):
            # The standing quorum: no etcd request (a change would have been said in the
            # last step's reduction).
            self.stats = StepStats()
            return q
        self._agree_first = False
        requests_before = self.requests
        t0 = time.monotonic()
        while True:
            doc = self._first_rank_says(self._agree)
            if doc.get("restore"):
                self._restore_alone(_quorum_of(doc))
                continue
            if not doc.get("enter"):
                break
            # A new quorum. Every rank lets go of the old quorum's process group before
            # the first rank waits for the members to enter: a member still in the old
            # quorum's collective (it began the step before this group saw the change)
            # then fails at once instead of at the collective timeout.
            self._drop_pg()
            self._pg_quorum = -1
            doc = self._first_rank_says(self._enter, doc)
            if not doc.get("again"):
                break
        quorum = _quorum_of(doc)
        self.stats = StepStats(quorum_s=time.monotonic() - t0)
        self.quorum, self._ok, self._failed = quorum, True, None
        if quorum.id != self._pg_quorum:
            t1 = time.monotonic()
            self._rebuild(quorum, doc["store"])
            self.stats.rebuild_s = time.monotonic() - t1
        if self._heal_refused is not None:
            self._leave_refused()
        if self.quorum_client is not None:
            # Watch from what this agreement read: a change after it is said in the next
            # reduction.
            self.quorum_client.watch_membership()
        self.stats.etcd_requests = self.requests - requests_before
        self._step_began = time.monotonic()
        return quorum

    def _first_rank_says(self, decide: Callable[..., dict[str, Any]], *args: Any
                         ) -> dict[str, Any]:
        """What the first rank's `decide(*args)` returns (it alone talks to etcd), on
        every rank; its `error` raised on every rank, so none hangs."""
        doc = self._link.share(decide(*args) if self.quorum_client is not None else None)
        if "error" in doc:
            raise QuorumError(doc["error"])
        return doc

    def _agree(self) -> dict[str, Any]:
        """The first rank's part of `start_step`: the quorum to share with the group's
        ranks, `restore` set when this group must restore the state from storage first,
        or the error every rank raises (none hangs)."""
        assert self.quorum_client is not None
        try:
            if not self._joined:
                self._join()
            failed, absent, self._failed, self._absent = self._failed, self._absent, None, None
            quorum, snap = self.quorum_client.agree(
                failed=failed, absent=absent, min_groups=self.settings.min_groups,
                grace_s=self.settings.failover_grace_s + 2 * self._step_s)
            if quorum.healing and not quorum.healthy:
                if self._restore is None:
                    raise QuorumError(
                        f"quorum {quorum.id} has no healthy group to heal "
                        f"{list(quorum.healing)} from: every replica is lost; restore "
                        "the job from its storage checkpoint (ReplicaManager restore=)")
                return {**_quorum_doc(quorum, None), "restore": True}
            store = self.quorum_client.store_of(snap, quorum.host) if quorum.size > 1 else None
            doc = _quorum_doc(quorum, store)
            # A new quorum is entered (`_enter`) once every rank has let go of the old one.
            return {**doc, "enter": True} if (quorum.size > 1
                                              and quorum.id != self._pg_quorum) else doc
        except QuorumError as exc:
            return {"error": str(exc)}

    def _enter(self, doc: dict[str, Any]) -> dict[str, Any]:
        """The first rank's entry into the new quorum `doc` names: wait for its members to
        enter it. `again` when the group must agree once more: a newer quorum replaced
        it, or some members did not come in (the next quorum forms without them)."""
        assert self.quorum_client is not None
        quorum = _quorum_of(doc)
        try:
            entry = self.quorum_client.confirm(quorum, self.settings.collective_timeout_s)
        except QuorumError as exc:
            return {"error": str(exc)}
        if entry.complete:
            return {k: v for k, v in doc.items() if k != "enter"}
        if entry.absent:
            self._absent = (quorum, entry.absent)
        return {"again": True}

    def _restore_alone(self, quorum: Quorum) -> None:
        """Every group holding the state is gone while this one waited to heal: restore
        from storage on every rank, then mark the group ready; its next quorum names it
        healthy (and a heal of other joiners then comes from it)."""
        assert self._restore is not None
        logger.warning("[replica %s/%d] quorum %d has no live group holding the state: "
                       "restoring from storage instead of healing", self.group,
                       self.local_rank, quorum.id)
        failure: BaseException | None = None
        try:
            self._restore()
        except Exception as exc:  # any failure: every rank must reach the AND below
            failure = exc
        if not self._link.all_ok(failure is None):
            raise QuorumError(f"replica group {self.group}: restoring from storage in "
                              f"quorum {quorum.id} failed on a rank") from failure
        self.healing = False
        if self.quorum_client is not None:
            self.quorum_client.set_ready(True)

    def _rebuild(self, quorum: Quorum, leader_store: list[Any] | None) -> None:
        self._drop_pg()
        self._pg_quorum, self._mixed = quorum.id, None
        self.stats.rebuilt = True
        if quorum.size == 1:
            return
        timeout = timedelta(seconds=self.settings.collective_timeout_s)
        healed = True
        try:
            assert leader_store is not None
            host, port = str(leader_store[0]), int(leader_store[1])
            store: dist.Store = (
                self._store if self._store is not None and quorum.host == self.group
                else dist.TCPStore(host, port, is_master=False, timeout=timeout))
            base = dist.PrefixStore(f"quorum/{quorum.id}/", store)
            sd = None if self._state is None else self._state()
            if sd is not None and self.group in quorum.healing:
                # A fresh optimizer has no state until its first step; the source's has.
                materialize_optimizer_states(sd)
            flat = None if sd is None else flatten_state(sd)
            if not self._groups_chosen:
                self._groups = default_factory(self.settings.device or _state_device(flat),
                                               self.settings.host)
                self._groups_chosen = True
            layout = None if flat is None else _layout_of(flat, self.local_rank)
            mixed = self._mixed_quorum(quorum, base, layout)
            if mixed is None:
                prefixed = dist.PrefixStore(f"rank{self.local_rank}/", base)
                rank, size = quorum.rank(self.group), quorum.size
            else:
                prefixed = dist.PrefixStore("all/", base)
                rank, size = mixed.me, sum(len(g) for g in mixed.groups)
            # Mixed quorums route boxes point to point on the host: gloo, whatever the
            # factory.
            factory = self._groups if mixed is None else GlooGroups(self.settings.host)
            self._pg = factory.create(prefixed, rank, size, timeout)
            self._mixed = mixed
            logger.info("[replica %s/%d] cross-group process group of quorum %d%s: %s rank "
                        "%d of %d", self.group, self.local_rank, quorum.id,
                        " (layouts differ)" if mixed else "", factory.backend, rank, size)
            if quorum.healing:
                self._heal(quorum, prefixed, sd, flat, layout)
        except (RuntimeError, dist.DistError, HealError) as exc:
            # A member died between the quorum and the connection: fail this step; the
            # next quorum forms without it. Our side closes now, so a member still in
            # the heal's collectives with us fails at once, not at its timeout.
            logger.warning("[replica %s/%d] building quorum %d's process group failed: %s",
                           self.group, self.local_rank, quorum.id, _said(exc))
            self._ok = healed = False
            self._drop_pg()
            if self.group in quorum.healing:
                self._heal_failures += 1
                if isinstance(exc, HealMismatchError):
                    self._heal_refused, self._heal_error = str(exc), HealMismatchError
                elif self._heal_failures >= self.settings.max_heal_tries:
                    self._heal_refused = (f"the heal failed {self._heal_failures} times "
                                          f"(last: {exc})")
                    self._heal_error = HealError
        if self.group in quorum.healing:
            # The group is ready only when every one of its ranks holds the state; a state
            # that cannot take the heal on any rank fails on every rank.
            healed, refused = self._link.combine(healed, self._heal_refused is not None)
            if refused and self._heal_refused is None:
                self._heal_refused = ("another rank of this replica group could not take "
                                      "the heal (its log says why)")
            if healed:
                self.healing = False
                if self.quorum_client is not None:
                    self.quorum_client.set_ready(True)
            else:
                self._ok = False

    def _leave_refused(self) -> None:
        """This group's state cannot take the heal (another structure than the source's):
        it leaves the job (its key is deleted, so the survivors re-form without it at
        once and lose the one step it was in) and its loop gets the reason. Trying again
        would fail the same way and cost the survivors a step every time."""
        reason, self._heal_refused = self._heal_refused, None
        self.close()
        raise self._heal_error(f"replica group {self.group} cannot heal from the live "
                               f"groups and has left the job: {reason}")

    def _mixed_quorum(self, quorum: Quorum, base: dist.Store, layout: _Layout | None
                      ) -> _MixedQuorum | None:
        """Whether `quorum`'s layouts differ, decided alike on every rank of every member
        from what each rank puts in the quorum's store: its group's size (first ranks)
        and its layout's digest (empty without `state=`: taken to match when the sizes
        do)."""
        digest = "" if layout is None else layout[2]
        base.set(f"layout/{self.group}/{self.local_rank}", digest)
        if self.local_rank == 0:
            base.set(f"size/{self.group}", str(self._link.size))
        sizes = [int(v) for v in base.multi_get([f"size/{g}" for g in quorum.members])]
        digests = [v.decode() for v in base.multi_get(
            [f"layout/{g}/{r}" for g, n in zip(quorum.members, sizes, strict=True)
             for r in range(n)])]
        if len(set(sizes)) == 1:
            per_rank = [set(digests[r::sizes[0]]) for r in range(sizes[0])]
            if all(len(d) == 1 or "" in d for d in per_rank):
                return None
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        groups = [list(range(o, o + n)) for o, n in zip(offsets, sizes, strict=True)]
        return _MixedQuorum(groups, offsets[quorum.rank(self.group)] + self.local_rank, base)

    def _heal(self, quorum: Quorum, store: dist.Store, sd: Mapping[str, Any] | None,
              flat: FlatState | None, layout: _Layout | None) -> None:
        """The quorum's first step begins with the live heal of its joiners: each rank
        of a joiner receives from the same rank of the first healthy member, or, when
        the layouts differ, each box from the member's rank that holds it."""
        if sd is None or flat is None or layout is None:
            raise QuorumError(f"group {list(quorum.healing)} is healing from this group's "
                              "memory, but this ReplicaManager was given no state=")
        receiving = self.group in quorum.healing
        if self._mixed is None:
            stats = transfer_state(self._pg, store, quorum.rank(self.group),
                                   quorum.rank(quorum.healthy[0]), sd, receiving=receiving)
        else:
            m = self._mixed
            mine, pieces, _ = layout
            layouts = m.layouts("heal/layout", dataclasses.replace(mine, rank=m.me))
            source = m.groups[quorum.rank(quorum.healthy[0])]
            dests = [r for g in quorum.healing for r in m.groups[quorum.rank(g)]]
            try:
                plan = plan_copy(layouts, source, dests, m.me)
            except RegionMismatchError as exc:
                raise HealMismatchError(f"live heal: {exc}") from exc
            stats = reshard_state(self._pg, m.store, flat, pieces, plan,
                                  publishes=m.me == source[0], receiving=receiving,
                                  timeout_s=self.settings.collective_timeout_s)
        if receiving:
            if self._load is not None:
                self._load(sd)
            self.heal_stats = stats
            logger.info("[replica %s/%d] healed from %s in quorum %d: %d tensors, %.1f MB in "
                        "%.2fs", self.group, self.local_rank, quorum.healthy[0], quorum.id,
                        stats.tensors, stats.bytes / 1e6, stats.seconds)

    def allreduce(self, tensors: list[torch.Tensor], *, weight: float | None = None,
                  names: list[str] | None = None) -> None:
        """Reduce `tensors` in place across the quorum's groups: each group's tensors
        times `weight`, summed (default weight `1 / quorum size`: the mean). A group
        whose share of the global batch differs from the others' passes its share as
        `weight`. A failure (a peer died or timed out) is remembered, not raised:
        `should_commit` then abandons the step on every group. `names`: each tensor's
        identity across groups (parameter names), which a quorum of different layouts
        pairs tensors by; default their positions, when every rank passes the same
        tensors in the same order (not so across pipeline splits that differ)."""
        if self.quorum is None:
            raise QuorumError("ReplicaManager.allreduce before start_step()")
        t0 = time.monotonic()
        scale = 1.0 / self.quorum.size if weight is None else weight
        if scale != 1.0:
            for t in tensors:
                (t.to_local() if hasattr(t, "to_local") else t).mul_(scale)
        if self._ok and self.quorum.size > 1:
            try:
                if self._pg is None:
                    raise RuntimeError("no process group for this quorum")
                if self._mixed is not None:
                    self._sum_mixed(tensors, names)
                else:
                    self._sum_matched([t.to_local() if hasattr(t, "to_local") else t
                                       for t in tensors], with_flags=self._flags is None)
            except (RuntimeError, dist.DistError) as exc:
                logger.warning("[replica %s/%d] cross-group reduction failed in quorum %d: "
                               "%s", self.group, self.local_rank, self.quorum.id, _said(exc))
                # Closing our side now makes a peer still blocked in this collective fail
                # at once instead of at its timeout, so every survivor votes in time.
                self._ok = False
                self._drop_pg()
        self.stats.allreduce_s += time.monotonic() - t0

    def agree(self, value: float) -> float:
        """After `allreduce`, before `should_commit`: in a quorum of different layouts,
        the quorum's first rank's `value` on every rank of every group (a quantity each
        group computes from the reduced gradients by its own layout, so rounded
        differently: the gradient norm that scales a clip). Elsewhere `value` itself:
        groups of one layout compute the same bits. A failure fails the step, as in
        `allreduce`."""
        if self._mixed is None or not self._ok or self._pg is None:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        try:
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = 0, 0
            self._pg.broadcast([t], opts).wait(self._timeout)
        except (RuntimeError, dist.DistError) as exc:
            logger.warning("[replica %s/%d] agreeing on a value failed in quorum %d: %s",
                           self.group, self.local_rank, self.quorum.id if self.quorum
                           else -1, _said(exc))
            self._ok = False
            self._drop_pg()
            return value
        return float(t.item())

    def _watch_saw_change(self) -> bool:
        """Whether this rank's etcd watch saw the job's keys change (the first rank only:
        it alone watches)."""
        return (self.quorum_client is not None
                and self.quorum_client.membership_changed.is_set())

    def _local_flags(self) -> torch.Tensor:
        """What this rank adds to the step's flags: it contributed, and whether its watch
        saw a change."""
        return torch.tensor([1.0, 1.0 if self._watch_saw_change() else 0.0],
                            dtype=torch.float64)

    def _sum_matched(self, tensors: list[torch.Tensor], *, with_flags: bool = False) -> None:
        """The reduction of a quorum of one layout: each local rank's tensors all-reduced
        with the same rank of every other group, one flat buffer per dtype (one
        collective for all of them: a gloo allreduce of a list means one tensor per
        device, not many tensors). `with_flags`: the step's flags ride at the end of the
        float32 or float64 buffer (exact: they count members), so the step's outcome
        needs no collective of its own."""
        assert self._pg is not None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        carrier = next((d for d in (torch.float32, torch.float64) if d in by_dtype), None)
        for dtype, group in by_dtype.items():
            flags = with_flags and dtype == carrier
            parts = [t.reshape(-1) for t in group]
            if flags:
                parts.append(self._local_flags().to(device=group[0].device, dtype=dtype))
            flat = (group[0] if len(parts) == 1 and group[0].is_contiguous()
                    else torch.cat(parts))
            self._groups.wait(self._pg.allreduce([flat]), self._timeout)
            if flags:
                self._flags = (float(flat[-2]), float(flat[-1]))
            if flat is not group[0]:
                offset = 0
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _sum_mixed(self, tensors: list[torch.Tensor], names: list[str] | None) -> None:
        """The reduction of a mixed quorum: every box summed across the groups by
        routing. The tensors' layouts are exchanged through the quorum's store at the
        first call and whenever they change."""
        m = self._mixed
        assert m is not None and self._pg is not None
        names = [str(i) for i in range(len(tensors))] if names is None else names
        if len(names) != len(tensors) or len(set(names)) != len(names):
            raise ValueError("ReplicaManager.allreduce: names= must name each tensor once")
        # A cheap signature per step; the layout (a walk and a digest of every tensor's
        # boxes) only when it changes.
        signature = tuple((n, tuple(t.shape), t.dtype, describe_placements(t))
                          for n, t in zip(names, tensors, strict=True))
        if m.grad_plan is None or m.grad_plan[0] != signature:
            flat = FlatState(tensors={n: TensorRef(n, (n,), t)
                                      for n, t in zip(names, tensors, strict=True)})
            mine, pieces, _ = _layout_of(flat, m.me)
            layouts = m.layouts(f"grads/{m.grad_rounds}", mine)
            m.grad_rounds += 1
            m.grad_plan = (signature, plan_sum(layouts, m.groups, m.me), pieces)
        _, plan, pieces = m.grad_plan
        local = {n: t.to_local() if hasattr(t, "to_local") else t
                 for n, t in zip(names, tensors, strict=True)}
        sum_regions(self._pg, plan, local, pieces, m.group_of,
                    timeout_s=self.settings.collective_timeout_s)

    def should_commit(self, step: int) -> bool:
        """Whether to apply `step`: True when this group's reductions of it completed on
        every rank, each with every member's contribution (no etcd request). False: apply
        nothing; the group has voted the failure in etcd and the same step is redone after
        `start_step()` (a member that applied it meanwhile heals this group first)."""
        if self.quorum is None:
            raise QuorumError("ReplicaManager.should_commit before start_step()")
        t0 = time.monotonic()
        quorum = self.quorum
        ok = self._ok
        if ok and quorum.size > 1 and self._flags is None:
            self._reduce_flags()  # no float tensor carried them (or a mixed quorum)
            ok = self._ok
        if quorum.size > 1:
            flags = self._flags or (0.0, 0.0)
            # One contribution per member on a matched quorum's per-rank groups; one per
            # rank of every member on a mixed quorum's single group.
            expected = (quorum.size if self._mixed is None
                        else sum(len(g) for g in self._mixed.groups))
            ok = ok and flags[0] == expected
            changed = flags[1] > 0
        else:
            changed = self._watch_saw_change()
        ok, changed = self._link.combine(ok, changed)
        if ok:
            self._agree_first = changed
            self._step_s = time.monotonic() - self._step_began
            self.stats.commit_s = time.monotonic() - t0
            return True
        logger.warning("[replica %s/%d] step %d abandoned in quorum %d: redone in the "
                       "next quorum", self.group, self.local_rank, step, quorum.id)
        # Close our side first: a member still in (or about to start) a collective with
        # us fails at once, and votes too.
        self._drop_pg()
        self._failed, self._pg_quorum = (quorum, step), -1
        requests_before = self.requests
        self._first_rank_says(self._vote_failed, quorum, step)
        self.stats.etcd_requests += self.requests - requests_before
        self.stats.commit_s = time.monotonic() - t0
        return False

    def _reduce_flags(self) -> None:
        """The step's flags in a collective of their own, when no reduction carried
        them."""
        assert self._pg is not None
        flags = self._local_flags().to(
            self._groups.device if self._mixed is None else torch.device("cpu"))
        try:
            self._pg.allreduce([flags]).wait(self._timeout)
            self._flags = (float(flags[0]), float(flags[1]))
        except (RuntimeError, dist.DistError) as exc:
            logger.warning("[replica %s/%d] the step's flags failed in quorum %d: %s",
                           self.group, self.local_rank, self.quorum.id if self.quorum
                           else -1, _said(exc))
            self._ok = False
            self._drop_pg()

    def _vote_failed(self, quorum: Quorum, step: int) -> dict[str, Any]:
        """The first rank's vote that `step` failed here (the fallback path: the
        survivors re-form with every member that voted in the quorum)."""
        assert self.quorum_client is not None
        try:
            self.quorum_client.vote(quorum, step, False)
            return {}
        except QuorumError as exc:
            return {"error": str(exc)}

    def _drop_pg(self) -> None:
        """Let go of the quorum's process group (a failed one is aborted: a peer still in
        a collective with it fails at once instead of at its timeout)."""
        pg, self._pg = self._pg, None
        if pg is not None:
            (self._groups if self._mixed is None else GlooGroups()).abort(pg)

    def close(self) -> None:
        self._drop_pg()
        if self.quorum_client is not None:
            self.quorum_client.leave()
            self.quorum_client = None
