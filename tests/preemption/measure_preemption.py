"""Figures for docs/preemption.md and benchmarks/results/ (not a test; run by hand, minutes):

    .venv/bin/python -m tests.preemption.measure_preemption --json /tmp/preempt.json

1. ``agreement``: per-step cost of agreeing on notices, 2 gloo ranks on loopback: the
   step's all-gather with 3 values per rank (before) and 5 (loss, flag, memory + notice
   flag and grace: what the trainer sends now), and a separate 1-value all-reduce (the
   alternative); plus the local check (``os.path.exists`` of the notice file).
2. ``save_vs_size``: emergency save time vs state size: 2-rank torchrun jobs of growing
   models with the notice file present from the start (the save of step 1, the worst
   case: no plan cached, no earlier save timed); the time is the trainer's own log line.
3. ``lost_steps``: the same scenario with and without notice handling: 2 ranks,
   checkpoint every 10 steps, SIGTERM to the torchrun agent once step N is logged, SIGKILL
   5 s later (chaos's ``preempt``); lost = last step logged - newest committed step.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.preemption.helpers import TINY, job, latest_step, metrics, torchrun, wait_until


def _agree_worker(rank: int, port: int, iters: int, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (as runtime.train).
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    # The three variants interleaved in every iteration, so machine load hits them alike.
    variants = {"gather3": 3, "gather5": 5, "allreduce1": 1}
    res: dict[str, list[float]] = {k: [] for k in variants}
    bufs = {k: (torch.zeros(n, dtype=torch.float64), torch.empty(2 * n, dtype=torch.float64))
            for k, n in variants.items()}
    for i in range(iters + 20):
        for name, (t, o) in bufs.items():
            dist.barrier()
            t0 = time.perf_counter()
            if name == "allreduce1":
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            else:
                gather(o, t)
            if i >= 20:
                res[name].append(time.perf_counter() - t0)
    if rank == 0:
        out.put(res)
    dist.destroy_process_group()


def agreement(iters: int = 300) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_agree_worker, args=(r, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    res = q.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    out: dict[str, Any] = {}
    for k, v in res.items():
        out[k] = {"median_us": round(statistics.median(v) * 1e6, 1),
                  "p90_us": round(sorted(v)[int(0.9 * len(v))] * 1e6, 1)}
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "notice")
        t0 = time.perf_counter()
        for _ in range(10000):
            os.path.exists(path)
        out["notice_file_stat_us"] = round((time.perf_counter() - t0) / 10000 * 1e6, 2)
    out["iters"] = iters
    return out


SIZES = [  # (dim, layers, mlp_hidden)
    (64, 2, 128), (256, 4, 1024), (384, 6, 1536), (512, 8, 2048),
]


def save_vs_size(tmp: Path) -> list[dict[str, Any]]:
    rows = []
    for dim, layers, mlp in SIZES:
        d = tmp / f"size-{dim}"
        d.mkdir()
        (d / "notice").touch()
        args = [*TINY, f"--model.dim={dim}", f"--model.n_layers={layers}",
                f"--model.mlp_hidden={mlp}", "--train.steps=50",
                f"--checkpoint.url={d / 'ck'}", f"--preemption.notice_file={d / 'notice'}",
                "--preemption.grace_s=600"]
        with job(torchrun(2, args), d / "log") as j:
            j.wait(600)
        text = j.text()
        got = re.findall(r"\[rank (\d) step 1\] preemption: emergency checkpoint committed "
                         r"step 1: ([\d.]+) MiB on this rank in ([\d.]+) s \(estimated "
                         r"([\d.]+) s\)", text)
        if len(got) != 2:
            raise RuntimeError(f"size {dim}: no emergency save lines in {d / 'log'}")
        rows.append({
            "dim": dim, "layers": layers, "mlp_hidden": mlp,
            "state_mib_total": round(sum(float(g[1]) for g in got), 1),
            "save_s_max_rank": max(float(g[2]) for g in got),
            "estimate_s": max(float(g[3]) for g in got),
            "load_avg_1m": os.getloadavg()[0],
        })
        print(rows[-1], flush=True)
    return rows


def lost_steps(tmp: Path, triggers: list[int]) -> list[dict[str, Any]]:
    rows = []
    for handling in (True, False):
        for at in triggers:
            d = tmp / f"lost-{handling}-{at}"
            d.mkdir()
            m = d / "m.jsonl"
            args = [*TINY, "--train.steps=400", "--checkpoint.every=10",
                    f"--checkpoint.url={d / 'ck'}", f"--train.metrics_path={m}",
                    f"--preemption.enabled={'true' if handling else 'false'}",
                    "--preemption.grace_s=5"]
            with job(torchrun(2, args), d / "log") as j:
                wait_until(lambda m=m, at=at: len(metrics(m)) >= at, 600, f"step {at}", j)
                t0 = time.time()
                os.kill(j.proc.pid, signal.SIGTERM)  # the agent, as a preempted node's
                try:
                    rc = j.proc.wait(timeout=5.0)
                except Exception:  # noqa: BLE001 - the grace period ends in SIGKILL
                    rc = None
                exit_s = time.time() - t0
            done = max(r["step"] for r in metrics(m))
            committed = latest_step(str(d / "ck")) or 0
            rows.append({"handling": handling, "signal_at_step": at, "last_step": done,
                         "committed": committed, "lost": done - committed,
                         "agent_exit_s": round(exit_s, 2), "agent_rc": rc})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--only", choices=["agreement", "save_vs_size", "lost_steps"])
    args = ap.parse_args()
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="preempt-measure-") as t:
        tmp = Path(t)
        if args.only in (None, "agreement"):
            out["agreement"] = agreement()
            print(out["agreement"], flush=True)
        if args.only in (None, "save_vs_size"):
            out["save_vs_size"] = save_vs_size(tmp)
        if args.only in (None, "lost_steps"):
            out["lost_steps"] = lost_steps(tmp, [13, 17, 24])
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
