"""Goodput figures from step records, the same for every arm of `benchmarks.goodput`.

A record is one committed (kept) training step as one group saw it: a mapping with at
least ``group`` (any hashable id), ``step`` (the global step number), ``time`` (unix time
the step was committed), ``step_time_s`` (how long the step took) and ``participants``
(the replica groups whose gradients the step holds), and optionally ``quorum_s`` (the part
of ``step_time_s`` spent waiting for the step's quorum, which is not training: after a
fault it holds the whole reconfiguration). Several groups record the same step;
a step redone after a rollback (the restart path) is recorded again, later.

Pure functions over plain data: no torch, no torchft, so every arm's runner (Relight's,
and torchft's in its own environment) and the tests use them as they are.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from relight.errors import RelightError

__all__ = ["MetricsError", "fleet_goodput", "heal_times", "kept_steps", "live_fraction",
           "outage_pause", "pauses", "read_records", "steps_in_window", "window_start"]

Record = Mapping[str, Any]
_FIELDS = ("group", "step", "time", "step_time_s", "participants")


class MetricsError(RelightError, ValueError):
    """A record lacks a field the figures need, or a figure's input is out of range."""


JOBS: dict[str, dict[str, int]] = {
    "small": {"model.n_layers": 2, "data.global_batch_size": 24, "data.micro_batch_size": 2},
    "large": {"model.n_layers": 4, "model.dim": 192, "model.mlp_hidden": 768,
              "model.n_heads": 4, "data.seq_len": 64, "model.max_seq_len": 64,
              "data.global_batch_size": 96, "data.micro_batch_size": 4},
}
"""The jobs every goodput arm trains (overrides of `configs/tiny.toml`): `small`, a step
of tens of milliseconds, where per-step costs weigh most; `large`, a step of about half a
second to a second on a 2-core machine shared by four groups, closer to a real step."""


def job_arguments(job: str) -> list[str]:
    """`JOBS[job]` as the trainer's command-line overrides."""
    return [f"--{key}={value}" for key, value in JOBS[job].items()]


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file, one a line; a missing file is none. A line
    that does not parse (cut by a kill mid-write) is left out."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            out.append(r)
    return out


def _check(records: Iterable[Record]) -> list[Record]:
    out = list(records)
    for i, r in enumerate(out):
        missing = [f for f in _FIELDS if f not in r]
        if missing:
            raise MetricsError(f"step record {i} lacks {', '.join(missing)}: {dict(r)!r}")
    return out


def window_start(records: Iterable[Record]) -> float | None:
    """When the first kept step began (its commit time less its step time); None if none."""
    recs = _check(records)
    return min((float(r["time"]) - float(r["step_time_s"]) for r in recs), default=None)


def kept_steps(records: Iterable[Record]) -> list[Record]:
    """One record per step number, the latest committed: where groups record the same step
    any one stands for it, and where a step was redone after a rollback only the redo was
    kept. Sorted by step."""
    last: dict[int, Record] = {}
    for r in _check(records):
        s = int(r["step"])
        if s not in last or float(r["time"]) >= float(last[s]["time"]):
            last[s] = r
    return [last[s] for s in sorted(last)]


def steps_in_window(records: Iterable[Record], start: float | None, duration_s: float
                    ) -> int:
    """How many kept steps committed in ``[start, start + duration_s]``: the work done,
    where every arm trains the same job (the same global batch per step). The fleet
    goodput is a share of time and does not see how long a step takes."""
    if start is None:
        return 0
    return sum(1 for r in kept_steps(records) if start < float(r["time"]) <= start + duration_s)


def fleet_goodput(records: Iterable[Record], start: float | None, duration_s: float,
                  fleet_size: int) -> float:
    """Share of the fleet's group-seconds in ``[start, start + duration_s]`` spent in steps
    that were kept: the sum over kept steps committed in the window of
    ``(step_time_s - quorum_s) * participants``, over ``duration_s * fleet_size``.
    ``start`` None: the window opens when the first kept step began (`window_start`).

    A step's time counts only from the previous kept step's commit (or the window's
    start) on: the kept record of a step may come from another group than its
    neighbours', and groups commit a step at slightly different times, so the raw step
    times of consecutive kept records can overlap; counted whole, a run without faults
    would score above 1."""
    if duration_s <= 0:
        raise MetricsError(f"duration_s must be > 0, got {duration_s}")
    if fleet_size < 1:
        raise MetricsError(f"fleet_size must be >= 1, got {fleet_size}")
    recs = kept_steps(records)
    if start is None:
        start = window_start(recs)
        if start is None:
            return 0.0
    end = start + duration_s
    busy, prev = 0.0, start
    for r in recs:
        t = float(r["time"])
        if start < t <= end:
            work = float(r["step_time_s"]) - float(r.get("quorum_s") or 0.0)
            busy += max(0.0, min(work, t - prev)) * int(r["participants"])
        prev = max(prev, t)
    return busy / (duration_s * fleet_size)


def live_fraction(fault_times: Iterable[float], down_s: float, duration_s: float,
                  fleet_size: int) -> float:
    """Share of the fleet's group-seconds in a window of ``duration_s`` (fault times
    counted from its start) during which the group's machines existed: each fault takes
    one group's machines away for ``down_s`` (until its replacement starts), or until the
    window ends. What the best possible arm could train; the fleet goodput over it is
    the share of the fleet's capacity that trained."""
    if duration_s <= 0:
        raise MetricsError(f"duration_s must be > 0, got {duration_s}")
    if fleet_size < 1:
        raise MetricsError(f"fleet_size must be >= 1, got {fleet_size}")
    if down_s < 0:
        raise MetricsError(f"down_s must be >= 0, got {down_s}")
    lost = sum(max(0.0, min(down_s, duration_s - t)) for t in fault_times
               if 0.0 <= t < duration_s)
    return 1.0 - lost / (duration_s * fleet_size)


def _by_group(records: Iterable[Record]) -> dict[Hashable, list[Record]]:
    out: dict[Hashable, list[Record]] = {}
    for r in records:
        out.setdefault(r["group"], []).append(r)
    for recs in out.values():
        recs.sort(key=lambda r: float(r["time"]))
    return out


def pauses(records: Iterable[Record], fault_times: Sequence[float],
           survivors: Sequence[Collection[Hashable]], window_s: float = 30.0
           ) -> list[float | None]:
    """The survivors' pause per fault: the longest gap between consecutive kept steps of a
    surviving group that ends within ``window_s`` after the fault (the gap across the
    fault included), less that group's median step time; the largest over the fault's
    survivors. ``survivors[i]`` are the groups that outlived fault ``i`` (neither its
    victim nor a replacement). None where no survivor committed a step in the window."""
    if len(survivors) != len(fault_times):
        raise MetricsError(f"{len(fault_times)} faults but {len(survivors)} survivor sets")
    groups = _by_group(_check(records))
    out: list[float | None] = []
    for t, alive in zip(fault_times, survivors, strict=True):
        worst: float | None = None
        for g in alive:
            recs = groups.get(g, [])
            if not recs:
                continue
            median = statistics.median(float(r["step_time_s"]) for r in recs)
            times = [float(r["time"]) for r in recs]
            gaps = [b - a for a, b in zip(times, times[1:], strict=False)
                    if t < b <= t + window_s]
            if gaps:
                p = max(gaps) - median
                worst = p if worst is None else max(worst, p)
        out.append(worst)
    return out


def outage_pause(records: Iterable[Record], t: float, groups: Collection[Hashable],
                 until: float) -> float | None:
    """What one outage at `t` that hit no group (the coordinator lost) cost the groups
    training then: the longest gap between consecutive kept steps of any of `groups`
    that spans or follows `t`, up to `until` (the end of the measured window), less that
    group's median step time. A group that never stepped again counts its gap from its
    last step to `until`: the figure is then a lower bound. None if none of `groups`
    has a step."""
    by_group = _by_group(_check(records))
    worst: float | None = None
    for g in groups:
        recs = [r for r in by_group.get(g, []) if float(r["time"]) <= until]
        if not recs:
            continue
        median = statistics.median(float(r["step_time_s"]) for r in recs)
        times = [float(r["time"]) for r in recs] + [until]
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if b > t]
        if gaps:
            p = max(gaps) - median
            worst = p if worst is None else max(worst, p)
    return worst


def heal_times(records: Iterable[Record], started: Mapping[Hashable, float]
               ) -> dict[Hashable, float | None]:
    """For each replacement group (id -> unix time its process started), the time from its
    start to its first kept step; None where it committed none."""
    groups = _by_group(_check(records))
    return {g: (float(groups[g][0]["time"]) - t0 if g in groups else None)
            for g, t0 in started.items()}
