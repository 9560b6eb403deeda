"""The six invariants, checked from evidence: the run's own logs, the checkpoint store, the
faults the harness injected, and an uninterrupted reference run.

Everything here is a pure function of a `RunEvidence`; the runner gathers the evidence
(tails the metrics, polls the store for commits, reads the writers' own commit records
from the nodes' logs, verifies checkpoints, compares final states) and the unit tests
build it by hand, including runs that are broken on purpose.

1. target    - the run reached its target step and the job ended by itself in time;
2. weights   - final weights and optimizer state equal the reference's: bitwise when the
               final layout is the reference's, else within the stated tolerance;
3. checkpoints - every committed checkpoint verifies (one the harness damaged must fail
               verification); every restore loaded a checkpoint that was committed, and not
               damaged since, when the restore happened;
4. lost work - per resume, steps lost (the stopped group's highest step done or committed
               - step restored) <= interval + 1, plus one interval per checkpoint-destroying
               fault since the previous resume (such a fault legitimately sends the resume
               one save back); no resume restores beyond the highest step ever reached;
5. loss curve - every logged step's loss equals the reference's at that step (exactly while
               the layout never changed; within `loss_rtol` once it has);
6. data      - every step consumed exactly the samples the reference did at that step (its
               `data_position`), each resume continues at restored step + 1, and the surviving
               history is contiguous: no sample consumed twice or skipped.

With checkpoint tiers, a scenario may add one more check (7, `restores from memory`):
every restore read at most `verify.max_restore_persistent_bytes` checkpoint data bytes
from the persistent store, by the runtime's own counters (`restore_tier_bytes`).

With replica groups every group logs every step; checks 1-7 read the job's history (each
step once, `chaos.logs.job_history`) and four more hold the groups to heal in place:

8.  survivors never restart - a node's workers start once, plus once per fault aimed
    at that node's own workers (its agent restarts its group); a fault elsewhere never
    restarts them (process starts counted by the harness);
9.  replicas identical - every group that logged a step logged the same parameter-shard
    crc32c for every rank (`state_crc`): no replica ever applied a partial update;
10. heals read no storage - a group that (re)joined while another group trained got its
    state from that group's memory (`healed_bytes` > 0, nothing restored from storage);
    a run in which no group joined while another trained holds it with nothing to check,
    and its result says so (`measured["vacuous"]`);
11. work lost per fault - a surviving group never skips or repeats a step, and abandons
    at most the step in flight per fault that lands while it trains.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from relight.chaos.faults import CHECKPOINT_ATTACKS, FaultKind
from relight.chaos.logs import (
    Attempt,
    StepRecord,
    by_group,
    effective_history,
    job_history,
    rel_diff,
    split_attempts,
)

__all__ = [
    "CheckpointEvent",
    "FaultMark",
    "InvariantResult",
    "RunEvidence",
    "Tolerances",
    "WeightsComparison",
    "WriterCommit",
    "all_ok",
    "settle_commit_times",
    "verify",
]

MAX_DETAILS = 12


@dataclass(frozen=True, slots=True)
class CheckpointEvent:
    """Something that happened to one checkpoint step in the store, and when."""

    step: int
    time: float
    """For a commit: a time by which the step was committed (never before the commit
    itself); for a damage: when the harness did it."""
    kind: str
    """`commit` (observed committed) or `damage` (the harness corrupted it on purpose)."""
    since: float = -math.inf
    """For a commit the harness's probe saw: when the listing before the one that first
    showed it began (the commit came after that). Tells which of a step's commits a
    writer's own record belongs to (`settle_commit_times`)."""


@dataclass(frozen=True, slots=True)
class WriterCommit:
    """A checkpoint writer's own record that it committed a step (its `committed` log
    line, written once the COMMIT marker exists)."""

    step: int
    time: float
    """No earlier than the commit it records."""


@dataclass(frozen=True, slots=True)
class FaultMark:
    index: int
    kind: FaultKind
    time: float
    ok: bool = True
    """The fault was injected."""
    required: bool = True
    """A timeline fault must be injected; a drawn (MTBF) one may be refused (say a node
    loss that would leave fewer than min_nodes) without failing the run."""
    error: str = ""
    node: int | None = None
    """The node it hit (None: not a node's fault, say storage or etcd)."""


@dataclass(frozen=True, slots=True)
class Tolerances:
    loss_rtol: float = 1e-3
    weights_rtol: float = 1e-3
    weights_atol: float = 1e-5


@dataclass
class WeightsComparison:
    """Final state of the chaos run against the reference's, tensor by tensor."""

    compared: bool
    error: str = ""
    tensors: int = 0
    bitwise_equal: bool = False
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    mismatched: list[str] = field(default_factory=list)
    """Keys missing on one side, or (after a layout change) outside the tolerance."""
    not_bitwise: list[str] = field(default_factory=list)
    chaos_step: int | None = None
    reference_step: int | None = None


@dataclass
class RunEvidence:
    records: list[StepRecord]
    target_step: int
    interval: int
    finished: bool
    """The job ended by itself (every agent exited 0) before the deadline."""
    finish_detail: str = ""
    reference: list[StepRecord] | None = None
    checkpoint_events: list[CheckpointEvent] = field(default_factory=list)
    verified: dict[int, str | None] = field(default_factory=dict)
    """Committed checkpoints in the store at the end: step -> None (verifies) or the error."""
    faults: list[FaultMark] = field(default_factory=list)
    weights: WeightsComparison | None = None
    compare_weights: bool = True
    tolerances: Tolerances = field(default_factory=Tolerances)
    max_restore_persistent_bytes: int = -1
    """Check 7's bound (-1: check 7 is not run)."""
    replica_groups: bool = False
    """Each node was a replica group (checks 8-11 run; 1-7 read the job's history)."""
    ranks_per_node: int = 1
    worker_starts: dict[int, int] = field(default_factory=dict)
    """Worker processes the harness saw start on each node (node index -> count)."""
    writer_commits: list[WriterCommit] = field(default_factory=list)
    """The writers' own records of their commits: they date the commits the probe saw
    (`checkpoint_events`) to when they happened, and add those it never saw."""


@dataclass
class InvariantResult:
    number: int
    name: str
    ok: bool
    summary: str
    details: list[str] = field(default_factory=list)
    tolerance: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "number": self.number,
            "name": self.name,
            "ok": self.ok,
            "summary": self.summary,
            "details": self.details,
            "tolerance": self.tolerance,
            "measured": self.measured,
        }


def _result(number: int, name: str, problems: list[str], ok_summary: str, **kw: Any
            ) -> InvariantResult:
    if problems:
        summary = f"{len(problems)} problem(s): {problems[0]}"
        details = problems[:MAX_DETAILS]
        if len(problems) > MAX_DETAILS:
            details.append(f"... and {len(problems) - MAX_DETAILS} more")
        return InvariantResult(number, name, False, summary, details, **kw)
    return InvariantResult(number, name, True, ok_summary, **kw)


def all_ok(results: Sequence[InvariantResult]) -> bool:
    return all(r.ok for r in results)


# commit evidence ----------------------------------------------------------------------------

def _owner(commits: Sequence[CheckpointEvent], record: WriterCommit) -> int | None:
    """The index of the probe's commit of `record.step` that the writer's record dates:
    the newest one whose window opened before the record (a commit the probe first
    showed after a listing begun at `since` happened after `since`)."""
    owners = [i for i, e in enumerate(commits)
              if e.step == record.step and e.since < record.time]
    return max(owners, key=lambda i: commits[i].since, default=None)


def settle_commit_times(events: Sequence[CheckpointEvent],
                        records: Sequence[WriterCommit]) -> list[CheckpointEvent]:
    """The checkpoint events with each commit dated by the best evidence of it. The
    probe samples the store (every half second at best, later while the harness is busy),
    so a group that restores within that time of a commit would restore a checkpoint not
    yet seen committed; the writer's record follows its commit by milliseconds. A commit
    the probe saw is dated by the earlier of the two; a writer's record the probe has no
    commit for (committed and collected between two samples) is a commit of its own.
    Neither ever precedes the commit it dates: a restore that began before it still
    fails."""
    commits = [e for e in events if e.kind == "commit"]
    dated: set[int] = set()
    unseen: list[CheckpointEvent] = []
    for record in sorted(records, key=lambda r: r.time):
        i = _owner(commits, record)
        if i is None or i in dated:
            unseen.append(CheckpointEvent(record.step, record.time, "commit"))
            continue
        dated.add(i)
        commits[i] = dataclasses.replace(commits[i], time=min(commits[i].time, record.time))
    others = [e for e in events if e.kind != "commit"]
    return sorted([*others, *commits, *unseen], key=lambda e: e.time)


def _with_writer_commits(ev: RunEvidence) -> RunEvidence:
    if not ev.writer_commits:
        return ev
    return dataclasses.replace(
        ev, checkpoint_events=settle_commit_times(ev.checkpoint_events, ev.writer_commits),
        writer_commits=[])


# 0 ------------------------------------------------------------------------------------------

def check_faults_injected(ev: RunEvidence) -> InvariantResult:
    """Not one of the six: a chaos run in which the faults did not happen proves nothing."""
    problems = [f"fault #{f.index} {f.kind.value} was not injected: {f.error or 'unknown'}"
                for f in ev.faults if f.required and not f.ok]
    injected = sum(1 for f in ev.faults if f.ok)
    if ev.faults and not injected:
        problems.append(f"none of the {len(ev.faults)} scheduled faults was injected")
    skipped = sum(1 for f in ev.faults if not f.required and not f.ok)
    return _result(0, "scheduled faults injected", problems,
                   f"{injected} of {len(ev.faults)} fault(s) injected"
                   + (f" ({skipped} drawn fault(s) refused, see the fault table)"
                      if skipped else ""),
                   measured={"injected": injected, "scheduled": len(ev.faults),
                             "refused_optional": skipped})


# 1 ------------------------------------------------------------------------------------------

def check_target(ev: RunEvidence) -> InvariantResult:
    problems = []
    hist = effective_history(ev.records)
    reached = max(hist, default=0)
    if reached < ev.target_step:
        problems.append(f"reached step {reached}, target is {ev.target_step}")
    if not ev.finished:
        ended = f"the job did not end by itself: {ev.finish_detail or 'unknown'}"
        # With no step logged, why it ended is all there is to say (a script that failed
        # at start, its error): first, where the summary line shows it.
        problems.insert(0 if reached == 0 else len(problems), ended)
    return _result(1, "target step reached", problems,
                   f"reached step {reached} of {ev.target_step}; {ev.finish_detail}",
                   measured={"reached_step": reached})


# 2 ------------------------------------------------------------------------------------------

def _same_final_layout(ev: RunEvidence) -> bool | None:
    """Did the run keep the reference's layout throughout? A run that changed layout and
    came back (scale down, then up) carries the float differences of the other layout's
    reductions: exactness can no longer be asked of it, only the tolerance."""
    if not ev.records or not ev.reference:
        return None
    ref = ev.reference[-1].layout_key
    return all(r.layout_key == ref for r in ev.records)


def check_weights(ev: RunEvidence) -> InvariantResult:
    tol = ev.tolerances
    same = _same_final_layout(ev)
    tolerance = (
        "bitwise" if same else f"rtol={tol.weights_rtol:g}, atol={tol.weights_atol:g}"
        " (the layout changed during the run)"
    )
    if not ev.compare_weights:
        return InvariantResult(2, "final state equals reference", True,
                               "not requested by the scenario (verify.compare_weights = false)",
                               tolerance="n/a")
    w = ev.weights
    if w is None or not w.compared:
        why = w.error if w is not None else "no comparison was made"
        return InvariantResult(2, "final state equals reference", False,
                               f"final state not compared: {why}", tolerance=tolerance)
    problems = [f"{k}: missing on one side or outside tolerance" for k in w.mismatched]
    if same and not w.bitwise_equal:
        problems += [f"{k}: not bitwise equal (same layout)" for k in w.not_bitwise]
        if not w.not_bitwise:
            problems.append("not bitwise equal (same layout)")
    if w.chaos_step != w.reference_step:
        problems.append(f"compared step {w.chaos_step} against reference step "
                        f"{w.reference_step}")
    measured = {"tensors": w.tensors, "bitwise_equal": w.bitwise_equal,
                "max_abs_diff": w.max_abs_diff, "max_rel_diff": w.max_rel_diff,
                "same_layout": same}
    how = "bitwise equal" if w.bitwise_equal else (
        f"max abs diff {w.max_abs_diff:.3g}, max rel diff {w.max_rel_diff:.3g}")
    return _result(2, "final state equals reference", problems,
                   f"{w.tensors} tensors at step {w.chaos_step}: {how}",
                   tolerance=tolerance, measured=measured)


# 3 ------------------------------------------------------------------------------------------

def _valid_at(events: Sequence[CheckpointEvent], step: int, t: float) -> tuple[bool, str]:
    """Was checkpoint `step` committed, and not damaged since, at time `t`? A commit's time
    is one it is known committed by (`settle_commit_times`), so a commit dated after `t`
    is not counted: nothing shows it came first."""
    later = [e.time - t for e in events if e.step == step and e.kind == "commit"
             and e.time > t]
    state, why = False, (f"step {step} was never committed before the restore" + (
        f" (first known committed {min(later):.3f} s after the restore began)" if later else
        " (no commit of it at all)"))
    for e in sorted(events, key=lambda e: e.time):
        if e.step != step or e.time > t:
            continue
        if e.kind == "commit":
            state, why = True, ""
        elif e.kind == "damage":
            state, why = False, f"step {step} was damaged on purpose before the restore"
    return state, why


def check_checkpoints(ev: RunEvidence) -> InvariantResult:
    problems = []
    damaged_last: dict[int, float] = {}
    committed_last: dict[int, float] = {}
    for e in ev.checkpoint_events:
        target = damaged_last if e.kind == "damage" else committed_last
        target[e.step] = max(target.get(e.step, -math.inf), e.time)
    detected = 0
    for step, err in sorted(ev.verified.items()):
        damaged = damaged_last.get(step, -math.inf) > committed_last.get(step, -math.inf)
        if damaged:
            if err is None:
                problems.append(f"checkpoint {step} was damaged on purpose but still verifies")
            else:
                detected += 1
        elif err is not None:
            problems.append(f"committed checkpoint {step} does not verify: {err}")
    restores = 0
    for att in split_attempts(ev.records):
        r = att.restored_step
        if r is None:
            continue
        restores += 1
        # When the restore began: a checkpoint damaged later (while the restore read it, or
        # while the new group ran its first step) may have been read intact.
        t = att.first.restore_started_at or att.start_time
        if t is None:
            problems.append(f"attempt {att.index} has no time; cannot check its restore")
            continue
        ok, why = _valid_at(ev.checkpoint_events, r, t)
        if not ok:
            problems.append(f"attempt {att.index} (from line {att.first.line}) restored "
                            f"step {r}: {why}")
    n = len(ev.verified)
    return _result(3, "committed checkpoints verify, only committed ones load", problems,
                   f"{n - detected} committed checkpoint(s) verify, {detected} damaged one(s) "
                   f"detected, {restores} restore(s) all from valid commits",
                   measured={"verified": n, "damaged_detected": detected, "restores": restores})


# 4 ------------------------------------------------------------------------------------------

def _persist_bound_s(ev: RunEvidence) -> float:
    """Twice the longest save the run was seen to complete (its step's record -> its
    commit observed): how long a save may legitimately still be persisting."""
    begun = {r.step: r.time for r in ev.records if r.time is not None}
    spans = [e.time - begun[e.step] for e in ev.checkpoint_events
             if e.kind == "commit" and e.step in begun and e.time >= begun[e.step]]
    return 2 * max(spans, default=0.0)


def _save_in_flight(att: Attempt, ev: RunEvidence, t: float, bound_s: float) -> bool:
    """Whether the newest save the group `att` began before time `t` (at a step that is a
    multiple of the interval) was still persisting then: begun less than `bound_s`
    before, and not seen committed by `t`. A save older than that which never committed
    is not excused: nothing explains it."""
    begun = [r for r in att.records
             if r.step % ev.interval == 0 and r.time is not None and r.time <= t]
    if not begun or t - begun[-1].time > bound_s:
        return False
    return not any(e.kind == "commit" and e.step == begun[-1].step and e.time <= t
                   for e in ev.checkpoint_events)


def check_lost_work(ev: RunEvidence) -> InvariantResult:
    problems = []
    lost_per_resume: list[dict[str, Any]] = []
    attempts = split_attempts(ev.records)
    persist_bound = _persist_bound_s(ev)
    high = 0  # highest step ever done or committed: no resume may restore beyond it
    prev_start = -math.inf
    for att in attempts:
        if att.index > 0:
            r = att.restored_step or 0
            start = att.start_time if att.start_time is not None else math.inf
            commits = [e.step for e in ev.checkpoint_events
                       if e.kind == "commit" and e.time <= start]
            high = max([high, *commits])
            # What this interruption cost: from the work of the group it stopped (its last
            # step, or a later one whose checkpoint committed, the kill taking its log line)
            # or the newest checkpoint still intact, back to the restored step. Work an
            # earlier interruption already lost is not charged again: after a damaged
            # checkpoint sent one resume a save back, the next may go back as far.
            damaged = {e.step for e in ev.checkpoint_events
                       if e.kind == "damage" and e.time <= start}
            done = max([attempts[att.index - 1].last.step,
                        *(e.step for e in ev.checkpoint_events
                          if e.kind == "commit" and e.time <= start
                          and (e.time > prev_start or e.step not in damaged))])
            attacks = [f for f in ev.faults if f.ok and f.kind in CHECKPOINT_ATTACKS
                       and prev_start < f.time <= start]
            # Any other fault that landed while a save was persisting (its step done and
            # the save begun, the commit not yet seen) loses that save with the killed
            # ranks' unwritten shards, as a kill_during_persist would.
            attacks += [f for f in ev.faults if f.ok and f.kind not in CHECKPOINT_ATTACKS
                        and prev_start < f.time <= start
                        and _save_in_flight(attempts[att.index - 1], ev, f.time,
                                            persist_bound)][:1]
            allowed = ev.interval + 1 + ev.interval * len(attacks)
            lost = done - r
            lost_per_resume.append({"attempt": att.index, "restored_step": r,
                                    "highest_step_before": done, "lost_steps": lost,
                                    "allowed": allowed})
            if lost > allowed:
                problems.append(
                    f"attempt {att.index} resumed from step {r} after step {done} was done: "
                    f"{lost} steps lost > allowed {allowed} (interval {ev.interval} + 1"
                    f"{f' + {len(attacks)} checkpoint-destroying fault(s)' if attacks else ''})"
                )
            if r > high:
                problems.append(f"attempt {att.index} restored step {r}, beyond the highest "
                                f"step ever done or committed ({high})")
        prev_start = att.start_time if att.start_time is not None else prev_start
        high = max(high, att.last.step)
    worst = max((x["lost_steps"] for x in lost_per_resume), default=0)
    return _result(4, "work lost per fault bounded", problems,
                   f"{len(lost_per_resume)} resume(s), at most {worst} step(s) lost",
                   tolerance=f"<= interval ({ev.interval}) + 1 per resume, + one interval per "
                             "checkpoint-destroying fault (or fault landing while a save "
                             "persisted)",
                   measured={"resumes": lost_per_resume, "max_lost": worst})


# 5 ------------------------------------------------------------------------------------------

def _layout_changed_flags(ev: RunEvidence) -> list[bool]:
    """For each record: has any attempt up to its own run under a layout other than the
    reference's at the same step? (After that, exact equality can no longer be expected.)"""
    ref_key = ev.reference[0].layout_key if ev.reference else None
    ref_keys = {r.step: r.layout_key for r in ev.reference or ()}
    changed = False
    flags = []
    for rec in ev.records:
        if rec.layout_key != ref_keys.get(rec.step, ref_key):
            changed = True
        flags.append(changed)
    return flags


def check_loss_curve(ev: RunEvidence) -> InvariantResult:
    tol = ev.tolerances.loss_rtol
    if ev.reference is None:
        return InvariantResult(5, "loss curve continues the reference", False,
                               "no reference run: cannot check the loss curve",
                               tolerance=f"exact / rtol={tol:g}")
    ref = {r.step: r.loss for r in ev.reference}
    problems = []
    if not ev.records:
        problems.append("the run logged no step: nothing continues the reference")
    if not ev.reference:
        problems.append("the reference run logged no step")
    worst_exact, worst_tol, n_exact, n_tol = 0.0, 0.0, 0, 0
    for rec, changed in zip(ev.records, _layout_changed_flags(ev), strict=True):
        if rec.step not in ref:
            problems.append(f"line {rec.line}: step {rec.step} not in the reference run")
            continue
        d = rel_diff(rec.loss, ref[rec.step])
        if changed:
            n_tol += 1
            worst_tol = max(worst_tol, d)
            if d > tol:
                problems.append(f"line {rec.line}: step {rec.step} loss {rec.loss!r} vs "
                                f"reference {ref[rec.step]!r} (rel {d:.3g} > {tol:g}, "
                                "after a layout change)")
        else:
            n_exact += 1
            worst_exact = max(worst_exact, d)
            if rec.loss != ref[rec.step]:
                problems.append(f"line {rec.line}: step {rec.step} loss {rec.loss!r} != "
                                f"reference {ref[rec.step]!r} (same layout: must be exact)")
    return _result(
        5, "loss curve continues the reference", problems,
        f"{n_exact} step(s) exactly equal, {n_tol} after a layout change within rtol "
        f"(max {worst_tol:.3g})",
        tolerance=f"exact on the reference layout; rtol={tol:g} after a layout change",
        measured={"exact_steps": n_exact, "tolerance_steps": n_tol,
                  "max_rel_diff_exact": worst_exact, "max_rel_diff_after_change": worst_tol},
    )


# 6 ------------------------------------------------------------------------------------------

def _batch(records: Sequence[StepRecord]) -> int | None:
    hist = effective_history(records)
    for s, rec in hist.items():
        nxt = hist.get(s + 1)
        if nxt and rec.data_position is not None and nxt.data_position is not None:
            return nxt.data_position - rec.data_position
    return None


def check_data(ev: RunEvidence) -> InvariantResult:
    problems = []
    ref_pos = {r.step: r.data_position for r in ev.reference} if ev.reference else {}
    if not ev.records:
        problems.append("the run logged no step: no data position to check")
    if ev.reference is not None and not ev.reference:
        problems.append("the reference run logged no step: no data position to compare")
    missing = [r.line for r in ev.records if r.data_position is None]
    if missing:
        problems.append(f"{len(missing)} record(s) without data_position (first at line "
                        f"{missing[0]}): the data position cannot be checked")
    for rec in ev.records:
        want = ref_pos.get(rec.step)
        if want is not None and rec.data_position is not None and rec.data_position != want:
            kind = "skipped" if rec.data_position > want else "re-consumed"
            problems.append(f"line {rec.line}: step {rec.step} read from sample "
                            f"{rec.data_position}, reference from {want} ({kind} "
                            f"{abs(rec.data_position - want)} sample(s))")
    for att in split_attempts(ev.records)[1:]:
        r = att.restored_step or 0
        if att.first.step != r + 1:
            problems.append(f"attempt {att.index} restored step {r} but its first step is "
                            f"{att.first.step}, not {r + 1}")
    hist = effective_history(ev.records)
    steps = list(hist)
    committed = {e.step for e in ev.checkpoint_events if e.kind == "commit"}
    unlogged: list[int] = []
    if steps and steps != list(range(steps[0], steps[0] + len(steps))):
        gaps = sorted(set(range(steps[0], steps[-1] + 1)) - set(steps))
        # A step with a committed checkpoint was completed: its line was lost to a kill
        # between the save and the log write. The next step's position is still checked.
        unlogged = [g for g in gaps if g in committed]
        gaps = [g for g in gaps if g not in committed]
        if gaps:
            problems.append(f"steps never completed: {gaps[:10]}")
    if steps and steps[0] != 1:
        problems.append(f"history starts at step {steps[0]}, not 1")
    batch = _batch(ev.reference) if ev.reference else _batch(ev.records)
    if batch is not None and batch <= 0:
        problems.append(f"data position does not advance (batch {batch})")
    elif batch is not None:
        for s in steps[1:]:
            if s - 1 not in hist:
                continue  # a gap, reported above
            a, b = hist[s - 1].data_position, hist[s].data_position
            if a is not None and b is not None and b - a != batch:
                problems.append(f"step {s} starts at sample {b}, step {s - 1} at {a}: "
                                f"expected +{batch}")
    note = (f" ({len(unlogged)} committed step(s) without a log line: {unlogged[:5]})"
            if unlogged else "")
    against = "matching the reference" if ev.reference else "(no reference run to match)"
    return _result(6, "no sample consumed twice or skipped", problems,
                   f"{len(steps)} steps x {batch} samples, contiguous, {against}" + note,
                   measured={"samples_per_step": batch, "steps": len(steps),
                             "unlogged_committed_steps": unlogged})


# 7 ------------------------------------------------------------------------------------------

def check_restore_tiers(ev: RunEvidence) -> InvariantResult:
    """Every resume's first record says how many data bytes each tier served its restore;
    the persistent store's share must stay within the bound."""
    limit = ev.max_restore_persistent_bytes
    problems, served = [], []
    for att in split_attempts(ev.records):
        if att.restored_step is None:
            continue
        tiers = att.first.restore_tier_bytes
        where = f"the resume at step {att.first.step} (metrics line {att.first.line})"
        if tiers is None:
            problems.append(f"{where} restored step {att.restored_step} but logged no "
                            "restore_tier_bytes (checkpoint tiers off?)")
            continue
        served.append(tiers)
        persistent = tiers.get("persistent", 0)
        if persistent > limit:
            problems.append(f"{where} read {persistent} data bytes of step "
                            f"{att.restored_step} from the persistent store (allowed "
                            f"{limit}; tiers served {tiers})")
    if not served and not problems:
        problems.append("no resume happened: the tiers were never exercised")
    total = {k: sum(t.get(k, 0) for t in served) for k in ("local", "peer", "persistent")}
    return _result(7, "restores from memory", problems,
                   f"{len(served)} restore(s) read {total['persistent']} data bytes from the "
                   f"persistent store (local tier {total['local']}, peers {total['peer']})",
                   tolerance=f"<= {limit} persistent data bytes per restore",
                   measured={"restores": len(served), **{f"{k}_bytes": v
                                                         for k, v in total.items()}})


# 8-11: replica groups ----------------------------------------------------------------------

WORKER_FAULTS = frozenset({FaultKind.KILL_WORKER, FaultKind.STOP_WORKER,
                           FaultKind.KILL_DURING_PERSIST,
                           FaultKind.KILL_COORDINATOR_BEFORE_COMMIT})
"""Faults aimed at one worker: that worker's agent restarts its group (only that one)."""


def check_survivors_never_restart(ev: RunEvidence) -> InvariantResult:
    problems = []
    hits: dict[int, int] = {}
    for f in ev.faults:
        if f.ok and f.node is not None and f.kind in WORKER_FAULTS:
            hits[f.node] = hits.get(f.node, 0) + 1
    if not ev.worker_starts:
        problems.append("the harness saw no worker process: nothing to count")
    for node, starts in sorted(ev.worker_starts.items()):
        allowed = ev.ranks_per_node * (1 + hits.get(node, 0))
        if starts > allowed:
            problems.append(f"node {node}: {starts} worker starts > {allowed} "
                            f"({ev.ranks_per_node} rank(s) x (1 + {hits.get(node, 0)} "
                            "fault(s) aimed at its own workers))")
    untouched = [n for n in ev.worker_starts if n not in hits]
    return _result(8, "survivors never restart", problems,
                   f"{len(ev.worker_starts)} node(s), {len(untouched)} never hit; worker "
                   f"starts {ev.worker_starts}",
                   tolerance="ranks per node x (1 + faults aimed at the node's workers)",
                   measured={"worker_starts": ev.worker_starts, "hit": hits})


def replica_lineages(records: Sequence[StepRecord]) -> dict[tuple[str, int], int]:
    """Which run of the job each group's attempt belongs to: attempts (a group's
    contiguous steps after one start, `split_attempts`) that trained in a common quorum
    are one lineage. When every replica is lost, the groups that start again (from a
    storage checkpoint, or from scratch) form new quorums and a new lineage, whose
    steps legitimately differ from the lost one's. Maps (group, attempt index) to a
    lineage number."""
    parent: dict[tuple[str, int], tuple[str, int]] = {}

    def find(x: tuple[str, int]) -> tuple[str, int]:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    first_in_quorum: dict[int, tuple[str, int]] = {}
    for group, recs in by_group(records).items():
        for att in split_attempts(recs):
            key = (group, att.index)
            parent.setdefault(key, key)
            for rec in att.records:
                if rec.quorum is None:
                    continue
                other = first_in_quorum.setdefault(rec.quorum, key)
                parent[find(key)] = find(other)
    roots: dict[tuple[str, int], int] = {}
    return {k: roots.setdefault(find(k), len(roots)) for k in parent}


def check_replicas_identical(ev: RunEvidence) -> InvariantResult:
    problems = []
    lineage = replica_lineages(ev.records)
    by_step: dict[tuple[int, int], dict[str, StepRecord]] = {}
    for group, recs in by_group(ev.records).items():
        for att in split_attempts(recs):
            for rec in att.records:
                if rec.state_crc is not None and rec.replica_group is not None:
                    at = (lineage[(group, att.index)], rec.step)
                    by_step.setdefault(at, {})[rec.replica_group] = rec
    compared = 0
    lineages = {line for line, _ in by_step}
    for (line, step), recs in sorted(by_step.items()):
        if len(recs) < 2:
            continue
        compared += 1
        # Shard digests compare between groups of one layout; groups of different
        # layouts (a mixed quorum) compare their whole parameters' digests.
        shards: dict[str | None, dict[str, tuple[int, ...]]] = {}
        for g, rec in recs.items():
            shards.setdefault(rec.layout, {})[g] = rec.state_crc
        whole = {g: rec.params_crc for g, rec in recs.items() if rec.params_crc is not None}
        where = f" (run {line} of the job: every replica was lost before it)" if line else ""
        for crcs in shards.values():
            if len(set(crcs.values())) > 1:
                problems.append(f"step {step}{where}: groups disagree on their state: {crcs}")
        if len(set(whole.values())) > 1:
            problems.append(f"step {step}{where}: groups of different layouts disagree on "
                            f"their whole parameters: {whole}")
        if len(shards) > 1 and len(whole) < len(recs):
            problems.append(f"step {step}{where}: groups of different layouts logged no "
                            "whole-parameter digest (params_crc) to compare")
    if not compared:
        problems.append("no step was logged with a state digest by two groups: replica "
                        "state was never compared (replica.digest_every = 0?)")
    runs = f" in {len(lineages)} runs of the job" if len(lineages) > 1 else ""
    return _result(9, "replicas bitwise identical", problems,
                   f"{compared} step(s) compared across groups{runs}, every digest equal",
                   tolerance="bitwise (crc32c of every rank's parameter shards; of the whole "
                             "parameters between groups of different layouts)",
                   measured={"steps_compared": compared})


def _group_attempts(ev: RunEvidence) -> list[tuple[str, Attempt]]:
    """Each group's runs: its records cut where a new worker group started (as
    `split_attempts` cuts) or where it healed in (a restarted group that rejoins at the
    step after its last one looks contiguous otherwise)."""
    out: list[tuple[str, Attempt]] = []
    for g, recs in sorted(by_group(ev.records).items()):
        run: list[StepRecord] = []
        for rec in recs:
            if run and rec.healed_bytes:
                out += [(g, a) for a in split_attempts(run)]
                run = []
            run.append(rec)
        out += [(g, a) for a in split_attempts(run)]
    return out


def check_heals_read_no_storage(ev: RunEvidence) -> InvariantResult:
    problems = []
    heals = [r.healed_bytes for r in ev.records if r.healed_bytes]
    healed = sum(heals)
    attempts = _group_attempts(ev)
    for g, att in attempts:
        first = att.first
        if first.restored_step is None or first.time is None:
            continue
        begun = first.restore_started_at or first.time
        # A group trained while this one restored if one of its runs had logged a step
        # before the restore began and logged one during it. Groups that restored
        # together when every replica was lost (none had a step logged yet) are peers,
        # not sources this one should have healed from.
        live = sorted({o for o, other in attempts if o != g
                       and other.first.time is not None and other.first.time < begun
                       and any(r.time is not None and begun <= r.time <= first.time
                               for r in other.records)})
        if live:
            problems.append(f"group {g} restored step {first.restored_step} from storage "
                            f"(line {first.line}) while {live} trained: it should have "
                            "healed from them")
    # The check is about groups that joined while another trained; in a run with none
    # (no fault, or every replica lost and the job restarted with nobody training) it
    # holds with nothing to check, and says so rather than passing as if heals were seen.
    vacuous = not heals and not problems
    summary = ("no group (re)joined while another group trained: no heal was due, "
               "nothing to check" if vacuous else
               f"{len(heals)} heal(s) from live groups, {healed} bytes received")
    return _result(10, "heals read no storage", problems, summary,
                   measured={"heals": len(heals), "healed_bytes": healed,
                             "vacuous": vacuous})


def check_survivor_work_lost(ev: RunEvidence) -> InvariantResult:
    problems = []
    for g, recs in sorted(by_group(ev.records).items()):
        for a, b in zip(recs, recs[1:], strict=False):
            resumed = b.restored_step is not None and b.step == b.restored_step + 1 and (
                b.restored_step != a.restored_step or b.step <= a.step)
            if b.step == a.step + 1 or resumed or (b.step > a.step and b.healed_bytes):
                continue
            what = "repeated" if b.step <= a.step else "skipped"
            problems.append(f"group {g} logged step {b.step} after step {a.step} (line "
                            f"{b.line}): steps {what} without a heal or a resume")
    worst = 0
    prev: dict[str, float] = {}
    for g, att in _group_attempts(ev):
        # A run's abandoned steps count from its process start: a restarted group's
        # join attempts follow the fault that restarted it, after its last record.
        t0, t1 = prev.get(g, -math.inf), att.last.time
        prev[g] = t1 if t1 is not None else t0
        faults = sum(1 for f in ev.faults if f.ok and t1 is not None and t0 <= f.time <= t1)
        abandoned = att.last.abandoned_steps or 0
        worst = max(worst, abandoned)
        if abandoned > faults:
            problems.append(f"group {g} (steps {att.first.step}-{att.last.step}) abandoned "
                            f"{abandoned} step(s) through {faults} fault(s)")
    return _result(11, "survivors lose at most the step in flight", problems,
                   f"every group's steps contiguous; at most {worst} step(s) abandoned by "
                   "one group's run",
                   tolerance="<= 1 abandoned step per fault during the group's run",
                   measured={"max_abandoned": worst})


def verify(ev: RunEvidence) -> list[InvariantResult]:
    """The faults-injected check, then the six invariants in order (and check 7 when the
    scenario bounds what restores read from the persistent store; 8-11 with replica
    groups, whose checks 1-7 read the job's history: each step once)."""
    ev = _with_writer_commits(ev)
    if ev.replica_groups:
        job = dataclasses.replace(ev, records=job_history(ev.records), replica_groups=False)
        return [*verify(job), check_survivors_never_restart(ev), check_replicas_identical(ev),
                check_heals_read_no_storage(ev), check_survivor_work_lost(ev)]
    results = [
        check_faults_injected(ev),
        check_target(ev),
        check_weights(ev),
        check_checkpoints(ev),
        check_lost_work(ev),
        check_loss_curve(ev),
        check_data(ev),
    ]
    if ev.max_restore_persistent_bytes >= 0:
        results.append(check_restore_tiers(ev))
    return results
