"""`relight plan`: how often to checkpoint, and the goodput that buys.

The model is Daly's (Future Generation Computer Systems 22, 2006) for failures that
arrive as a Poisson process: with a job-wide MTBF `M` (the per-GPU MTBF divided by
the GPU count), a checkpoint that stalls training for `delta`, a restart that costs
`R`, and `tau` seconds of work between checkpoints, the expected wall time per unit
of useful work is `M * exp(R/M) * (exp((tau + delta)/M) - 1) / tau`; goodput is its
inverse. The optimum is Daly's higher-order estimate of the interval, which reduces
to Young's `sqrt(2 * delta * M)` when `delta << M`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["PlanInputs", "PlanResult", "daly_interval", "expected_goodput", "plan", "main"]


class PlanInputError(ValueError):
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

    def __post_init__(self) -> None:
        checks = {
            "gpus": self.gpus >= 1,
            "mtbf_hours_per_gpu": self.mtbf_hours_per_gpu > 0,
            "save_stall_s": self.save_stall_s >= 0,
            "restore_time_s": self.restore_time_s >= 0,
            "step_time_s": self.step_time_s is None or self.step_time_s > 0,
            "current_interval_s": self.current_interval_s is None or self.current_interval_s > 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise PlanInputError(f"{name}={getattr(self, name)!r} is out of range")

    @property
    def job_mtbf_s(self) -> float:
        return self.mtbf_hours_per_gpu * 3600.0 / self.gpus


@dataclass(frozen=True, slots=True)
class PlanResult:
    job_mtbf_s: float
    optimal_interval_s: float
    optimal_goodput: float
    young_interval_s: float
    optimal_interval_steps: int | None
    current_interval_s: float | None
    current_goodput: float | None


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


def plan(inputs: PlanInputs) -> PlanResult:
    m = inputs.job_mtbf_s
    best = daly_interval(inputs.save_stall_s, m)
    current = inputs.current_interval_s
    return PlanResult(
        job_mtbf_s=m,
        optimal_interval_s=best,
        optimal_goodput=expected_goodput(best, inputs.save_stall_s, inputs.restore_time_s, m),
        young_interval_s=math.sqrt(2 * inputs.save_stall_s * m),
        optimal_interval_steps=(
            max(1, round(best / inputs.step_time_s)) if inputs.step_time_s else None
        ),
        current_interval_s=current,
        current_goodput=(
            expected_goodput(current, inputs.save_stall_s, inputs.restore_time_s, m)
            if current
            else None
        ),
    )


def goodput_curve(inputs: PlanInputs, points: int = 60) -> list[tuple[float, float]]:
    """(interval, goodput) on a log grid from 1/30x to 30x the optimum."""
    best = daly_interval(inputs.save_stall_s, inputs.job_mtbf_s)
    lo, hi = math.log(best / 30), math.log(best * 30)
    grid = [math.exp(lo + (hi - lo) * i / (points - 1)) for i in range(points)]
    return [
        (t, expected_goodput(t, inputs.save_stall_s, inputs.restore_time_s, inputs.job_mtbf_s))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="relight plan",
        description="Optimal checkpoint interval (Young/Daly) and expected goodput.",
    )
    parser.add_argument("--gpus", type=int, required=True)
    parser.add_argument("--mtbf-hours-per-gpu", type=float, required=True)
    parser.add_argument("--save-stall", type=float, required=True, help="seconds per checkpoint")
    parser.add_argument("--restore-time", type=float, required=True, help="seconds per recovery")
    parser.add_argument("--step-time", type=float, help="seconds per training step")
    parser.add_argument("--interval", type=float, help="current checkpoint interval, seconds")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--plot", type=Path, help="write a PNG of goodput vs interval")
    args = parser.parse_args(argv)
    try:
        inputs = PlanInputs(
            gpus=args.gpus,
            mtbf_hours_per_gpu=args.mtbf_hours_per_gpu,
            save_stall_s=args.save_stall,
            restore_time_s=args.restore_time,
            step_time_s=args.step_time,
            current_interval_s=args.interval,
        )
    except PlanInputError as exc:
        print(f"relight plan: {exc}", file=sys.stderr)
        return 2
    result = plan(inputs)
    if args.plot:
        _plot(inputs, result, args.plot)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
        return 0
    print(f"job MTBF: {result.job_mtbf_s / 3600:.2f} h ({inputs.gpus} GPUs)")
    steps = f" (~{result.optimal_interval_steps} steps)" if result.optimal_interval_steps else ""
    print(f"optimal interval: {result.optimal_interval_s:.0f} s{steps}; "
          f"goodput {result.optimal_goodput:.1%}")
    if result.current_goodput is not None:
        print(f"current interval: {result.current_interval_s:.0f} s; "
              f"goodput {result.current_goodput:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
