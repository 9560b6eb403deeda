"""One rank of a replica group of several ranks (HSDP in miniature): the tiny float64
regression of tiny_train.py with the weights sharded over the group's ranks, as FSDP
shards them, and the group's share of the global batch split over its ranks.

Per step every rank gathers the full weights from its group (the all-gather FSDP does
before the forward), computes the gradients of its samples, the group sums them (the
reduce-scatter FSDP does after the backward; a plain all-reduce here, of which each
rank keeps its shard), and each rank reduces its shard across the groups with
`ReplicaManager.allreduce` (weighted by the group's share of the batch). The group is a
torch.distributed world of its own (RANK/WORLD_SIZE/MASTER_PORT in the environment,
one port per group), as under its own torchrun agent.

Every committed step appends an event with the rank's shard digest and the samples it
used, so the test checks bitwise identical shards across groups after every step and
that every sample of every step is consumed exactly once.

With `--dtensor` the weights are a DTensor sharded over a one-dimensional mesh of the
group's ranks, so groups of different sizes (different layouts) can train together: the
manager then routes the heal and the reduction by global region, and each step's event
carries the digest of the whole weights (gathered in the group) instead of the shard's.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from relight.elastic.etcd_client import EtcdSettings
from relight.elastic.replica import ReplicaManager, ReplicaSettings
from tests.elastic.scripts.replica_train import event
from tests.elastic.scripts.tiny_train import DIM, LR, grad_of

BATCH_R = 12
"""Global batch: 12 samples, split over the quorum's groups, then over a group's ranks."""


def share(step: int, groups: int, group_rank: int, ranks: int, rank: int) -> list[int]:
    """Samples of `step` this rank computes: the group's contiguous run of the batch
    (as even as it goes), then every `ranks`-th of those."""
    base, extra = divmod(BATCH_R, groups)
    first = group_rank * base + min(group_rank, extra)
    mine = range(first, first + base + (group_rank < extra))
    return [step * BATCH_R + j for j in mine][rank::ranks]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoints", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-file", required=True,
                   help="a file whose content, once it exists, is the number of steps")
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--heal", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--dtensor", action="store_true")
    a = p.parse_args()
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    settings = ReplicaSettings(
        job=a.job, group=a.group, lease_ttl=5.0, collective_timeout_s=5.0,
        min_groups=a.min_groups,
        etcd=EtcdSettings(endpoints=tuple(a.endpoints.split(",")), prefix="/relight-test",
                          timeout=30.0, attempt_timeout=1.0))
    shard = slice(rank * DIM // ranks, (rank + 1) * DIM // ranks)
    w_local = torch.zeros(DIM // ranks, dtype=torch.float64)
    state = {"w": w_local, "progress": {"step": 0}, "extra": torch.zeros(4096)}
    if a.dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (ranks,))

        def sharded(local: torch.Tensor) -> torch.Tensor:
            return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

        state["w"] = sharded(w_local)
    if a.heal is not True:  # a joiner's copy arrives by the heal
        # A plain tensor is the same on every rank of a group when layouts may differ.
        state["extra"].copy_(torch.arange(4096, dtype=torch.float32) + (0 if a.dtensor
                                                                        else rank))
    mgr = ReplicaManager(settings, state=lambda: state, heal=a.heal)
    event(a.out, ev="start", group=a.group, rank=rank, heal=mgr.healing)
    target = None
    while target is None or state["progress"]["step"] < target:
        q = mgr.start_step()
        step = state["progress"]["step"]  # a heal may have set it
        if mgr.heal_stats is not None:
            event(a.out, ev="healed", group=a.group, rank=rank, step=step, quorum=q.id,
                  bytes=mgr.heal_stats.bytes)
            mgr.heal_stats = None
        pieces = [torch.empty_like(w_local) for _ in range(ranks)]
        dist.all_gather(pieces, w_local)
        w = torch.cat(pieces)
        mine = share(step, q.size, q.rank(a.group), ranks, rank)
        total = torch.zeros(DIM, dtype=torch.float64)
        for i in mine:
            total += grad_of(w, i)
        dist.all_reduce(total)  # the group's sum over its ranks' samples
        grad = total[shard].clone()
        # Logged before the reduction (as in replica_train.py): a group killed while its
        # peers' reduction completes still accounts for its share.
        event(a.out, ev="reduced", group=a.group, rank=rank, step=step, quorum=q.id,
              samples=mine)
        # Summed across groups: every sample of the global batch once.
        mgr.allreduce([sharded(grad) if a.dtensor else grad], weight=1.0)
        time.sleep(a.step_sleep)
        if mgr.should_commit(step):
            w_local.sub_(LR * grad / BATCH_R)
            state["progress"]["step"] = step + 1
            if a.dtensor:
                dist.all_gather(pieces, w_local)
                held = torch.cat(pieces)
            else:
                held = w_local
            event(a.out, ev="step", group=a.group, rank=rank, step=step, quorum=q.id,
                  size=q.size, samples=mine, mixed=mgr.layouts_differ,
                  digest=hashlib.sha256(held.numpy().tobytes()).hexdigest())
        else:
            event(a.out, ev="abandoned", group=a.group, rank=rank, step=step, quorum=q.id,
                  samples=mine)
        if target is None and os.path.exists(a.stop_file):
            target = int(open(a.stop_file).read() or 0) or None
    extra = hashlib.sha256(state["extra"].numpy().tobytes()).hexdigest()
    event(a.out, ev="done", group=a.group, rank=rank, extra=extra)
    mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
