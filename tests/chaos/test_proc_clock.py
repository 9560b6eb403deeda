"""Process start times exact to a clock tick, and a worker restarted within milliseconds
of a fault counted as recovered, so a fault that waits for that recovery fires."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path

import pytest

from relight.chaos.cluster import Cluster, Node
from relight.chaos.faults import FaultKind
from relight.chaos.proc_clock import CLOCK_TICK_S, start_time, started_after
from relight.chaos.runner import launch
from relight.chaos.scenario import parse_scenario


def test_start_time_is_exact_to_a_tick() -> None:
    before = time.time()
    proc = subprocess.Popen(["sleep", "30"])
    after = time.time()
    try:
        t = start_time(proc.pid)
        # psutil's create_time() reads up to a second early here (a boot time in whole
        # seconds): it would fail the lower bound on most machines.
        assert before - CLOCK_TICK_S <= t <= after, (t - before, after - before)
    finally:
        proc.kill()
        proc.wait()


def test_start_time_of_no_process_is_a_lookup_error() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    with pytest.raises(ProcessLookupError):
        start_time(proc.pid)


def test_started_after_allows_one_tick_and_no_more() -> None:
    assert started_after(100.0, 100.0)
    assert started_after(100.0 - CLOCK_TICK_S / 2, 100.0)  # read early, started after
    assert not started_after(100.0 - 2 * CLOCK_TICK_S, 100.0)


# An agent that restarts its one worker within milliseconds of its death (as a warm
# start does, only faster), and logs a step every 50 ms whatever happens to the worker.
# Each worker start's time goes to stdout, for the test to measure the restart.
FAST_AGENT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    metrics, target = sys.argv[1], int(sys.argv[2])
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", TORCHELASTIC_RESTART_COUNT="0")

    def start():
        print("worker start", time.time(), flush=True)
        return subprocess.Popen(["sleep", "600"], env=env)

    worker = start()
    with open(metrics, "a") as fh:
        for step in range(1, target + 1):
            fh.write(json.dumps({"step": step, "loss": 1.0, "data_position": step,
                                 "restored_step": None, "time": time.time()}) + "\\n")
            fh.flush()
            until = time.monotonic() + 0.05
            while time.monotonic() < until:
                if worker.poll() is not None:
                    worker = start()
                time.sleep(0.002)
    worker.kill()
""")


class _FastAgents(Cluster):
    """The runner's cluster with `FAST_AGENT` for each node instead of `relight run`."""

    def start_node(self) -> int:
        index = len(self.nodes)
        log_path = self.run_dir / f"node-{index}.log"
        with open(log_path, "ab") as fh:
            proc = subprocess.Popen(
                [sys.executable, "-c", FAST_AGENT, str(self.run_dir / "metrics.jsonl"),
                 str(self.scenario.target_step)],
                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes[index] = Node(index, proc, log_path, time.time())
        self._track(proc.pid)
        return index


@pytest.mark.timeout(120)
def test_a_restart_within_milliseconds_is_a_recovery(tmp_path: Path) -> None:
    scenario = parse_scenario({
        "name": "fast-restart", "target_step": 100, "deadline_s": 60,
        "cluster": {"nodes": 1, "ranks_per_node": 1, "min_nodes": 1, "max_nodes": 1},
        "training": {"command": ["fast-agent"]},
        "verify": {"reference": False},
        "faults": [{"kind": "kill_worker", "at_step": 5, "node": 0},
                   {"kind": "kill_worker", "at_step": 10, "node": 0, "after_recovery": True}],
    })
    run_dir = tmp_path / "chaos"
    outcome = launch(scenario, run_dir, types.SimpleNamespace(endpoint="127.0.0.1:1"),
                     "memory://fast-restart", "fast-restart", {}, faults=True,
                     deadline_s=60, seed=0, cluster_type=_FastAgents)
    first, second = outcome.faults
    starts = [float(line.split()[-1]) for line in
              (run_dir / "node-0.log").read_text().splitlines() if line.startswith("worker")]
    restart_s = min(t for t in starts if t > first.time) - first.time
    assert restart_s < 0.1, f"the fake agent took {restart_s:.3f} s to restart its worker"
    assert first.ok and first.kind is FaultKind.KILL_WORKER
    assert first.rendezvous_at is not None and first.first_step_at is not None, first
    # The fault that waits for that recovery fired, and met a worker of the new group.
    assert second.ok, second.error
    assert second.pids and second.pids != first.pids
    assert outcome.finished, outcome.detail
    assert json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 100
