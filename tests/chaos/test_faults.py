"""Injectors on real processes: workers found in an agent's tree by their environment,
signals delivered to exactly the victims, follow-ups scheduled, refusals explained."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from relight.chaos.faults import FaultKind, Injector, find_workers, kill_tree, process_tree
from relight.chaos.scenario import FaultSpec

# A fake agent: two "workers" (RANK/LOCAL_RANK set, as torchrun does), each with a child of
# its own that inherits the variables (a data-loader process, say).
AGENT = textwrap.dedent("""
    import os, subprocess, sys, time
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', " \\
            "'import time; time.sleep(120)']); time.sleep(120)"
    for r in range(2):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), TORCHELASTIC_RESTART_COUNT="0")
        subprocess.Popen([sys.executable, "-c", child], env=env)
    time.sleep(120)
""")


@pytest.fixture
def agent() -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen([sys.executable, "-c", AGENT], start_new_session=True)
    deadline = time.monotonic() + 20
    while len(process_tree(proc.pid)) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait()


def test_find_workers_skips_workers_children(agent: subprocess.Popen) -> None:
    workers = find_workers(agent.pid)
    assert [(w.rank, w.local_rank) for w in workers] == [(0, 0), (1, 1)]
    assert len(process_tree(agent.pid)) == 5


def test_kill_tree_kills_every_descendant(agent: subprocess.Popen) -> None:
    procs = process_tree(agent.pid)
    hit = kill_tree(agent.pid)
    assert sorted(hit) == sorted(p.pid for p in procs)
    gone, alive = psutil.wait_procs(procs, timeout=10)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


# A supervisor that keeps starting workers, as an agent does while it starts its group
# again after its workers died: killed after its workers, it would start more that
# outlive it. Each worker is a fork (1-2 ms), so many start while the tree is killed.
SPAWNER = textwrap.dedent("""
    import os, time
    for _ in range(400):  # kill-tree-test
        if os.fork() == 0:
            time.sleep(120)
            os._exit(0)
        time.sleep(0.001)
    time.sleep(120)
""")


def test_kill_tree_leaves_no_worker_a_supervisor_started_meanwhile() -> None:
    sup = subprocess.Popen([sys.executable, "-c", SPAWNER], start_new_session=True)
    deadline = time.monotonic() + 60  # the supervisor's Python start, then 20 forks
    while len(process_tree(sup.pid)) < 20:
        assert time.monotonic() < deadline, "the supervisor started no workers in 60 s"
        time.sleep(0.01)
    killed = []
    for pid in kill_tree(sup.pid):
        with contextlib.suppress(psutil.NoSuchProcess):  # already gone
            killed.append(psutil.Process(pid))
    sup.wait()
    psutil.wait_procs(killed, timeout=60)  # their exits, slow only on a loaded machine
    orphans = [p for p in psutil.process_iter(["ppid", "cmdline", "status"])
               if p.info["ppid"] == 1 and p.info["status"] != psutil.STATUS_ZOMBIE
               and "kill-tree-test" in " ".join(p.info["cmdline"] or [])]
    for p in orphans:
        p.kill()
    assert not orphans, f"{len(orphans)} worker(s) started while the tree was killed outlived it"


class FakeCluster:
    def __init__(self, agent_pid: int | None = None, nodes: int = 1, min_nodes: int = 1) -> None:
        self.pid = agent_pid
        self.nodes = list(range(nodes))
        self._min = min_nodes
        self.timers: list[tuple[float, str, Callable[[], None]]] = []
        self.calls: list[Any] = []

    def live_nodes(self) -> list[int]:
        return list(self.nodes)

    def min_nodes(self) -> int:
        return self._min

    def agent_pid(self, node: int) -> int | None:
        return self.pid

    def remove_node(self, node: int, sig: int) -> list[int]:
        self.nodes.remove(node)
        self.calls.append(("remove", node, sig))
        return [1000 + node]

    def add_node(self) -> int:
        self.nodes.append(len(self.nodes))
        return self.nodes[-1]

    def schedule(self, delay_s: float, action: Callable[[], None], label: str) -> None:
        self.timers.append((delay_s, label, action))

    def etcd_kill(self) -> int | None:
        self.calls.append("etcd_kill")
        return 42

    def etcd_start(self) -> None:
        self.calls.append("etcd_start")

    def set_storage_fault(self, plan: dict[str, Any] | None) -> None:
        self.calls.append(("storage", plan))

    def newest_committed_chunk(self) -> tuple[int, str]:
        return 10, "step-000000000010/data/a/t0/c/0"

    def corrupt(self, key: str, mode: str) -> None:
        self.calls.append(("corrupt", key, mode))

    def checkpoint_phase(self) -> dict[str, Any]:
        return {"phase": "persist", "checkpoint_step": 10}


def test_kill_worker_kills_exactly_one_worker(agent: subprocess.Popen) -> None:
    before = find_workers(agent.pid)
    inj = Injector(FakeCluster(agent.pid), random.Random(0))
    ev = inj.inject(FaultSpec(kind=FaultKind.KILL_WORKER, at_step=1, local_rank=1), 0, "t", 1)
    assert ev.ok and ev.pids == [before[1].pid] and ev.detail["rank"] == 1
    victim = psutil.Process(before[1].pid)
    deadline = time.monotonic() + 10
    while victim.is_running() and victim.status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the victim survived SIGKILL"
        time.sleep(0.02)
    assert [w.pid for w in find_workers(agent.pid)] == [before[0].pid]


def test_stop_worker_then_cont(agent: subprocess.Popen) -> None:
    cluster = FakeCluster(agent.pid)
    ev = Injector(cluster, random.Random(0)).inject(
        FaultSpec(kind=FaultKind.STOP_WORKER, at_step=1, local_rank=0, resume_after_s=5.0),
        0, "t", 1)
    p = psutil.Process(ev.pids[0])
    deadline = time.monotonic() + 5
    while p.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.status() == psutil.STATUS_STOPPED
    (delay, label, action), = cluster.timers
    assert delay == 5.0 and "SIGCONT" in label
    action()
    time.sleep(0.1)
    assert p.status() != psutil.STATUS_STOPPED


def test_coordinator_kill_targets_rank_zero(agent: subprocess.Popen) -> None:
    zero = find_workers(agent.pid)[0]
    ev = Injector(FakeCluster(agent.pid), random.Random(5)).inject(
        FaultSpec(kind=FaultKind.KILL_COORDINATOR_BEFORE_COMMIT, during="before_commit"),
        0, "during", 12)
    assert ev.pids == [zero.pid] and ev.detail["checkpoint_step"] == 10


def test_node_etcd_storage_and_damage_faults() -> None:
    c = FakeCluster(nodes=3, min_nodes=2)
    inj = Injector(c, random.Random(1))
    ev = inj.inject(FaultSpec(kind=FaultKind.KILL_NODE, at_step=1, node=2), 0, "t", 1)
    assert ev.ok and ("remove", 2, signal.SIGKILL) in c.calls
    # A second permanent loss would leave 1 < min_nodes = 2: refused, and said why.
    ev = inj.inject(FaultSpec(kind=FaultKind.SCALE_DOWN, at_step=1), 1, "t", 1)
    assert not ev.ok and "min_nodes" in ev.error
    # With a replacement it is allowed; the replacement is scheduled.
    ev = inj.inject(FaultSpec(kind=FaultKind.PREEMPT, at_step=1, replace_after_s=3.0), 2, "t", 1)
    assert ev.ok and [t[0] for t in c.timers] == [5.0, 3.0]
    ev = inj.inject(FaultSpec(kind=FaultKind.ETCD_RESTART, at_step=1, down_s=1.5), 3, "t", 1)
    assert "etcd_kill" in c.calls and c.timers[-1][0] == 1.5
    c.timers[-1][2]()
    assert c.calls[-1] == "etcd_start"
    ev = inj.inject(FaultSpec(kind=FaultKind.STORAGE_TRANSIENT, at_step=1, fail_fraction=0.5,
                              duration_s=4.0, ops=("put",)), 4, "t", 1)
    assert c.calls[-1][1]["fail_fraction"] == 0.5 and c.calls[-1][1]["ops"] == ["put"]
    c.timers[-1][2]()
    assert c.calls[-1] == ("storage", None)
    ev = inj.inject(FaultSpec(kind=FaultKind.TRUNCATE_CHECKPOINT, at_step=1), 5, "t", 1)
    assert c.calls[-1] == ("corrupt", "step-000000000010/data/a/t0/c/0", "truncate")
    assert ev.detail["checkpoint_step"] == 10


def test_no_victim_is_reported_not_raised() -> None:
    ev = Injector(FakeCluster(agent_pid=None), random.Random(0)).inject(
        FaultSpec(kind=FaultKind.KILL_WORKER, at_step=1), 0, "t", 1)
    assert not ev.ok and "no live worker" in ev.error
    assert os.getpid()  # this process was not touched


def test_an_injection_that_raises_is_recorded_not_fatal() -> None:
    class Flaky(FakeCluster):
        def newest_committed_chunk(self) -> tuple[int, str]:
            raise RuntimeError("store went away")

    ev = Injector(Flaky(), random.Random(0)).inject(
        FaultSpec(kind=FaultKind.CORRUPT_CHECKPOINT, at_step=1), 0, "t", 1)
    assert not ev.ok and ev.error == "RuntimeError: store went away"
