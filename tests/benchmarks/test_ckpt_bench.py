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


def test_a_worker_that_dies_fails_the_benchmark_at_once_with_its_exit_code() -> None:
    """A crashed worker leaves the others blocked in a collective: the parent must not
    wait out the result timeout on the queue, but fail naming the rank and exit code."""
    import multiprocessing as mp
    import sys
    import time

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=time.sleep, args=(30,)), ctx.Process(target=sys.exit, args=(3,))]
    for p in procs:
        p.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(ckpt_bench.WorkerDiedError, match="rank 1 with exit code 3") as got:
            ckpt_bench._result(q, procs, timeout_s=600, poll_s=0.1)
        assert got.value.exit_code == 3
        assert time.monotonic() - t0 < 20
    finally:
        for p in procs:
            p.kill()
            p.join()


def test_a_worker_killed_by_a_signal_reports_the_shell_status() -> None:
    """One that exits cleanly without results fails too (after a short grace for results
    in flight); a SIGKILLed one gives 128 + 9, as a shell would."""
    import multiprocessing as mp
    import signal

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=int)  # exits 0 at once, without results
    p.start()
    p.join()
    with pytest.raises(ckpt_bench.WorkerDiedError, match="rank 0 with exit code 0"):
        ckpt_bench._result(q, [p], timeout_s=600, poll_s=0.1)
    killed = ctx.Process(target=signal.pause)
    killed.start()
    killed.kill()
    killed.join()
    with pytest.raises(ckpt_bench.WorkerDiedError) as got:
        ckpt_bench._result(q, [killed], timeout_s=600, poll_s=0.1)
    assert got.value.exit_code == 128 + signal.SIGKILL
