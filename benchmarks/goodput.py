"""Goodput benchmark: healing in place against the restart path and torchft, on the same
job and the same failure schedule, in one run.

    relight bench goodput --json OUT.json [--groups 4] [--duration 150] [--mtbf 60 15]
                          [--arms heal restart torchft] [--torchft-python PATH]

The job: the tiny transformer (`configs/tiny.toml`, two layers), a global batch of 24
samples that stays the same whatever the number of live groups, `--groups` groups of
`--ranks` gloo ranks on this machine. The failures: whole groups (nodes) SIGKILLed at
times drawn from an exponential distribution of mean `--mtbf` seconds (the same draws,
by `--seed`, for every arm), each replaced `--replace-after` seconds later, as a fleet's
autoscaler would. Each arm runs `--duration` seconds from its first step.

Arms:

- `heal`: Relight's replica groups (`replica.job`, each group its own `relight run`):
  survivors keep training, a replacement heals from a live group's memory;
- `restart`: Relight's restart path: one job over every node (`relight run`, etcd
  rendezvous, FSDP over all ranks, warm starts): a lost node restarts every worker,
  which resume from the newest checkpoint, and again when the replacement joins;
- `torchrun`: the same job as a torchrun + DCP user runs it: plain torchrun with its
  c10d rendezvous, its store on a host no fault hits (a store on a node that is killed
  ends a c10d job), the runtime's model and step with DCP checkpoints in place of
  Relight's (`benchmarks/dcp_train.py`), cold worker starts;
- `torchft`: torchft's own Manager and lighthouse (`benchmarks/torchft_arm.py`, run
  with the interpreter of its own environment, `scripts/torchft-env.sh`; skipped with a
  note when none is found);
- `sync`: the same job as one synchronous job without replica groups: the restart
  path's job with the groups as its replicated data-parallel dimension
  (`parallel.dp_replicate` = groups, each group's ranks sharded inside), in the
  fault-free window only (a fixed replicate size does not survive the loss of a group):
  the yardstick of what replica groups cost when nothing fails.

The headline is the work done: each run's steps kept in its window (every arm trains the
same global batch per step, so steps are samples) divided by the most steps any arm kept
in its fault-free window of the same invocation; every arm runs that fault-free window
first.

Reported per arm and MTBF, every figure by the same functions
(`benchmarks.goodput_metrics`) from each arm's per-step records: fleet goodput (the
share of the fleet's group-seconds in the window spent training in steps that were
kept: each kept step's time, less its time in the quorum protocol, times the groups
that trained it), the survivors' pause per fault (the longest gap between a surviving
group's steps within 30 s after the fault, less its median step time; for the restart
arm, the one job's gap) and the heal time of each replacement (its process start -> its
first step), with the machine's load average before and after. The Relight arms run
through the chaos harness (`chaos.runner`), which also checks the heal arm's
invariants (survivors never restart, replicas identical, heals read no storage).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relight.benchmarks.goodput_metrics import (
    JOBS,
    fleet_goodput,
    heal_times,
    live_fraction,
    outage_pause,
    pauses,
    read_records,
    steps_in_window,
    window_start,
)
from relight.chaos.faults import FaultKind, draw_mtbf_schedule
from relight.runtime.config import parse_value

ROOT = Path(__file__).resolve().parents[1]
ARMS = ("heal", "restart", "torchrun", "torchft", "sync")
FAULT_FREE_ONLY = ("sync",)
TORCHFT_ENV = "RELIGHT_TORCHFT_PYTHON"

__all__ = ["GoodputConfig", "main", "parse_settings", "run_arm", "schedule"]


@dataclass(frozen=True, slots=True)
class GoodputConfig:
    job: str = "small"
    """The job every arm trains (`goodput_metrics.JOBS`)."""
    groups: int = 4
    """Replica groups (nodes) of the fleet."""
    ranks: int = 1
    """Ranks per group."""
    duration_s: float = 150.0
    """Window measured, from each arm's first step."""
    replace_after_s: float = 10.0
    """A lost group's replacement starts this long after the fault."""
    seed: int = 0
    interval: int = 20
    """Steps between storage checkpoints (every arm but torchft keeps them)."""
    coordinator_kill_s: float | None = None
    """Kill the coordinator once, this long after the first step, and start it again
    `coordinator_down_s` later: the etcd leader of a 3-member etcd (heal and restart
    arms), torchft's lighthouse (torchft arm). The torchrun arm's c10d store is not
    killed: a c10d job does not survive its store."""
    coordinator_down_s: float = 5.0
    settings: tuple[tuple[str, Any], ...] = ()
    """Training settings (`("section.key", value)`) for Relight's arms, after the
    benchmark's own: to compare settings on the same schedule."""
    torchft_timeout_s: float = 15.0
    """torchft's Manager timeout (quorum, commit, heal): Relight's heal arm bounds its
    cross-group collectives by the same 15 s (`replica.collective_timeout_s`)."""
    torchft_pg_timeout_s: float = 5.0
    """torchft's ProcessGroupGloo timeout: what bounds its collectives, below Relight's
    (a killed process is seen at once by both: its connections reset)."""


def parse_settings(items: list[str]) -> tuple[tuple[str, Any], ...]:
    """`--set SECTION.KEY=VALUE` items as `GoodputConfig.settings`, each value parsed as
    the trainer parses an override; ValueError naming an item that is not of that form."""
    out = []
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or "." not in key:
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        out.append((key, parse_value(value)))
    return tuple(out)


def schedule(mtbf_s: float | None, cfg: GoodputConfig) -> list[float]:
    """Fault times (seconds after the first step) inside the window: exponential gaps of
    mean `mtbf_s`, the same for every arm (none for `None`: the fault-free window). None
    in the last 20 s, where a fault's cost would fall outside the window."""
    if mtbf_s is None:
        return []
    count = max(1, int(4 * cfg.duration_s / mtbf_s))
    draws = draw_mtbf_schedule([FaultKind.KILL_NODE], count, mtbf_s, 0.0, cfg.seed)
    return [t for t, _ in draws if t < cfg.duration_s - 20.0]


def _scenario(arm: str, times: list[float], cfg: GoodputConfig) -> dict[str, Any]:
    replica = arm == "heal"
    plain = arm == "torchrun"
    overrides: dict[str, Any] = {
        **JOBS[cfg.job], "train.log_every": 50, "train.watchdog_timeout_s": 300.0,
        "train.collective_timeout_s": 30.0}
    if replica:
        # digest_every = 1: check 9 (replicas bitwise identical) compares every step.
        overrides.update({"replica.lease_ttl_s": 5.0, "replica.collective_timeout_s": 15.0,
                          "replica.digest_every": 1})
    if arm == "sync":
        if times:
            raise ValueError("the sync arm runs the fault-free window only")
        overrides["parallel.dp_replicate"] = cfg.groups
    overrides.update(cfg.settings)
    faults: list[dict[str, Any]] = [
        {"kind": "kill_node", "at_time_s": t, "replace_after_s": cfg.replace_after_s}
        for t in times]
    etcd_members = 1
    if cfg.coordinator_kill_s is not None and arm in ("heal", "restart"):
        etcd_members = 3
        faults.append({"kind": "etcd_restart", "at_time_s": cfg.coordinator_kill_s,
                       "down_s": cfg.coordinator_down_s})
    return {
        "name": f"goodput-{arm}", "seed": cfg.seed, "target_step": 1_000_000,
        "deadline_s": cfg.duration_s + 600.0, "run_for_s": cfg.duration_s,
        "cluster": {"nodes": cfg.groups, "ranks_per_node": cfg.ranks, "min_nodes": 1,
                    "max_nodes": cfg.groups, "max_restarts": 1000, "monitor_interval_s": 0.2,
                    "replica_groups": replica, "lease_ttl_s": 0 if replica or plain else 3,
                    "etcd_members": etcd_members,
                    **({"launcher": "torchrun", "rendezvous": "c10d", "c10d_store": "standalone"}
                       if plain else {})},
        "training": {"config": "configs/tiny.toml", "overrides": overrides,
                     # torchrun's shared rendezvous store made restarted groups fail in
                     # init_process_group here (as in `relight bench recovery`): each
                     # round gets a fresh store, torch's own opt-out.
                     **({"command": ["benchmarks/dcp_train.py", "--config", "{config}"],
                         "env": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}
                        if plain else {})},
        "storage": {"kind": "local"},
        "checkpoint": {"interval": cfg.interval},
        "verify": {"reference": False, "compare_weights": False},
        "faults": faults,
    }


def _records(metrics: Path, replica: bool, ranks: int) -> list[dict[str, Any]]:
    """The run's step records as the goodput metrics take them: `participants` is the
    number of groups that trained the step, `quorum_s` the step's time in the quorum
    protocol."""
    out = []
    for r in read_records(metrics):
        if "step" not in r or "step_time_s" not in r:
            continue
        participants = r.get("quorum_size") if replica else r.get("world_size", 0) // ranks
        # Time in the quorum protocol (agreeing, building a new quorum's process group,
        # healing a joiner) is part of the step's time but trains nothing.
        protocol = (r.get("quorum_s") or 0.0) + (r.get("rebuild_s") or 0.0)
        out.append({"group": r.get("replica_group", "job"), "step": r["step"],
                    "time": r["time"], "step_time_s": r["step_time_s"],
                    "participants": participants, "quorum_s": protocol,
                    "etcd_requests": r.get("etcd_requests")})
    return out


def _harness_arm(arm: str, times: list[float], cfg: GoodputConfig, out: Path
                 ) -> dict[str, Any]:
    from relight.chaos.runner import run_scenario
    from relight.chaos.scenario import parse_scenario

    result = run_scenario(parse_scenario(_scenario(arm, times, cfg)), out)
    rep = result.report
    records = _records(out / "chaos" / "metrics.jsonl", arm == "heal", cfg.ranks)
    first = window_start(records) if records else None
    kills = [f for f in rep["faults"] if f["ok"] and f["kind"] == FaultKind.KILL_NODE.value]
    # When each replacement's agent started (the harness's follow-up actions).
    actions = json.loads((out / "chaos" / "actions.json").read_text())
    started_at = {a["action"]: a["time"] for a in actions if a.get("ok")}
    started: dict[str, float] = {}
    for f in kills:
        new = f["detail"].get("replacement")
        t0 = started_at.get(f"replacement for node {f['node']}")
        if new is not None and t0 is not None:
            started[f"node-{new}"] = t0
    if arm == "heal":
        groups = {r["group"] for r in records}
        survivors = [sorted(g for g in groups if g != f"node-{f['node']}" and g not in started)
                     for f in kills]
        heals = heal_times(records, started)
    else:
        # One job: every rank restarts, and the replacement joins through a restart.
        survivors = [["job"] for _ in kills]
        heals = {}
    # The coordinator lost: every group that was training then.
    outages = [f["time"] for f in rep["faults"]
               if f["ok"] and f["kind"] == FaultKind.ETCD_RESTART.value]
    training = [sorted({r["group"] for r in records if t - 5.0 <= r["time"] <= t})
                for t in outages]
    summary = {
        "fleet_goodput": (round(fleet_goodput(records, first, cfg.duration_s, cfg.groups), 4)
                          if first is not None else None),
        "coordinator_pauses_s": [
            None if p is None else round(p, 3)
            for p in (outage_pause(records, t, alive, first + cfg.duration_s)
                      for t, alive in zip(outages, training, strict=True))] if first else [],
        "faults": len(kills),
        "pauses_s": [p for p in pauses(records, [f["time"] for f in kills], survivors)
                     if p is not None],
        "rejoins_s": [round(v, 3) for v in heals.values() if v is not None],
        "steps": len({r["step"] for r in records}),
        "steps_in_window": steps_in_window(records, first, cfg.duration_s),
        "report": str(out / "report.json"),
    }
    if arm == "heal":
        summary["invariants_broken"] = [
            i["name"] for i in rep["invariants"] if not i["ok"] and i["number"] >= 8]
        counted = [r["etcd_requests"] for r in records if r["etcd_requests"] is not None]
        summary["etcd_requests_per_group_step"] = (
            round(sum(counted) / len(counted), 4) if counted else None)
        summary["steps_without_etcd"] = (
            round(sum(1 for c in counted if c == 0) / len(counted), 4) if counted else None)
    return summary


def _torchft_python(explicit: str | None) -> str | None:
    for candidate in (explicit, os.environ.get(TORCHFT_ENV), str(ROOT / ".venv-torchft" /
                                                                  "bin" / "python"),
                      "/work/venv-torchft/bin/python"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _torchft_arm(times: list[float], cfg: GoodputConfig, out: Path, python: str | None
                 ) -> dict[str, Any]:
    if python is None:
        return {"skipped": f"no torchft environment: run scripts/torchft-env.sh or set "
                           f"${TORCHFT_ENV}"}
    out.mkdir(parents=True, exist_ok=True)
    sched = out / "schedule.json"
    faults = [{"time_s": t, "kind": "kill_group", "replace_after_s": cfg.replace_after_s}
              for t in times]
    if cfg.coordinator_kill_s is not None:
        faults.append({"time_s": cfg.coordinator_kill_s, "kind": "kill_lighthouse",
                       "replace_after_s": cfg.coordinator_down_s})
    sched.write_text(json.dumps(faults))
    proc = subprocess.run(
        [python, str(ROOT / "benchmarks" / "torchft_arm.py"), "--groups", str(cfg.groups),
         "--duration", str(cfg.duration_s), "--schedule", str(sched), "--out", str(out),
         "--seed", str(cfg.seed), "--job", cfg.job, "--timeout", str(cfg.torchft_timeout_s),
         "--pg-timeout", str(cfg.torchft_pg_timeout_s)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=cfg.duration_s + 600)
    if proc.returncode != 0:
        return {"error": f"torchft arm exited {proc.returncode}: {proc.stderr[-2000:]}"}
    summary = json.loads((out / "summary.json").read_text())
    # Its own figures come from the same functions (benchmarks.goodput_metrics).
    summary["faults"] = summary.get("faults_fired")
    summary["pauses_s"] = [p for p in summary.get("pauses_s", []) if p is not None]
    summary["rejoins_s"] = [v for v in summary.get("rejoins_s", []) if v is not None]
    return summary


def run_arm(arm: str, mtbf_s: float | None, cfg: GoodputConfig, out: Path,
            torchft_python: str | None = None) -> dict[str, Any]:
    """One arm at one MTBF; the machine's load average before and after."""
    times = schedule(mtbf_s, cfg)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    if arm == "torchft":
        summary = _torchft_arm(times, cfg, out, torchft_python)
    else:
        summary = _harness_arm(arm, times, cfg, out)
    live = live_fraction(times, cfg.replace_after_s, cfg.duration_s, cfg.groups)
    goodput = summary.get("fleet_goodput")
    summary.update(live_fraction=round(live, 4),
                   goodput_over_live=None if goodput is None else round(goodput / live, 4))
    summary.update(arm=arm, mtbf_s=mtbf_s, fault_times_s=times,
                   wall_s=round(time.monotonic() - t0, 1),
                   loadavg_before=[round(x, 1) for x in load0],
                   loadavg_after=[round(x, 1) for x in os.getloadavg()])
    for key in ("pauses_s", "rejoins_s"):
        values = summary.get(key) or []
        summary[key.replace("_s", "_median_s")] = (round(statistics.median(values), 2)
                                                   if values else None)
    return summary


def _mtbf_label(mtbf_s: float | None) -> str:
    return "none" if mtbf_s is None else f"{mtbf_s:g}"


def add_work_done(results: list[dict[str, Any]]) -> None:
    """The headline: each run's steps kept in the window (the same global batch per step
    in every arm: samples trained) divided by the most any arm kept in its fault-free
    window of the same invocation."""
    free = [r["steps_in_window"] for r in results
            if r["mtbf_s"] is None and r.get("steps_in_window")]
    best = max(free) if free else None
    for r in results:
        kept = r.get("steps_in_window")
        r["work_done"] = None if not best or kept is None else round(kept / best, 4)


def _table(results: list[dict[str, Any]]) -> str:
    rows = ["| MTBF s | arm | faults | work done (steps kept ÷ best fault-free arm) | "
            "steps kept in the window | etcd requests per group step | fleet goodput | "
            "survivors' pause median s | heal time median s | coordinator killed: pause s | "
            "load before / after |",
            "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        label = _mtbf_label(r["mtbf_s"])
        if "skipped" in r or "error" in r:
            rows.append(f"| {label} | {r['arm']} | - | - | - | - | - | - | - | - | "
                        f"{r.get('skipped') or r.get('error', '')[:80]} |")
            continue
        g, work = r.get("fleet_goodput"), r.get("work_done")
        coord = [p for p in r.get("coordinator_pauses_s") or [] if p is not None]
        pause = r.get("pauses_median_s")
        if pause is None and r.get("faults"):
            pause = "no step within 30 s"
        etcd = r.get("etcd_requests_per_group_step")
        rows.append(
            f"| {label} | {r['arm']} | {r.get('faults', '-')} | "
            f"{'-' if work is None else f'{work:.3f}'} | "
            f"{r.get('steps_in_window', '-')} | {'-' if etcd is None else etcd} | "
            f"{'-' if g is None else f'{g:.3f}'} | "
            f"{'-' if pause is None else pause} | "
            f"{r.get('rejoins_median_s', '-')} | "
            f"{', '.join(f'{p:.2f}' for p in coord) or '-'} | {r['loadavg_before'][0]} / "
            f"{r['loadavg_after'][0]} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relight bench goodput", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--duration", type=float, default=150.0)
    p.add_argument("--job", choices=sorted(JOBS), default="small",
                   help="the job every arm trains (small: steps of tens of ms; large: "
                        "about half a second to a second on 2 cores)")
    p.add_argument("--mtbf", type=float, nargs="*", default=[60.0, 15.0],
                   help="mean seconds between group kills; every arm also runs a "
                        "fault-free window first, the headline's yardstick")
    p.add_argument("--replace-after", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    p.add_argument("--torchft-python", help="interpreter of the torchft environment")
    p.add_argument("--out", help="keep every arm's run directory here")
    p.add_argument("--coordinator-kill-at", type=float, metavar="S",
                   help="also kill the coordinator once, S seconds after the first step: "
                        "the etcd leader (3 members), torchft's lighthouse")
    p.add_argument("--coordinator-down", type=float, default=5.0, metavar="S",
                   help="seconds until the killed coordinator starts again")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="a training setting for Relight's arms (repeatable), e.g. "
                        "replica.collective_timeout_s=20")
    args = p.parse_args(argv)
    if args.groups < 2:
        p.error("--groups must be >= 2: a fleet of one group cannot heal in place")
    try:
        settings = parse_settings(args.set)
    except ValueError as exc:
        p.error(str(exc))
    cfg = GoodputConfig(job=args.job, groups=args.groups, ranks=args.ranks,
                        duration_s=args.duration,
                        replace_after_s=args.replace_after, seed=args.seed,
                        coordinator_kill_s=args.coordinator_kill_at,
                        coordinator_down_s=args.coordinator_down,
                        settings=settings)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="relight-goodput-"))
    python = _torchft_python(args.torchft_python)
    results = []
    try:
        for mtbf in [None, *args.mtbf]:
            for arm in args.arms:
                if mtbf is not None and arm in FAULT_FREE_ONLY:
                    continue
                label = _mtbf_label(mtbf)
                print(f"goodput: arm {arm}, MTBF {label} s ...", file=sys.stderr, flush=True)
                results.append(run_arm(arm, mtbf, cfg, base / f"mtbf{label}-{arm}", python))
                add_work_done(results)
                print(_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        if not args.out:
            shutil.rmtree(base, ignore_errors=True)
    doc = {"config": asdict(cfg), "mtbf_s": args.mtbf, "results": results,
           "machine": {"cpus": os.cpu_count()}}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
