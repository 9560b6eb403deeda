"""Checks 8-11 (replica groups heal in place) on evidence built by hand: a correct run of
two groups through a worker kill passes, and each way of breaking the promise fails the
check that guards it."""

from __future__ import annotations

from dataclasses import replace

from relight.chaos.faults import FaultKind
from relight.chaos.logs import job_history
from relight.chaos.verifier import (
    FaultMark,
    RunEvidence,
    StepRecord,
    WeightsComparison,
    verify,
)

TARGET = 20
BATCH = 16


def loss(step: int, groups: int = 2) -> float:
    return 4.0 / step * (1 if groups == 2 else 1 + 1e-7)


def rec(group: str, step: int, t: float, *, quorum: int = 0, size: int = 2,
        healed: int | None = None, abandoned: int = 0, restored: int | None = None,
        crc: tuple[int, ...] | None = None) -> StepRecord:
    return StepRecord(
        step=step, loss=loss(step, size), data_position=(step - 1) * BATCH,
        restored_step=restored, world_size=2, layout="dp_shard2", time=t, step_time_s=0.3,
        replica_group=group, quorum=quorum, quorum_size=size,
        state_crc=crc if crc is not None else (step, step + 1000),
        abandoned_steps=abandoned, healed_bytes=healed)


def reference() -> list[StepRecord]:
    return [rec(g, s, float(s)) for s in range(1, TARGET + 1) for g in ("node-0", "node-1")]


def correct_run() -> RunEvidence:
    """node-0's worker dies at t=8.5 (after step 8): node-1 abandons the step in flight,
    trains steps 9-10 alone, and node-0's restarted group heals in at step 11."""
    records = []
    for s in range(1, 9):
        records += [rec("node-0", s, float(s)), rec("node-1", s, float(s))]
    records += [rec("node-1", 9, 10.0, quorum=1, size=1, abandoned=1),
                rec("node-1", 10, 11.0, quorum=1, size=1, abandoned=1)]
    for s in range(11, TARGET + 1):
        records += [rec("node-0", s, float(s + 1), quorum=2, healed=5000 if s == 11 else None),
                    rec("node-1", s, float(s + 1), quorum=2, abandoned=1)]
    return RunEvidence(
        records=records, target_step=TARGET, interval=5, finished=True,
        finish_detail="agents exited 0", reference=reference(),
        faults=[FaultMark(0, FaultKind.KILL_WORKER, 8.5, node=0)],
        weights=WeightsComparison(compared=True, tensors=4, bitwise_equal=False,
                                  max_abs_diff=1e-9, chaos_step=TARGET,
                                  reference_step=TARGET),
        replica_groups=True, ranks_per_node=2, worker_starts={0: 4, 1: 2})


def failing(ev: RunEvidence) -> set[int]:
    return {r.number for r in verify(ev) if not r.ok}


def edit(ev: RunEvidence, group: str, step: int, **kw) -> RunEvidence:
    records = [replace(r, **kw) if (r.replica_group, r.step) == (group, step) else r
               for r in ev.records]
    return replace(ev, records=records)


def test_a_correct_heal_in_place_passes_every_check() -> None:
    results = verify(correct_run())
    assert {r.number for r in results} == {0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11}
    assert [r.summary for r in results if not r.ok] == []


def test_the_job_history_counts_each_step_once() -> None:
    hist = job_history(correct_run().records)
    assert [r.step for r in hist] == list(range(1, TARGET + 1))


def test_a_survivor_that_restarted_fails_check_8() -> None:
    ev = replace(correct_run(), worker_starts={0: 4, 1: 4})
    assert failing(ev) == {8}


def test_replicas_that_disagree_fail_check_9() -> None:
    ev = edit(correct_run(), "node-0", 15, state_crc=(1, 2))
    assert failing(ev) == {9}


def test_groups_of_different_layouts_compare_whole_parameters_in_check_9() -> None:
    """node-0 holds the weights on one rank, node-1 on two: their shard digests cannot
    match, and check 9 compares their whole-parameter digests instead."""
    def mixed(r: StepRecord) -> StepRecord:
        whole = (r.step * 7,)
        if r.replica_group == "node-0":
            return replace(r, layout="dp_shard1", state_crc=(r.step * 3,), params_crc=whole)
        return replace(r, params_crc=whole)

    ev = correct_run()
    ev = replace(ev, records=[mixed(r) for r in ev.records])
    assert failing(ev) == set()
    assert failing(edit(ev, "node-0", 15, params_crc=(1,))) == {9}
    assert failing(edit(ev, "node-1", 15, params_crc=None)) == {9}


def test_a_join_restored_from_storage_while_a_group_trained_fails_check_10() -> None:
    ev = edit(correct_run(), "node-0", 11, healed_bytes=None, restored_step=10)
    ev = replace(ev, records=[replace(r, restored_step=10) if r.replica_group == "node-0"
                              and r.step > 11 else r for r in ev.records])
    assert 10 in failing(ev)


def test_a_survivor_that_repeats_a_step_fails_check_11() -> None:
    ev = correct_run()
    i = next(i for i, r in enumerate(ev.records) if (r.replica_group, r.step) == ("node-1", 9))
    ev = replace(ev, records=[*ev.records[:i + 1], ev.records[i], *ev.records[i + 1:]])
    assert 11 in failing(ev)


def test_more_abandoned_steps_than_faults_fail_check_11() -> None:
    ev = correct_run()
    ev = replace(ev, records=[replace(r, abandoned_steps=2) if r.replica_group == "node-1"
                              and r.step > 8 else r for r in ev.records])
    assert failing(ev) == {11}


def test_replicas_are_compared_within_each_run_of_the_job() -> None:
    """Every replica lost at step 8: new groups start over (here from scratch) in quorums
    of their own. Their steps 1-8 differ from the lost run's, and are not compared with
    them; within the new run the groups still must agree."""
    from relight.chaos.verifier import check_replicas_identical, replica_lineages

    lost = [rec(g, s, float(s), crc=(s, 1000)) for s in range(1, 9) for g in ("node-0", "node-1")]
    again = [rec(g, s, float(s + 20), quorum=5, crc=(s, 2000))
             for s in range(1, 13) for g in ("node-2", "node-3")]
    ev = replace(correct_run(), records=lost + again)
    lineage = replica_lineages(ev.records)
    assert lineage[("node-0", 0)] == lineage[("node-1", 0)] != lineage[("node-2", 0)]
    assert lineage[("node-2", 0)] == lineage[("node-3", 0)]
    result = check_replicas_identical(ev)
    assert result.ok, result.summary
    assert "2 runs of the job" in result.summary
    bad = edit(ev, "node-3", 10, state_crc=(1, 2))
    assert not check_replicas_identical(bad).ok


def test_a_run_with_no_join_while_training_holds_check_10_and_says_it_was_vacuous() -> None:
    """Every replica lost at step 8, the job restarted from scratch with nobody training:
    no group had anything to heal from, so check 10 holds, and says there was nothing
    to check; a run with a heal is not vacuous."""
    from relight.chaos.verifier import check_heals_read_no_storage

    lost = [rec(g, s, float(s)) for s in range(1, 9) for g in ("node-0", "node-1")]
    again = [rec(g, s, float(s + 20), quorum=5) for s in range(1, 13)
             for g in ("node-2", "node-3")]
    result = check_heals_read_no_storage(replace(correct_run(), records=lost + again))
    assert result.ok, result.summary
    assert result.measured["vacuous"] and "nothing to check" in result.summary
    healed = check_heals_read_no_storage(correct_run())
    assert healed.ok and not healed.measured["vacuous"] and healed.measured["heals"] == 1


def test_groups_that_restore_together_after_every_replica_is_lost_are_peers() -> None:
    """Every replica lost after step 8; two replacements restore step 8 from storage at
    about the same moment (0.1 s apart) and form a quorum: neither could heal from the
    other, so check 10 holds. A group that restores while another had been training
    since before it began still fails the check."""
    from relight.chaos.verifier import check_heals_read_no_storage

    lost = [rec(g, s, float(s)) for s in range(1, 9) for g in ("node-0", "node-1")]
    again = []
    for s in range(9, 13):
        again += [replace(rec("node-2", s, 30.0 + s, quorum=5, restored=8),
                          restore_started_at=29.0 if s == 9 else None),
                  replace(rec("node-3", s, 30.1 + s, quorum=5, restored=8),
                          restore_started_at=29.1 if s == 9 else None)]
    together = check_heals_read_no_storage(replace(correct_run(), records=lost + again))
    assert together.ok, together.summary
    # node-3 restored while node-2 had been training since t=39 (before node-3 began).
    late = [r if r.replica_group == "node-2" else replace(
        r, time=r.time + 10.0, restore_started_at=40.0 if r.step == 9 else None)
        for r in again]
    alone = check_heals_read_no_storage(replace(correct_run(), records=lost + late))
    assert not alone.ok and "node-3 restored step 8" in alone.details[0], alone.details
