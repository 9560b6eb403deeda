"""The device check itself, on the CPU: `scripts/gpu-check.sh --dry-run` runs every part
and writes its JSON; the benchmark skips what does not fit its time budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]


def test_benchmark_skips_a_size_that_does_not_fit_the_budget(tmp_path: Path) -> None:
    import torch

    from relight.benchmarks import gpu_ckpt

    if dist.is_initialized():  # an earlier test in this process left its group behind
        dist.destroy_process_group()
    gpu_ckpt.init_world1(torch.device("cpu"))
    rows = []
    try:
        out = gpu_ckpt.run([8, 64 << 10], str(tmp_path), torch.device("cpu"), budget_s=20.0,
                           floor_rounds=1, on_row=lambda r: rows.append(dict(r["sizes"])))
    finally:
        dist.destroy_process_group()
    row = out["sizes"]["8"]
    assert row["relight"]["bitwise"] and row["dcp_thread"]["bitwise"]
    assert row["floor"]["copy_s"] > 0 and "relight_stall_over_floor" in row["ratios"]
    assert "relight_stall_over_dcp_thread_stall" in row["ratios"]
    assert row["dcp_thread_pinned"] == {"skipped": "needs an accelerator"}
    # 64 GiB: estimated from the 8 MiB size (or refused for memory or disk), never built.
    assert set(out["skipped"]) == {str(64 << 10)}
    assert rows and "8" in rows[0]  # reported as soon as the size was done
    assert not list(tmp_path.iterdir())  # every checkpoint was deleted


@pytest.mark.long
@pytest.mark.slow
def test_dry_run_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run(["bash", "scripts/gpu-check.sh", "--dry-run", "--out", str(out),
                           "--sizes-mib", "16"], cwd=ROOT, capture_output=True, text=True,
                          timeout=420, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["cuda"] is False and report["dry_run"] is True
    tests = report["tests"]
    assert tests["tests"] > 0 and tests["skipped"] == tests["tests"]  # no GPU: all skip
    assert report["train"]["bitwise"] and report["train"]["restored_step"] == 6
    assert report["train"]["trained"]["autocast_bf16"] or report["train"]["trained"]["fsdp"]
    emergency = report["emergency"]
    assert emergency["trained"]["preempted"] and emergency["bitwise"]
    assert emergency["restored_step"] == emergency["trained"]["emergency_step"]
    row = report["bench"]["sizes"]["16"]
    assert row["relight"]["bitwise"] and "stall_over_floor" in report["targets"]["bench"]["16"]
    assert report["bench"]["complete"]
    assert report["elapsed_s"] < 400
