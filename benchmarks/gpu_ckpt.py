"""The checkpoint benchmark on accelerator tensors: Relight beside DCP's `async_save`.

    python -m relight.benchmarks.gpu_ckpt --sizes-mib 1024,8192,32768 --json OUT.json [--dir DIR]

One process (world 1; on CUDA a ``cpu:gloo,cuda:nccl`` group, since DCP's `async_save`
needs a CPU backend), the same state for every system: fp32 weights plus two Adam
moments, on the device, about SIZE MiB in all. Per size, in this order, each system's
checkpoint deleted before the next starts:

- floor: the same bytes copied into one preallocated page-locked host buffer with
  non-blocking copies and one stream synchronize: the physical floor of any snapshot
  (median and min of `--floor-rounds`);
- relight: a first async save (plan, buffer allocation and pinning: what the first save
  of a run pays), then a second one: `stall_s` (until `save()` returns: the state may be
  changed from then on, and this benchmark does change it at once, in place), `total_s`
  (until committed), `save_gb_s`, then `load_s` / `load_gb_s` into device tensors, and
  `bitwise` (the loaded state equals the state at the save call, not the changed one);
  then, budget permitting, a pipelined save (`SaveOptions(pipelined_staging=True)`):
  `return_s`, `staged_s` (until training may mutate), `total_s`;
- dcp_thread: `async_save` as shipped (thread executor, its default stager): `stall_s`,
  `mutate_ok_s` (`staging_completion` where the response has one, else the stall),
  `total_s`, load; dcp_thread_pinned: the same with one `DefaultStager` kept across saves
  (pinned memory, non-blocking copies: DCP's fastest synchronous staging), second save;
  dcp_process: `async_checkpointer_type=PROCESS`, where torch has it.

Figures are GB/s of 1e9 bytes; sizes are MiB of state. A size that does not fit the time
budget, the free disk or the free host memory is skipped and says so.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

ROW = 4096
"""Columns of every weight-sized tensor (fp32: 16 KiB a row)."""


def _state(nbytes: int, device: torch.device) -> dict[str, Any]:
    """Weights + biases and two moments each, ~nbytes in all, random, on `device`."""
    layers = max(1, nbytes // (3 * (64 << 20)))
    rows = max(1, (nbytes - 3 * layers * ROW * 4) // (3 * layers * ROW * 4))
    gen = torch.Generator(device=device).manual_seed(0)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, generator=gen)

    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(layers):
        for name, shape in ((f"layers.{i}.weight", (rows, ROW)), (f"layers.{i}.bias", (ROW,))):
            model[name] = make(*shape)
            optim[name] = {"exp_avg": make(*shape), "exp_avg_sq": make(*shape)}
    return {"model": model, "optim": {"state": optim}}


def _leaves(state: dict[str, Any]) -> list[torch.Tensor]:
    out = list(state["model"].values())
    for moments in state["optim"]["state"].values():
        out += list(moments.values())
    return out


def _zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    """A load target: the same names, shapes and device, all zeros."""
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "optim": {"state": {k: {n: torch.zeros_like(t) for n, t in m.items()}
                                for k, m in state["optim"]["state"].items()}}}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in _leaves(state))


def _digest(state: dict[str, Any]) -> list[int]:
    """A bit-sensitive digest per tensor, computed on the device (int64 sum of the int32
    words): a flipped sign or any changed bit changes it."""
    with torch.no_grad():
        sums = [t.view(torch.int32).sum(dtype=torch.int64) for t in _leaves(state)]
        return torch.stack(sums).cpu().tolist()


def _negate(state: dict[str, Any]) -> None:
    """Change every tensor in place, exactly reversibly (a sign flip), as a step would."""
    with torch.no_grad():
        for t in _leaves(state):
            t.neg_()


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def sync(self) -> None:
        if self.device.type != "cpu":
            torch.get_device_module(self.device.type).synchronize(self.device)

    def timed(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.sync()
        return time.perf_counter() - t0, out


def _rm(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _free_host_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - then only the disk check applies
        return 1 << 62


def floor_arm(state: dict[str, Any], clock: _Clock, rounds: int = 3) -> dict[str, Any]:
    from relight.ckpt.staging import host_buffer

    leaves = _leaves(state)
    pin = None if clock.device.type == "cpu" else clock.device.type
    t_alloc, buf = clock.timed(lambda: host_buffer(_nbytes(state), pin))
    dsts, at = [], 0
    for t in leaves:
        nb = t.numel() * t.element_size()
        dsts.append(buf[at: at + nb].view(t.dtype).view(t.shape))
        at += nb
    dma = clock.device.type != "cpu"

    def copy() -> None:
        for d, s in zip(dsts, leaves, strict=True):
            d.copy_(s, non_blocking=dma)
        if dma:
            torch.get_device_module(clock.device.type).current_stream(clock.device).synchronize()

    copy()  # first touch of the buffer's pages
    times = [clock.timed(copy)[0] for _ in range(rounds)]
    dsts.clear()
    buf = None
    gc.collect()
    nb = _nbytes(state)
    return {"copy_s": statistics.median(times), "copy_min_s": min(times),
            "copy_gb_s": nb / statistics.median(times) / 1e9, "alloc_pin_s": t_alloc,
            "rounds": times}


def relight_arm(state: dict[str, Any], base: str, clock: _Clock,
                pipelined: bool) -> dict[str, Any]:
    from relight import ckpt

    nb = _nbytes(state)
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    h = ckpt.save(state, f"{base}-0", async_save=True)
    out["first_stall_s"] = time.perf_counter() - t0
    h.wait()
    out["first_total_s"] = time.perf_counter() - t0
    _rm(f"{base}-0")
    before = _digest(state)
    clock.sync()
    t0 = time.perf_counter()
    h = ckpt.save(state, f"{base}-1", async_save=True)
    out["stall_s"] = time.perf_counter() - t0
    out["mutate_ok_s"] = out["stall_s"]  # staging is done when save() returns
    out["stage_copy_s"] = h.stage_s
    _negate(state)  # training changes the state right after save() returns
    h.wait()
    out["total_s"] = time.perf_counter() - t0
    out["save_gb_s"] = nb / out["total_s"] / 1e9
    target = _zeros_like(state)
    out["load_s"], _ = clock.timed(ckpt.load, target, f"{base}-1")
    out["load_gb_s"] = nb / out["load_s"] / 1e9
    out["bitwise"] = _digest(target) == before
    del target
    _negate(state)
    _rm(f"{base}-1")
    if pipelined:
        opts = ckpt.SaveOptions(pipelined_staging=True)
        clock.sync()
        t0 = time.perf_counter()
        h = ckpt.save(state, f"{base}-p", async_save=True, options=opts)
        ret = time.perf_counter() - t0
        h.wait_staged()
        staged = time.perf_counter() - t0
        h.wait()
        out["pipelined"] = {"return_s": ret, "staged_s": staged,
                            "total_s": time.perf_counter() - t0}
        _rm(f"{base}-p")
    ckpt.default_checkpointer().cached = None  # free the staging buffers for the next system
    gc.collect()
    return out


def dcp_arm(state: dict[str, Any], path: str, clock: _Clock, mode: str,
            load: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import state_dict_saver as saver

    nb = _nbytes(state)
    kwargs: dict[str, Any] = {}
    stager = None
    if mode == "process":
        kwargs["async_checkpointer_type"] = saver.AsyncCheckpointerType.PROCESS
    elif mode == "thread_pinned":
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                              use_async_staging=False,
                                              use_non_blocking_copy=True))
        kwargs["async_stager"] = stager

    def one(dest: str) -> tuple[dict[str, float], Any, float]:
        clock.sync()
        t0 = time.perf_counter()
        r = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(dest), **kwargs)
        res = {"stall_s": time.perf_counter() - t0}
        staging = getattr(r, "staging_completion", None)
        if staging is not None:
            staging.result()
        res["mutate_ok_s"] = time.perf_counter() - t0
        return res, (getattr(r, "upload_completion", None) or r), t0

    out: dict[str, Any] = {}
    bound = max(120.0, nb / 0.1e9)  # seconds: a save slower than 0.1 GB/s counts as hung
    if stager is not None:  # the kept stager's first save allocates; the second is timed
        res, fut, t0 = one(path + "-warm")
        fut.result(timeout=bound)
        out["first_stall_s"] = res["stall_s"]
        _rm(path + "-warm")
    before = _digest(state)
    res, fut, t0 = one(path)
    _negate(state)
    fut.result(timeout=bound)
    res["total_s"] = time.perf_counter() - t0
    res["save_gb_s"] = nb / res["total_s"] / 1e9
    out.update(res)
    if load:
        target = _zeros_like(state)
        out["load_s"], _ = clock.timed(dcp.load, target,
                                       storage_reader=dcp.FileSystemReader(path))
        out["load_gb_s"] = nb / out["load_s"] / 1e9
        out["bitwise"] = _digest(target) == before
        del target
    _negate(state)
    if stager is not None:
        stager.close()
    _rm(path)
    gc.collect()
    return out


MANDATORY = ("floor", "relight", "dcp_thread")
"""The arms every size runs; the others run while the time budget allows."""


def run(sizes_mib: list[int], base_dir: str, device: torch.device, budget_s: float,
        floor_rounds: int = 3, on_row: Callable[[dict[str, Any]], None] | None = None
        ) -> dict[str, Any]:
    """Every size in order, within `budget_s` seconds; returns the figures (and passes
    them to `on_row` after every size, so a kill keeps the sizes done)."""
    from torch.distributed.checkpoint import state_dict_saver as saver

    deadline = time.monotonic() + budget_s
    clock = _Clock(device)
    results: dict[str, Any] = {"sizes": {}, "skipped": {}}
    cost: dict[str, float] = {}
    """Arm -> seconds per byte of state at the previous size (estimates the next)."""

    def estimate(names: tuple[str, ...] | list[str], nb: int) -> float | None:
        known = [cost[n] for n in names if n in cost]
        return None if len(known) < len(names) else sum(known) * nb

    for mib in sizes_mib:
        nb = mib << 20
        left = deadline - time.monotonic()
        est = estimate(MANDATORY + ("state",), nb)
        free_disk = shutil.disk_usage(base_dir).free
        free_host = _free_host_bytes()
        if est is not None and est > left:
            results["skipped"][str(mib)] = (f"time budget: ~{est:.0f} s estimated from the "
                                            f"previous size, {left:.0f} s left")
            continue
        if free_disk < 1.3 * nb:
            results["skipped"][str(mib)] = f"free disk {free_disk >> 30} GiB < 1.3 x the state"
            continue
        if free_host < 1.5 * nb:
            results["skipped"][str(mib)] = (f"free host memory {free_host >> 30} GiB < 1.5 x "
                                            "the state (staging plus page cache)")
            continue
        t_size = time.monotonic()
        state = _state(nb, device)
        clock.sync()
        nb = _nbytes(state)
        cost["state"] = (time.monotonic() - t_size) / nb
        row: dict[str, Any] = {"bytes": nb, "tensors": len(_leaves(state))}
        base = os.path.join(base_dir, f"s{mib}")
        arms: list[tuple[str, Callable[..., dict[str, Any]], tuple[Any, ...]]] = [
            ("floor", floor_arm, (clock, floor_rounds)),
            ("relight", relight_arm, (base + "-relight", clock, mib <= 8192)),
            ("dcp_thread", dcp_arm, (base + "-dcp", clock, "thread", True)),
        ]
        if device.type == "cpu":  # DCP's pinned, non-blocking staging needs an accelerator
            row["dcp_thread_pinned"] = {"skipped": "needs an accelerator"}
        else:
            arms.append(("dcp_thread_pinned", dcp_arm,
                         (base + "-dcpp", clock, "thread_pinned", False)))
        if hasattr(saver, "AsyncCheckpointerType"):
            arms.append(("dcp_process", dcp_arm, (base + "-dcpproc", clock, "process", False)))
        for name, fn, args in arms:
            if name not in MANDATORY:
                need = estimate([name], nb)
                left = deadline - time.monotonic()
                if (need is not None and need > left) or (need is None and left < 0.3 * budget_s):
                    row[name] = {"skipped": f"time budget ({left:.0f} s left)"}
                    continue
            t_arm = time.monotonic()
            try:
                row[name] = fn(state, *args)
            except Exception as e:  # noqa: BLE001 - one arm's failure is a figure too
                row[name] = {"error": f"{type(e).__name__}: {e}"}
                gc.collect()
            cost[name] = (time.monotonic() - t_arm) / nb
        _ratios(row)
        row["seconds"] = time.monotonic() - t_size
        results["sizes"][str(mib)] = row
        del state
        gc.collect()
        if device.type != "cpu":
            torch.get_device_module(device.type).empty_cache()
        if on_row is not None:
            on_row(results)
        print(json.dumps({mib: {k: v for k, v in row.items() if k != "floor"}}), flush=True)
    return results


def _ratios(row: dict[str, Any]) -> None:
    fl, rl, dc = row.get("floor", {}), row.get("relight", {}), row.get("dcp_thread", {})
    r: dict[str, float] = {}
    if "stall_s" in rl and "copy_s" in fl:
        r["relight_stall_over_floor"] = rl["stall_s"] / fl["copy_s"]
    if "stall_s" in rl:
        for name in ("dcp_thread", "dcp_thread_pinned", "dcp_process"):
            d = row.get(name, {})
            if "stall_s" in d:
                r[f"relight_stall_over_{name}_stall"] = rl["stall_s"] / d["stall_s"]
                r[f"relight_stall_over_{name}_mutate_ok"] = rl["stall_s"] / d["mutate_ok_s"]
    if "load_s" in rl and "load_s" in dc:
        r["dcp_load_over_relight_load"] = dc["load_s"] / rl["load_s"]
    row["ratios"] = r


def init_world1(device: torch.device) -> None:
    """A 1-rank group for the benchmark: gloo on CPU, gloo + NCCL on CUDA (DCP's
    async_save refuses a group without a CPU backend)."""
    import torch.distributed as dist

    from relight.runtime.device import Device, init_process_group

    if device.type == "cpu":
        init_process_group(Device("cpu"), 600, store=dist.HashStore(), rank=0, world_size=1)
        return
    torch.cuda.set_device(device)
    from relight.runtime.device import apply_nccl_env

    apply_nccl_env()
    dist.init_process_group("cpu:gloo,cuda:nccl", store=dist.HashStore(), rank=0,
                            world_size=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1024,8192,32768")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--budget-s", type=float, default=300.0)
    p.add_argument("--floor-rounds", type=int, default=3)
    p.add_argument("--json", dest="json_out", default=None)
    a = p.parse_args(argv)
    import torch.distributed as dist

    from relight.runtime.device import resolve_device

    device = resolve_device(a.device).torch
    init_world1(device)
    meta = {"device": str(device) if device.type == "cpu" else
            torch.cuda.get_device_name(device), "torch": torch.__version__,
            "sizes_mib": a.sizes_mib, "budget_s": a.budget_s}

    def write(results: dict[str, Any], done: bool = False) -> None:
        text = json.dumps({**results, **meta, "complete": done}, indent=1)
        if a.json_out:
            tmp_out = a.json_out + ".tmp"
            with open(tmp_out, "w") as f:
                f.write(text)
            os.replace(tmp_out, a.json_out)
        elif done:
            print(text)

    tmp = tempfile.mkdtemp(prefix="bench-gpu-ckpt-", dir=a.dir)
    try:
        out = run([int(x) for x in a.sizes_mib.split(",") if x], tmp, device, a.budget_s,
                  a.floor_rounds, on_row=write)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write(out, done=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
