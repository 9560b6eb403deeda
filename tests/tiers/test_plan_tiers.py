"""`relight plan` with a local tier: the restore time it uses and the memory it states."""

from __future__ import annotations

import json

import pytest

from relight.runtime.goodput_plan import PlanInputError, PlanInputs, expected_goodput, main, plan

BASE = dict(gpus=1024, mtbf_hours_per_gpu=50_000.0, save_stall_s=2.0, restore_time_s=600.0)


def test_restore_time_is_weighted_by_the_share_the_local_tier_serves() -> None:
    inputs = PlanInputs(**BASE, local_restore_time_s=100.0, local_hit_fraction=0.75)
    result = plan(inputs)
    assert result.effective_restore_time_s == pytest.approx(0.75 * 100 + 0.25 * 600)
    assert result.optimal_goodput == pytest.approx(expected_goodput(
        result.optimal_interval_s, 2.0, 225.0, inputs.job_mtbf_s))
    assert result.optimal_goodput > plan(PlanInputs(**BASE)).optimal_goodput
    assert plan(PlanInputs(**BASE)).effective_restore_time_s == 600.0


def test_hit_fraction_without_a_local_restore_time_is_refused() -> None:
    with pytest.raises(PlanInputError, match="local_hit_fraction"):
        PlanInputs(**BASE, local_hit_fraction=0.5)
    with pytest.raises(PlanInputError, match="local_hit_fraction"):
        PlanInputs(**BASE, local_restore_time_s=1.0, local_hit_fraction=1.5)


def test_cli_prints_tier_restore_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--gpus", "1024", "--mtbf-hours-per-gpu", "50000", "--save-stall", "2",
            "--restore-time", "600", "--local-restore-time", "120", "--local-hit-fraction",
            "0.8", "--tier-shard-gb", "40"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "mean restore 216 s" in out
    assert "40 GB per node between saves, 80 GB while a save is copied" in out
    assert main(argv + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["effective_restore_time_s"] == pytest.approx(216.0)
    assert doc["tier_memory_gb_per_node"] == 40.0
