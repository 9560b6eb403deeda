"""etcd faults without split brain: etcd killed and restarted during a rendezvous and
during training, a node frozen (SIGSTOP) for longer than its lease TTL, and a client
without the etcd role. (etcd unreachable at join: test_rendezvous; two jobs side by
side: test_rendezvous.)

"No split brain" is asserted from the workers' own step events, each tagged with the
rendezvous round its agent joined: every round forms once, and two rounds never train
at the same time (a worker frozen inside a step may finish that one step on waking,
never another).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from relight.elastic.etcd_client import EtcdClient, EtcdSettings
from relight.elastic.rendezvous import PASSWORD_ENV
from tests.elastic.agents import SCRIPTS, Agents, events, torchrun_cmd, wait_for
from tests.elastic.rdzv_util import handler, in_thread, job_id, shutdown_all
from tests.elastic.test_failures import steps, train_args
from tests.elastic.test_rendezvous import _check_group

pytestmark = [pytest.mark.etcd]


@pytest.mark.timeout(120)
def test_etcd_killed_and_restarted_during_a_rendezvous(etcd_restartable) -> None:
    run = job_id()
    # etcd may take a while to come back on a loaded machine: 30 s of etcd_timeout.
    hs = [handler(etcd_restartable.endpoint, run, 3, 3, etcd_timeout="30") for _ in range(3)]
    client = EtcdClient(EtcdSettings(endpoints=(etcd_restartable.endpoint,), timeout=30))
    waiting = [in_thread(h.next_rendezvous) for h in hs[:2]]
    try:
        wait_for(lambda: (kv := client.get(f"/relight-test/{run}/state")) is not None
                 and len(kv.json()["members"]) == 2, 30, "two members in the open round")
        etcd_restartable.kill()
        time.sleep(1.0)  # the two joiners now retry against a dead etcd
        etcd_restartable.start()
        third = hs[2].next_rendezvous()
        for t, _ in waiting:
            t.join(60)
        infos = _check_group([*[out[0] for _, out in waiting], third], 3)
        assert len({i.bootstrap_store_info.master_port for i in infos}) == 1
        state = client.get(f"/relight-test/{run}/state").json()
        # One round, formed once, with all three: no second group on either side of the
        # restart.
        assert (state["round"], state["phase"], len(state["participants"])) == (0, "complete", 3)
    finally:
        shutdown_all(hs)


def test_client_without_the_role_is_refused(etcd_secure, tls_certs, monkeypatch) -> None:
    from tests.elastic.conftest import etcdctl

    etcdctl(etcd_secure, tls_certs, "user", "add", "mallory:mallory-pw", "--interactive=false",
            user="root:root-pw")
    monkeypatch.setenv(PASSWORD_ENV, "mallory-pw")
    conf = {"prefix": "/relight-secure", "username": "mallory", "ca_file": tls_certs.ca,
            "cert_file": tls_certs.client_cert, "key_file": tls_certs.client_key}
    intruder = handler(etcd_secure.endpoint, job_id(), 1, 1, **conf)
    try:
        with pytest.raises(RendezvousConnectionError, match="denied"):
            intruder.next_rendezvous()
    finally:
        intruder.shutdown()  # as torchrun's agent does: stops the lease keeper


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _rounds_never_overlap(out: Path, frozen: set[int], t_cont: float) -> None:
    evs = [e for e in events(out) if e["ev"] == "step"]
    by_round: dict[int, list[dict]] = {}
    for e in evs:
        by_round.setdefault(e["round"], []).append(e)
    assert -1 not in by_round, "a worker did not get RELIGHT_RDZV_ROUND"
    # A worker frozen inside a step may log that step when it wakes; nothing more.
    stragglers = [e for e in evs if e["pid"] in frozen and e["t"] > t_cont]
    for pid in {e["pid"] for e in stragglers}:
        mine = [e for e in stragglers if e["pid"] == pid]
        before = max(e["step"] for e in evs if e["round"] == mine[0]["round"]
                     and e["t"] < t_cont)
        assert len(mine) <= 1 and mine[0]["step"] <= before + 1, mine
    spans = {}
    for r, es in by_round.items():
        ts = [e["t"] for e in es if e not in stragglers]
        if ts:
            spans[r] = (min(ts), max(ts))
        worlds = {e["world"] for e in es}
        assert len(worlds) == 1, (r, worlds)  # one group per round
    ordered = sorted(spans.items())
    for (r1, (_, end1)), (r2, (start2, _)) in zip(ordered, ordered[1:], strict=False):
        assert end1 <= start2, f"round {r1} still trained at {end1} after round {r2} began"


@pytest.mark.long
@pytest.mark.multirank
@pytest.mark.timeout(420)
def test_etcd_restart_then_a_frozen_node_during_training(etcd_restartable, tmp_path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    run = job_id()
    agents = Agents(out)
    cmd = torchrun_cmd(etcd_restartable.endpoint, run, "1:2", 1, SCRIPTS / "tiny_train.py",
                       train_args(out), max_restarts=3,
                       conf={"rejoin_timeout": "5", "etcd_timeout": "30"})
    try:
        a = agents.start(cmd, "node-a")
        b = agents.start(cmd, "node-b")
        wait_for(lambda: len({e["pid"] for e in steps(out, world=2)}) == 2
                 and max(e["step"] for e in steps(out, world=2)) >= 8, 120,
                 "two workers training together", agents)

        # 1. etcd dies for 2 s (the lease TTL) under a running job: nobody restarts,
        # training goes on.
        rdzv_before = len([e for e in events(out) if e["ev"] == "rdzv_start"])
        etcd_restartable.kill()
        t_down = time.time()
        time.sleep(2.0)
        etcd_restartable.start()
        time.sleep(1.0)  # > one keepalive period (ttl/3) after the restart
        assert len([e for e in events(out) if e["ev"] == "rdzv_start"]) == rdzv_before, \
            agents.logs()
        assert [e for e in steps(out, world=2) if e["t"] > t_down + 1], "training stalled"

        # 2. node b frozen for longer than its 2 s lease: a goes on alone.
        round_before = max(e["round"] for e in steps(out))
        frozen = agents.worker_pids(b)
        for pid in [b.pid, *frozen]:
            os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: len(steps(out, world=1)) >= 5, 90, "a training alone", agents)
        finally:
            t_cont = time.time()
            for pid in [b.pid, *frozen]:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        alone = {e["round"] for e in steps(out, world=1)}
        assert len(alone) == 1
        alone_round = alone.pop()
        assert alone_round > round_before

        # 3. b wakes: its old worker dies in its next collective (logging at most the
        # step it was frozen in), its agent registers with a new lease (the old one
        # expired) and joins a newer round.
        wait_for(lambda: not any(_running(pid) for pid in frozen), 60,
                 "b's old worker gone", agents)
        wait_for(lambda: [e for e in events(out) if e["ev"] == "rdzv_done"
                          and f"-{b.pid}-" in e["node"] and e["round"] > alone_round],
                 60, "b back in a newer round", agents)
        assert b.poll() is None and a.poll() is None, agents.logs()
        _rounds_never_overlap(out, frozen, t_cont)
    finally:
        agents.close()
