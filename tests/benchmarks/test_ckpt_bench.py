"""The checkpoint benchmark at a tiny size: every arm runs and reports (not a timing
test): Relight, DCP and both floors, with loads from a dropped page cache."""

from __future__ import annotations

import json

import pytest

from relight.benchmarks import ckpt as ckpt_bench


@pytest.mark.long  # two ranks that import torch, and DCP
def test_the_file_benchmark_reports_every_arm_with_cold_loads(tmp_path, capsys) -> None:
    out = tmp_path / "out.json"
    # No pauses: they stand in for training and for a node's idle memory, which a test
    # need not wait out.
    assert ckpt_bench.main(["--mb", "16", "--ranks", "2", "--rounds", "2", "--train-gap-s", "0",
                            "--cold-settle-s", "0", "--dir", str(tmp_path),
                            "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["load_cache"] == "cold" and got["config"]["condition"] == "kept"
    assert got["config"]["train_gap_s"] == 0 and got["config"]["cold_settle_s"] == 0
    assert got["config"]["step_iters"] == 200  # the training step beside the async saves
    rounds = got["extra"]["all_rounds"]
    assert len(rounds["floor"]["step_s"]) == 2 and min(rounds["floor"]["step_s"]) > 0
    assert {"relight_step_s", "dcp_step_s"} <= set(got["floor_ratios"])
    assert "step_s" in got["ratios"]
    for system in ("relight", "dcp"):
        for field in ("save_s", "stall_s", "load_s", "reshard_load_s", "step_s"):
            assert len(rounds[system][field]) == 2 and min(rounds[system][field]) > 0
        assert got[system]["bytes_written"] > 15 << 20  # the state: ~16 MiB
    assert len(rounds["floor"]["save_direct_s"]) == 2 and min(rounds["floor"]["save_direct_s"]) > 0
    assert {"relight_save_s_direct", "dcp_save_s_direct"} <= set(got["floor_ratios"])
    assert got["extra"]["floor_direct_io_taken"] in (0.0, 1.0)
    # At 2 ranks the reshard target is dp2 x tp1: each rank needs half the rows, so the
    # ranks together read about the state once.
    assert got["relight"]["bytes_read_reshard"] <= 1.1 * got["relight"]["bytes_written"]
