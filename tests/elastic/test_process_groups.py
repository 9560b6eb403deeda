"""Cross-group process groups come from the factory a replica manager is given: one per
quorum, aborted when a collective on it fails; the default picks gloo for CPU state and
NCCL for CUDA state where torch has it. Groups run as threads agreeing in one
`MemoryEtcd` (no etcd, no processes)."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from relight.elastic.memory_kv import MemoryEtcd
from relight.elastic.process_groups import GlooGroups, NcclGroups, default_factory
from relight.elastic.replica import ReplicaManager, ReplicaSettings


class _Recording(GlooGroups):
    """Gloo groups that remember what was built and aborted; `fail_at` makes the
    reduction's wait fail once at that call."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.created: list[tuple[int, int]] = []
        self.aborted = 0
        self.waits = 0
        self.fail_at = fail_at

    def create(self, store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroup:
        self.created.append((rank, size))
        return super().create(store, rank, size, timeout)

    def wait(self, work: dist.Work, timeout: timedelta) -> None:
        super().wait(work, timeout)
        self.waits += 1
        if self.waits == self.fail_at:
            raise RuntimeError("injected: the collective failed on this group")

    def abort(self, pg: dist.ProcessGroup) -> None:
        self.aborted += 1
        super().abort(pg)


def _train(mgrs: dict[str, ReplicaManager], states: dict[str, dict], steps: int
           ) -> dict[str, list]:
    log: dict[str, list] = {g: [] for g in mgrs}

    def run(mgr: ReplicaManager) -> None:
        state = states[mgr.group]
        while state["progress"]["step"] < steps:
            q = mgr.start_step()
            step = state["progress"]["step"]  # a heal may just have set it
            grad = torch.full((3,), float(step + 1))
            mgr.allreduce([grad], weight=1.0)
            ok = mgr.should_commit(step)
            if ok:
                state["w"].add_(grad)
                state["progress"]["step"] = step + 1
            log[mgr.group].append((step, q.id, ok))

    threads = [threading.Thread(target=run, args=(m,), daemon=True) for m in mgrs.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # bounds a hang: the steps take milliseconds
    assert not any(t.is_alive() for t in threads), log
    return log


def _managers(factories: dict[str, GlooGroups], states: dict[str, dict]
              ) -> dict[str, ReplicaManager]:
    server, job = MemoryEtcd(), f"pg-{uuid.uuid4().hex[:8]}"
    mgrs = {}
    for g, factory in factories.items():
        settings = ReplicaSettings(job=job, group=g, lease_ttl=30.0, collective_timeout_s=20.0,
                                   quorum_timeout_s=60.0, failover_grace_s=0.5,
                                   min_groups=len(factories))
        mgrs[g] = ReplicaManager(settings, state=lambda g=g: states[g], heal=False,
                                 kv=server.client(), process_groups=factory)
    return mgrs


def test_each_quorum_builds_one_group_from_the_factory_and_a_failed_one_is_aborted() -> None:
    factories = {"a": _Recording(fail_at=3), "b": _Recording()}
    states = {g: {"w": torch.zeros(3), "progress": {"step": 0}} for g in factories}
    mgrs = _managers(factories, states)
    try:
        log = _train(mgrs, states, steps=5)
    finally:
        for m in mgrs.values():
            m.close()
    # a's third reduction completed and then failed on a alone: a abandons step 2; b
    # applied it and fails at its next reduction (a closed its side at once, not at the
    # 20 s timeout). Both re-form once; a heals from b and no step is lost.
    assert [s for s, _, ok in log["a"] if not ok] == [2], log
    assert [s for s, _, ok in log["b"] if not ok] == [3], log
    for g in ("a", "b"):
        assert len({qid for _, qid, _ in log[g]}) == 2, log[g]
        assert states[g]["progress"]["step"] == 5
    assert torch.equal(states["a"]["w"], states["b"]["w"])
    assert states["a"]["w"].tolist() == [2.0 * sum(range(1, 6))] * 3
    # One group per quorum on each member, from its factory; the failed one aborted, the
    # last at close.
    assert factories["a"].created == [(0, 2), (0, 2)]
    assert factories["b"].created == [(1, 2), (1, 2)]
    assert factories["a"].aborted == 2 and factories["b"].aborted == 2


def test_the_default_factory_follows_the_state_device() -> None:
    assert isinstance(default_factory(None), GlooGroups)
    assert isinstance(default_factory("cpu"), GlooGroups)
    cuda = default_factory("cuda:0")
    if dist.is_nccl_available():
        assert isinstance(cuda, NcclGroups) and cuda.device == torch.device("cuda", 0)
    else:  # a CPU build: the reduction is staged through the host over gloo
        assert isinstance(cuda, GlooGroups)
        with pytest.raises(RuntimeError, match="no NCCL"):
            NcclGroups(torch.device("cuda", 0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or not dist.is_nccl_available(),
                    reason="needs a GPU and a torch build with NCCL")
def test_nccl_groups_build_reduce_on_the_device_and_abort() -> None:
    """One GPU: a communicator of one rank (NCCL refuses two ranks on one device), built
    eagerly, a reduction of a CUDA tensor waited on by the host, then aborted. The cross-
    group sum on two GPUs waits for a machine that has them."""
    groups = NcclGroups(torch.device("cuda", 0))
    pg = groups.create(dist.HashStore(), 0, 1, timedelta(seconds=60))
    t = torch.arange(1024, dtype=torch.float32, device="cuda")
    groups.wait(pg.allreduce([t]), timedelta(seconds=60))
    assert t.device.type == "cuda" and torch.equal(t.cpu(), torch.arange(1024.0))
    groups.abort(pg)
