"""`runtime.device`: choosing the device and backend, the NCCL environment, and aborting a
process group whose collective timed out, then rebuilding it (real gloo processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from relight.runtime.config import ConfigError
from relight.runtime.device import (
    NCCL_ENV_DEFAULTS,
    Device,
    DeviceError,
    apply_nccl_env,
    resolve_device,
)

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()


def test_cpu_device_uses_gloo_and_no_op_calls() -> None:
    d = resolve_device("cpu")
    assert d == Device("cpu") and d.backend == "gloo" and d.torch == torch.device("cpu")
    assert not d.is_accelerator
    d.activate()
    d.synchronize()
    with d.autocast(None):
        pass
    with d.autocast(torch.bfloat16):
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert y.dtype == torch.bfloat16


def test_auto_picks_cuda_only_when_available() -> None:
    d = resolve_device("auto", local_rank=0)
    assert d.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert d.backend == ("nccl" if d.type == "cuda" else "gloo")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_config_error_that_says_why() -> None:
    with pytest.raises(DeviceError, match="train.device=cuda but torch") as e:
        resolve_device("cuda")
    assert isinstance(e.value, ConfigError)


def test_unknown_device_is_rejected() -> None:
    with pytest.raises(DeviceError, match="'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_train_with_cuda_on_a_cpu_machine_exits_with_the_config_status() -> None:
    # Exit status 2: a config error, which `relight run` does not restart.
    proc = subprocess.run(
        [sys.executable, "-m", "relight.runtime.train", "--config", "configs/tiny.toml",
         "--train.steps=1", "--train.device=cuda"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "DeviceError" in proc.stderr and "train.device=cuda" in proc.stderr


def test_nccl_env_defaults_never_override_the_user() -> None:
    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    set_now = apply_nccl_env(env, overrides={"TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the user's value stays
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in set_now
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1"
    for k, v in NCCL_ENV_DEFAULTS.items():
        if k != "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            assert env[k] == v and set_now[k] == v
    assert apply_nccl_env(env) == {}  # idempotent


_ABORT_REBUILD = """
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from relight.runtime.device import abort_process_group, init_process_group, resolve_device

rank, port, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
dev = resolve_device(kind, local_rank=rank)
dev.activate()
init_process_group(dev, 60, store=dist.PrefixStore("round0", store), rank=rank, world_size=2)
t = torch.ones(4, device=dev.torch)
dist.all_reduce(t)
assert t.tolist() == [2.0] * 4
if rank == 0:
    # Rank 1 never joins this collective: the bounded wait must raise, not hang.
    work = dist.all_reduce(torch.ones(4, device=dev.torch), async_op=True)
    t0 = time.monotonic()
    try:
        work.wait(timedelta(seconds=2))
    except Exception as e:
        print("timed out after %.1f s: %s" % (time.monotonic() - t0, type(e).__name__))
    else:
        raise SystemExit("the collective returned although rank 1 never joined")
    store.set("rank0_timed_out", "1")
else:
    store.wait(["rank0_timed_out"], timedelta(seconds=60))
abort_process_group()
assert not dist.is_initialized()
# A new group on a fresh store prefix works at once.
init_process_group(dev, 60, store=dist.PrefixStore("round1", store), rank=rank, world_size=2)
t = torch.full((4,), float(rank + 1), device=dev.torch)
dist.all_reduce(t)
assert t.tolist() == [3.0] * 4, t
print("rebuilt", rank)
dist.barrier()
dist.destroy_process_group()
"""


def run_ranks(tmp_path: Path, source: str, n: int, *args: str, timeout: float = 240,
              env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """Run `source` as `n` processes (`script RANK PORT *args`, PORT free for rank 0's
    store); every rank's (exit status, stdout, stderr)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "ranks.py"
    script.write_text(source)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **(env or {}))
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(port), *args],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def run_abort_rebuild(tmp_path: Path, kind: str, env: dict[str, str] | None = None
                      ) -> list[tuple[int, str, str]]:
    """Two ranks on `kind` (cpu: gloo, cuda: NCCL on cuda:0 and cuda:1) through the
    script above; every rank's (exit status, stdout, stderr)."""
    return run_ranks(tmp_path, _ABORT_REBUILD, 2, kind, env=env)


def check_abort_rebuild(outs: list[tuple[int, str, str]]) -> None:
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"rank {r}: {out}\n{err[-3000:]}"
        assert f"rebuilt {r}" in out
    assert "timed out after" in outs[0][1]
    secs = float(outs[0][1].split("timed out after ")[1].split()[0])
    assert secs < 30, outs[0][1]


@pytest.mark.multirank
def test_timed_out_collective_then_abort_and_rebuild(tmp_path: Path) -> None:
    check_abort_rebuild(run_abort_rebuild(tmp_path, "cpu"))


_MESH_TIMEOUTS = """
import os, sys, time
from datetime import timedelta
rank, port = int(sys.argv[1]), int(sys.argv[2])
os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="4",
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
import torch, torch.distributed as dist
from relight.runtime.config import load_config
from relight.runtime.train import Trainer

cfg = load_config("configs/tiny.toml", ["--parallel.tp=2", "--train.device=cpu",
                                        "--train.collective_timeout_s=15"])
trainer = Trainer(cfg)
seen = set()
for mesh in trainer.pmesh.meshes.values():
    for dim in range(mesh.ndim):
        backend = mesh.get_group(dim)._get_backend(torch.device("cpu"))
        seen.add(backend.options._timeout.total_seconds())
print("timeouts", sorted(seen), flush=True)
store = dist.distributed_c10d._get_default_store()
if rank == 0:
    # Its tp peer never joins: the mesh group's own timeout must end the wait.
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=trainer.pmesh["tp"].get_group())
    except Exception as e:
        print("raised after %.1f s" % (time.monotonic() - t0), flush=True)
    store.set("done", "1")
    # Rank 0 serves the store: it leaves only once every other rank has read "done".
    store.wait([f"ack{r}" for r in (1, 2, 3)], timedelta(seconds=200))
else:
    store.wait(["done"], timedelta(seconds=200))
    store.set(f"ack{rank}", "1")
os._exit(0)
"""


@pytest.mark.long
@pytest.mark.multirank
def test_every_mesh_group_is_bounded_by_the_collective_timeout(tmp_path: Path) -> None:
    # DeviceMesh gives its groups torch's default timeout (30 min on gloo, 10 on NCCL);
    # the trainer bounds them all by train.collective_timeout_s.
    outs = run_ranks(tmp_path, _MESH_TIMEOUTS, 4, timeout=300)
    for r, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"rank {r}: {out}\n{err[-3000:]}"
        assert "timeouts [15.0]" in out, out
    secs = float(outs[0][1].split("raised after ")[1].split()[0])
    assert 12 < secs < 150, outs[0][1]  # the 15 s bound, not gloo's default 1800 s
