"""The runtime on CUDA: NCCL groups (abort and rebuild, a timed-out collective), a bf16
training run whose checkpoint restores bitwise in a CPU-only process, and an emergency
save on a preemption notice with the state on the GPU.

Every test here is marked `cuda` and is skipped where torch sees no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from relight.benchmarks.gpu_check import run_train_and_restore
from tests.runtime.test_device import check_abort_rebuild, run_abort_rebuild

pytestmark = pytest.mark.cuda

ROOT = Path(__file__).resolve().parents[2]


def test_nccl_world_of_one_aborts_and_rebuilds() -> None:
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from relight.runtime.device import abort_process_group, init_process_group, resolve_device
        dev = resolve_device("cuda", local_rank=0)
        dev.activate()
        assert dev.backend == "nccl"
        for round in range(2):
            init_process_group(dev, 30, store=dist.HashStore(), rank=0, world_size=1)
            assert dist.get_backend() == "nccl"
            t = torch.ones(8, device=dev.torch)
            dist.all_reduce(t)
            torch.cuda.synchronize()
            assert t.tolist() == [1.0] * 8
            abort_process_group()
            assert not dist.is_initialized()
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per rank: two")
def test_nccl_timed_out_collective_then_abort_and_rebuild(tmp_path: Path) -> None:
    # The caller handles the fault itself (bounded wait, abort, rebuild): the watchdog's
    # own handling is off, as torch asks for _abort_process_group.
    check_abort_rebuild(run_abort_rebuild(tmp_path, "cuda",
                                          {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}))


def test_bf16_training_on_cuda_restores_bitwise_in_a_cpu_process(tmp_path: Path) -> None:
    out = run_train_and_restore("t", tmp_path, "cuda", big=False, timeout=240, steps=6,
                                every=3)
    assert "error" not in out, out
    trained = out["trained"]
    assert trained["device"].startswith("cuda") and trained["final_step"] == 6
    assert trained["checkpoint_failures"] == 0
    assert trained["fsdp"] or trained["autocast_bf16"]  # bf16 compute, either way
    assert all(loss == loss for loss in trained["losses"])  # no NaN
    assert out["restored"]["device"] == "cpu" and out["restored_step"] == 6
    assert out["bitwise"], out["differ"]
    assert out["tensors"] > 10


def test_emergency_save_on_notice_with_state_on_the_gpu(tmp_path: Path) -> None:
    out = run_train_and_restore("e", tmp_path, "cuda", big=False, timeout=240, steps=50,
                                every=100000, notice_at=3)
    assert "error" not in out, out
    trained = out["trained"]
    assert trained["preempted"] and trained["emergency_step"] == 3, trained
    assert trained["emergency_save_s"] is not None
    assert out["restored_step"] == 3 and out["bitwise"], out.get("differ")
