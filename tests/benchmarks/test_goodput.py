"""The goodput benchmark's arms as the chaos harness gets them: each one a valid
scenario, with the same failure times, and the coordinator kill where it exists."""

from __future__ import annotations

import pytest

from relight.benchmarks.goodput import (
    ARMS,
    GoodputConfig,
    _scenario,
    _table,
    add_work_done,
    parse_settings,
    schedule,
)
from relight.benchmarks.goodput_metrics import JOBS, job_arguments
from relight.chaos.scenario import parse_scenario


@pytest.mark.parametrize("arm", [a for a in ARMS if a not in ("torchft", "sync")])
def test_every_harness_arm_is_a_valid_scenario_with_the_same_faults(arm: str) -> None:
    cfg = GoodputConfig(groups=4, duration_s=150.0, coordinator_kill_s=40.0)
    times = schedule(15.0, cfg)
    s = parse_scenario(_scenario(arm, times, cfg))
    kills = [f.at_time_s for f in s.faults if f.kind.value == "kill_node"]
    assert kills == times and all(f.replace_after_s == 10.0 for f in s.faults
                                  if f.kind.value == "kill_node")
    coordinator = [f for f in s.faults if f.kind.value == "etcd_restart"]
    if arm == "torchrun":
        # plain torchrun on c10d with its store on a host no fault hits, DCP checkpoints
        c = s.cluster
        assert (c.launcher, c.rendezvous, c.c10d_store) == ("torchrun", "c10d", "standalone")
        assert s.training.command[0] == "benchmarks/dcp_train.py" and not coordinator
    else:
        assert s.cluster.etcd_members == 3
        assert [(f.at_time_s, f.down_s) for f in coordinator] == [(40.0, 5.0)]
        assert s.cluster.replica_groups == (arm == "heal")


def test_without_a_coordinator_kill_etcd_is_one_member() -> None:
    cfg = GoodputConfig()
    s = parse_scenario(_scenario("heal", schedule(60.0, cfg), cfg))
    assert s.cluster.etcd_members == 1
    assert all(f.kind.value == "kill_node" for f in s.faults)


def test_settings_reach_relights_arms_typed_after_the_benchmarks_own() -> None:
    cfg = GoodputConfig(settings=parse_settings([
        "replica.failover_grace_s=2", "replica.collective_timeout_s=20",
        "parallel.pp_schedule=gpipe"]))
    for arm in ("heal", "restart"):
        o = parse_scenario(_scenario(arm, [], cfg)).training.overrides
        assert o["replica.failover_grace_s"] == 2 and o["parallel.pp_schedule"] == "gpipe", o
        assert o["replica.collective_timeout_s"] == 20  # the benchmark's 15 replaced
    with pytest.raises(ValueError, match="'overlap': expected SECTION.KEY=VALUE"):
        parse_settings(["overlap"])


def test_the_torchrun_arms_script_runs_as_torchrun_starts_it() -> None:
    """torchrun runs it as a script: its directory first on sys.path, where
    benchmarks/ckpt.py must not shadow the checkpoint package the runtime imports."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "dcp_train.py"), "--help"],
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "--config" in res.stdout


def test_the_headline_is_work_done_against_the_best_fault_free_arm() -> None:
    """Steps kept in the window over the most any arm kept without faults in the same
    invocation: a slower step can never raise it."""
    results = [
        {"arm": "heal", "mtbf_s": None, "steps_in_window": 3000},
        {"arm": "torchft", "mtbf_s": None, "steps_in_window": 3200},
        {"arm": "heal", "mtbf_s": 60.0, "steps_in_window": 2880},
        {"arm": "torchft", "mtbf_s": 60.0, "steps_in_window": 2400},
        {"arm": "torchft", "mtbf_s": 15.0, "skipped": "no torchft environment"},
    ]
    add_work_done(results)
    assert [r["work_done"] for r in results] == [0.9375, 1.0, 0.9, 0.75, None]
    for r in results:
        r.update(loadavg_before=[1.0], loadavg_after=[2.0])
    table = _table(results).splitlines()
    assert table[2].startswith("| none | heal |") and "| 0.938 | 3000 |" in table[2]
    assert "no torchft environment" in table[-1]


def test_the_fault_free_window_has_no_faults_and_each_job_is_a_valid_scenario() -> None:
    assert schedule(None, GoodputConfig()) == []
    for job in JOBS:
        cfg = GoodputConfig(job=job)
        s = parse_scenario(_scenario("heal", [], cfg))
        assert not s.faults
        for key, value in JOBS[job].items():
            assert s.training.overrides[key] == value
        assert job_arguments(job) == [f"--{k}={v}" for k, v in JOBS[job].items()]


def test_the_sync_arm_is_one_job_replicated_over_the_groups_without_faults() -> None:
    cfg = GoodputConfig(groups=4, ranks=2)
    s = parse_scenario(_scenario("sync", [], cfg))
    assert not s.cluster.replica_groups and not s.faults
    assert s.training.overrides["parallel.dp_replicate"] == 4
    with pytest.raises(ValueError, match="fault-free window only"):
        _scenario("sync", schedule(60.0, cfg), cfg)
