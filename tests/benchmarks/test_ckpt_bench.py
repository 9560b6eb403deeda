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


@pytest.mark.long  # two ranks that import torch, and DCP
def test_loads_of_the_checkpoint_before_the_newest_as_saved_are_cached_and_bitwise(
        tmp_path) -> None:
    """`--load-from sync --load-cache as-saved`: the same-layout load reads the sync save,
    made just before the async one. That async save took no pages of it (the newest
    committed checkpoint keeps its pages), so the cache serves the whole load; every
    load checked is bitwise the saved state."""
    import os

    from relight.storage.direct_io import cached_pages
    from tests.storage.filesystems import on_memory_filesystem

    out = tmp_path / "out.json"
    assert ckpt_bench.main(["--mb", "16", "--ranks", "2", "--rounds", "2", "--layers", "2",
                            "--no-biases", "--load-from", "sync", "--load-cache", "as-saved",
                            "--train-gap-s", "0", "--step-iters", "0", "--dir", str(tmp_path),
                            "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["config"]["load_from"] == "sync" and got["config"]["biases"] is False
    assert got["config"]["layers"] == 2
    assert got["loads_bitwise_equal"] is True
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 4096)
    fd = os.open(probe, os.O_RDONLY)
    try:
        counts = cached_pages(fd, 0, 4096) is not None
    finally:
        os.close(fd)
    if counts and not on_memory_filesystem(str(tmp_path)):
        assert got["extra"]["relight_load_cached_share"] >= 0.99, got["extra"]
