"""`relight chaos check-script`: run a training script a few steps without faults, stop it,
resume it, and say which parts of the contract (docs/chaos.md) it misses.

Three short launches on one node, through the same machinery as a chaos run (`relight
run`, warm starts, the same environment, arguments and working directory):

1. **first**: from nothing to step `t1` (one more than a multiple of the checkpoint
   interval plus a few, so the target step is not a save step: a script that saves only
   at multiples of the interval shows here);
2. **resumed**: the same store, target `t2 = t1 + interval`: it must restore `t1` and
   continue at `t1 + 1`;
3. **reference**: a fresh store straight to `t2`.

The findings come from the records and the store: the metrics fields, the steps logged,
the commits (every interval and the target step), the resume, and the chaos verifier's
own checks (final state, loss curve and data positions equal to the reference's), plus
warnings for what makes a chaos run weaker (steps too fast for step-triggered faults, no
`time` field, no commit lines in the log).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relight.chaos.ckpt_probe import CheckpointProbe, compare_final_states
from relight.chaos.logs import StepRecord
from relight.chaos.runner import RunOutcome, launch
from relight.chaos.scenario import ClusterSpec, Scenario
from relight.chaos.verifier import RunEvidence, Tolerances, WeightsComparison, verify
from relight.elastic.etcd_server import EtcdServer
from relight.storage import open_store

__all__ = ["Finding", "check_script", "check_steps"]

REQUIRED_FIELDS = ("step", "loss", "data_position", "restored_step")
FAST_STEP_S = 0.2
"""The harness reads the metrics every 0.2 s: a step-triggered fault lands up to that
late, so steps faster than this let the run race past its faults."""
LAUNCH_DEADLINE_S = 180.0
RUN_DIRS = ("first", "resumed", "reference", "ckpt", "ckpt-reference")
"""What a check writes under its output directory (and removes there before it starts)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One point of the contract: `ok`, `missing` (the chaos run would fail or prove
    less than it says) or `warn` (it would work, less well)."""

    level: str
    point: str
    detail: str = ""

    def line(self) -> str:
        tag = {"ok": "ok", "missing": "MISSING", "warn": "warn"}[self.level]
        return f"  [{tag}] {self.point}" + (f": {self.detail}" if self.detail else "")


def check_steps(interval: int) -> tuple[int, int]:
    """(t1, t2): the first run's target, off the interval's multiples when the interval
    allows, and the resumed run's, one interval further."""
    t1 = interval + max(1, interval // 2) if interval > 1 else 2
    return t1, t1 + interval


def check_script(scenario: Scenario, out: Path, nproc: int) -> list[Finding]:
    """Run the three launches of `scenario`'s training on one node of `nproc` ranks
    under `out` and return the findings, in the contract's order."""
    t1, t2 = check_steps(scenario.checkpoint.interval)
    out.mkdir(parents=True, exist_ok=True)
    for name in RUN_DIRS:  # a previous check's metrics and checkpoints would be resumed
        shutil.rmtree(out / name, ignore_errors=True)
    data = Path(tempfile.mkdtemp(prefix="relight-check-etcd-"))
    etcd = EtcdServer(data / "data", log_path=out / "etcd.log")
    try:
        etcd.start()
        store, ref_store = str(out / "ckpt"), str(out / "ckpt-reference")
        first = _launch(scenario, nproc, t1, out / "first", store, etcd)
        findings = _first_run(first, out / "first", scenario.checkpoint.interval, t1)
        if not first.finished or not first.records:
            return findings
        resumed = _launch(scenario, nproc, t2, out / "resumed", store, etcd)
        findings += _resumed_run(resumed, t1)
        if not resumed.finished:
            return findings
        reference = _launch(scenario, nproc, t2, out / "reference", ref_store, etcd)
        if not reference.finished:
            return [*findings, Finding("missing", "a fresh run to the resumed run's target "
                                       "finishes", reference.detail)]
        findings += _against_reference(scenario, first, resumed, reference, store, ref_store,
                                       t2)
        return findings + _warnings(first, out / "first")
    finally:
        etcd.stop()
        shutil.rmtree(data, ignore_errors=True)


def _one_node(scenario: Scenario, nproc: int, target: int) -> Scenario:
    """`scenario`'s training on one node of `nproc` ranks to `target`, no faults, no
    restarts (a script that fails fails at once)."""
    cluster = ClusterSpec(nodes=1, ranks_per_node=nproc, min_nodes=1, max_nodes=1,
                          max_restarts=0)
    return dataclasses.replace(scenario, target_step=target, cluster=cluster, faults=(),
                               mtbf=dataclasses.replace(scenario.mtbf, count=0))


def _launch(scenario: Scenario, nproc: int, target: int, run_dir: Path, store: str,
            etcd: EtcdServer) -> RunOutcome:
    return launch(_one_node(scenario, nproc, target), run_dir, etcd, store,
                  f"check-{run_dir.name}", {}, faults=False, deadline_s=LAUNCH_DEADLINE_S,
                  seed=0)


def _raw_lines(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def _committed(outcome: RunOutcome) -> set[int]:
    """Steps seen committed during a launch (the probe's sightings, the writers' lines)."""
    return ({e.step for e in outcome.checkpoint_events if e.kind == "commit"}
            | {c.step for c in outcome.writer_commits})


def _first_run(first: RunOutcome, run_dir: Path, interval: int, t1: int) -> list[Finding]:
    if not first.finished:
        return [Finding("missing", "the script runs and exits 0", first.detail)]
    out = [Finding("ok", "the script runs and exits 0",
                   f"{t1} steps in {first.ended_at - first.started_at:.1f} s")]
    out.append(_metrics_fields(_raw_lines(run_dir)))
    steps = [r.step for r in first.records]
    out.append(Finding("ok", "one metrics line per step, 1 to RELIGHT_TARGET_STEP")
               if steps == list(range(1, t1 + 1)) else
               Finding("missing", "one metrics line per step, 1 to RELIGHT_TARGET_STEP",
                       f"logged steps {_span(steps)} for a target of {t1}"))
    fresh = [r.step for r in first.records if r.restored_step is not None]
    out.append(Finding("ok", "a fresh start logs restored_step null") if not fresh else
               Finding("missing", "a fresh start logs restored_step null",
                       f"steps {_span(fresh)} say they restored a checkpoint"))
    out += _saves(_committed(first), interval, t1)
    return out


def _metrics_fields(lines: list[dict[str, Any]]) -> Finding:
    point = "metrics lines hold " + ", ".join(REQUIRED_FIELDS)
    if not lines:
        return Finding("missing", point, "no JSON object in RELIGHT_METRICS_PATH")
    lacking = sorted({k for obj in lines for k in REQUIRED_FIELDS if k not in obj})
    if lacking:
        return Finding("missing", point, f"lines without {', '.join(lacking)}")
    return Finding("ok", point)


def _saves(committed: set[int], interval: int, t1: int) -> list[Finding]:
    every = {s for s in range(interval, t1 + 1, interval)}
    out = [Finding("ok", f"a checkpoint at the target step ({t1})") if t1 in committed else
           Finding("missing", f"a checkpoint at the target step ({t1})",
                   "the chaos run compares the final state at exactly the target step: "
                   "save when step == RELIGHT_TARGET_STEP too, and wait for it "
                   "(manager.wait()) before exiting")]
    seen = every & committed
    if seen == every:
        out.append(Finding("ok", "a checkpoint every RELIGHT_CKPT_INTERVAL steps",
                           f"steps {sorted(every)}"))
    else:
        level = "missing" if not seen else "warn"
        out.append(Finding(level, "a checkpoint every RELIGHT_CKPT_INTERVAL steps",
                           f"steps {sorted(every - seen)} not seen committed (of "
                           f"{sorted(every)}; a save deleted by retention before the "
                           "harness looked counts only if the log has ckpt's INFO lines)"))
    return out


def _resumed_run(resumed: RunOutcome, t1: int) -> list[Finding]:
    point = f"a restart restores the newest checkpoint ({t1}) and continues at step {t1 + 1}"
    if not resumed.finished or not resumed.records:
        return [Finding("missing", point, resumed.detail)]
    head = resumed.records[0]
    if head.restored_step != t1 or head.step != t1 + 1:
        return [Finding("missing", point, f"its first line: step {head.step}, restored_step "
                        f"{head.restored_step}")]
    return [Finding("ok", point)]


def _against_reference(scenario: Scenario, first: RunOutcome, resumed: RunOutcome,
                       reference: RunOutcome, store: str, ref_store: str, t2: int
                       ) -> list[Finding]:
    """The chaos verifier's checks on first + resumed against the reference."""
    records = _renumbered(first.records + resumed.records)
    probe = CheckpointProbe(open_store(store))
    v = scenario.verify
    try:
        weights = compare_final_states(
            probe.read_state(t2), CheckpointProbe(open_store(ref_store)).read_state(t2),
            rtol=v.weights_rtol, atol=v.weights_atol, chaos_step=t2, ref_step=t2)
    except LookupError as exc:
        weights = WeightsComparison(compared=False, error=str(exc))
    evidence = RunEvidence(
        records=records, target_step=t2, interval=scenario.checkpoint.interval,
        finished=True, reference=reference.records,
        checkpoint_events=first.checkpoint_events + resumed.checkpoint_events,
        verified=probe.verify_all(), weights=weights,
        tolerances=Tolerances(loss_rtol=v.loss_rtol, weights_rtol=v.weights_rtol,
                              weights_atol=v.weights_atol),
        writer_commits=first.writer_commits + resumed.writer_commits)
    names = {2: "the resumed run's final state equals a fresh run's",
             3: "every committed checkpoint verifies; restores load committed ones",
             5: "the resumed run's losses equal a fresh run's",
             6: "the resumed run reads the samples a fresh run reads (data position)"}
    return [Finding("ok" if r.ok else "missing", names[r.number],
                    "" if r.ok else r.summary)
            for r in verify(evidence) if r.number in names]


def _renumbered(records: list[StepRecord]) -> list[StepRecord]:
    return [dataclasses.replace(r, line=i) for i, r in enumerate(records, start=1)]


def _warnings(first: RunOutcome, run_dir: Path) -> list[Finding]:
    out = []
    times = [r.time for r in first.records if r.time is not None]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    if gaps and statistics.median(gaps) < FAST_STEP_S:
        out.append(Finding("warn", "steps long enough for step-triggered faults",
                           f"median step {statistics.median(gaps):.3f} s: the harness reads "
                           f"the metrics every {FAST_STEP_S} s, so a fault at_step N lands "
                           "steps later, or after the run; pad each step (sleep) to "
                           "0.25 s or more in chaos runs"))
    if any("time" not in obj for obj in _raw_lines(run_dir)):
        out.append(Finding("warn", "metrics lines hold `time`",
                           "without it a step is dated when the harness saw it (±0.2 s)"))
    if not first.writer_commits:
        out.append(Finding("warn", "ckpt's commit lines in the log",
                           "configure logging at INFO with %(asctime)s (logging.basicConfig"
                           "(level=logging.INFO)): commit times then come from the writer, "
                           "not from a listing every 0.5 s"))
    return out


def _span(steps: list[int]) -> str:
    if not steps:
        return "none"
    return f"{steps[0]}..{steps[-1]} ({len(steps)} lines)" if len(steps) > 3 else str(steps)
