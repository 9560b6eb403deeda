"""`relight plan`: how often to checkpoint, and the goodput that buys.

The model is Daly's (Future Generation Computer Systems 22, 2006) for failures that
arrive as a Poisson process: with a job-wide MTBF `M` (the per-GPU MTBF divided by
the GPU count), a checkpoint that stalls training for `delta`, a restart that costs
`R`, and `tau` seconds of work between checkpoints, the expected wall time per unit
of useful work is `M * exp(R/M) * (exp((tau + delta)/M) - 1) / tau`; goodput is its
inverse. The optimum is Daly's higher-order estimate of the interval, which reduces
to Young's `sqrt(2 * delta * M)` when `delta << M`.

`--from-run DIR` measures `delta`, `R` and the step time from the metrics JSONL a run of
`runtime.train` left (``DIR/metrics.jsonl``; see `measure_run`).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from relight.errors import RelightError

__all__ = [
    "PlanInputs",
    "PlanResult",
    "RunMeasurements",
    "RunMetricsError",
    "daly_interval",
    "expected_goodput",
    "heal_goodput",
    "main",
    "measure_run",
    "plan",
]

EXIT_OK, EXIT_USAGE, EXIT_NO_MEASUREMENT = 0, 2, 3


class PlanInputError(RelightError, ValueError):
    """An input to the planner is out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class PlanInputs:
    gpus: int
    """GPUs in the job."""
    mtbf_hours_per_gpu: float
    """Mean time between failures of one GPU (with its share of host and network)."""
    save_stall_s: float
    """Training time lost per checkpoint (the blocking part of an async save)."""
    restore_time_s: float
    """Fault to first useful step after resume: detection, rendezvous, restart, restore."""
    step_time_s: float | None = None
    """Seconds per training step; gives intervals in steps."""
    current_interval_s: float | None = None
    """The interval in use now, to compare with the optimum."""
    local_restore_time_s: float | None = None
    """Fault to first useful step when the restore is served by the node-local tier
    (docs/tiers.md); None: no local tier."""
    local_hit_fraction: float = 0.0
    """Share of failures that leave the failed ranks' node memory intact (a process or
    GPU fault, not a lost host), so the local tier serves the restore."""
    tier_shard_gb_per_node: float | None = None
    """Checkpoint data bytes one node holds (its ranks' shards), for the tier's memory
    cost."""
    replica_groups: int | None = None
    """Healing in place (docs/healing.md): the job's replica groups; None: the restart
    path only."""
    heal_pause_s: float | None = None
    """Healing in place: the survivors' pause per fault (rebuilding the cross-group
    process group and redoing the step, plus the failover grace when the lost group's
    process cannot be seen to be gone)."""
    heal_time_s: float | None = None
    """Healing in place: a lost group's replacement from its start to healed (its GPUs
    are idle that long)."""

    def __post_init__(self) -> None:
        checks = {
            "gpus": self.gpus >= 1,
            "mtbf_hours_per_gpu": self.mtbf_hours_per_gpu > 0,
            "save_stall_s": self.save_stall_s >= 0,
            "restore_time_s": self.restore_time_s >= 0,
            "step_time_s": self.step_time_s is None or self.step_time_s > 0,
            "current_interval_s": self.current_interval_s is None or self.current_interval_s > 0,
            "local_restore_time_s": self.local_restore_time_s is None
            or self.local_restore_time_s >= 0,
            "local_hit_fraction": 0.0 <= self.local_hit_fraction <= 1.0
            and (self.local_hit_fraction == 0.0 or self.local_restore_time_s is not None),
            "tier_shard_gb_per_node": self.tier_shard_gb_per_node is None
            or self.tier_shard_gb_per_node >= 0,
            "replica_groups": self.replica_groups is None
            or 2 <= self.replica_groups <= self.gpus,
            "heal_pause_s": (self.heal_pause_s is None) == (self.replica_groups is None)
            and (self.heal_pause_s is None or self.heal_pause_s >= 0),
            "heal_time_s": (self.heal_time_s is None) == (self.replica_groups is None)
            and (self.heal_time_s is None or self.heal_time_s >= 0),
        }
        for name, ok in checks.items():
            if not ok:
                raise PlanInputError(f"{name}={getattr(self, name)!r} is out of range")

    @property
    def job_mtbf_s(self) -> float:
        return self.mtbf_hours_per_gpu * 3600.0 / self.gpus

    @property
    def effective_restore_time_s(self) -> float:
        """Mean restore time over failures: the local tier's for the share it serves,
        the persistent store's for the rest."""
        if self.local_restore_time_s is None:
            return self.restore_time_s
        h = self.local_hit_fraction
        return h * self.local_restore_time_s + (1 - h) * self.restore_time_s


@dataclass(frozen=True, slots=True)
class PlanResult:
    job_mtbf_s: float
    optimal_interval_s: float
    optimal_goodput: float
    young_interval_s: float
    optimal_interval_steps: int | None
    current_interval_s: float | None
    current_goodput: float | None
    effective_restore_time_s: float
    """The restore time the goodput uses (per tier, weighted by the hit fraction)."""
    tier_memory_gb_per_node: float | None
    """Node memory the local tier holds between saves: the node's shard bytes (twice that
    while a save is being copied, to keep the committed copy meanwhile)."""
    heal_goodput: float | None = None
    """Healing in place at the optimal interval: survivors continue, so a fault costs the
    fleet's pause and the lost group's share until its replacement healed, not a
    rollback to the last checkpoint (`heal_goodput`)."""


def daly_interval(save_stall_s: float, job_mtbf_s: float) -> float:
    """Daly's higher-order optimum of the compute time between checkpoints."""
    delta, m = save_stall_s, job_mtbf_s
    if delta <= 0:
        # Free checkpoints: checkpoint as often as possible; one second is a floor
        # that keeps the expression finite.
        return 1.0
    if delta >= 2 * m:
        return m
    ratio = delta / (2 * m)
    return math.sqrt(2 * delta * m) * (1 + math.sqrt(ratio) / 3 + ratio / 9) - delta


def expected_goodput(interval_s: float, save_stall_s: float, restore_time_s: float,
                     job_mtbf_s: float) -> float:
    """Useful time / wall time at a checkpoint interval (Daly's exponential model)."""
    m = job_mtbf_s
    wall_per_work = m * math.exp(restore_time_s / m) * math.expm1((interval_s + save_stall_s) / m)
    return interval_s / wall_per_work


def heal_goodput(interval_s: float, save_stall_s: float, job_mtbf_s: float, groups: int,
                 heal_pause_s: float, heal_time_s: float) -> float:
    """Useful time / wall time when faults heal in place. Per fault (Poisson, job-wide
    MTBF `M`) every GPU pauses `heal_pause_s`, and the lost group's GPUs (1/groups of the
    fleet) stay idle for `heal_time_s`; nothing rolls back. Storage checkpoints still
    stall every `interval_s` (they cover the loss of the whole job, not modelled here)."""
    lost_per_fault = heal_pause_s + heal_time_s / groups
    return interval_s / (interval_s + save_stall_s) * max(0.0, 1.0 - lost_per_fault / job_mtbf_s)


def heal_scale_costs(rows: list[dict[str, Any]], groups: int) -> tuple[float, float]:
    """What a membership change adds per fault at `groups` replica groups, from the rows
    of `relight bench scale_heal --json`: `(extra survivor pause, extra heal time)` in
    seconds over the smallest measured size (the lost group's and the joiner's settle
    times), interpolated linearly between measured sizes. A size outside the measured
    range is refused (PlanInputError): the settle time does not grow linearly, and an
    extrapolation would be a guess."""
    sizes = sorted((int(r["groups"]), float(r["lost"]["settle_s"]),
                    float(r["joined"]["settle_s"])) for r in rows
                   if (r.get("lost") or {}).get("settle_s") is not None
                   and (r.get("joined") or {}).get("settle_s") is not None)
    if not sizes:
        raise PlanInputError("the heal-scale results hold no size with both settle times")
    if not sizes[0][0] <= groups <= sizes[-1][0]:
        raise PlanInputError(f"--replica-groups {groups} is outside the measured sizes "
                             f"{sizes[0][0]}..{sizes[-1][0]} of the heal-scale results")
    base_lost, base_joined = sizes[0][1], sizes[0][2]
    pairs = list(zip(sizes[:-1], sizes[1:], strict=True)) or [(sizes[0], sizes[0])]
    for (n0, l0, j0), (n1, l1, j1) in pairs:
        if n0 <= groups <= n1:
            w = 0.0 if n1 == n0 else (groups - n0) / (n1 - n0)
            return (l0 + w * (l1 - l0) - base_lost, j0 + w * (j1 - j0) - base_joined)
    raise AssertionError("unreachable: groups is within the measured sizes")


def plan(inputs: PlanInputs) -> PlanResult:
    m = inputs.job_mtbf_s
    best = daly_interval(inputs.save_stall_s, m)
    current = inputs.current_interval_s
    restore = inputs.effective_restore_time_s
    return PlanResult(
        job_mtbf_s=m,
        optimal_interval_s=best,
        optimal_goodput=expected_goodput(best, inputs.save_stall_s, restore, m),
        young_interval_s=math.sqrt(2 * inputs.save_stall_s * m),
        optimal_interval_steps=(
            max(1, round(best / inputs.step_time_s)) if inputs.step_time_s else None
        ),
        current_interval_s=current,
        current_goodput=(
            expected_goodput(current, inputs.save_stall_s, restore, m)
            if current
            else None
        ),
        effective_restore_time_s=restore,
        tier_memory_gb_per_node=inputs.tier_shard_gb_per_node,
        heal_goodput=(
            heal_goodput(best, inputs.save_stall_s, m, inputs.replica_groups,
                         inputs.heal_pause_s, inputs.heal_time_s)
            if inputs.replica_groups is not None and inputs.heal_pause_s is not None
            and inputs.heal_time_s is not None else None
        ),
    )


class RunMetricsError(RelightError, ValueError):
    """A run directory has no usable metrics; the message names the file."""


@dataclass(frozen=True, slots=True)
class RunMeasurements:
    """What one run of `runtime.train` measured, read from its metrics JSONL."""

    source: str
    """The metrics file read."""
    steps: int
    """Step records read (every process lifetime)."""
    lifetimes: int
    """Processes (worker groups) that wrote records: 1 + the restarts the file shows."""
    world_size: int | None
    """Ranks of the last lifetime."""
    step_time_s: float | None
    """Median step time, without the first step of each lifetime (warm-up)."""
    save_stall_s: float | None
    """Mean training stall of the steps that started a checkpoint."""
    saves: int
    restore_time_s: float | None
    """Fault (last record of a lifetime) to the first step of the next, minus that step;
    without a restart in the file: process start to first step of a resumed lifetime (or of
    the first lifetime), which misses fault detection and rendezvous."""
    restore_basis: str
    """How `restore_time_s` was measured."""
    interval_steps: int | None
    """Steps between checkpoints (the most common gap between saving steps)."""

    @property
    def interval_s(self) -> float | None:
        """Compute time between checkpoints at the measured step time."""
        if self.interval_steps is None or self.step_time_s is None:
            return None
        return self.interval_steps * self.step_time_s


def _metrics_file(path: Path) -> Path:
    f = path / "metrics.jsonl" if path.is_dir() else path
    if not f.is_file():
        raise RunMetricsError(f"{f}: no metrics file; point --from-run at a run directory "
                              "holding metrics.jsonl (train.metrics_path) or at the file")
    return f


def _lifetimes(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Split the appended records per process: the runtime marks each process's first record
    with `startup_s`; files without it split where the step does not follow."""
    out: list[list[dict[str, Any]]] = []
    for r in records:
        new = not out or "startup_s" in r or r["step"] != out[-1][-1]["step"] + 1
        if new:
            out.append([])
        out[-1].append(r)
    return out


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def measure_run(path: str | Path) -> RunMeasurements:
    """Measure save stall, restore time, step time and interval from a run's metrics."""
    f = _metrics_file(Path(path))
    records = []
    for line in f.read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a kill
            continue
        if isinstance(r, dict) and isinstance(r.get("step"), int):
            records.append(r)
    if not records:
        raise RunMetricsError(f"{f}: no step records")
    lives = _lifetimes(records)
    steps = [t for life in lives for r in life[1:] if (t := _num(r.get("step_time_s")))]
    if not steps:  # every lifetime was one step long: warm-up is all there is
        steps = [t for r in records if (t := _num(r.get("step_time_s")))]
    # Older files lack `ckpt_saved`: a non-zero stall marks a saving step there.
    saving = [[r for r in life if r.get("ckpt_saved", (_num(r.get("ckpt_stall_s")) or 0) > 0)]
              for life in lives]
    stalls = [s for life in saving for r in life if (s := _num(r.get("ckpt_stall_s"))) is not None]
    gaps = Counter(b["step"] - a["step"] for life in saving
                   for a, b in zip(life, life[1:], strict=False))
    restore, basis = _restore_time(lives)
    return RunMeasurements(
        source=str(f), steps=len(records), lifetimes=len(lives),
        world_size=next((int(w) for r in reversed(lives[-1])
                         if (w := _num(r.get("world_size")))), None),
        step_time_s=statistics.median(steps) if steps else None,
        save_stall_s=statistics.fmean(stalls) if stalls else None, saves=len(stalls),
        restore_time_s=restore, restore_basis=basis,
        interval_steps=max(gaps.items(), key=lambda kv: (kv[1], kv[0]))[0] if gaps else None,
    )


def _restore_time(lives: list[list[dict[str, Any]]]) -> tuple[float | None, str]:
    gaps = []
    for prev, life in zip(lives, lives[1:], strict=False):
        t_end, t_first = _num(prev[-1].get("time")), _num(life[0].get("time"))
        first_step = _num(life[0].get("step_time_s")) or 0.0
        if t_end is not None and t_first is not None and t_first - first_step > t_end:
            gaps.append(t_first - first_step - t_end)
    if gaps:
        return statistics.median(gaps), f"restart gap, median of {len(gaps)}"
    resumed = [s for life in lives if life[0].get("restore_s") is not None
               and (s := _num(life[0].get("startup_s"))) is not None]
    if resumed:
        return statistics.median(resumed), ("process start to first step of a resumed "
                                             "process (no fault detection or rendezvous)")
    fresh = [s for life in lives if (s := _num(life[0].get("startup_s"))) is not None]
    if fresh:
        return fresh[0], "process start to first step, no restore (a lower bound)"
    return None, "not measured"


def goodput_curve(inputs: PlanInputs, points: int = 60) -> list[tuple[float, float]]:
    """(interval, goodput) on a log grid from 1/30x to 30x the optimum."""
    best = daly_interval(inputs.save_stall_s, inputs.job_mtbf_s)
    lo, hi = math.log(best / 30), math.log(best * 30)
    grid = [math.exp(lo + (hi - lo) * i / (points - 1)) for i in range(points)]
    return [
        (t, expected_goodput(t, inputs.save_stall_s, inputs.effective_restore_time_s,
                             inputs.job_mtbf_s))
        for t in grid
    ]


def _plot(inputs: PlanInputs, result: PlanResult, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit("relight plan --plot needs matplotlib (pip install matplotlib)") from exc
    xs, ys = zip(*goodput_curve(inputs), strict=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.semilogx(xs, ys, label="expected goodput")
    ax.axvline(result.optimal_interval_s, color="g", ls="--", label="optimum (Daly)")
    if result.current_interval_s:
        ax.axvline(result.current_interval_s, color="r", ls=":", label="current")
    ax.set_xlabel("checkpoint interval (s of compute)")
    ax.set_ylabel("goodput (useful / wall time)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_EPILOG = """\
examples:
  relight plan --gpus 16384 --mtbf-hours-per-gpu 50000 --save-stall 2 --restore-time 600
  relight plan --from-run runs/local --mtbf-hours-per-gpu 50000 --gpus 1024 --plot g.png

With --from-run, the save stall, restore time, step time and current interval are measured
from the run's metrics (DIR/metrics.jsonl, written by runtime.train with
train.metrics_path); --save-stall/--restore-time/--step-time/--interval override them and
--gpus defaults to the run's world size. The MTBF is never measured: pass your fleet's.

exit status: 0 ok; 2 usage error or an input out of range; 3 --from-run found no metrics
or could not measure an input that was not given.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="relight plan", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Optimal checkpoint interval (Young/Daly) and expected goodput.",
    )
    p.add_argument("--from-run", type=Path, metavar="DIR",
                   help="measure save stall, restore time, step time and interval from a run")
    p.add_argument("--gpus", type=int, help="GPUs in the job (default with --from-run: "
                   "the run's world size)")
    p.add_argument("--mtbf-hours-per-gpu", type=float, required=True,
                   help="mean time between failures of one GPU, hours")
    p.add_argument("--save-stall", type=float, help="seconds training stalls per checkpoint")
    p.add_argument("--restore-time", type=float,
                   help="seconds from a fault to the first useful step after the resume")
    p.add_argument("--step-time", type=float, help="seconds per training step")
    p.add_argument("--interval", type=float,
                   help="current checkpoint interval, seconds of compute")
    p.add_argument("--local-restore-time", type=float,
                   help="seconds from a fault to the first step when the node-local tier "
                   "serves the restore (checkpoint.local_tier_dir)")
    p.add_argument("--local-hit-fraction", type=float, default=0.0,
                   help="share of failures the local tier serves (node memory intact: "
                   "process and GPU faults, not lost hosts); default 0")
    p.add_argument("--tier-shard-gb", type=float,
                   help="checkpoint GB one node holds, for the local tier's memory cost")
    p.add_argument("--replica-groups", type=int,
                   help="healing in place: replica groups in the job (with --heal-pause "
                   "and --heal-time)")
    p.add_argument("--heal-pause", type=float,
                   help="healing in place: seconds the survivors pause per fault")
    p.add_argument("--heal-time", type=float,
                   help="healing in place: seconds from a replacement's start to healed")
    p.add_argument("--heal-scale", type=Path,
                   help="healing in place: the JSON of `relight bench scale_heal`; adds the "
                   "membership change's settle time at --replica-groups (over its smallest "
                   "size) to --heal-pause and --heal-time, measured at a few groups")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", type=Path, help="write a PNG of goodput vs interval")
    return p


def _inputs(args: argparse.Namespace, measured: RunMeasurements | None) -> PlanInputs:
    m = measured
    values = {
        "gpus": args.gpus if args.gpus is not None else (m.world_size if m else None),
        "save_stall_s": args.save_stall if args.save_stall is not None
        else (m.save_stall_s if m else None),
        "restore_time_s": args.restore_time if args.restore_time is not None
        else (m.restore_time_s if m else None),
    }
    missing = [k for k, v in values.items() if v is None]
    if missing:
        flags = {"gpus": "--gpus", "save_stall_s": "--save-stall",
                 "restore_time_s": "--restore-time"}
        where = f"{m.source} does not measure" if m else "missing"
        raise RunMetricsError(f"{where} {', '.join(missing)}: pass "
                              + " ".join(flags[k] for k in missing))
    step = args.step_time if args.step_time is not None else (m.step_time_s if m else None)
    current = args.interval
    if current is None and m is not None and m.interval_steps is not None and step:
        current = m.interval_steps * step
    heal_pause, heal_time = args.heal_pause, args.heal_time
    if args.heal_scale is not None:
        if args.replica_groups is None or heal_pause is None or heal_time is None:
            raise PlanInputError("--heal-scale needs --replica-groups, --heal-pause and "
                                 "--heal-time (the pause and heal time at a few groups)")
        try:
            rows = json.loads(Path(args.heal_scale).read_text())
        except (OSError, ValueError) as exc:
            raise PlanInputError(f"--heal-scale {args.heal_scale}: {exc}") from None
        extra_pause, extra_heal = heal_scale_costs(rows, args.replica_groups)
        heal_pause, heal_time = heal_pause + extra_pause, heal_time + extra_heal
    return PlanInputs(gpus=int(values["gpus"]), mtbf_hours_per_gpu=args.mtbf_hours_per_gpu,
                      save_stall_s=float(values["save_stall_s"]),
                      restore_time_s=float(values["restore_time_s"]), step_time_s=step,
                      current_interval_s=current,
                      local_restore_time_s=args.local_restore_time,
                      local_hit_fraction=args.local_hit_fraction,
                      tier_shard_gb_per_node=args.tier_shard_gb,
                      replica_groups=args.replica_groups, heal_pause_s=heal_pause,
                      heal_time_s=heal_time)


def _print_text(inputs: PlanInputs, result: PlanResult, m: RunMeasurements | None) -> None:
    if m is not None:
        print(f"measured from {m.source}: {m.steps} steps in {m.lifetimes} process "
              f"lifetime(s), world size {m.world_size}")
        if m.save_stall_s is not None:
            print(f"  save stall {m.save_stall_s:.3f} s (mean of {m.saves} saves)")
        if m.restore_time_s is not None:
            print(f"  restore time {m.restore_time_s:.2f} s ({m.restore_basis})")
        if m.step_time_s is not None:
            print(f"  step time {m.step_time_s:.3f} s (median)")
        if m.interval_steps is not None:
            print(f"  checkpoint every {m.interval_steps} steps")
    print(f"inputs: {inputs.gpus} GPUs, MTBF {inputs.mtbf_hours_per_gpu:g} h per GPU, save "
          f"stall {inputs.save_stall_s:.3g} s, restore {inputs.restore_time_s:.3g} s")
    if inputs.local_restore_time_s is not None:
        print(f"tiers: local tier serves {inputs.local_hit_fraction:.0%} of failures in "
              f"{inputs.local_restore_time_s:.3g} s, the persistent store the rest in "
              f"{inputs.restore_time_s:.3g} s: mean restore "
              f"{result.effective_restore_time_s:.3g} s")
    if result.tier_memory_gb_per_node is not None:
        gb = result.tier_memory_gb_per_node
        print(f"local tier memory: {gb:.3g} GB per node between saves, {2 * gb:.3g} GB "
              "while a save is copied (checkpoint.local_tier_budget_mb)")
    print(f"job MTBF: {result.job_mtbf_s / 3600:.2f} h ({inputs.gpus} GPUs)")
    steps = f" (~{result.optimal_interval_steps} steps)" if result.optimal_interval_steps else ""
    print(f"optimal interval: {result.optimal_interval_s:.0f} s{steps}; "
          f"goodput {result.optimal_goodput:.1%}")
    if result.current_goodput is not None:
        cur = (f" (~{round(result.current_interval_s / inputs.step_time_s)} steps)"
               if inputs.step_time_s else "")
        print(f"current interval: {result.current_interval_s:.0f} s{cur}; "
              f"goodput {result.current_goodput:.1%}")
    if result.heal_goodput is not None:
        print(f"heal in place ({inputs.replica_groups} replica groups; survivors pause "
              f"{inputs.heal_pause_s:.3g} s per fault, a replacement heals in "
              f"{inputs.heal_time_s:.3g} s): goodput {result.heal_goodput:.1%} at the "
              "optimal interval")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return EXIT_USAGE if e.code else EXIT_OK
    measured = None
    try:
        if args.from_run is not None:
            measured = measure_run(args.from_run)
        inputs = _inputs(args, measured)
    except RunMetricsError as exc:
        print(f"relight plan: {exc}", file=sys.stderr)
        return EXIT_NO_MEASUREMENT if args.from_run is not None else EXIT_USAGE
    except PlanInputError as exc:
        print(f"relight plan: {exc}", file=sys.stderr)
        return EXIT_USAGE
    result = plan(inputs)
    if args.plot:
        _plot(inputs, result, args.plot)
    if args.json:
        out: dict[str, Any] = asdict(result)
        out["inputs"] = asdict(inputs)
        if measured is not None:
            out["measured"] = {**asdict(measured), "interval_s": measured.interval_s}
        print(json.dumps(out, indent=2))
        return EXIT_OK
    _print_text(inputs, result, measured)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
