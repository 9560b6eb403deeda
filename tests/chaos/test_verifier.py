"""The verifier against synthetic runs: correct resumes pass, and each kind of broken resume
(older state than claimed, skipped data, an uncommitted or damaged checkpoint loaded, too
much work lost, target missed, final state off) fails the invariant that guards it."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from relight.chaos.faults import FaultKind
from relight.chaos.logs import parse_metrics, split_attempts
from relight.chaos.verifier import (
    CheckpointEvent,
    FaultMark,
    RunEvidence,
    StepRecord,
    WeightsComparison,
    WriterCommit,
    settle_commit_times,
    verify,
)

BATCH = 16
TARGET = 20
INTERVAL = 5


def ref_loss(step: int, ws: int = 4) -> float:
    # A deterministic, decreasing curve; a different world size perturbs it slightly, as a
    # different reduction order would.
    base = 4.0 * math.exp(-step / 10.0) + 0.5
    return base if ws == 4 else base * (1 + 1e-6 * step)


def rec(step: int, t: float, restored: int | None = None, ws: int = 4,
        loss: float | None = None, pos: int | None = None) -> StepRecord:
    return StepRecord(
        step=step,
        loss=ref_loss(step, ws) if loss is None else loss,
        data_position=(step - 1) * BATCH if pos is None else pos,
        restored_step=restored,
        world_size=ws,
        layout=f"dp{ws}",
        time=t,
        step_time_s=0.5,
    )


def reference() -> list[StepRecord]:
    return [rec(s, float(s)) for s in range(1, TARGET + 1)]


def same_weights() -> WeightsComparison:
    return WeightsComparison(compared=True, tensors=10, bitwise_equal=True,
                             chaos_step=TARGET, reference_step=TARGET)


def simulate(kills: list[float], ws_after: int = 4, lose: frozenset[int] = frozenset()
             ) -> RunEvidence:
    """A correct run: one step per second of work; at each kill time the group dies, 3 s
    later a new group restores the newest commit (committed 0.3 s after its step)."""
    records: list[StepRecord] = []
    events: list[CheckpointEvent] = []
    t, step, restored, ws = 0.0, 0, None, 4
    kills = sorted(kills)
    fired: list[float] = []
    while step < TARGET:
        t += 1.0
        if kills and t > kills[0]:
            kill = kills.pop(0)
            fired.append(kill)
            committed = [e.step for e in events if e.time <= kill]
            restored = max(committed) if committed else None
            step = restored or 0
            t = kill + 3.0
            ws = ws_after
            continue
        step += 1
        records.append(rec(step, t, restored, ws))
        if step % INTERVAL == 0 and step not in lose:
            events.append(CheckpointEvent(step, t + 0.3, "commit"))
    return RunEvidence(
        records=records, target_step=TARGET, interval=INTERVAL, finished=True,
        finish_detail="all agents exited 0", reference=reference(), checkpoint_events=events,
        verified={e.step: None for e in events},
        faults=[FaultMark(i, FaultKind.KILL_WORKER, k) for i, k in enumerate(fired)],
        weights=same_weights(),
    )


def failing(ev: RunEvidence) -> set[int]:
    return {r.number for r in verify(ev) if not r.ok}


# correct runs -------------------------------------------------------------------------------

def test_uninterrupted_run_passes() -> None:
    assert failing(simulate([])) == set()


def test_resume_after_kill_passes() -> None:
    ev = simulate([8.5])
    assert len(split_attempts(ev.records)) == 2
    assert failing(ev) == set()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=0.5, max_value=40.0), max_size=4))
def test_any_correct_kill_sequence_passes(kills: list[float]) -> None:
    assert failing(simulate(kills)) == set()


def test_layout_change_within_tolerance_passes() -> None:
    ev = simulate([12.5], ws_after=2)
    ev.weights = WeightsComparison(compared=True, tensors=10, bitwise_equal=False,
                                   max_abs_diff=1e-7, max_rel_diff=1e-6,
                                   chaos_step=TARGET, reference_step=TARGET)
    assert failing(ev) == set()


# broken runs --------------------------------------------------------------------------------

def _resumed_records(ev: RunEvidence, fn) -> RunEvidence:
    atts = split_attempts(ev.records)
    assert len(atts) >= 2
    first = set(id(r) for r in atts[0].records)
    return replace(ev, records=[r if id(r) in first else fn(r) for r in ev.records])


def test_restoring_an_older_state_than_claimed_fails() -> None:
    # Claims step 5 but the weights came from step 0: every later loss is the reference's
    # five steps earlier.
    ev = _resumed_records(simulate([8.5]), lambda r: replace(r, loss=ref_loss(r.step - 5)))
    assert 5 in failing(ev)


def test_claimed_restore_step_older_than_loaded_state_fails() -> None:
    # The log says restored step 5, but the state (and so the data) continued from step 10.
    ev = _resumed_records(simulate([12.5]), lambda r: replace(r, loss=ref_loss(r.step + 5),
                                                             data_position=(r.step + 4) * BATCH))
    assert {5, 6} <= failing(ev)


def test_skipped_data_position_fails() -> None:
    ev = _resumed_records(simulate([8.5]),
                          lambda r: replace(r, data_position=r.data_position + BATCH))
    bad = verify(ev)
    assert [r.number for r in bad if not r.ok] == [6]
    assert "skipped" in bad[6].summary


def test_reconsumed_data_position_fails() -> None:
    ev = _resumed_records(simulate([8.5]),
                          lambda r: replace(r, data_position=r.data_position - BATCH))
    assert failing(ev) == {6}


def test_resume_at_wrong_step_fails() -> None:
    # Restored step 5 but went on at step 7: step 6 was skipped.
    ev = simulate([8.5])
    atts = split_attempts(ev.records)
    dropped = atts[1].records[0]
    ev = replace(ev, records=[r for r in ev.records if r is not dropped])
    assert 6 in failing(ev)


def test_uncommitted_checkpoint_loaded_fails() -> None:
    ev = simulate([13.5])
    ev = replace(ev, checkpoint_events=[e for e in ev.checkpoint_events if e.step != 10])
    assert 3 in failing(ev)


def test_damaged_checkpoint_loaded_fails() -> None:
    ev = simulate([13.5])
    ev.checkpoint_events.append(CheckpointEvent(10, 12.0, "damage"))
    ev.verified[10] = "chunk crc32c mismatch"
    assert 3 in failing(ev)


def test_checkpoint_damaged_after_its_restore_began_is_not_blamed() -> None:
    """preemptible-fleet seed 1: a truncation 1.6 s after every rank had restored step 30,
    while the new group ran its first step, was taken for damage before the restore."""
    ev = simulate([13.5])  # the new group restores step 10 at 16.5; its first step at 17.5
    ev.checkpoint_events.append(CheckpointEvent(10, 17.0, "damage"))
    ev.verified[10] = "truncated"
    assert 3 in failing(ev)  # without the restore's start time: the first step's time
    ev = _resumed_records(ev, lambda r: replace(r, restore_started_at=16.5)
                          if r.step == 11 else r)
    assert failing(ev) == set()
    ev.checkpoint_events.append(CheckpointEvent(10, 16.0, "damage"))  # before it began
    assert 3 in failing(ev)


# commit evidence: when each commit happened ----------------------------------------------

NOTICE = 8.2
"""The preemption notice lands while the group runs step 8."""
EMERGENCY_COMMIT = 8.3
"""The emergency save at the notice commits step 8 (its writer logs it a millisecond on)."""
RESTORE = EMERGENCY_COMMIT + 0.34
"""The new group begins restoring step 8 (its agent restarted it within half a second)."""


def preempted_run(probe_sees_emergency_commit_at: float) -> RunEvidence:
    """The preempt scenario's first fault as seed 4242 met it: a notice mid-interval, the
    emergency save of the step in flight, and a new group restoring that save 0.34 s
    after its commit. The harness's probe lists the store every half second, or later
    when busy: it first shows the emergency commit at the time given, the listing
    before it having begun just after the notice."""
    records = [rec(s, float(s)) for s in range(1, 9)]
    records += [replace(rec(s, s + 1.5, restored=8), restore_started_at=RESTORE if s == 9
                        else None) for s in range(9, TARGET + 1)]
    seen = {5: 5.6, 8: probe_sees_emergency_commit_at, 10: 11.9, 15: 16.9, 20: 21.9}
    since = {8: NOTICE}
    events = [CheckpointEvent(s, t, "commit", since=since.get(s, t - 0.5))
              for s, t in seen.items()]
    return RunEvidence(
        records=records, target_step=TARGET, interval=INTERVAL, finished=True,
        finish_detail="all agents exited 0", reference=reference(), checkpoint_events=events,
        verified={s: None for s in seen},
        faults=[FaultMark(0, FaultKind.PREEMPT, NOTICE)], weights=same_weights(),
    )


def writers_records(emergency_at: float = EMERGENCY_COMMIT + 0.001) -> list[WriterCommit]:
    """What the writers logged: each commit, a millisecond after it."""
    return [WriterCommit(5, 5.301), WriterCommit(8, emergency_at),
            *(WriterCommit(s, s + 1.801) for s in (10, 15, 20))]


def test_restore_right_after_an_emergency_save_passes_on_the_writers_record() -> None:
    """The preempt scenario, seed 4242: the emergency save at the notice committed the step
    in flight 0.34 s before the new group began restoring it, and the probe's next
    listing ended after the restore began: a correct run failed check 3. The writer's
    own record dates the commit before the restore."""
    ev = preempted_run(probe_sees_emergency_commit_at=RESTORE + 0.25)
    assert failing(ev) == {3}  # the probe's sample alone
    assert "first known committed 0.250 s after the restore" in verify(ev)[3].summary
    ev.writer_commits = writers_records()
    assert failing(ev) == set()
    assert verify(ev)[4].measured["max_lost"] == 0


def test_restore_of_a_step_committed_only_after_it_began_still_fails() -> None:
    """The runtime read the emergency save while it was still being written: its commit
    came (by the writer's own record) after the restore began. No evidence may date a
    commit before it happened, so the restore is still caught."""
    ev = preempted_run(probe_sees_emergency_commit_at=RESTORE + 0.25)
    ev.writer_commits = writers_records(emergency_at=RESTORE + 0.05)
    assert failing(ev) == {3}
    assert "first known committed 0.050 s after the restore" in verify(ev)[3].summary


def test_restore_of_a_step_never_committed_still_fails_with_the_writers_records() -> None:
    """The save at the notice never committed (no marker, no writer's record): a restore
    that read it anyway fails whatever else the writers recorded."""
    ev = preempted_run(probe_sees_emergency_commit_at=RESTORE + 0.25)
    ev = replace(ev, checkpoint_events=[e for e in ev.checkpoint_events if e.step != 8],
                 writer_commits=[r for r in writers_records() if r.step != 8])
    del ev.verified[8]
    assert 3 in failing(ev)
    assert "no commit of it at all" in verify(ev)[3].summary


def test_writers_record_dates_the_commit_the_probe_showed_and_never_later() -> None:
    probe = [CheckpointEvent(10, 10.9, "commit", since=10.2)]
    assert settle_commit_times(probe, [WriterCommit(10, 10.31)]) == [
        CheckpointEvent(10, 10.31, "commit", since=10.2)]
    # Logged after the listing that showed it (the writer was slow): the listing's time.
    assert settle_commit_times(probe, [WriterCommit(10, 11.2)]) == probe


def test_writers_record_of_a_commit_the_probe_never_saw_is_a_commit() -> None:
    # Committed and collected between two listings.
    got = settle_commit_times([], [WriterCommit(10, 10.31)])
    assert got == [CheckpointEvent(10, 10.31, "commit")]


def test_writers_record_dates_only_its_own_commit_of_a_step() -> None:
    """Step 10 committed, damaged by the harness, and saved again after the fallback:
    the first commit's record must not date the second (which would make the damaged
    checkpoint look repaired from the start), nor a late record of the first revive it
    after the damage."""
    probe = [CheckpointEvent(10, 10.9, "commit", since=10.2),
             CheckpointEvent(10, 12.0, "damage"),
             CheckpointEvent(10, 25.9, "commit", since=25.1)]
    got = settle_commit_times(probe, [WriterCommit(10, 10.31), WriterCommit(10, 25.31)])
    assert [(e.time, e.kind) for e in got] == [(10.31, "commit"), (12.0, "damage"),
                                              (25.31, "commit")]
    late = settle_commit_times(probe[:2], [WriterCommit(10, 12.5)])
    assert [(e.time, e.kind) for e in late] == [(10.9, "commit"), (12.0, "damage")]


def test_damaged_checkpoint_that_still_verifies_fails() -> None:
    ev = simulate([])
    ev.checkpoint_events.append(CheckpointEvent(15, 30.0, "damage"))
    assert 3 in failing(ev)
    ev.verified[15] = "crc mismatch in chunk 0.0"
    assert failing(ev) == set()


def test_committed_checkpoint_that_does_not_verify_fails() -> None:
    ev = simulate([])
    ev.verified[10] = "manifest missing"
    assert failing(ev) == {3}


def test_too_much_work_lost_fails() -> None:
    # Killed at step 14; step 10's checkpoint never committed, so it resumed from step 5:
    # 9 steps lost with no fault to explain the missing save.
    ev = simulate([14.5], lose=frozenset({10}))
    res = verify(ev)
    assert not res[4].ok and res[4].measured["max_lost"] == 9
    # The same loss is allowed when a fault destroyed the step-10 checkpoint.
    ev.faults.append(FaultMark(1, FaultKind.CORRUPT_CHECKPOINT, 11.0))
    assert verify(ev)[4].ok


def test_slowed_save_lost_with_a_kill_is_allowed_one_more_interval() -> None:
    """A storage latency fault delays the step-10 commit past step 12, when a kill lands:
    the resume goes back to step 5 (7 steps, allowed 6 plus one interval)."""
    ev = simulate([12.5], lose=frozenset({10}))
    ev.faults.append(FaultMark(9, FaultKind.STORAGE_LATENCY, 9.5))
    assert failing(ev) == set()
    assert verify(ev)[4].measured["resumes"][0]["allowed"] == 2 * INTERVAL + 1


def test_kill_landing_while_a_save_persists_is_allowed_one_more_interval() -> None:
    """preemptible-fleet seed 9 on efe1a0f: a worker killed at step 21 while the step-20
    save was still persisting; the group reached step 22 and resumed from step 10 (12 steps,
    allowed 11 for a fault between saves). The save in flight was lost with the killed
    rank: one more interval. Had step 20 been seen committed before the kill, resuming
    from 10 loses committed work and still fails."""
    # Saves take 0.3 s here; the kill lands 0.2 s after step 10's save began.
    ev = simulate([10.2], lose=frozenset({10}))
    assert failing(ev) == set()
    assert verify(ev)[4].measured["resumes"][0] == {
        "attempt": 1, "restored_step": 5, "highest_step_before": 10, "lost_steps": 5,
        "allowed": 2 * INTERVAL + 1}
    # 2.5 s after it began (8x the longest save seen) it is not in flight but missing:
    # nothing explains it (test_too_much_work_lost_fails has the same at 4.5 s).
    late = simulate([12.5], lose=frozenset({10}))
    assert verify(late)[4].measured["resumes"][0]["allowed"] == INTERVAL + 1
    assert 4 in failing(late)


def test_target_not_reached_fails() -> None:
    ev = simulate([])
    ev = replace(ev, records=ev.records[:-3], finished=False, finish_detail="deadline")
    assert 1 in failing(ev)


def test_job_not_finished_fails() -> None:
    ev = replace(simulate([]), finished=False, finish_detail="agent 1 exited 1")
    assert failing(ev) == {1}


def test_loss_off_after_layout_change_fails() -> None:
    ev = simulate([12.5], ws_after=2)
    ev = _resumed_records(ev, lambda r: replace(r, loss=r.loss * 1.01))
    assert 5 in failing(ev)


def test_same_layout_loss_must_be_exact() -> None:
    ev = _resumed_records(simulate([8.5]), lambda r: replace(r, loss=r.loss * (1 + 1e-12)))
    assert failing(ev) == {5}


def test_weights_not_bitwise_on_same_layout_fails() -> None:
    ev = simulate([8.5])
    ev.weights = WeightsComparison(compared=True, tensors=10, bitwise_equal=False,
                                   max_abs_diff=1e-9, not_bitwise=["model/tok_emb.weight"],
                                   chaos_step=TARGET, reference_step=TARGET)
    assert failing(ev) == {2}


def test_weights_not_compared_fails() -> None:
    ev = replace(simulate([]), weights=WeightsComparison(compared=False, error="no ckpt"))
    assert failing(ev) == {2}


def test_no_reference_fails_curve_check() -> None:
    assert 5 in failing(replace(simulate([]), reference=None))


def test_empty_run_fails_every_log_check() -> None:
    ev = replace(simulate([]), records=[], finished=False, finish_detail="agents crashed")
    assert {1, 5, 6} <= failing(ev)


def test_fault_that_never_fired_fails() -> None:
    ev = simulate([8.5])
    ev.faults.append(FaultMark(1, FaultKind.KILL_NODE, 30.0, ok=False, error="run ended"))
    assert failing(ev) == {0}
    # A drawn (MTBF) fault the harness refused is reported, not failed.
    ev.faults[-1] = FaultMark(1, FaultKind.KILL_NODE, 30.0, ok=False, required=False)
    assert failing(ev) == set()


# parsing ------------------------------------------------------------------------------------

def test_parse_metrics_skips_noise_and_torn_lines() -> None:
    lines = [
        json.dumps({"step": 1, "loss": 2.5, "data_position": 0, "restored_step": None,
                    "world_size": 2, "layout": "dp2", "time": 10.0}),
        "some progress noise",
        json.dumps({"step": 2, "loss": 2.25, "data_position": 16, "seen": 11.0}),
        '{"step": 3, "loss": 2.',  # torn by SIGKILL
        json.dumps({"event": "restore", "restored_step": 0}),
    ]
    parsed = parse_metrics(lines)
    assert [r.step for r in parsed.records] == [1, 2]
    assert parsed.records[1].time == 11.0
    assert parsed.skipped == [2, 4, 5]


def test_split_attempts_on_restart_to_the_last_logged_step() -> None:
    recs = [rec(1, 1), rec(2, 2), rec(3, 3, restored=2)]
    assert [len(a.records) for a in split_attempts(recs)] == [2, 1]


def test_committed_step_without_log_line_is_accepted() -> None:
    # Killed after step 10 was saved but before its line was written: restored 10, and
    # the history has no line for step 10. Lost work is 0, no sample skipped.
    ev = simulate([10.5])
    ev = replace(ev, records=[r for r in ev.records if not (r.step == 10
                                                            and r.restored_step is None)])
    assert failing(ev) == set()
    # Without the commit it is a real gap (and an uncommitted restore).
    ev = replace(ev, checkpoint_events=[e for e in ev.checkpoint_events if e.step != 10])
    assert {3, 6} <= failing(ev)


def test_layout_changed_and_back_is_judged_by_tolerance() -> None:
    # Scale down then up: the final layout is the reference's again, but the weights went
    # through another layout's reductions, so only the tolerance can be asked.
    ev = simulate([8.5], ws_after=2)
    ev = replace(ev, records=[*ev.records[:-3], *(replace(r, world_size=4, layout="dp4")
                                                for r in ev.records[-3:])])
    ev.weights = WeightsComparison(compared=True, tensors=10, bitwise_equal=False,
                                   max_abs_diff=1e-7, not_bitwise=["model/w"],
                                   chaos_step=TARGET, reference_step=TARGET)
    res = verify(ev)
    assert res[2].ok and "layout changed" in res[2].tolerance
    ev.weights.mismatched.append("model/w: outside rtol")
    assert not verify(ev)[2].ok



def test_work_lost_to_a_damaged_checkpoint_is_charged_once() -> None:
    # Step 10's checkpoint is destroyed (never committed here, a fault to excuse it): the
    # kill at step 14 resumes from step 5 (9 lost, allowed by the fault). That group dies
    # at step 8 before saving again and the next resumes from step 5 too: 3 steps lost,
    # not 9 again (seed 4 of the preemptible-fleet series was failed that way).
    ev = simulate([14.5, 20.5], lose=frozenset({10}))
    ev.faults.append(FaultMark(2, FaultKind.TRUNCATE_CHECKPOINT, 11.0))
    res = verify(ev)[4]
    assert res.ok, res.details
    assert [x["lost_steps"] for x in res.measured["resumes"]] == [9, 3]
    # Without the fault the first resume's loss is not excused (and only the first's).
    ev.faults.pop()
    assert [d.split(":")[0] for d in verify(ev)[4].details] == [
        "attempt 1 resumed from step 5 after step 14 was done"]


def test_resume_behind_an_intact_checkpoint_counts_from_it() -> None:
    # Kills at steps 14 and 12: both resumes restore step 10. Had the second restored step
    # 5 instead, it would lose 7 steps (from step 12) > interval + 1.
    ev = simulate([14.5, 19.5])
    res = verify(ev)[4]
    assert res.ok and [x["lost_steps"] for x in res.measured["resumes"]] == [4, 2]
    third = split_attempts(ev.records)[2]
    bad = [replace(r, restored_step=5) if r.time >= third.start_time else r
           for r in ev.records]
    res = verify(replace(ev, records=bad))[4]
    assert not res.ok and res.measured["resumes"][1]["lost_steps"] == 7


# check 7: restores from memory --------------------------------------------------------------

def _with_tier_bytes(ev: RunEvidence, persistent: int | None) -> RunEvidence:
    """Put `restore_tier_bytes` on each resume's first record (None: not logged)."""
    firsts = {id(a.first) for a in split_attempts(ev.records) if a.restored_step is not None}
    tiers = None if persistent is None else {"local": 900, "peer": 100,
                                             "persistent": persistent}
    return replace(ev, records=[replace(r, restore_tier_bytes=tiers) if id(r) in firsts else r
                                for r in ev.records], max_restore_persistent_bytes=0)


def test_restores_served_from_memory_pass_check_7() -> None:
    ev = _with_tier_bytes(simulate([8.5, 14.5]), 0)
    results = {r.number: r for r in verify(ev)}
    assert results[7].ok and results[7].measured["restores"] == 2
    assert results[7].measured["local_bytes"] == 1800
    assert failing(simulate([8.5])) == set()  # unbounded scenarios never run check 7
    assert 7 not in {r.number for r in verify(simulate([8.5]))}


def test_restore_reading_the_persistent_store_fails_check_7() -> None:
    assert failing(_with_tier_bytes(simulate([8.5]), 4096)) == {7}
    assert failing(_with_tier_bytes(simulate([8.5]), None)) == {7}  # tiers off: no evidence
    assert failing(_with_tier_bytes(simulate([]), 0)) == {7}  # nothing was restored


def test_parse_metrics_reads_restore_tier_bytes() -> None:
    line = json.dumps({"step": 6, "loss": 1.0, "restored_step": 5,
                       "restore_tier_bytes": {"local": 10, "peer": 2, "persistent": 0}})
    bad = json.dumps({"step": 7, "loss": 1.0, "restore_tier_bytes": {"local": "x"}})
    got = parse_metrics([line, bad]).records
    assert got[0].restore_tier_bytes == {"local": 10, "peer": 2, "persistent": 0}
    assert got[1].restore_tier_bytes is None
