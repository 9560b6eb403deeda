"""A series of chaos runs (one scenario, many seeds) summed up: one row per seed, the
recovery-time distribution over the whole series, and the goodput `relight plan` predicts
next to the goodput each run measured.

    python -m relight.chaos.series runs/chaos/fleet-1 runs/chaos/fleet-2 ...   # Markdown tables
    python -m relight.chaos.series --json runs/chaos/fleet-*

The prediction uses Daly's model (`runtime.goodput_plan.expected_goodput`) with what the run's own
metrics measure (`runtime.goodput_plan.measure_run` on `DIR/chaos/metrics.jsonl`: save stall,
restore time, step time, checkpoint interval) and the run's fault rate: the wall time over
the faults that forced a restart (the model's failures all cost a rollback; a storage
error absorbed by retries or an etcd restart the job rides through costs nothing). The
scenario's nominal MTBF (`mtbf.mean_s`, every kind) is shown beside it.

Scenarios of replica groups that heal in place use the heal model instead
(`runtime.goodput_plan.heal_goodput`: per fault every group pauses, and the lost group's GPUs
wait for its heal; nothing rolls back), with the run's own median pause (fault ->
survivors' first step in a new quorum) and median rejoin (fault -> the hit or
replacement group's first step), against the run's fleet goodput.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relight.chaos.faults import RESTARTING, FaultKind
from relight.chaos.report import load_report, percentile
from relight.runtime.goodput_plan import (
    RunMetricsError,
    expected_goodput,
    heal_goodput,
    measure_run,
)

__all__ = ["SeedRow", "main", "predicted_goodput", "render_markdown", "seed_row",
           "series_recovery"]


@dataclass(frozen=True, slots=True)
class SeedRow:
    seed: int
    passed: bool
    wall_s: float
    faults_injected: int
    faults_drawn: int
    restarting_faults: int
    recovery_median_s: float | None
    recovery_p90_s: float | None
    recovery_max_s: float | None
    goodput: float | None
    broken: tuple[str, ...]
    """Names of the broken invariants (empty when it passed)."""
    recoveries_s: tuple[float, ...]
    nominal_mtbf_s: float | None
    measured_mtbf_s: float | None
    """Wall time / faults that forced a restart."""
    interruptions: int
    """Resumes the metrics show (worker groups that trained, minus one): faults that hit
    while the job was already restarting merge into one interruption."""
    interruption_mtbf_s: float | None
    """Wall time / interruptions."""
    save_stall_s: float | None
    restore_time_s: float | None
    step_time_s: float | None
    interval_s: float | None
    predicted_goodput: float | None
    """Daly's expected goodput at `measured_mtbf_s` with the measured inputs."""
    predicted_goodput_interruptions: float | None
    """The same at `interruption_mtbf_s`."""
    predicted_goodput_nominal: float | None
    """The same at the scenario's nominal MTBF."""


def predicted_goodput(interval_s: float | None, save_stall_s: float | None,
                      restore_time_s: float | None, mtbf_s: float | None) -> float | None:
    """`relight plan`'s expected goodput, or None when an input was not measured."""
    if None in (interval_s, save_stall_s, restore_time_s, mtbf_s) or not mtbf_s:
        return None
    return expected_goodput(interval_s, save_stall_s, restore_time_s, mtbf_s)


def _forces_restart(fault: dict[str, Any]) -> bool:
    kind = FaultKind(fault["kind"])
    if kind in (FaultKind.CORRUPT_CHECKPOINT, FaultKind.TRUNCATE_CHECKPOINT):
        return "killed_rank" in fault["detail"]  # damage alone stops nothing
    return kind in RESTARTING


def seed_row(run_dir: str | Path) -> SeedRow:
    """One chaos run's output directory (report.json, chaos/metrics.jsonl) as a row."""
    run_dir = Path(run_dir)
    rep = load_report(run_dir)
    faults = rep["faults"]
    injected = [f for f in faults if f["ok"]]
    restarting = [f for f in injected if _forces_restart(f)]
    rec = rep["recovery"]["first_step"]
    wall = float(rep["wall_s"])
    mtbf_cfg = (rep.get("scenario_config") or {}).get("mtbf") or {}
    nominal = mtbf_cfg.get("mean_s") if mtbf_cfg.get("count") else None
    try:
        m = measure_run(run_dir / "chaos")
        stall, restore, step, interval = (m.save_stall_s, m.restore_time_s, m.step_time_s,
                                          m.interval_s)
    except RunMetricsError:
        stall = restore = step = interval = None
    measured_mtbf = wall / len(restarting) if restarting else None
    interruptions = max(0, len(rep["attempts"]) - 1)
    interruption_mtbf = wall / interruptions if interruptions else None
    goodput = rep["goodput"]["goodput"]
    predict = predicted_goodput
    cluster = (rep.get("scenario_config") or {}).get("cluster") or {}
    if cluster.get("replica_groups"):
        goodput = rep["goodput"].get("fleet_goodput", goodput)
        rejoins = [f["detail"]["rejoin_s"] for f in injected if "rejoin_s" in f["detail"]]
        heal_s = statistics.median(rejoins) if rejoins else 0.0
        groups = int(cluster.get("nodes", 1))

        def predict(interval: float | None, stall: float | None, pause: float | None,
                    mtbf: float | None) -> float | None:
            if None in (interval, stall, pause, mtbf) or not mtbf:
                return None
            return heal_goodput(interval, stall, mtbf, groups, pause, heal_s)

        restore = rec["median_s"]  # the survivors' pause takes the restore's place
    return SeedRow(
        seed=int(rep["seed"]), passed=bool(rep["passed"]), wall_s=wall,
        faults_injected=len(injected), faults_drawn=len(faults),
        restarting_faults=len(restarting),
        recovery_median_s=rec["median_s"], recovery_p90_s=rec["p90_s"],
        recovery_max_s=rec["max_s"], goodput=goodput,
        broken=tuple(i["name"] for i in rep["invariants"] if not i["ok"]),
        recoveries_s=tuple(rec["values_s"]), nominal_mtbf_s=nominal,
        measured_mtbf_s=measured_mtbf, interruptions=interruptions,
        interruption_mtbf_s=interruption_mtbf, save_stall_s=stall, restore_time_s=restore,
        step_time_s=step, interval_s=interval,
        predicted_goodput=predict(interval, stall, restore, measured_mtbf),
        predicted_goodput_interruptions=predict(interval, stall, restore, interruption_mtbf),
        predicted_goodput_nominal=predict(interval, stall, restore, nominal),
    )


def series_recovery(rows: Sequence[SeedRow]) -> dict[str, Any]:
    """Fault -> first step after the resume, pooled over every run of the series."""
    values = [v for r in rows for v in r.recoveries_s]
    return {"count": len(values),
            "median_s": statistics.median(values) if values else None,
            "p90_s": percentile(values, 90), "max_s": max(values) if values else None}


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def render_markdown(rows: Sequence[SeedRow]) -> str:
    out = ["| seed | passed | wall s | faults injected (drawn) | restarts forced | recovery "
           "median / p90 / max s | goodput |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        verdict = "yes" if r.passed else "**no**: " + ", ".join(r.broken)
        out.append(
            f"| {r.seed} | {verdict} | {r.wall_s:.0f} | {r.faults_injected} "
            f"({r.faults_drawn}) | {r.restarting_faults} | {_f(r.recovery_median_s)} / "
            f"{_f(r.recovery_p90_s)} / {_f(r.recovery_max_s)} | {_f(r.goodput, '{:.2f}')} |")
    pooled = series_recovery(rows)
    passed = sum(r.passed for r in rows)
    out += ["", f"{passed} of {len(rows)} run(s) passed. Recovery (fault -> first step), "
            f"pooled over {pooled['count']} recoveries: median {_f(pooled['median_s'])} s, "
            f"p90 {_f(pooled['p90_s'])} s, max {_f(pooled['max_s'])} s.", ""]
    out += ["| seed | save stall s | restore s | step s | interval s | MTBF s: per restart "
            "/ per interruption / nominal | predicted goodput: per restart / per interruption "
            "/ nominal | measured goodput |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(
            f"| {r.seed} | {_f(r.save_stall_s, '{:.3f}')} | {_f(r.restore_time_s)} | "
            f"{_f(r.step_time_s, '{:.2f}')} | {_f(r.interval_s)} | {_f(r.measured_mtbf_s)} "
            f"({r.restarting_faults}) / {_f(r.interruption_mtbf_s)} ({r.interruptions}) / "
            f"{_f(r.nominal_mtbf_s, '{:.0f}')} | {_f(r.predicted_goodput, '{:.2f}')} / "
            f"{_f(r.predicted_goodput_interruptions, '{:.2f}')} / "
            f"{_f(r.predicted_goodput_nominal, '{:.2f}')} | {_f(r.goodput, '{:.2f}')} |")
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relight.chaos.series", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path, help="chaos run output directories")
    p.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = p.parse_args(argv)
    try:
        rows = [seed_row(d) for d in args.runs]
    except (OSError, ValueError, KeyError) as exc:
        print(f"chaos.series: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in rows],
                          "recovery": series_recovery(rows)}, indent=1))
    else:
        print(render_markdown(rows), end="")
    return 0 if all(r.passed for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
