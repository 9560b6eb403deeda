"""The scale benchmark at tiny sizes: its output's structure, and that Relight's and
DCP's plans of the same simulated layout cover the same bytes (not a timing test)."""

from __future__ import annotations

import json
import math

import pytest

from relight.benchmarks import scale, scale_plan
from relight.benchmarks.scale_rdzv import RdzvConfig, run_rendezvous
from relight.benchmarks.scale_report import growth_exponent
from relight.benchmarks.scale_state import CONFIGS, MESHES, MODELS, rank_pieces, state_bytes


@pytest.mark.parametrize("config,world", [("8b-fsdp", 8), ("moe-ep", 8), ("70b-3d", 64)])
def test_relight_and_dcp_plan_the_same_bytes(config: str, world: int) -> None:
    model = MODELS[CONFIGS[config][0]]
    mine = scale_plan.relight_arm(config, world, manifest=False)
    dcp = scale_plan.dcp_arm(config, world, load_ranks=world)
    # Every byte of the state written exactly once by each (replicas deduplicated)...
    assert mine["save_bytes"] == dcp["save_bytes"] == state_bytes(model)
    # ...every rank gets all of its shards back (70b-3d: TP replicas of the norms too)...
    assert mine["load_bytes"] == dcp["load_bytes"] >= state_bytes(model)
    # ...and Relight reads each distinct region from storage once.
    assert mine["read_bytes"] == state_bytes(model)
    assert mine["pieces"] == dcp["pieces"]


def test_hsdp_replicas_hold_the_same_boxes() -> None:
    mesh = MESHES["hsdp"].at(64)
    assert (mesh.replicate, mesh.fsdp) == (2, 32)
    held = dict(rank_pieces(MODELS["llama3-70b"], mesh))
    assert held[3] == held[3 + 32] and held[3] != held[4]
    distinct = {(name, box) for pieces in held.values() for name, _, box in pieces}
    volume = sum(math.prod(box[1]) for _, box in distinct) * 4
    assert volume == state_bytes(MODELS["llama3-70b"])


def test_growth_exponent() -> None:
    xs = [64, 256, 1024]
    assert growth_exponent(xs, [x**2 * 3.0 for x in xs]) == pytest.approx(2.0)
    assert growth_exponent(xs, [1.0, None, None]) is None


@pytest.mark.long  # the whole harness at small sizes; its pure parts run in CI above
def test_harness_writes_tables_and_plots(tmp_path) -> None:
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    rc = scale.main(["--quick", "--cap", "300", "--parts", "plan", "--configs", "8b-fsdp",
                     "--worlds", "8,16",
                     "--md", str(md), "--json", str(js), "--plots", str(tmp_path / "img")])
    assert rc == 0
    res = json.loads(js.read_text())
    rows = res["plan"]["8b-fsdp"]
    assert [r["world"] for r in rows["relight"]] == [8, 16] == [r["world"] for r in rows["dcp"]]
    for r in rows["relight"] + rows["dcp"]:
        assert r["save_s"] > 0 and r["load_s"] > 0 and r["save_mib"] >= 0
    assert all(r["manifest_bytes"] > 0 and r["manifest_parse_s"] > 0 for r in rows["relight"])
    text = md.read_text()
    assert "| ranks | pieces | Relight save | DCP save |" in text
    assert "growth exponent" in text and "load average" in text
    pngs = sorted(p.name for p in (tmp_path / "img").iterdir())
    assert "out-save-plan.png" in pngs and "out-manifest.png" in pngs


def test_commit_part_reports_the_exchange_over_a_process_group(tmp_path) -> None:
    md, js = tmp_path / "out.md", tmp_path / "out.json"
    rc = scale.main(["--quick", "--parts", "commit", "--no-s3", "--commit-sizes", "8,32",
                     "--md", str(md), "--json", str(js), "--plots", str(tmp_path / "img")])
    assert rc == 0
    rows = json.loads(js.read_text())["commit"]["sync"]
    assert [r["ranks"] for r in rows] == [8, 32]
    for r in rows:
        # the coordinator gets every index; the others only its verdict and the outcome
        assert r["coordinator_bytes"] >= r["ranks"] * r["index_bytes"] > r["other_bytes"] > 0
        assert r["coordinator_parse_s"] > 0 and r["other_parse_s"] >= 0
        # the commit group's collectives ran on real processes, carrying those bytes
        assert r["procs"] == 2 and r["total_bytes"] == r["coordinator_bytes"]
        assert r["head_s"] > 0 and r["gather_s"] > 0 and r["outcome_s"] > 0
        assert r["group_commit_s"] > r["coordinator_parse_s"]
    assert rows[1]["other_bytes"] == rows[0]["other_bytes"]  # the same at any world size
    assert rows[1]["coordinator_bytes"] > rows[0]["coordinator_bytes"]
    assert "### Commit over a process group" in md.read_text()


@pytest.mark.long  # starts etcd and two worker processes that import torch
def test_rendezvous_agents_spread_over_processes_are_counted_together() -> None:
    rows = run_rendezvous(RdzvConfig(agents=(6,), timeout_s=60, agent_procs=2),
                          log=lambda _msg: None)
    (row,) = rows
    assert row["complete"] and row["agent_procs"] == 2 and row["round_s"] > 0
    # Every agent's registration is counted, whichever process it ran in.
    assert row["by_path"]["lease/grant"] == 6 and row["by_path"]["kv/put"] >= 6
    assert row["requests"] == sum(v for k, v in row["by_path"].items()
                                  if k != "lease/keepalive")
