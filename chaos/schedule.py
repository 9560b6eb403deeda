"""The fault schedule of a chaos run: the faults still to fire, when each is due, and
injecting it into the cluster.

A fault is due by its trigger: a step logged (`at_step`, optionally only once the
earlier faults' groups train again: `after_recovery`), a time after the first step
(`at_time_s`, and every drawn MTBF fault), or a phase of the run (`during`: a save's
persist or commit, a restore, training). A drawn fault also waits until it can happen
(`mtbf_spec`, `FaultSchedule.due`). A fault aimed at a save's phase holds the next save
in that phase with storage latency (`window_plan`) until it lands.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from relight.chaos.faults import (
    RESTARTING,
    SAVE_PHASES,
    FaultEvent,
    FaultKind,
    Injector,
    Phase,
    draw_mtbf_schedule,
)
from relight.chaos.measure import CommitPoll, MetricsTail, Recoveries
from relight.chaos.scenario import FaultSpec, Scenario
from relight.chaos.verifier import CheckpointEvent

__all__ = ["DAMAGE", "FaultSchedule", "Pending", "mtbf_spec", "planned_faults",
           "window_plan"]

DAMAGE = (FaultKind.CORRUPT_CHECKPOINT, FaultKind.TRUNCATE_CHECKPOINT)


@dataclass
class Pending:
    """A fault not fired yet: its index in the fault log, its spec, the trigger as the
    report names it, and (a drawn fault) its time after the first step."""

    index: int
    spec: FaultSpec
    trigger: str
    at_time_s: float | None = None


def planned_faults(scenario: Scenario, seed: int) -> list[Pending]:
    """The scenario's timeline, then the MTBF faults drawn from `seed`."""
    pending = []
    for i, spec in enumerate(scenario.faults):
        trig = (f"step>={spec.at_step}" if spec.at_step is not None else
                f"t>={spec.at_time_s}s" if spec.at_time_s is not None else
                f"during={spec.during}")
        pending.append(Pending(i, spec, trig))
    m = scenario.mtbf
    for t, kind in draw_mtbf_schedule(m.kinds, m.count, m.mean_s, m.start_s, seed):
        spec = mtbf_spec(kind, m, scenario.checkpoint.interval)
        pending.append(Pending(len(pending), spec, f"mtbf t>={t}s", t))
    return pending


def window_plan(spec: FaultSpec) -> dict[str, Any] | None:
    """Storage latency that holds a save in the phase a waiting fault aims at."""
    if not spec.window_s:
        return None
    key = "/index/" if spec.during is Phase.PERSIST else "manifest.json"
    return {"latency_s": spec.window_s, "ops": ["put"], "key_contains": key}


def mtbf_spec(kind: FaultKind, m: Any, interval: int) -> FaultSpec:
    """A drawn fault: its time gates it; the kinds aimed at a save wait for the next one,
    damage waits until there is a committed checkpoint to damage, and a scale up (down)
    waits until the fleet is below max_nodes (above min_nodes) — see `FaultSchedule.due`."""
    if kind in DAMAGE:
        return FaultSpec(kind=kind, during=Phase.TRAINING, after_step=interval + 2)
    if kind is FaultKind.KILL_DURING_PERSIST:
        return FaultSpec(kind=kind, during=Phase.PERSIST)
    if kind is FaultKind.KILL_COORDINATOR_BEFORE_COMMIT:
        return FaultSpec(kind=kind, during=Phase.BEFORE_COMMIT)
    if kind in (FaultKind.KILL_NODE, FaultKind.PREEMPT):
        return FaultSpec(kind=kind, during=Phase.TRAINING, replace_after_s=m.replace_after_s)
    if kind is FaultKind.STOP_WORKER:
        return FaultSpec(kind=kind, during=Phase.TRAINING, resume_after_s=m.resume_after_s)
    return FaultSpec(kind=kind, during=Phase.TRAINING)


class FaultSchedule:
    """The faults still pending and the log of those fired (`events`).

    Reads what the watch measures (`metrics`: the steps logged; `commits`: the commits
    seen; `recoveries`: the faults whose groups are not back yet), injects through
    `injector` into `cluster`, and records what it did: each fault's event, the damage
    it did to a checkpoint (`commits.events`), the recovery it opened."""

    def __init__(self, scenario: Scenario, cluster: Any, injector: Injector | None,
                 metrics: MetricsTail, commits: CommitPoll, recoveries: Recoveries,
                 pending: list[Pending] | None = None) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.injector = injector
        self.metrics = metrics
        self.commits = commits
        self.recoveries = recoveries
        self.pending: list[Pending] = pending or []
        self.events: list[FaultEvent] = []

    def due(self, p: Pending, now: float, phase: dict[str, Any] | None) -> bool:
        spec = p.spec
        high, first_step_time = self.metrics.high, self.metrics.first_step_time
        if p.at_time_s is not None and (
            first_step_time is None or now - first_step_time < p.at_time_s
        ):
            return False
        if spec.at_step is not None:
            if high < spec.at_step:
                return False
            return not spec.after_recovery or (
                not self.recoveries.open
                and high >= self.recoveries.recovered_at + spec.steps_after_recovery)
        if spec.at_time_s is not None:
            return first_step_time is not None and (
                now - first_step_time >= spec.at_time_s)
        if spec.during is None or high < max(spec.after_step, 1):
            return False
        if spec.kind in DAMAGE and len({step for step, _ in self.commits.committed}) < 2:
            # Damage the newest checkpoint only once an older one exists to fall back to:
            # with one checkpoint, damaging it leaves no good state to resume from, and
            # the runtime refuses to start over silently (preemptible-fleet seed 9 looped
            # on CheckpointNotFoundError).
            return False
        c = self.scenario.cluster
        if spec.kind is FaultKind.SCALE_UP and len(self.cluster.live_nodes()) >= c.max_nodes:
            return False  # the fleet is full: grow it once a node is gone
        if spec.kind is FaultKind.SCALE_DOWN and len(self.cluster.live_nodes()) <= c.min_nodes:
            return False  # shrinking now would stop the job: wait for a node to come back
        if spec.during in SAVE_PHASES:
            return phase is not None and phase["phase"] == spec.during
        if spec.during is Phase.RESTORE:
            # A restarted group is up and has not logged a step yet.
            return self.recoveries.restoring()
        return True

    def fire(self, now: float, steps_only: bool = False) -> None:
        """Inject every fault that is due (`steps_only`: only step-triggered ones, as a
        step's line is read), then hold the next save in the phase the first waiting
        fault aims at."""
        high = self.metrics.high
        waiting_phase = [p for p in self.pending if p.spec.during in SAVE_PHASES
                         and high >= max(p.spec.after_step, 1)]
        phase = None
        if waiting_phase and not steps_only:
            phase = self.cluster.checkpoint_phase()
        for p in list(self.pending):
            if steps_only and p.spec.at_step is None:
                continue
            if not self.due(p, now, phase):
                continue
            self.pending.remove(p)
            self.inject(p)
            phase = None
        if not steps_only:
            high = self.metrics.high
            waiting = [p for p in self.pending if p.spec.during in SAVE_PHASES
                       and high >= max(p.spec.after_step, 1)]
            self.cluster.arm(window_plan(waiting[0].spec) if waiting else None)

    def inject(self, p: Pending) -> None:
        assert self.injector is not None
        spec = p.spec
        before = self.cluster.workers()
        ev = self.injector.inject(spec, p.index, p.trigger, self.metrics.high)
        if not ev.ok and spec.during is not None and ev.error.startswith("no live"):
            # Aimed at a phase, it met a group still restarting (its victim not up yet):
            # wait for the phase to come round again rather than give up.
            self.pending.append(p)
            return
        self.events.append(ev)
        damage = spec.kind in DAMAGE
        if ev.ok and damage:
            self.commits.events.append(CheckpointEvent(ev.detail["checkpoint_step"], ev.time,
                                                       "damage"))
        if ev.ok and spec.kind in RESTARTING and (not damage or spec.kill_after):
            self.recoveries.start(ev, before, self.metrics.records)

    def never_fired(self) -> None:
        """Log each fault still pending as one the run ended before."""
        for p in self.pending:
            self.events.append(FaultEvent(index=p.index, kind=p.spec.kind, trigger=p.trigger,
                                          time=time.time(), step=self.metrics.high, ok=False,
                                          error="never fired: the run ended first"))
