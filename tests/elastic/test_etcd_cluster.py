"""The rendezvous against a 3-member etcd cluster, as users run it: members killed,
frozen (SIGSTOP: the member accepts connections and never answers) and restarted.

Each fault states its outcome as a bound: no restart where the group was healthy, and a
rendezvous after failover within 2 x lease_ttl/3 + the round's own time. The handler
tests run nodes as threads (cheap); the torchrun test runs two agents x two gloo workers
through a sequence of cluster faults in one job.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from tests.elastic.agents import SCRIPTS, Agents, events, torchrun_cmd, wait_for
from tests.elastic.rdzv_util import handler, in_thread, job_id, join_all, shutdown_all
from tests.elastic.test_failures import finish, steps, train_args, workers
from tests.elastic.test_rendezvous import _check_group

pytestmark = [pytest.mark.etcd]

TTL = 3.0
"""Lease TTL of these tests: keepalives every second."""


def _endpoints(cluster, first: int) -> str:
    """All members, member `first` listed first (the one a client tries first)."""
    order = [first, *[i for i in range(len(cluster.members)) if i != first]]
    return ",".join(cluster.endpoints[i] for i in order)


def _follower(cluster) -> int:
    leader = cluster.leader()
    return next(i for i in range(len(cluster.members)) if i != leader)


@pytest.mark.timeout(120)
def test_frozen_first_follower_keeps_every_lease(etcd_cluster) -> None:
    frozen = _follower(etcd_cluster)
    ep = _endpoints(etcd_cluster, frozen)
    run = job_id()
    hs = [handler(ep, run, 2, 2, lease_ttl=str(TTL), etcd_timeout="30") for _ in range(2)]
    try:
        _check_group(join_all(hs), 2)
        etcd_cluster.pause(frozen)
        try:
            # Three TTLs with the first-listed member frozen, the group watching for
            # lost members as torchrun's monitor loop does.
            t_end = time.monotonic() + 3 * TTL
            while time.monotonic() < t_end:
                assert [h.num_nodes_waiting() for h in hs] == [0, 0]
                assert not any(h._keeper.lost.is_set() for h in hs)
                time.sleep(0.2)
        finally:
            etcd_cluster.resume(frozen)
        client = EtcdClient(EtcdSettings(endpoints=tuple(etcd_cluster.endpoints)))
        for h in hs:
            kv = client.get(f"/relight-test/{run}/nodes/{h.node_id}")
            assert kv is not None and kv.lease == h._lease, "a healthy node lost its lease"
    finally:
        shutdown_all(hs)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("frozen_role", ["leader", "follower"])
def test_rendezvous_fails_over_from_a_frozen_first_member(etcd_cluster, frozen_role) -> None:
    leader = etcd_cluster.leader()
    frozen = leader if frozen_role == "leader" else _follower(etcd_cluster)
    ep = _endpoints(etcd_cluster, frozen)
    run = job_id()
    # The etcd deadline of a real job (30 s): a hung member must not eat it.
    hs = [handler(ep, run, 2, 2, lease_ttl=str(TTL), etcd_timeout="30") for _ in range(2)]
    try:
        _check_group(join_all(hs), 2)
        t0 = time.monotonic()
        _check_group(join_all(hs), 2)  # a re-rendezvous on a healthy cluster
        round_time = time.monotonic() - t0
        etcd_cluster.pause(frozen)
        try:
            # A worker failed: both agents re-rendezvous with the member frozen.
            t0 = time.monotonic()
            _check_group(join_all(hs), 2)
            failover = time.monotonic() - t0
        finally:
            if frozen_role == "follower":
                etcd_cluster.resume(frozen)
            else:
                # A resumed 3.5.1 leader may revoke leases the new leader renewed
                # (etcd-io/etcd#15247): end it instead of waking it.
                etcd_cluster.kill(frozen)
        print(f"\nrendezvous with the first-listed {frozen_role} frozen: {failover:.2f}s "
              f"(healthy: {round_time:.2f}s)")
        # 2 x lease_ttl/3 for the failover, plus the round's own time; the second term
        # is slack for a loaded machine (an election takes ~1 s when the leader froze).
        assert failover < 2 * TTL / 3 + round_time + 5.0, (failover, round_time)
    finally:
        shutdown_all(hs)


@pytest.mark.timeout(120)
def test_leader_killed_during_a_rendezvous(etcd_cluster) -> None:
    leader = etcd_cluster.leader()
    ep = _endpoints(etcd_cluster, leader)
    run = job_id()
    hs = [handler(ep, run, 3, 3, lease_ttl=str(TTL), etcd_timeout="30") for _ in range(3)]
    client = EtcdClient(EtcdSettings(endpoints=tuple(etcd_cluster.endpoints), timeout=30))
    try:
        waiting = [in_thread(h.next_rendezvous) for h in hs[:2]]
        wait_for(lambda: (kv := client.get(f"/relight-test/{run}/state")) is not None
                 and len(kv.json()["members"]) == 2, 30, "two members in the open round")
        etcd_cluster.kill(leader)
        third = hs[2].next_rendezvous()
        for t, _ in waiting:
            t.join(60)
        _check_group([*[out[0] for _, out in waiting], third], 3)
        state = client.get(f"/relight-test/{run}/state").json()
        assert (state["round"], state["phase"]) == (0, "complete")  # formed once
    finally:
        shutdown_all(hs)


# -- torchrun agents through a sequence of cluster faults ------------------------------

def _rdzv_starts(out) -> int:
    return len([e for e in events(out) if e["ev"] == "rdzv_start"])


def _trains_on(out, after: float, n: int = 5):
    return lambda: len([s for s in steps(out, world=4) if s["t"] > after]) >= n


@pytest.mark.long
@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_torchrun_job_through_cluster_faults(etcd_cluster, tmp_path) -> None:
    """Plain torchrun, 2 agents x 2 workers, all three members in --rdzv-endpoint:
    1. the first-listed follower frozen for 3 TTLs: no restart;
    2. the leader killed during training: no restart;
    3. two of three members down for 3 TTLs: no restart, training goes on;
    4. the leader frozen and a worker killed inside the stop: one restart, and the
       rendezvous completes after failover.
    The job ends with weights bitwise equal to an uninterrupted run."""
    out = tmp_path / "out"
    out.mkdir()
    first = _follower(etcd_cluster)
    run, agents = job_id(), Agents(out)
    cmd = torchrun_cmd(_endpoints(etcd_cluster, first), run, "2", 2,
                       SCRIPTS / "tiny_train.py", train_args(out), max_restarts=3,
                       conf={"lease_ttl": f"{TTL:g}", "etcd_timeout": "30"})
    outcome: dict[str, dict] = {}
    try:
        procs = [agents.start(cmd, f"node-{i}") for i in range(2)]
        wait_for(_trains_on(out, 0, 10), 120, "four workers training", agents)

        # 1. The first-listed follower frozen.
        starts = _rdzv_starts(out)
        etcd_cluster.pause(first)
        t0 = time.time()
        time.sleep(3 * TTL)
        etcd_cluster.resume(first)
        wait_for(_trains_on(out, t0 + 3 * TTL), 60, "training after the freeze", agents)
        outcome["follower frozen"] = {"restarts": _rdzv_starts(out) - starts}
        print(f"\n{outcome}", flush=True)

        # 2. The leader killed.
        starts = _rdzv_starts(out)
        leader = etcd_cluster.leader()
        etcd_cluster.kill(leader)
        t0 = time.time()
        wait_for(_trains_on(out, t0 + TTL), 60, "training after the leader's death", agents)
        etcd_cluster.start_member(leader)
        outcome["leader killed"] = {"restarts": _rdzv_starts(out) - starts}
        print(f"\n{outcome}", flush=True)

        # 3. Two of three members down: no quorum, but a running group needs none.
        starts = _rdzv_starts(out)
        down = [etcd_cluster.leader(), first if first != etcd_cluster.leader() else
                next(i for i in range(3) if i != first)]
        for i in down:
            etcd_cluster.kill(i)
        t0 = time.time()
        wait_for(_trains_on(out, t0, 10), 60, "training without etcd quorum", agents)
        time.sleep(max(0.0, t0 + 3 * TTL - time.time()))
        for i in down:
            etcd_cluster.start_member(i)
        outcome["two members down"] = {"restarts": _rdzv_starts(out) - starts}
        print(f"\n{outcome}", flush=True)

        # 4. The leader frozen, then a worker killed while it is.
        starts = _rdzv_starts(out)
        leader = etcd_cluster.leader()
        etcd_cluster.pause(leader)
        newest = max(workers(out, rank=1), key=lambda e: e["t"])  # the live rank 1
        restart, victim = newest["restart"], newest["pid"]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: [s for s in steps(out, world=4) if s["t"] > t_kill
                          and s["restart"] > restart], 90, "recovery after the kill", agents)
        done = [e["t"] for e in events(out) if e["ev"] == "rdzv_done" and e["t"] > t_kill]
        begun = [e["t"] for e in events(out) if e["ev"] == "rdzv_start" and e["t"] > t_kill]
        outcome["leader frozen + worker killed"] = {
            "restarts": 1 if begun else 0, "rendezvous_s": max(done) - min(begun)}
        etcd_cluster.kill(leader)  # never resumed: a 3.5.1 leader may revoke leases

        final = finish(agents, out, procs)
        print(f"\ncluster faults: {outcome}; final step {final['step']}")
        assert outcome["follower frozen"]["restarts"] == 0, (outcome, agents.logs())
        assert outcome["leader killed"]["restarts"] == 0, (outcome, agents.logs())
        assert outcome["two members down"]["restarts"] == 0, (outcome, agents.logs())
        # 2 x lease_ttl/3 of failover + the round's own time (slack for a loaded
        # machine: an election, four workers importing torch are not in it).
        assert outcome["leader frozen + worker killed"]["rendezvous_s"] < 2 * TTL / 3 + 8
    finally:
        agents.close()
