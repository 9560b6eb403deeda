"""Replica groups of different layouts against groups of one layout, same bytes:
``relight bench cross_group --json OUT.json``.

Two replica groups of two ranks each (four gloo processes on loopback) hold the same
float32 state, `--mb` MB in `--tensors` 2-D tensors. Three arms per repetition:

* **matched** (the baseline): both groups split every tensor's rows in halves. The
  reduction is what `elastic.replica.ReplicaManager` does for matching layouts: each rank
  all-reduces one flat buffer of its shards with the same rank of the other group. The
  heal is `elastic.heal.transfer_state`: each tensor broadcast from a rank of the first
  group to the same rank of the second.
* **mixed**: the second group splits the columns instead (as tensor parallelism would).
  The reduction is `elastic.regions.sum_regions` and the heal `elastic.regions.copy_regions`
  (each box from the rank that holds it), the paths a quorum of different layouts takes.
* **floor**: each rank sends its whole local bytes to its peer in the other group and
  receives as many (one message each way): what moving a replica's shards once costs on
  this machine's transport.

Every arm is checked: both reductions must give the exact sum on every rank, both heals
the source's bytes. Times are the slowest rank's, median over `--reps`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

__all__ = ["main", "run"]

RANKS = 4
GROUPS = [[0, 1], [2, 3]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _boxes(rank: int, shape: tuple[int, int], mixed: bool) -> tuple[tuple[int, int],
                                                                       tuple[int, int]]:
    rows, cols = shape
    half = rank % 2
    if mixed and rank in GROUPS[1]:
        return (0, half * cols // 2), (rows, cols // 2)
    return (half * rows // 2, 0), (rows // 2, cols)


def _worker(rank: int, port: int, cfg: dict[str, Any], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from relight.ckpt.layout import Piece
    from relight.ckpt.plan import RankLayout, TensorLayout
    from relight.elastic import regions
    from relight.elastic.heal import transfer_state
    from relight.elastic.regions import copy_regions, plan_copy, plan_sum, sum_regions

    if cfg.get("message_mb"):
        regions.MESSAGE_BYTES = int(cfg["message_mb"] * 2**20)

    timeout = timedelta(seconds=cfg["timeout_s"])
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timeout)
    world = dist.distributed_c10d._get_default_group()
    pair = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    store = dist.distributed_c10d._get_default_store()
    group = 0 if rank in GROUPS[0] else 1
    n = cfg["tensors"]
    rows = cols = max(2, int((cfg["mb"] * 2**20 / 4 / n) ** 0.5) // 2 * 2)
    shape = (rows, cols)
    names = [f"t{i:03d}" for i in range(n)]

    def full(i: int, g: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(1000 * g + i)
        return torch.randn(shape, generator=gen)

    def local(mixed: bool, g: int, r: int = rank) -> dict[str, torch.Tensor]:
        (o, s) = _boxes(r, shape, mixed)
        return {nm: full(i, g)[o[0]:o[0] + s[0], o[1]:o[1] + s[1]].clone()
                for i, nm in enumerate(names)}

    def layout(r: int, mixed: bool) -> RankLayout:
        box = _boxes(r, shape, mixed)
        return RankLayout(r, tuple(TensorLayout(nm, (nm,), shape, "float32", "bench", (box,))
                                   for nm in names), ())

    def pieces(mixed: bool) -> dict[str, list[Piece]]:
        o, s = _boxes(rank, shape, mixed)
        return {nm: [Piece(o, s, (0, 0))] for nm in names}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn) -> float:  # noqa: ANN001
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - t0)

    expected_sum = {m: {nm: a + b for nm, a, b in zip(
        names, local(m, 0).values(), local(m, 1).values(), strict=True)} for m in (False, True)}
    source = {m: local(m, 0, r=rank) for m in (False, True)}
    results: dict[str, list[float]] = {k: [] for k in (
        "matched_reduce", "mixed_reduce", "matched_heal", "mixed_heal", "floor")}
    correct = True
    layouts = {m: [layout(r, m) for r in range(RANKS)] for m in (False, True)}
    sum_plan = plan_sum(layouts[True], GROUPS, rank)
    copy_plan = plan_copy(layouts[True], GROUPS[0], GROUPS[1], rank)
    for rep in range(cfg["reps"]):
        # Reductions: every rank holds its group's gradients; afterwards the sum.
        grads = local(False, group)

        def matched_reduce(grads: dict[str, torch.Tensor] = grads) -> None:
            flat = torch.cat([t.reshape(-1) for t in grads.values()])
            pair.allreduce([flat]).wait()
            off = 0
            for t in grads.values():
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()

        results["matched_reduce"].append(timed(matched_reduce))
        correct &= all(torch.equal(grads[nm], expected_sum[False][nm]) for nm in names)
        grads = local(True, group)
        results["mixed_reduce"].append(timed(lambda grads=grads: sum_regions(
            world, sum_plan, grads, pieces(True), [0, 0, 1, 1], timeout_s=cfg["timeout_s"])))
        correct &= all(torch.equal(grads[nm], expected_sum[True][nm]) for nm in names)
        # Heals: the second group's state is overwritten by the first group's.
        state = local(False, group) if group == 0 else {
            nm: torch.zeros_like(t) for nm, t in local(False, 0).items()}
        results["matched_heal"].append(timed(lambda state=state, rep=rep: transfer_state(
            pair, dist.PrefixStore(f"heal{rep}/{rank % 2}", store), group, 0, state,
            receiving=group == 1)))
        correct &= all(torch.equal(state[nm], source[False][nm]) for nm in names)
        state = source[True] if group == 0 else {
            nm: torch.zeros_like(t) for nm, t in local(True, 1).items()}
        results["mixed_heal"].append(timed(lambda state=state: copy_regions(
            world, copy_plan, state, pieces(True), timeout_s=cfg["timeout_s"])))
        if group == 1:
            want = {nm: full(i, 0) for i, nm in enumerate(names)}
            o, s = _boxes(rank, shape, True)
            correct &= all(torch.equal(state[nm], want[nm][o[0]:o[0] + s[0], o[1]:o[1] + s[1]])
                           for nm in names)
        # Floor: one message each way between the two groups' matching ranks.
        mine = torch.cat([t.reshape(-1) for t in local(False, group).values()])
        peer = (rank + 2) % RANKS

        def floor(mine: torch.Tensor = mine, peer: int = peer) -> None:
            got = torch.empty_like(mine)
            works = [world.recv([got], peer, 1), world.send([mine], peer, 1)]
            for w in works:
                w.wait(timeout)

        results["floor"].append(timed(floor))
    ok = torch.tensor([1 if correct else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        out.put({"results": results, "correct": bool(ok.item()), "shape": list(shape),
                 "bytes_per_rank": sum(t.numel() * 4 for t in local(False, 0).values())})
    dist.destroy_process_group()


def run(mb: float, tensors: int, reps: int, timeout_s: float = 120.0,
        message_mb: float | None = None) -> dict[str, Any]:
    """Run the three arms in four fresh processes; the medians and the checks.
    `message_mb`: the routed exchanges' message size (`elastic.regions.MESSAGE_BYTES`)."""
    load_before = os.getloadavg()[0]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    cfg = {"mb": mb, "tensors": tensors, "reps": reps, "timeout_s": timeout_s,
           "message_mb": message_mb}
    procs = [ctx.Process(target=_worker, args=(r, port, cfg, out)) for r in range(RANKS)]
    for p in procs:
        p.start()
    try:
        # Bounded by the workers: each collective waits at most timeout_s.
        got = out.get(timeout=timeout_s * (5 * reps + 4))
    finally:
        for p in procs:
            p.join(timeout_s)
            if p.is_alive():
                p.kill()
    med = {k: statistics.median(v) for k, v in got["results"].items()}
    return {"mb": mb, "tensors": tensors, "reps": reps, "shape": got["shape"],
            "message_mb": message_mb,
            "bytes_per_rank": got["bytes_per_rank"], "correct": got["correct"],
            "median_s": med, "all_s": got["results"],
            "mixed_over_matched_reduce": med["mixed_reduce"] / med["matched_reduce"],
            "mixed_over_matched_heal": med["mixed_heal"] / med["matched_heal"],
            "reduce_over_floor": {k: med[f"{k}_reduce"] / med["floor"]
                                  for k in ("matched", "mixed")},
            "load_before": load_before, "load_after": os.getloadavg()[0]}


def table(res: dict[str, Any]) -> str:
    m = res["median_s"]
    rows = [
        "| operation | groups of one layout | groups of different layouts | different / one "
        "| floor (one message each way) |",
        "| --- | ---: | ---: | ---: | ---: |",
        f"| cross-group reduction | {m['matched_reduce']:.3f} s | {m['mixed_reduce']:.3f} s "
        f"| {res['mixed_over_matched_reduce']:.2f} | {m['floor']:.3f} s |",
        f"| heal of a group | {m['matched_heal']:.3f} s | {m['mixed_heal']:.3f} s "
        f"| {res['mixed_over_matched_heal']:.2f} | {m['floor']:.3f} s |",
    ]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="relight bench cross_group", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=64.0, help="state size in MB (all tensors)")
    ap.add_argument("--tensors", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--message-mb", type=float,
                    help="the routed exchanges' message size (default: elastic.regions')")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)
    res = run(a.mb, a.tensors, a.reps, message_mb=a.message_mb)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(table(res))
    print(f"\n{res['bytes_per_rank'] / 2**20:.1f} MiB per rank, {a.tensors} tensors "
          f"{res['shape']}, median of {a.reps}; results exact: {res['correct']}")
    return 0 if res["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
