"""Data parallelism across replica groups that survives the loss of groups.

`ReplicaManager` is what a training loop (Relight's, or a user's own, as torchft's
Manager wraps one) calls around its cross-group gradient reduction:

    mgr = ReplicaManager(ReplicaSettings(job="run-1", group="g0", etcd=EtcdSettings(...)))
    while step < steps:
        quorum = mgr.start_step()               # who trains this step (etcd quorum)
        grads = local_gradients(samples_for(step, quorum.rank(mgr.group), quorum.size))
        mgr.allreduce(grads)                    # sum across groups, time-bounded
        if mgr.should_commit(step):             # every member reduced: apply
            optimizer_step(grads); step += 1
        # else: nothing was applied anywhere; the same step is redone in the new quorum

The quorum and the commit vote live in etcd (`elastic.quorum`). The cross-group process
group is rebuilt for every new quorum on a fresh store prefix (gloo on CPU), from the
store the quorum's first member hosts; every collective on it is bounded by
`collective_timeout_s`, so a dead or frozen peer fails the step within a stated time
instead of hanging it. Survivors never restart: a lost group costs the step in flight.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from elastic.etcd_client import EtcdClient, EtcdSettings
from elastic.heal import HealError, HealStats, transfer_state
from elastic.quorum import Quorum, QuorumClient, QuorumError, Snapshot

logger = logging.getLogger(__name__)

__all__ = ["ReplicaManager", "ReplicaSettings", "StepStats"]


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
    """After a failed step, how long survivors wait for every member's vote before
    re-forming without the silent ones: the survivors' pause per lost group is about
    this plus rebuilding the process group."""

    def __post_init__(self) -> None:
        if self.min_groups < 1:
            raise ValueError("ReplicaSettings.min_groups must be >= 1")
        for name in ("lease_ttl", "collective_timeout_s", "quorum_timeout_s",
                     "failover_grace_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ReplicaSettings.{name} must be > 0")


@dataclass(slots=True)
class StepStats:
    """What the last step cost: time in the quorum protocol, the reduction, the vote."""

    quorum_s: float = 0.0
    allreduce_s: float = 0.0
    commit_s: float = 0.0
    rebuilt: bool = False


class ReplicaManager:
    """One replica group's cross-group reduction and commit (see the module docstring).

    Call order per step: `start_step()` -> `allreduce(...)` (any number) ->
    `should_commit(step)`. `close()` at the end. Used by one thread.
    """

    def __init__(self, settings: ReplicaSettings, *,
                 state: Callable[[], Mapping[str, Any]] | None = None,
                 heal: bool | None = None) -> None:
        """`state()` returns the group's live state dict (tensors, stateful objects and
        JSON values, as for `ckpt.save`): what this group sends to a healing group, or,
        when this group heals (a replacement, a restarted group, a spare), where what it
        receives lands before its first step. `heal=None` decides at start: heal when
        other groups are already training (a quorum with a live member exists)."""
        self.settings = settings
        self.group = settings.group
        self._state = state
        client = EtcdClient(settings.etcd)
        self.quorum_client = QuorumClient(client, settings.job, settings.group,
                                          lease_ttl=settings.lease_ttl,
                                          timeout=settings.quorum_timeout_s,
                                          failover_grace_s=settings.failover_grace_s)
        if heal is None:
            heal = self.quorum_client.training_elsewhere()
        if heal and state is None:
            raise ValueError("ReplicaManager: joining a job that is training needs state=: "
                             "where the state healed from a live group lands")
        self.healing = heal
        self.heal_stats: HealStats | None = None
        timeout = timedelta(seconds=settings.collective_timeout_s)
        self._store = dist.TCPStore(settings.host, 0, is_master=True,
                                    wait_for_workers=False, timeout=timeout)
        self.quorum_client.join((settings.host, self._store.port), ready=not heal,
                                heal=heal)
        self.quorum: Quorum | None = None
        self._pg: dist.ProcessGroup | None = None
        self._pg_quorum = -1
        self._failed: tuple[Quorum, int] | None = None
        self._ok = True
        self.stats = StepStats()

    def start_step(self) -> Quorum:
        """Agree on this step's quorum; rebuild the cross-group process group if it is
        a new one."""
        t0 = time.monotonic()
        quorum, snap = self.quorum_client.agree(failed=self._failed,
                                                min_groups=self.settings.min_groups)
        self.stats = StepStats(quorum_s=time.monotonic() - t0)
        self.quorum, self._ok, self._failed = quorum, True, None
        if quorum.id != self._pg_quorum:
            self._rebuild(quorum, snap)
        return quorum

    def _rebuild(self, quorum: Quorum, snap: Snapshot) -> None:
        self._pg, self._pg_quorum = None, quorum.id
        self.stats.rebuilt = True
        if quorum.healing and not quorum.healthy:
            raise QuorumError(f"quorum {quorum.id} has no healthy group to heal "
                              f"{list(quorum.healing)} from: every replica is lost; "
                              "restore the job from its storage checkpoint")
        if quorum.size == 1:
            return
        timeout = timedelta(seconds=self.settings.collective_timeout_s)
        host, port = self.quorum_client.store_of(snap, quorum.members[0])
        try:
            store: dist.Store = (self._store if quorum.members[0] == self.group else
                                 dist.TCPStore(host, port, is_master=False, timeout=timeout))
            prefixed = dist.PrefixStore(f"quorum/{quorum.id}/", store)
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(
                hostname=self.settings.host)]
            self._pg = dist.ProcessGroupGloo(prefixed, quorum.rank(self.group),
                                             quorum.size, options)
            logger.info("[replica %s] cross-group process group of quorum %d: rank %d of "
                        "%d", self.group, quorum.id, quorum.rank(self.group), quorum.size)
            if quorum.healing:
                self._heal(quorum, prefixed)
        except (RuntimeError, dist.DistError, HealError) as exc:
            # A member died between the quorum and the connection: fail this step; the
            # next quorum forms without it.
            logger.warning("[replica %s] building quorum %d's process group failed: %s",
                           self.group, quorum.id, exc)
            self._ok = False

    def _heal(self, quorum: Quorum, store: dist.Store) -> None:
        """The quorum's first step begins with the live heal of its joiners."""
        if self._state is None:
            raise QuorumError(f"group {list(quorum.healing)} is healing from this group's "
                              "memory, but this ReplicaManager was given no state=")
        receiving = self.group in quorum.healing
        stats = transfer_state(self._pg, store, quorum.rank(self.group),
                               quorum.rank(quorum.healthy[0]), self._state(),
                               receiving=receiving)
        if receiving:
            self.heal_stats, self.healing = stats, False
            self.quorum_client.set_ready(True)
            logger.info("[replica %s] healed from %s in quorum %d: %d tensors, %.1f MB in "
                        "%.2fs", self.group, quorum.healthy[0], quorum.id, stats.tensors,
                        stats.bytes / 1e6, stats.seconds)

    def allreduce(self, tensors: list[torch.Tensor]) -> None:
        """Average `tensors` in place across the quorum's groups. A failure (a peer died
        or timed out) is remembered, not raised: `should_commit` then abandons the step
        on every group."""
        if self.quorum is None:
            raise QuorumError("ReplicaManager.allreduce before start_step()")
        t0 = time.monotonic()
        if self._ok and self.quorum.size > 1:
            try:
                if self._pg is None:
                    raise RuntimeError("no process group for this quorum")
                self._pg.allreduce(tensors).wait()
            except (RuntimeError, dist.DistError) as exc:
                logger.warning("[replica %s] cross-group allreduce failed in quorum %d: %s",
                               self.group, self.quorum.id, exc)
                # Closing our side now makes a peer still blocked in this collective fail
                # at once instead of at its timeout, so every survivor votes in time.
                self._ok, self._pg = False, None
        if self._ok and self.quorum.size > 1:
            for t in tensors:
                t.div_(self.quorum.size)
        self.stats.allreduce_s += time.monotonic() - t0

    def should_commit(self, step: int) -> bool:
        """Vote, and return whether every member of the quorum finished its reduction of
        `step`. False: apply nothing; the same step is redone after `start_step()`."""
        if self.quorum is None:
            raise QuorumError("ReplicaManager.should_commit before start_step()")
        t0 = time.monotonic()
        quorum = self.quorum
        voted = self.quorum_client.vote(quorum, step, self._ok)
        verdict = voted and self.quorum_client.decide(quorum, step)
        self.stats.commit_s = time.monotonic() - t0
        if not verdict:
            logger.warning("[replica %s] step %d abandoned in quorum %d: redone in the next "
                           "quorum", self.group, step, quorum.id)
            self._failed, self._pg, self._pg_quorum = (quorum, step), None, -1
        return bool(verdict)

    def close(self) -> None:
        self._pg = None
        self.quorum_client.leave()
