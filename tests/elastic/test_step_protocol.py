"""The step protocol's failure points between a reduction and its apply, against a real
etcd and real gloo groups: a reduction that completes on some groups and fails on one
(that one applies nothing and heals from the groups that applied, before anyone trains
on); a group killed between its reduction and its apply (the others applied the step and
train on from it). After every fault every group holds the same state at the same step,
and no sample is trained twice or skipped."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid
from typing import Any

import pytest
import torch

from relight.elastic.etcd_client import EtcdSettings
from relight.elastic.replica import ReplicaManager, ReplicaSettings
from tests.elastic.agents import ROOT, SCRIPTS, events
from tests.elastic.rdzv_util import job_id

pytestmark = [pytest.mark.etcd]


class _ReductionFailsHereOnce:
    """Wraps a manager's matched reduction: at `step` it completes (every member's data
    arrived everywhere: it waits until `others` completed theirs) and then fails on this
    group alone, as a local timeout that fires just after the last message does (a peer
    frozen and thawed just after). Failing sooner could close the sockets while a peer
    still reads the reduction's last message."""

    def __init__(self, mgr: ReplicaManager, state: dict[str, Any], step: int,
                 others: list[threading.Event]) -> None:
        self.real, self.state, self.step, self.fired = mgr._sum_matched, state, step, False
        self.others = others
        mgr._sum_matched = self  # type: ignore[method-assign]

    def __call__(self, tensors: list[torch.Tensor], **kw: Any) -> None:
        self.real(tensors, **kw)
        if not self.fired and self.state["progress"]["step"] == self.step:
            self.fired = True
            # Bounds a test bug: the peers complete within milliseconds of this group.
            assert all(done.wait(60) for done in self.others)
            raise RuntimeError("injected: the reduction timed out here after completing "
                               "on the other groups")


class _ReductionCompletes:
    """Wraps a manager's matched reduction: `done` is set once it completed at `step`."""

    def __init__(self, mgr: ReplicaManager, state: dict[str, Any], step: int) -> None:
        self.real, self.state, self.step = mgr._sum_matched, state, step
        self.done = threading.Event()
        mgr._sum_matched = self  # type: ignore[method-assign]

    def __call__(self, tensors: list[torch.Tensor], **kw: Any) -> None:
        self.real(tensors, **kw)
        if self.state["progress"]["step"] == self.step:
            self.done.set()


def test_a_reduction_that_fails_on_one_group_heals_it_from_the_groups_that_applied(
        etcd_server) -> None:
    job = f"steps-{uuid.uuid4().hex[:8]}"
    groups = ("a", "b", "c")
    steps = 6
    states = {g: {"w": torch.zeros(4, dtype=torch.float64), "progress": {"step": 0}}
              for g in groups}
    log: dict[str, list[tuple[str, int, int]]] = {g: [] for g in groups}

    def manager(g: str) -> ReplicaManager:
        settings = ReplicaSettings(
            job=job, group=g, etcd=EtcdSettings(endpoints=(etcd_server.endpoint,),
                                                prefix="/relight-test"),
            lease_ttl=30.0, collective_timeout_s=30.0, quorum_timeout_s=120.0,
            failover_grace_s=2.0, min_groups=3)
        return ReplicaManager(settings, state=lambda: states[g], heal=False)

    mgrs = {g: manager(g) for g in groups}
    others = [_ReductionCompletes(mgrs[g], states[g], step=2).done for g in ("b", "c")]
    _ReductionFailsHereOnce(mgrs["a"], states["a"], step=2, others=others)

    def train(g: str) -> bool:
        mgr, state = mgrs[g], states[g]
        while state["progress"]["step"] < steps:
            q = mgr.start_step()
            step = state["progress"]["step"]  # a heal may just have set it
            if mgr.heal_stats is not None:
                log[g].append(("healed", step, q.id))
                mgr.heal_stats = None
            grad = torch.full((4,), float(step + 1), dtype=torch.float64) * (q.rank(g) + 1)
            mgr.allreduce([grad], weight=1.0)
            if mgr.should_commit(step):
                state["w"].add_(grad)
                state["progress"]["step"] = step + 1
                log[g].append(("applied", step, q.id))
            else:
                log[g].append(("abandoned", step, q.id))
        return True

    try:
        out: dict[str, list] = {g: [] for g in groups}
        threads = [threading.Thread(target=lambda g=g: out[g].append(train(g)), daemon=True)
                   for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert all(out[g] == [True] for g in groups), (out, log)
    finally:
        for m in mgrs.values():
            m.close()
    # a: step 2 not applied; healed into step 3 from b or c (which applied step 2).
    assert ("abandoned", 2, 0) in log["a"], log["a"]
    assert any(e[0] == "healed" and e[1] == 3 for e in log["a"]), log["a"]
    assert not any(e[0] == "applied" and e[1] == 2 for e in log["a"]), log["a"]
    # b and c applied step 2, then lost step 3 once (a had closed its side).
    for g in ("b", "c"):
        assert ("applied", 2, 0) in log[g] and ("abandoned", 3, 0) in log[g], log[g]
    # The same state everywhere, and it is the sum of every step's reduced gradient once.
    expected = sum(float(s + 1) * 6 for s in range(steps))  # ranks 1 + 2 + 3 per step
    for g in groups:
        assert states[g]["progress"]["step"] == steps
        assert states[g]["w"].tolist() == [expected] * 4, (g, states[g]["w"], log)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_group_killed_between_its_reduction_and_its_apply(etcd_server, tmp_path) -> None:
    """g2 exits after its reduction of step 6 completed and before it applied the step:
    g0 and g1 applied it (their reduction completed too) and train on from it; g2's share
    of step 6 counts once, in the quorum that committed it."""
    job = job_id()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = {}
    try:
        for g in ("g0", "g1", "g2"):
            extra = ["--die-before-apply-at", "6"] if g == "g2" else []
            procs[g] = subprocess.Popen(
                [sys.executable, str(SCRIPTS / "replica_train.py"), "--endpoints",
                 etcd_server.endpoint, "--job", job, "--group", g, "--out", str(tmp_path),
                 "--steps", "14", "--min-groups", "3", *extra],
                stdout=open(tmp_path / f"{g}.log", "wb"),  # noqa: SIM115 - the child owns it
                stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        for g in ("g0", "g1"):
            procs[g].wait(240)
            assert procs[g].returncode == 0, (tmp_path / f"{g}.log").read_text()[-3000:]
        procs["g2"].wait(60)
        assert procs["g2"].returncode == 9
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    evs = events(tmp_path)
    steps = {g: [e for e in evs if e["ev"] == "step" and e["group"] == g] for g in procs}
    for g in ("g0", "g1"):
        assert [e["step"] for e in steps[g]] == list(range(14)), steps[g]
    assert [e["step"] for e in steps["g2"]] == list(range(6))
    # Step 6 was applied by g0 and g1 in the three groups' quorum, with g2's share.
    for g in ("g0", "g1"):
        six = steps[g][6]
        assert six["size"] == 3, six
    # Bitwise the same weights on g0 and g1 after every step.
    assert [e["digest"] for e in steps["g0"]] == [e["digest"] for e in steps["g1"]]
    # Every sample of every step once, in the quorum that committed it: g2's share of
    # step 6 is in its reduction, which g0 and g1 applied.
    for s in range(14):
        done = [e for e in evs if e["ev"] == "step" and e["step"] == s]
        q = max(e["quorum"] for e in done)
        trained = [i for e in done if e["quorum"] == q for i in e["samples"]]
        if s == 6:
            trained += [i for e in evs if e["ev"] == "reduced" and e["group"] == "g2"
                        and e["step"] == 6 for i in e["samples"]]
        assert sorted(trained) == list(range(s * 12, s * 12 + 12)), (s, done)


def test_the_optimizer_wrapper_trains_two_groups_alike_under_an_lr_schedule(
        etcd_server) -> None:
    """Two groups, each a model with AdamW wrapped in `ReplicaOptimizer` and a warm-up
    schedule on the wrapper: `zero_grad` starts the step, `step` applies the mean of the
    groups' gradients, the wrapper counts the steps and carries the count in its state."""
    from relight import ReplicaOptimizer

    job = f"optim-{uuid.uuid4().hex[:8]}"

    def group(g: str) -> tuple[torch.nn.Module, ReplicaOptimizer,
                               torch.optim.lr_scheduler.LRScheduler]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 1)
        mgr = ReplicaManager(ReplicaSettings(
            job=job, group=g, etcd=EtcdSettings(endpoints=(etcd_server.endpoint,),
                                                prefix="/relight-test"),
            lease_ttl=30.0, collective_timeout_s=30.0, min_groups=2), heal=False)
        opt = ReplicaOptimizer(mgr, torch.optim.AdamW(model.parameters(), lr=0.1))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
        return model, opt, sched

    groups = {g: group(g) for g in ("a", "b")}
    done: dict[str, list] = {g: [] for g in groups}

    def train(g: str) -> None:
        model, opt, sched = groups[g]
        while opt.steps < 4:
            opt.zero_grad()
            x = torch.full((2, 3), float(opt.steps + opt.rank + 1))  # differs per group
            model(x).sum().backward()
            if opt.step():
                sched.step()
                done[g].append(opt.steps)

    try:
        threads = [threading.Thread(target=train, args=(g,), daemon=True) for g in groups]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert done == {"a": [1, 2, 3, 4], "b": [1, 2, 3, 4]}, done
        (ma, oa, sa), (mb, _, _) = groups["a"], groups["b"]
        assert all(torch.equal(p, q) for p, q in zip(ma.parameters(), mb.parameters(),
                                                      strict=True))
        assert oa.param_groups[0]["lr"] == pytest.approx(0.1) and sa.last_epoch == 4
        sd = oa.state_dict()
        assert sd["steps"] == 4 and "state" in sd["optimizer"]
    finally:
        for _, opt, _ in groups.values():
            opt.manager.close()
