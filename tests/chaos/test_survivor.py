"""A 4-node FSDP x TP job loses a node for good under chaos: the 3 survivors train on at
dp = 3 with the job's power-of-two batch (uneven, weighted shares), and the harness's
verifier holds the run to the uninterrupted reference (loss and weights within the
scenario's tolerance, every sample once, the target step reached)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relight.chaos.logs import parse_metrics
from relight.chaos.report import render_markdown
from relight.chaos.runner import run_scenario
from relight.chaos.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.etcd, pytest.mark.multirank]


@pytest.mark.long  # eight ranks on four nodes, then six: minutes on two cores
@pytest.mark.timeout(900)
def test_three_survivors_of_four_fsdp_tp_nodes_train_on_at_dp3(tmp_path: Path) -> None:
    scenario = load_scenario(ROOT / "scenarios" / "fleet-survivor.toml")
    assert scenario.training.overrides["data.global_batch_size"] == 16
    out = tmp_path / "survivor"
    result = run_scenario(scenario, out)
    assert result.passed, render_markdown(result.report, None)
    rep = result.report
    assert [f["kind"] for f in rep["faults"] if f["ok"]] == ["kill_node"]
    sizes = [a["world_size"] for a in rep["attempts"]]
    assert sizes[0] == 8 and sizes[-1] == 6, sizes
    records = parse_metrics((out / "chaos" / "metrics.jsonl").read_text().splitlines()).records
    layouts = {r.layout for r in records}
    assert {"dp_shard4xtp2", "dp_shard3xtp2"} <= layouts, layouts
