"""Recovery with the node-local tier vs without: kill one worker, time until a step again.

    python -m relight.benchmarks.tiers --json OUT.json [--state-mib 256] [--kills 3]

The job, the kill schedule, the S3 server and the measurement are those of
`benchmarks.recovery` (imported, not copied): one worker (rank 1) is SIGKILLed once the
running generation has completed `--ckpt-every + 2` steps; torchrun restarts the group,
which restores and steps again. Arms, run one after the other in one invocation:

- `baseline`: torchrun + c10d + DCP (fsspec on S3), as in `benchmarks.recovery`;
- `relight`: torchrun + relight-etcd + `ckpt.CheckpointManager` on S3;
- `tiers`: the same, its store fronted by `ckpt.tiered.TieredStore` with the local
  tier in a tmpfs directory (`/dev/shm` when there is one), so the restarted workers
  read the data objects from node memory and only manifests and markers from S3.

Reported per arm: kill -> first step (`median_s`) and the restore phase of the restarted
workers (`breakdown_median.restore_s`), with the ratios of `tiers` to the other two and the
load average sampled during the run. First, unless `--restores 0`, `restore_only`: the
restore alone in this process, S3 vs tiered, interleaved (see `restore_only`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from relight.benchmarks import recovery

ARMS = ("baseline", "relight", "tiers")


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def restore_only(args: argparse.Namespace, s3: Any, local: str) -> dict[str, Any]:
    """The restore alone, in this process, interleaved so that load drifts hit both arms:
    one checkpoint of `--state-mib` MiB on S3 (and, written behind, in the local tier),
    then `--restores` rounds, each restoring it once through the S3 store and once
    through a new `TieredStore` (as a restarted worker would: nothing verified yet), in
    alternating order. Every restore is checked bitwise."""
    import statistics

    import torch

    from relight import ckpt
    from relight.ckpt.local_tier import local_tier_dir
    from relight.ckpt.tiered import TieredStore
    from relight.storage import open_store

    os.environ.update(s3.env())
    url = s3.url(f"tiers-restore/{Path(local).name}")
    base = open_store(url)
    tier_dir = local_tier_dir(local, base.url)
    budget = 4 * args.state_mib << 20
    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(args.state_mib << 18, generator=gen)}
    writer = TieredStore(base, tier_dir, budget)
    ckpt.CheckpointManager(writer, keep_last=1).save(1, state, async_save=False)
    writer.flush()
    times: dict[str, list[float]] = {"persistent": [], "tiers": []}
    served: dict[str, int] = {}
    for i in range(args.restores):
        for arm in (("persistent", "tiers") if i % 2 == 0 else ("tiers", "persistent")):
            store = open_store(url)
            if arm == "tiers":
                store = TieredStore(store, tier_dir, budget)
            target = {"w": torch.empty_like(state["w"])}
            t0 = time.perf_counter()
            ckpt.CheckpointManager(store, keep_last=1).restore(target)
            times[arm].append(time.perf_counter() - t0)
            if not torch.equal(target["w"], state["w"]):
                raise AssertionError(f"{arm} restore {i} is not bitwise the saved state")
            if arm == "tiers":
                served = store.tier_stats.snapshot()["served"]
    med = {arm: statistics.median(v) for arm, v in times.items()}
    return {"restore_s": times, "median_s": med, "served_last": served,
            "ratio_tiers_to_persistent": _ratio(med["tiers"], med["persistent"])}


def main(argv: list[str] | None = None) -> int:
    p = recovery.job_argument_parser("python -m relight.benchmarks.tiers", __doc__, ",".join(ARMS))
    p.add_argument("--restores", type=int, default=5,
                   help="interleaved rounds of the restore-only measurement (0: skip it)")
    args = p.parse_args(argv)
    from relight.chaos.s3_server import S3Server

    work = Path(args.workdir or tempfile.mkdtemp(prefix="relight-tiers-"))
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    local = tempfile.mkdtemp(prefix="relight-tiers-local-", dir=shm)
    results: dict[str, Any] = {
        "config": vars(args) | {"local_tier_dir": local},
        "machine": {"cpus": os.cpu_count(), "loadavg_before": os.getloadavg()},
    }
    s3 = S3Server(work / "s3").start()
    try:
        with recovery._LoadSampler() as load:
            if args.restores > 0:
                results["restore_only"] = restore_only(args, s3, local)
            for arm in filter(None, args.arms.split(",")):
                if arm not in ARMS:
                    p.error(f"unknown arm {arm!r}; choose from {ARMS}")
                if arm == "tiers":
                    os.environ[recovery.LOCAL_TIER_ENV] = local
                try:
                    # The tier arm is the relight worker with the tier switched on; its own
                    # work dir gives it its own S3 prefix and event files.
                    results[arm] = recovery._run_jobs(
                        "relight" if arm == "tiers" else arm, args, work / arm, s3)
                finally:
                    os.environ.pop(recovery.LOCAL_TIER_ENV, None)
    finally:
        s3.stop()
        shutil.rmtree(local, ignore_errors=True)
    results["machine"]["loadavg_after"] = os.getloadavg()
    results["machine"]["loadavg"] = load.summary()

    def get(arm: str, what: str) -> float | None:
        r = results.get(arm) or {}
        return r.get("median_s") if what == "median_s" else \
            (r.get("breakdown_median") or {}).get("restore_s")

    results["ratios"] = {
        f"tiers/{base}": {"kill_to_step": _ratio(get("tiers", "median_s"), get(base, "median_s")),
                          "restore": _ratio(get("tiers", "restore_s"), get(base, "restore_s"))}
        for base in ("baseline", "relight")}
    text = json.dumps(results, indent=1)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
