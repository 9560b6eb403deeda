"""The entry points: ``relight.runtime.train.main`` (metrics JSONL), ``python -m
relight.runtime.train`` under
torchrun, and the progress watchdog."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.runtime.pool import RankPool

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.multirank
def test_main_writes_metrics_per_step(rank_pool: RankPool, tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rc = rank_pool.run("tests.runtime.cases:cli", 2, argv=[
        "--config", str(ROOT / "configs/tiny.toml"), "--train.steps=3",
        f"--train.metrics_path={path}", "--parallel.tp=2"])
    assert rc == [0, 0]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        for key in ("loss", "tokens_per_s", "step_time_s", "ckpt_stall_s", "mem_max_mb",
                    "mem_per_rank_mb", "mfu", "data_position", "restored_step", "world_size",
                    "layout", "lr", "grad_norm", "time"):
            assert key in r, key
        assert r["world_size"] == 2 and r["layout"] == "tp2"
        assert len(r["mem_per_rank_mb"]) == 2 and r["tokens_per_s"] > 0
    assert [r["data_position"] for r in records] == [0, 16, 32]


@pytest.mark.multirank
def test_a_healing_groups_warm_up_step_leaves_no_trace(rank_pool: RankPool) -> None:
    """The forward and backward a healing group runs before it asks to be taken in
    changes nothing a checkpoint or the next steps see (FSDP over 2 ranks)."""
    out = rank_pool.run("tests.runtime.cases:warm_up_leaves_no_trace", 2)
    for rank in out:
        assert rank["changed"] == [], f"the warm-up changed {rank['changed']}"
        assert rank["position"][0] == rank["position"][1], "the warm-up consumed samples"
        assert rank["grads"] == [], f"gradients left after the warm-up: {rank['grads']}"
        assert rank["warmed"] == rank["unwarmed"], "the steps after a warm-up differ"


@pytest.mark.multirank
@pytest.mark.long  # plain torchrun; CI runs the same entry point under relight run
def test_torchrun_entry_point(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "relight.runtime.train", "--config", "configs/tiny.toml", "--train.steps=2",
         f"--train.metrics_path={path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["world_size"], r["layout"]) for r in records] == [
        (1, 2, "dp_shard2"), (2, 2, "dp_shard2")]


def test_watchdog_exits_non_zero_when_no_step_completes() -> None:
    script = textwrap.dedent("""
        import time
        from relight.runtime.watchdog import Watchdog
        w = Watchdog(0.5, poll_s=0.05).start()
        for step in range(5):      # steady progress keeps it quiet
            time.sleep(0.2); w.beat(step)
        time.sleep(30)             # a hang
    """)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 75, proc.stderr
    assert "no step completed" in proc.stderr
    assert 1.0 < elapsed < 30, elapsed


def test_watchdog_stays_quiet_when_stopped() -> None:
    script = textwrap.dedent("""
        import time
        from relight.runtime.watchdog import Watchdog
        w = Watchdog(0.3, poll_s=0.05).start()
        w.stop(); time.sleep(1.0)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.multirank
def test_main_reports_a_bad_layout_with_status_2(rank_pool: RankPool) -> None:
    rc = rank_pool.run("tests.runtime.cases:cli", 1, argv=[
        "--config", str(ROOT / "configs/tiny.toml"), "--parallel.pp=2"])
    assert rc == [2]


@pytest.mark.multirank
# "wait" (the default policy, which every save of every other test goes through) in the
# long tier: CI keeps the slow-storage run of "skip".
@pytest.mark.parametrize("busy", ["skip", pytest.param("wait", marks=pytest.mark.long)])
def test_checkpoint_busy_policy_on_slow_storage(rank_pool: RankPool, tmp_path: Path,
                                                busy: str) -> None:
    """Storage slower than the interval: "skip" drops saves while one persists (training
    goes on), "wait" takes every one; the last step's save is taken either way."""
    # Each data object put sleeps: a persist takes many steps' time under "skip", even on
    # a loaded CI machine where a tiny step can take a few hundred ms (0.3 s was not
    # enough there); "wait" only has to take every checkpoint, so its storage is slowed less.
    latency = 1.0 if busy == "skip" else 0.05
    slow = json.dumps({"ops": ["put"], "key_contains": "/data/", "latency_s": latency})
    steps = 6
    out = rank_pool.run("tests.runtime.cases:train_on_slow_storage", 2, plan_json=slow,
                        overrides=[f"--train.steps={steps}", "--checkpoint.every=1",
                                   f"--checkpoint.url={tmp_path / 'ckpt'}",
                                   "--checkpoint.keep_last=100", f"--checkpoint.busy={busy}"])
    for r in out:
        assert r["final_step"] == steps
        assert r["committed"][-1] == steps  # the last save always waits for the one before
    if busy == "skip":
        assert all(r["skipped"] > 0 for r in out), out
        assert len(out[0]["committed"]) < steps
    else:
        assert all(r["skipped"] == 0 for r in out), out
        assert out[0]["committed"] == list(range(1, steps + 1))
