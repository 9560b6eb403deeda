"""Scenario files: the shipped ones load, and every mistake names its key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from relight.chaos.faults import FaultKind, draw_mtbf_schedule
from relight.chaos.scenario import ScenarioError, load_scenario, parse_scenario

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["ci-smoke", "preemptible-fleet", "storage-hell",
                                  "replica-ci", "replica-pp", "replica-fleet"])
def test_shipped_scenarios_load(name: str) -> None:
    s = load_scenario(ROOT / "scenarios" / f"{name}.toml")
    assert s.name == name
    assert s.faults or s.mtbf.count


def test_ci_smoke_has_the_three_faults() -> None:
    s = load_scenario(ROOT / "scenarios" / "ci-smoke.toml")
    assert [f.kind for f in s.faults] == [FaultKind.KILL_WORKER, FaultKind.KILL_DURING_PERSIST,
                                          FaultKind.KILL_NODE]
    assert s.cluster.nodes - 1 >= s.cluster.min_nodes


def test_preemptible_fleet_covers_every_kind() -> None:
    s = load_scenario(ROOT / "scenarios" / "preemptible-fleet.toml")
    assert set(s.mtbf.kinds) == set(FaultKind)
    assert s.mtbf.count >= 10 and s.target_step >= 200
    assert (s.cluster.nodes, s.cluster.ranks_per_node, s.storage.kind) == (4, 2, "s3")


BASE = {"name": "t", "training": {"config": "configs/tiny.toml"}}


@pytest.mark.parametrize(
    ("patch", "key"),
    [
        ({"cluster": {"nodes": "2"}}, "cluster.nodes"),
        ({"cluster": {"nodes": 2, "min_nodes": 3}}, "cluster.min_nodes"),
        ({"cluster": {"nodez": 2}}, "cluster.nodez"),
        ({"storage": {"kind": "nfs"}}, "storage.kind"),
        ({"faults": [{"kind": "explode", "at_step": 1}]}, "faults[0].kind"),
        ({"faults": [{"kind": "kill_worker"}]}, "faults[0]"),
        ({"faults": [{"kind": "kill_worker", "at_step": 1, "at_time_s": 2.0}]}, "faults[0]"),
        ({"faults": [{"kind": "kill_worker", "during": "lunch"}]}, "faults[0].during"),
        ({"faults": [{"kind": "kill_during_persist", "at_step": 3}]}, "faults[0].during"),
        ({"faults": [{"kind": "kill_worker", "at_step": 50}]}, "faults[0].at_step"),
        ({"faults": [{"kind": "kill_worker", "at_time_s": 3.0, "after_recovery": True}]},
         "faults[0].after_recovery"),
        ({"faults": [{"kind": "kill_worker", "at_step": 3, "steps_after_recovery": 2}]},
         "faults[0].steps_after_recovery"),
        ({"faults": [{"kind": "kill_worker", "at_step": 3, "after_recovery": True,
                      "steps_after_recovery": -1}]}, "faults[0].steps_after_recovery"),
        ({"cluster": {"nodes": 2, "min_nodes": 2},
          "faults": [{"kind": "kill_node", "at_step": 3}]}, "faults"),
        ({"mtbf": {"count": 3}}, "mtbf.kinds"),
        ({"target_step": 0}, "target_step"),
        ({"training": {}}, "training.config"),
        ({"verify": {"loss_rtol": -1.0}}, "verify.loss_rtol"),
        ({"cluster": {"lease_ttl_s": 0.5}}, "cluster.lease_ttl_s"),
        ({"cluster": {"rejoin_timeout_s": -1.0}}, "cluster.rejoin_timeout_s"),
        ({"cluster": {"etcd_members": 2}}, "cluster.etcd_members"),
        ({"cluster": {"replica_groups": True, "launcher": "torchrun"}},
         "cluster.replica_groups"),
        ({"run_for_s": -1.0}, "run_for_s"),
    ],
)
def test_errors_name_the_key(patch: dict, key: str) -> None:
    raw = {**BASE, **patch}
    with pytest.raises(ScenarioError) as info:
        parse_scenario(raw, source="x.toml")
    assert info.value.key == key, str(info.value)
    assert "x.toml" in str(info.value)


def test_missing_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="no scenario file"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(ScenarioError, match="not valid TOML"):
        load_scenario(bad)


def test_seed_override_and_mtbf_schedule_is_deterministic() -> None:
    kinds = list(FaultKind)
    a = draw_mtbf_schedule(kinds, 26, 10.0, 5.0, seed=3)
    assert a == draw_mtbf_schedule(kinds, 26, 10.0, 5.0, seed=3)
    assert a != draw_mtbf_schedule(kinds, 26, 10.0, 5.0, seed=4)
    assert {k for _, k in a} == set(kinds)  # every kind appears when count allows
    times = [t for t, _ in a]
    assert times == sorted(times) and times[0] > 5.0
    s = parse_scenario(BASE).with_seed(9)
    assert s.seed == 9


def test_rendezvous_timings_reach_the_agents_only_when_set() -> None:
    from relight.chaos.commands import agent_command

    def conf(cluster: dict) -> str:
        s = parse_scenario({**BASE, "cluster": cluster})
        argv = agent_command(s, "http://e", "job", "1:2", ["train.py"], Path("/tmp/n"))
        return next(a for a in argv if a.startswith("--rdzv-conf="))

    assert conf({}) == "--rdzv-conf=join_timeout=60,last_call_timeout=30"
    assert conf({"lease_ttl_s": 3, "rejoin_timeout_s": 10}) == (
        "--rdzv-conf=join_timeout=60,last_call_timeout=30,lease_ttl=3,rejoin_timeout=10")
    # torchrun's c10d backend knows neither: they are not passed to it.
    assert conf({"rendezvous": "c10d", "lease_ttl_s": 3}) == (
        "--rdzv-conf=join_timeout=60,last_call_timeout=30")
    # A c10d store the harness serves: agents connect to it and never host one.
    assert conf({"rendezvous": "c10d", "c10d_store": "standalone"}) == (
        "--rdzv-conf=join_timeout=60,last_call_timeout=30,is_host=false")
    with pytest.raises(ScenarioError, match="cluster.c10d_store"):
        parse_scenario({**BASE, "cluster": {"c10d_store": "standalone"}})


def test_a_standalone_c10d_store_serves_until_torn_down(tmp_path: Path) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from relight.chaos.cluster import start_c10d_store
    from relight.elastic.etcd_server import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    proc = start_c10d_store(endpoint, tmp_path / "store.log")
    try:
        host, port = endpoint.rsplit(":", 1)
        client = dist.TCPStore(host, int(port), is_master=False,
                               timeout=timedelta(seconds=30))
        client.set("k", "v")
        assert client.get("k") == b"v"
    finally:
        proc.kill()
        proc.wait(30)


def test_training_processes_share_the_machines_cores(monkeypatch) -> None:
    """The simulated nodes run on one machine: each training process gets its share of
    the cores as intra-op threads, unless the caller or the scenario says otherwise."""
    from relight.chaos.commands import training_command

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)

    def threads(cluster: dict, env: dict | None = None) -> str | None:
        training = {**BASE.get("training", {}), **({"env": env} if env else {})}
        s = parse_scenario({**BASE, "cluster": cluster, "training": training})
        return training_command(s, "/tmp/ck", Path("/tmp/m.jsonl"))[1].get("OMP_NUM_THREADS")

    assert threads({"nodes": 4, "ranks_per_node": 1}) == "2"
    assert threads({"nodes": 2, "ranks_per_node": 2, "max_nodes": 4}) == "1"
    assert threads({"nodes": 16, "ranks_per_node": 2}) == "1"  # never 0
    assert threads({"nodes": 1, "ranks_per_node": 1}) == "8"
    assert threads({"nodes": 4, "ranks_per_node": 1}, env={"OMP_NUM_THREADS": "3"}) == "3"
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # the caller's own setting is inherited
    assert threads({"nodes": 4, "ranks_per_node": 1}) is None
