"""The run's own logs, parsed: per-step JSONL metrics into records, records into attempts.

The contract a training script meets (runtime.train does, and so does
`examples/user_train.py`): rank 0 appends one JSON object per completed optimizer step to
the metrics file (append mode, so restarts extend it), with at least

- `step`          - completed optimizer steps after this step (1 for the first step);
- `loss`          - the step's global mean loss (a float; JSON round-trips it exactly);
- `data_position` - global index of the first sample this step consumed;
- `restored_step` - the checkpoint step this process restored at start (null: fresh start);
- `world_size`    - ranks in the group (optional, `layout` too: a layout change relaxes
  the exact comparisons to tolerances);
- `time`          - unix time the step finished (optional: the runner stamps the time it
  saw the line, `seen`, with ~0.2 s resolution);
- `step_time_s`   - seconds the step took (optional, for goodput);
- `restore_started_at` - on the first step after a restore, the unix time the restore
  began (optional: invariant 3 then uses the step's own `time`, which makes a checkpoint
  damaged while the new group ran its first step look damaged before its restore);
- `restore_tier_bytes` - on the first step after a restore with checkpoint tiers, the
  data bytes each tier served to it, `{"local": .., "peer": .., "persistent": ..}`
  (optional; checked when the scenario sets `verify.max_restore_persistent_bytes`).

With replica groups (`runtime.replicas`), every group's first rank appends to the same
file, and each record also says which group logged it and in which quorum:
`replica_group`, `quorum` (its id), `quorum_size`, `state_crc` (each rank's crc32c of
its parameter shards after the step), in a quorum of groups of different layouts also
`params_crc` (a digest of the whole parameters, layout-independent),
`abandoned_steps` (steps this process abandoned because a quorum member failed) and, on
a group's first step after it joined, `healed_bytes` (state bytes received from a live
group).

Lines that are not JSON objects with a `step` (progress noise, a line torn by a SIGKILL)
are skipped and counted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["Attempt", "MetricsParse", "StepRecord", "by_group", "job_history", "parse_metrics",
           "split_attempts"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    loss: float
    data_position: int | None = None
    restored_step: int | None = None
    world_size: int | None = None
    layout: str | None = None
    time: float | None = None
    step_time_s: float | None = None
    line: int = 0
    restore_started_at: float | None = None
    """On the first record after a restore: unix time the restore began."""
    restore_tier_bytes: dict[str, int] | None = None
    """On the first record after a restore with checkpoint tiers: data bytes each tier
    (local, peer, persistent) served, summed over the ranks."""
    replica_group: str | None = None
    quorum: int | None = None
    quorum_size: int | None = None
    state_crc: tuple[int, ...] | None = None
    params_crc: tuple[int, ...] | None = None
    abandoned_steps: int | None = None
    healed_bytes: int | None = None

    @property
    def layout_key(self) -> str:
        # Replica groups: the number of groups in the step's quorum is part of the
        # layout (a step reduced over fewer groups rounds differently).
        groups = f":x{self.quorum_size}" if self.quorum_size is not None else ""
        return f"{self.world_size}:{self.layout}{groups}"


@dataclass(frozen=True, slots=True)
class Attempt:
    """One worker group's life: a contiguous run of steps after one (re)start."""

    index: int
    records: tuple[StepRecord, ...]

    @property
    def restored_step(self) -> int | None:
        return self.records[0].restored_step

    @property
    def first(self) -> StepRecord:
        return self.records[0]

    @property
    def last(self) -> StepRecord:
        return self.records[-1]

    @property
    def start_time(self) -> float | None:
        return self.records[0].time


@dataclass
class MetricsParse:
    records: list[StepRecord] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    """Line numbers that were not step records."""


def _num(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)


def _int(v: Any) -> int | None:
    if isinstance(v, bool) or not isinstance(v, int):
        return None
    return v


def _tier_bytes(v: Any) -> dict[str, int] | None:
    if not isinstance(v, dict):
        return None
    out = {str(k): _int(n) for k, n in v.items()}
    return None if any(n is None for n in out.values()) else out  # type: ignore[return-value]


def _crcs(v: Any) -> tuple[int, ...] | None:
    if not isinstance(v, list) or not v:
        return None
    out = tuple(_int(c) for c in v)
    return None if any(c is None for c in out) else out  # type: ignore[return-value]


def parse_metrics(lines: Iterable[str]) -> MetricsParse:
    """Parse JSONL metrics lines (see the module docstring for the fields)."""
    out = MetricsParse()
    for n, line in enumerate(lines, start=1):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            out.skipped.append(n)
            continue
        if not isinstance(obj, dict):
            out.skipped.append(n)
            continue
        step, loss = _int(obj.get("step")), _num(obj.get("loss"))
        if step is None or loss is None or obj.get("event", "step") != "step":
            out.skipped.append(n)
            continue
        t = _num(obj.get("time"))
        if t is None:
            t = _num(obj.get("seen"))
        layout = obj.get("layout")
        out.records.append(
            StepRecord(
                step=step,
                loss=loss,
                data_position=_int(obj.get("data_position")),
                restored_step=_int(obj.get("restored_step")),
                world_size=_int(obj.get("world_size")),
                layout=layout if isinstance(layout, str) else None,
                time=t,
                step_time_s=_num(obj.get("step_time_s")),
                line=n,
                restore_started_at=_num(obj.get("restore_started_at")),
                restore_tier_bytes=_tier_bytes(obj.get("restore_tier_bytes")),
                replica_group=group if isinstance(group := obj.get("replica_group"), str)
                else None,
                quorum=_int(obj.get("quorum")),
                quorum_size=_int(obj.get("quorum_size")),
                state_crc=_crcs(obj.get("state_crc")),
                params_crc=_crcs(obj.get("params_crc")),
                abandoned_steps=_int(obj.get("abandoned_steps")),
                healed_bytes=_int(obj.get("healed_bytes")),
            )
        )
    return out


def split_attempts(records: Sequence[StepRecord]) -> list[Attempt]:
    """Cut the records where a new worker group started: the step does not follow the
    previous one, or the restored step or the world size changed."""
    attempts: list[Attempt] = []
    current: list[StepRecord] = []
    for rec in records:
        if current:
            prev = current[-1]
            if (
                rec.step != prev.step + 1
                or rec.restored_step != prev.restored_step
                or rec.world_size != prev.world_size
            ):
                attempts.append(Attempt(len(attempts), tuple(current)))
                current = []
        current.append(rec)
    if current:
        attempts.append(Attempt(len(attempts), tuple(current)))
    return attempts


def by_group(records: Sequence[StepRecord]) -> dict[str, list[StepRecord]]:
    """Replica groups' records, each group's in the order they were logged."""
    out: dict[str, list[StepRecord]] = {}
    for rec in records:
        out.setdefault(rec.replica_group or "", []).append(rec)
    return out


def job_history(records: Sequence[StepRecord]) -> list[StepRecord]:
    """The job's records when replica groups each log every step: a step every group
    logged counts once (groups that agree on a quorum log the same step with the same
    loss and data position). A resume of the whole job from a checkpoint (a record
    restored from step r logging step r + 1) starts over from there, as it would
    without groups; the other groups' records of that resume count once too."""
    out: list[StepRecord] = []
    high = 0
    resumes: set[tuple[int, int]] = set()
    epoch: int | None = None  # the step the job's current run restored from storage
    for rec in records:
        r = rec.restored_step
        if r is not None and rec.step == r + 1 and (r, rec.step) not in resumes:
            resumes.add((r, rec.step))
            epoch = r
        elif rec.step <= high:
            continue
        high = rec.step
        # A group that healed from a live one restored nothing itself; it continues
        # the job's run, which restored from `epoch`.
        out.append(rec if r == epoch else replace(rec, restored_step=epoch))
    return out


def effective_history(records: Sequence[StepRecord]) -> dict[int, StepRecord]:
    """For each step, the last record of it: the execution whose update survived."""
    out: dict[int, StepRecord] = {}
    for rec in records:
        out[rec.step] = rec
    return dict(sorted(out.items()))


def rel_diff(a: float, b: float) -> float:
    if a == b:
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-12)
