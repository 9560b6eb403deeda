"""Staging from CUDA tensors: pinned buffers, the side stream, ordering against the caller's
stream, the caching allocator, and bitwise round trips (bf16 included) onto the CPU.

Every test here is marked `cuda` and is skipped where torch sees no GPU."""

from __future__ import annotations

import pytest
import torch

from relight import ckpt
from relight.ckpt.staging import host_buffer

pytestmark = pytest.mark.cuda

DEV = torch.device("cuda", 0)


def _state(seed: int = 0) -> dict:
    g = torch.Generator(device=DEV).manual_seed(seed)
    big = torch.randn(1024, 1024, device=DEV, generator=g)
    return {"model": {
        "w32": torch.randn(512, 768, device=DEV, generator=g),
        "w16": torch.randn(256, 1024, device=DEV, generator=g).to(torch.bfloat16),
        "half": torch.randn(64, 64, device=DEV, generator=g).to(torch.float16),
        "ids": torch.randint(0, 1 << 40, (4096,), device=DEV, generator=g),
        "small": torch.randn(7, device=DEV, generator=g),  # packed
        "scalar": torch.tensor(3.5, device=DEV),
        "strided": big[:, ::2],  # not contiguous
    }, "step": 12}


def _cpu_target(sd: dict) -> dict:
    return {"model": {k: torch.empty_like(v, device="cpu").contiguous()
                      for k, v in sd["model"].items()}, "step": 0}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("mode", ["sync", "async", "pipelined"])
def test_cuda_state_round_trips_bitwise_onto_cpu(tmp_path, mode: str) -> None:
    sd = _state()
    expect = {k: v.cpu() for k, v in sd["model"].items()}
    opts = ckpt.SaveOptions(pipelined_staging=mode == "pipelined")
    h = ckpt.save(sd, tmp_path / "c", async_save=mode != "sync", options=opts)
    h.wait()
    out = _cpu_target(sd)
    ckpt.load(out, tmp_path / "c")
    assert out["step"] == 12
    for k, v in expect.items():
        assert _same_bits(out["model"][k], v), k
    back = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "step": 0}
    ckpt.load(back, tmp_path / "c")  # and back onto the GPU
    for k, v in expect.items():
        assert back["model"][k].is_cuda and _same_bits(back["model"][k], v), k


def test_staging_buffers_are_pinned_and_exactly_sized(tmp_path) -> None:
    sd = _state()
    ckpt.save(sd, tmp_path / "c", async_save=True).wait()
    bufs = ckpt.default_checkpointer().cached.bufs
    assert bufs.pinned_for == "cuda"
    assert bufs.staging is not None and bufs.staging.is_pinned()
    assert bufs.packed is not None and bufs.packed.is_pinned()
    need = sum(v.numel() * v.element_size() for v in sd["model"].values())
    # Not rounded up to a power of two (torch's pinned allocator would): at most the
    # per-piece alignment over the bytes staged.
    assert bufs.staging.numel() < need + 64 * 1024
    n = (3 << 30) // 2  # 1.5 GiB: the caching allocator would hold 2 GiB
    buf = host_buffer(n, "cuda")
    assert buf.numel() == n and buf.is_pinned()
    del buf


def test_copy_sees_kernels_queued_before_the_save_and_not_after(tmp_path) -> None:
    x = torch.zeros(64 << 20, dtype=torch.uint8, device=DEV)  # 64 MiB
    sd = {"x": x}
    ckpt.save(sd, tmp_path / "warm", async_save=True).wait()  # plan + buffers once
    for i, mode in enumerate(["sync", "async", "pipelined"]):
        torch.cuda._sleep(200_000_000)  # keeps the caller's stream busy (~0.1 s)
        x.fill_(7 + i)  # queued before save(): must be in the checkpoint
        h = ckpt.save(sd, tmp_path / mode, async_save=mode != "sync",
                      options=ckpt.SaveOptions(pipelined_staging=mode == "pipelined"))
        h.wait_staged()
        x.fill_(100)  # after the state may change: must not be
        h.wait()
        out = {"x": torch.empty(x.shape, dtype=x.dtype)}
        ckpt.load(out, tmp_path / mode)
        assert bool((out["x"] == 7 + i).all()), mode


def test_background_copy_keeps_freed_sources_from_being_reused(tmp_path) -> None:
    # A pipelined save copies after save() returns; a source freed in between must not
    # be handed to a new tensor (Tensor.record_stream) before the side stream read it.
    n = 32 << 20
    keep = torch.arange(n, dtype=torch.int32, device=DEV)
    ckpt.save({"x": keep.clone()}, tmp_path / "warm", async_save=True,
              options=ckpt.SaveOptions(pipelined_staging=True)).wait()
    torch.cuda._sleep(300_000_000)  # the copy starts only after this
    sd = {"x": keep.clone()}
    h = ckpt.save(sd, tmp_path / "c", async_save=True,
                  options=ckpt.SaveOptions(pipelined_staging=True))
    del sd  # the only reference to the source goes away
    junk = [torch.full((n,), -1, dtype=torch.int32, device=DEV) for _ in range(4)]
    h.wait()
    out = {"x": torch.empty(n, dtype=torch.int32)}
    ckpt.load(out, tmp_path / "c")
    assert torch.equal(out["x"], keep.cpu())
    del junk


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_staging_runs_on_the_sources_device_not_the_current_one(tmp_path) -> None:
    dev1 = torch.device("cuda", 1)
    sd = {"x": torch.randn(1 << 20, device=dev1), "y": torch.randn(5, device=dev1)}
    for mode in ("async", "pipelined"):
        with torch.cuda.device(0):  # the caller's current device is another GPU
            torch.cuda._sleep(100_000_000)
            h = ckpt.save(sd, tmp_path / mode, async_save=True,
                          options=ckpt.SaveOptions(pipelined_staging=mode == "pipelined"))
        h.wait()
        out = {"x": torch.empty(1 << 20), "y": torch.empty(5)}
        ckpt.load(out, tmp_path / mode)
        assert _same_bits(out["x"], sd["x"]) and _same_bits(out["y"], sd["y"]), mode
