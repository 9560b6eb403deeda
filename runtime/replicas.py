"""The trainer's replica-group component: data parallelism across groups that heal in place.

With ``replica.job`` set, this rank's torch.distributed world is one replica group (its
own torchrun agent, any layout inside) and the groups of the job
train together through `elastic.replica.ReplicaManager`:

- before each step the groups agree on a quorum in etcd, and this group's share of the
  global batch follows from its place in it (`runtime.data.BatchPlan`): the global batch
  stays the same whatever the number of groups;
- after the backward (and the group's own gradient reduction: FSDP's reduce-scatter) each
  rank sums its gradient shards with the same rank of every other group, each group's
  weighted by its share of the batch;
- the step is applied only if every member of the quorum finished that reduction;
  otherwise nothing is applied anywhere and the same samples are redone in the next quorum;
- a group that starts while others train receives the whole state (parameters,
  optimizer, step, data position) from a live group's memory instead of storage.

Only the quorum's first group writes checkpoints: the replicas hold the same state.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from relight.elastic.etcd_client import EtcdSettings
from relight.elastic.quorum import Quorum
from relight.elastic.replica import ReplicaManager, ReplicaSettings
from relight.runtime.config import ConfigError, ReplicaConfig
from relight.runtime.data import BatchPlan

__all__ = ["ReplicaTraining", "SoleCopy", "replica_group_id"]

GROUP_ENV = "RELIGHT_REPLICA_GROUP"


def replica_group_id(cfg: ReplicaConfig) -> str:
    """This group's id: the config's, else `$RELIGHT_REPLICA_GROUP`, else the group's
    torchrun rendezvous id."""
    group = cfg.group or os.environ.get(GROUP_ENV) or os.environ.get("TORCHELASTIC_RUN_ID")
    if not group:
        raise ConfigError(f"replica.job={cfg.job!r} needs this group's id: set replica.group, "
                          f"${GROUP_ENV}, or run the group under its own torchrun/relight "
                          "run rendezvous id")
    if "/" in group:
        raise ConfigError(f"replica group id {group!r} must not contain '/'")
    return group


class SoleCopy:
    """When a replica group's memory has just become the job's only copy of its state:
    fed each step's quorum size, `committed()` after the step is True at the first
    committed step of a quorum of one that follows quorums of several, then not again
    until several groups have trained together once more."""

    def __init__(self) -> None:
        self._size = 0
        self._shared = False

    def quorum(self, size: int) -> None:
        self._size = size
        self._shared = self._shared or size > 1

    def committed(self) -> bool:
        if self._size != 1 or not self._shared:
            return False
        self._shared = False
        return True


class ReplicaTraining:
    """What `runtime.train.Trainer` calls around a step when replica groups are on."""

    def __init__(self, cfg: ReplicaConfig, plan: BatchPlan, *,
                 state: Callable[[], Mapping[str, Any]],
                 load: Callable[[Mapping[str, Any]], None],
                 restore: Callable[[], None] | None = None) -> None:
        """`state`, `load`: the trainer's live state (sent to, or healed into, a group);
        `restore()`: load the newest committed storage checkpoint, called when this group
        was to heal but every group holding the state is gone."""
        self.group = replica_group_id(cfg)
        endpoints = tuple(e.strip() for e in cfg.etcd.split(",") if e.strip())
        settings = ReplicaSettings(
            job=cfg.job, group=self.group,
            etcd=EtcdSettings(endpoints=endpoints, prefix=cfg.prefix,
                              attempt_timeout=min(2.0, max(0.2, cfg.lease_ttl_s / 3))),
            lease_ttl=cfg.lease_ttl_s, collective_timeout_s=cfg.collective_timeout_s,
            quorum_timeout_s=cfg.quorum_timeout_s, host=cfg.host or socket.gethostname(),
            min_groups=cfg.min_groups, failover_grace_s=cfg.failover_grace_s)
        self.base_plan = plan
        self.manager = ReplicaManager(settings, state=state, load=load, restore=restore)
        self.quorum: Quorum | None = None
        self.abandoned = 0
        """Steps abandoned on this group (a member of their quorum failed)."""
        self._sole = SoleCopy()

    @property
    def healing(self) -> bool:
        """Whether this group waits to receive the state from a live group (then it must
        not restore from storage). False once it healed, or restored from storage because
        no live group held the state."""
        return self.manager.healing

    def begin_step(self) -> BatchPlan:
        """The quorum of the next step (a heal may land first) and this rank's plan in it
        (no etcd request while the quorum stands)."""
        self.quorum = q = self.manager.start_step()
        self._sole.quorum(q.size)
        return dataclasses.replace(self.base_plan, replicas=q.size,
                                   replica_rank=q.rank(self.group))

    def reduce(self, params: list[torch.nn.Parameter], share: float, *,
               names: Sequence[str], extra: Sequence[torch.Tensor] = ()) -> None:
        """Sum every gradient (this rank's shard of it) across the groups, weighted by
        this group's share of the global batch, and `extra` tensors (the step's loss) in
        the same collective. Every group passes the same tensors in the same order: a
        parameter without a gradient contributes zeros. The gradients go as DTensors
        named by their parameters' `names`, so a quorum whose groups' layouts differ sums
        them by global region; `extra` must then be equal on every rank of the group
        (`layouts_differ`)."""
        grads = list(extra)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        self.manager.allreduce(grads, weight=share,
                               names=[f"extra/{i}" for i in range(len(extra))]
                               + [f"param/{n}" for n in names])

    @property
    def layouts_differ(self) -> bool:
        """Whether this step's quorum holds groups of different layouts."""
        return self.manager.layouts_differ

    def agree(self, value: float) -> float:
        """After `reduce`, before `commit`: the quorum's first group's `value` (the
        gradient norm), so every group clips alike (`ReplicaManager.agree`)."""
        return self.manager.agree(value)

    def commit(self, step: int) -> bool:
        ok = self.manager.should_commit(step)
        self.abandoned += 0 if ok else 1
        return ok

    @property
    def saves_checkpoints(self) -> bool:
        """Whether this group writes the job's checkpoints now (the quorum's first)."""
        return self.quorum is None or self.quorum.rank(self.group) == 0

    def sole_copy(self) -> bool:
        """After a committed step: True once when the job's state has just come to live in
        this group's memory alone (the first step of a quorum of one after quorums of
        several: the other replicas are lost). The trainer then checkpoints to storage
        whatever `checkpoint.every` says: were this group lost too before the lost ones
        are replaced, the job would restart from its last periodic checkpoint, or from
        step 0. Once per such loss, not every step it trains alone."""
        return self._sole.committed()

    @property
    def alone(self) -> bool:
        return self.quorum is None or self.quorum.size == 1

    def record(self) -> dict[str, Any]:
        """Fields of the step's metrics record."""
        q, st = self.quorum, self.manager.stats
        rec: dict[str, Any] = {
            "replica_group": self.group, "quorum": q.id if q else None,
            "quorum_size": q.size if q else None, "quorum_s": round(st.quorum_s, 4),
            "rebuild_s": round(st.rebuild_s, 4),
            "cross_group_reduce_s": round(st.allreduce_s, 4),
            "commit_s": round(st.commit_s, 4), "abandoned_steps": self.abandoned,
            "etcd_requests": st.etcd_requests}
        healed = self.manager.heal_stats
        if healed is not None:
            rec.update(healed_bytes=healed.bytes, heal_s=round(healed.seconds, 4))
            self.manager.heal_stats = None
        return rec

    def close(self) -> None:
        self.manager.close()
