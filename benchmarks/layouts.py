"""Layouts side by side on 4 ranks: ``python -m relight.benchmarks.layouts --json OUT.json``.

Every layout trains the same model on the same global batch; "dp4" (plain replicated data
parallelism) is the "just add devices" baseline. Per layout it measures, on every rank:

* step time (median of the timed steps) and tokens/s of the global batch, and the CPU seconds
  all ranks spent per step (less sensitive than wall time to other load on the machine),
* peak RSS during the timed steps (a 5 ms sampling thread; CPU has no allocator peak) and the
  RSS before the model was built (torch itself), so ``peak - base`` is what the layout costs,
* bytes sent per step: every c10d / functional collective of one step is intercepted with a
  TorchDispatchMode, and its tensor sizes and group size give the bytes each rank sends with
  bandwidth-optimal algorithms (ring all-reduce 2(n-1)/n S, all-gather and reduce-scatter
  (n-1)/n S of the full tensor, all-to-all (n-1)/n of the input, send S).

The 1-minute load average before and after each layout is recorded: on a shared machine,
step times are only comparable when it stayed near the rank count. Each layout runs in fresh
processes (gloo over loopback, one thread per rank) with
``MALLOC_MMAP_THRESHOLD_`` fixed so freed large tensors go back to the OS and RSS tracks live
memory. Absolute times on a 2-core machine say little; compare the rows of one run.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

DENSE = [
    "--model.vocab_size=8192", "--model.dim=768", "--model.n_layers=8", "--model.n_heads=12",
    "--model.mlp_hidden=3072", "--model.max_seq_len=64",
    "--data.seq_len=64", "--data.global_batch_size=8", "--data.micro_batch_size=1",
    "--data.branching=4",
]
MOE = [
    "--model.vocab_size=8192", "--model.dim=768", "--model.n_layers=8", "--model.n_heads=12",
    "--model.mlp_hidden=1536", "--model.max_seq_len=64", "--model.num_experts=8",
    "--model.moe_every=2", "--model.top_k=2",
    "--data.seq_len=64", "--data.global_batch_size=8", "--data.micro_batch_size=1",
]
LAYOUTS: dict[str, tuple[list[str], list[str]]] = {
    "dp4 (baseline)": (DENSE, ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"]),
    "fsdp4": (DENSE, []),
    "hsdp2x2": (DENSE, ["--parallel.dp_replicate=2"]),
    "fsdp2xtp2": (DENSE, ["--parallel.tp=2"]),
    "fsdp2xtp2+sp": (DENSE, ["--parallel.tp=2", "--parallel.sequence_parallel=true"]),
    "tp4": (DENSE, ["--parallel.tp=4"]),
    "pp2xfsdp2 1f1b": (DENSE, ["--parallel.pp=2"]),
    "pp4 1f1b": (DENSE, ["--parallel.pp=4"]),
    "pp4 gpipe": (DENSE, ["--parallel.pp=4", "--parallel.pp_schedule=gpipe"]),
    "moe dp4 (baseline)": (MOE, ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"]),
    "moe dp4xep4": (MOE, ["--parallel.dp_replicate=4", "--parallel.dp_shard=1",
                          "--parallel.ep=4"]),
    "moe fsdp4xep4": (MOE, ["--parallel.ep=4"]),
}


def _rss_mb() -> float:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / 2**20


class _PeakRSS:
    def __init__(self, period_s: float = 0.005) -> None:
        self.period_s = period_s
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> _PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mb())


def _comm_counter():  # noqa: ANN202 - returns a TorchDispatchMode instance
    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    def nbytes(t: Any) -> int:
        if isinstance(t, torch.Tensor):
            return t.numel() * t.element_size()
        if isinstance(t, (list, tuple)):
            return sum(nbytes(x) for x in t)
        return 0

    def group_size(args: tuple, kwargs: dict) -> int:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, dist.ProcessGroup):
                return a.size()
            if isinstance(a, torch.ScriptObject) and a._type().qualified_name().endswith(
                    "c10d.ProcessGroup"):
                return dist.ProcessGroup.unbox(a).size()
            if isinstance(a, str):
                try:
                    from torch.distributed.distributed_c10d import _resolve_process_group

                    return _resolve_process_group(a).size()
                except Exception:  # noqa: BLE001, S112 - not a group name
                    continue
        return 1

    class CommBytes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sent = 0.0
            self.calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            ns = func.namespace
            if ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd"):
                name = func._schema.name.split("::")[-1]
                n = group_size(args, kwargs)
                frac = (n - 1) / n if n > 1 else 0.0
                if name.startswith("allreduce") or name == "all_reduce":
                    self.sent += 2 * frac * nbytes(args[0])
                elif name in ("_allgather_base_", "allgather_into_tensor_coalesced_"):
                    self.sent += frac * nbytes(args[0])  # output: the gathered tensor
                elif name == "all_gather_into_tensor":
                    self.sent += (n - 1) * nbytes(args[0])  # input: this rank's shard
                elif name in ("_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_"):
                    self.sent += frac * nbytes(args[1])
                elif name == "reduce_scatter_tensor":
                    self.sent += frac * nbytes(args[0])
                elif name == "alltoall_base_":
                    self.sent += frac * nbytes(args[1])
                elif name == "all_to_all_single":
                    self.sent += frac * nbytes(args[0])
                elif name == "send":
                    self.sent += nbytes(args[0])
                elif name.startswith("broadcast"):
                    self.sent += frac * nbytes(args[0])
                if name not in ("recv_", "recv_any_source_", "barrier", "wait_tensor",
                                "monitored_barrier_", "_wrap_tensor_autograd"):
                    self.calls[name] += 1
            return func(*args, **(kwargs or {}))

    return CommBytes()


def _rank_main(rank: int, world: int, port: int, overrides: list[str], steps: int,
               out: Any) -> None:
    try:
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=600))
        from relight.runtime.config import load_config
        from relight.runtime.train import Trainer

        base_rss = _rss_mb()
        cfg = load_config(None, overrides + ["--train.watchdog_timeout_s=0",
                                             f"--train.steps={steps + 2}"])
        trainer = Trainer(cfg)
        from torch.distributed.tensor import DTensor

        n_params = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                       for p in trainer.model.parameters())
        trainer.train_step()  # warm-up (first-step setup, pipeline shape inference)
        dist.barrier()
        times, cpu = [], []
        with _PeakRSS() as peak:
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.process_time()
                rec = trainer.train_step()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        counter = _comm_counter()
        with counter:
            trainer.train_step()
        out.put((rank, {
            "step_times_s": times, "cpu_s_per_step": statistics.median(cpu),
            "base_rss_mb": base_rss, "peak_rss_mb": peak.peak,
            "sent_bytes": counter.sent, "calls": dict(counter.calls), "loss": rec["loss"],
            "local_param_elems": n_params, "layout": trainer.layout.describe(),
        }))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported to the parent
        out.put((rank, {"error": traceback.format_exc()}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(name: str, overrides: list[str], *, world: int, steps: int,
               timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    os.environ.update(OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="131072")
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, overrides, steps, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < world:
            rank, res = q.get(timeout=max(1.0, deadline - time.monotonic()))
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = {r: v["error"] for r, v in results.items() if "error" in v}
    if errors:
        raise RuntimeError(f"layout {name} failed: {errors}")
    ranks = [results[r] for r in range(world)]
    step_time = statistics.median(max(r["step_times_s"][i] for r in ranks)
                                  for i in range(steps))
    return {
        "layout": name,
        "mesh": ranks[0]["layout"],
        "step_time_s": step_time,
        # CPU seconds of all ranks per step: less sensitive than wall time to other load.
        "cpu_s_per_step_all_ranks": sum(r["cpu_s_per_step"] for r in ranks),
        "peak_rss_mb_per_rank": [round(r["peak_rss_mb"], 1) for r in ranks],
        "base_rss_mb_per_rank": [round(r["base_rss_mb"], 1) for r in ranks],
        "sent_mb_per_rank": [round(r["sent_bytes"] / 2**20, 2) for r in ranks],
        "collective_calls_rank0": ranks[0]["calls"],
        "local_param_elems_per_rank": [r["local_param_elems"] for r in ranks],
        "loss_after": ranks[0]["loss"],
    }


def _table(rows: list[dict], tokens: dict[str, int]) -> str:
    lines = [
        "| layout | mesh | step time (s) | tokens/s | peak RSS - base, max rank (MiB) "
        "| sent per rank per step, max (MiB) | params held per rank, max (M) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        over = max(p - b for p, b in zip(r["peak_rss_mb_per_rank"], r["base_rss_mb_per_rank"],
                                         strict=True))
        lines.append(
            f"| {r['layout']} | {r['mesh']} | {r['step_time_s']:.2f} | "
            f"{tokens[r['layout']] / r['step_time_s']:,.0f} | {over:,.0f} | "
            f"{max(r['sent_mb_per_rank']):,.1f} | "
            f"{max(r['local_param_elems_per_rank']) / 1e6:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m relight.benchmarks.layouts")
    parser.add_argument("--json", required=True, help="write the results here")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per layout")
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--only", default="", help="comma-separated layout names")
    parser.add_argument("--timeout-s", type=float, default=900)
    parser.add_argument("--extra", action="append", default=[],
                        help="extra config override for every layout (repeatable)")
    args = parser.parse_args(argv)
    names = [n for n in LAYOUTS if not args.only or n in args.only.split(",")]
    rows, tokens = [], {}
    for name in names:
        model, par = LAYOUTS[name]
        t0 = time.perf_counter()
        load_before = os.getloadavg()[0]
        row = run_layout(name, model + par + args.extra, world=args.world, steps=args.steps,
                         timeout_s=args.timeout_s)
        cfg_tokens = 8 * 64  # global_batch_size * seq_len of both model configs
        tokens[name] = cfg_tokens
        row["tokens_per_s"] = cfg_tokens / row["step_time_s"]
        # The 1-minute load average before/after: other work on the machine skews step times.
        row["loadavg_1m"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
        rows.append(row)
        print(f"{name}: {row['step_time_s']:.2f} s/step, sent "
              f"{max(row['sent_mb_per_rank']):.1f} MiB/rank, peak "
              f"{max(row['peak_rss_mb_per_rank']):.0f} MiB ({time.perf_counter() - t0:.0f} s)",
              file=sys.stderr, flush=True)
    result = {"world": args.world, "timed_steps": args.steps, "rows": rows,
              "cpu_count": os.cpu_count(), "unix_time": time.time()}
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(_table(rows, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
