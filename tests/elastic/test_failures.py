"""Failure semantics end to end: torchrun agents on relight-etcd running the tiny
deterministic training job (tests/elastic/scripts/tiny_train.py).

Each test asserts the run reaches its final step with weights bitwise equal to an
uninterrupted run, and records fault -> detection -> re-rendezvous -> first step
(printed, and written to timings.json in the test's temp dir).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from tests.elastic.agents import SCRIPTS, Agents, events, torchrun_cmd, wait_for
from tests.elastic.rdzv_util import job_id
from tests.elastic.scripts.tiny_train import reference

pytestmark = [pytest.mark.etcd, pytest.mark.multirank]

CKPT_EVERY = 5


def train_args(out: Path, *extra: str) -> list[str]:
    return ["--out", str(out), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0.02",
            "--collective-timeout", "20", *extra]


def steps(out: Path, **match: Any) -> list[dict]:
    return [e for e in events(out) if e["ev"] == "step"
            and all(e.get(k) == v for k, v in match.items())]


def workers(out: Path, **match: Any) -> list[dict]:
    return [e for e in events(out) if e["ev"] == "start"
            and all(e.get(k) == v for k, v in match.items())]


def recovery(out: Path, t_fault: float, world: int) -> dict[str, float]:
    """Seconds from the fault to: the first rendezvous call (detection), the round's
    completion on every node, and the first step of a worker started after the fault."""
    evs = events(out)
    old = {e["pid"] for e in evs if e["ev"] in ("start", "step") and e["t"] < t_fault}
    starts = [e["t"] for e in evs if e["ev"] == "rdzv_start" and e["t"] > t_fault]
    first_done: dict[str, float] = {}
    for e in evs:
        if e["ev"] == "rdzv_done" and e["t"] > t_fault:
            first_done.setdefault(e["node"], e["t"])
    done_t = max(first_done.values())
    first = min(e["t"] for e in evs if e["ev"] == "step" and e["t"] > t_fault
                and e["pid"] not in old and e["world"] == world)
    return {"detect_s": min(starts) - t_fault, "rendezvous_s": done_t - min(starts),
            "first_step_s": first - t_fault}


def finish(agents: Agents, out: Path, procs: list, timeout: float = 60) -> dict:
    (out / "STOP").write_text("")
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(max(1, deadline - time.monotonic()))
    assert [p.returncode for p in procs] == [0] * len(procs), agents.logs()
    final = json.loads((out / "final.json").read_text())
    assert final["w"] == reference(final["step"]), "resumed weights differ from a clean run"
    return final


def check_work_lost(out: Path) -> None:
    """Every (re)start resumed from a checkpoint at most one interval + 1 step behind
    the furthest step any earlier worker completed."""
    evs = events(out)
    for e in evs:
        if e["ev"] != "resume" or e["step"] == 0:
            continue
        before = [s["step"] for s in evs if s["ev"] == "step" and s["t"] < e["t"]]
        assert max(before) - e["step"] <= CKPT_EVERY + 1, (e, max(before))


def report(out: Path, name: str, timings: list[dict[str, float]]) -> None:
    summary = {k: {"median": statistics.median(t[k] for t in timings),
                   "max": max(t[k] for t in timings)} for k in timings[0]}
    (out / "timings.json").write_text(json.dumps({"runs": timings, "summary": summary},
                                                 indent=1))
    print(f"\n{name}: {len(timings)} faults; " + ", ".join(
        f"{k} median {v['median']:.2f}s max {v['max']:.2f}s" for k, v in summary.items()))


@pytest.mark.long
# ~90 s on a quiet 2-core machine; the bound leaves room for a heavily shared one.
@pytest.mark.timeout(600)
def test_twenty_worker_kills_in_a_row_all_recover(etcd_server, tmp_path) -> None:
    run, agents = job_id(), Agents(tmp_path)
    try:
        agent = agents.start(torchrun_cmd(etcd_server.endpoint, run, "1", 2,
                                          SCRIPTS / "tiny_train.py", train_args(tmp_path),
                                          max_restarts=25), "agent")
        timings = []
        for k in range(20):
            # Let each generation pass a checkpoint, so the job makes progress.
            def stepped(k: int = k) -> bool:
                done = steps(tmp_path, restart=k)
                return all(len([e for e in done if e["rank"] == r]) > CKPT_EVERY
                           for r in (0, 1))

            wait_for(stepped, 60, f"both ranks stepping after {k} kills", agents)
            victim = next(e["pid"] for e in workers(tmp_path, restart=k, rank=k % 2))
            t_fault = time.time()
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda k=k: steps(tmp_path, restart=k + 1), 60,
                     f"recovery from kill {k + 1}", agents)
            timings.append(recovery(tmp_path, t_fault, world=2))
        assert agent.poll() is None, agents.logs()
        final = finish(agents, tmp_path, [agent])
        assert {e["restart"] for e in workers(tmp_path)} == set(range(21))
        assert final["step"] > 20 * CKPT_EVERY
        check_work_lost(tmp_path)
        report(tmp_path, "worker SIGKILL", timings)
    finally:
        agents.close()


@pytest.mark.long
@pytest.mark.timeout(200)
def test_node_lost_then_node_added(etcd_server, tmp_path) -> None:
    run, agents = job_id(), Agents(tmp_path)
    cmd = torchrun_cmd(etcd_server.endpoint, run, "1:2", 1, SCRIPTS / "tiny_train.py",
                       train_args(tmp_path), max_restarts=3)
    try:
        a, b = agents.start(cmd, "node-a"), agents.start(cmd, "node-b")
        wait_for(lambda: len(steps(tmp_path, world=2)) >= 20, 90, "2 nodes training", agents)
        # Kill the node hosting the round's store (group rank 0): the harder case.
        host = next(e["agent_pid"] for e in reversed(workers(tmp_path)) if e["group_rank"] == 0)
        victim, survivor = (a, b) if a.pid == host else (b, a)
        t_loss = time.time()
        agents.kill_node(victim)
        wait_for(lambda: [s for s in steps(tmp_path, world=1) if s["t"] > t_loss], 60,
                 "the survivor training alone", agents)
        lost = recovery(tmp_path, t_loss, world=1)
        wait_for(lambda: len([s for s in steps(tmp_path, world=1) if s["t"] > t_loss]) >= 10,
                 30, "10 steps at world size 1", agents)

        t_add = time.time()
        c = agents.start(cmd, "node-c")
        wait_for(lambda: [s for s in steps(tmp_path, world=2) if s["t"] > t_add], 90,
                 "the grown group training", agents)
        added = recovery(tmp_path, t_add, world=2)
        final = finish(agents, tmp_path, [survivor, c])
        assert final["step"] > 30
        check_work_lost(tmp_path)
        (tmp_path / "timings.json").write_text(json.dumps({"node_lost": lost,
                                                           "node_added": added}))
        print(f"\nnode lost: {lost}\nnode added: {added}")
        # A lost node is out once its lease (2 s) expires: no longer.
        assert lost["rendezvous_s"] < 2 + 6, lost
    finally:
        agents.close()


@pytest.mark.long
@pytest.mark.timeout(150)
def test_hung_worker_is_killed_by_the_watchdog_and_the_group_restarts(etcd_server,
                                                                      tmp_path) -> None:
    run, agents = job_id(), Agents(tmp_path)
    try:
        agent = agents.start(
            torchrun_cmd(etcd_server.endpoint, run, "1", 2, SCRIPTS / "tiny_train.py",
                         train_args(tmp_path, "--watchdog", "3"), max_restarts=2),
            "agent")
        wait_for(lambda: len(steps(tmp_path, restart=0)) >= 20, 60, "training", agents)
        victim = next(e["pid"] for e in workers(tmp_path, restart=0, rank=1))
        t_fault = time.time()
        os.kill(victim, signal.SIGSTOP)
        wait_for(lambda: steps(tmp_path, restart=1), 60, "recovery from the hang", agents)
        hang = recovery(tmp_path, t_fault, world=2)
        dog = [e for e in events(tmp_path) if e["ev"] == "watchdog"]
        assert dog and dog[0]["killed"] == [victim], dog
        finish(agents, tmp_path, [agent])
        check_work_lost(tmp_path)
        (tmp_path / "timings.json").write_text(json.dumps({"hang": hang}))
        print(f"\nhang: {hang}")
        # Detected within the 3 s progress watchdog plus the agent's reaction, not
        # the 20 s collective timeout or the agent's 30 s shutdown grace.
        assert hang["detect_s"] < 3 + 6, hang
    finally:
        agents.close()
