"""What the watch of a launch measures: commits dated by the listings around them, and
each fault's recovery."""

from __future__ import annotations

import time

from relight.chaos.faults import FaultEvent, FaultKind
from relight.chaos.logs import StepRecord
from relight.chaos.measure import CommitPoll, QuorumRecovery
from relight.storage import StorageError


class _Probe:
    """Answers each listing from a script: a set of (step, attempt) or an error."""

    def __init__(self, answers) -> None:
        self.answers = list(answers)
        self.listed: list[tuple[float, float]] = []

    def commits(self):
        began = time.time()
        answer = self.answers.pop(0)
        self.listed.append((began, time.time()))
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_commit_poll_dates_a_commit_between_the_listings_around_it(tmp_path) -> None:
    """A commit the probe first shows is dated by the end of that listing (committed by
    then) and bounded below by the start of the listing before it that succeeded (not
    committed when that one began): a listing that failed shows nothing about it."""
    probe = _Probe([set(), StorageError("listing refused"), {(5, "a")}, {(5, "a")}])
    poll = CommitPoll(probe)
    for _ in range(4):
        poll.poll(force=True)
    [event] = poll.events
    (empty, _), (failed, _), (_, showed), _ = probe.listed
    assert (event.step, event.kind) == (5, "commit")
    assert event.since <= empty < failed
    assert event.time >= showed


def test_a_step_the_victim_logged_after_the_kill_is_not_its_rejoin() -> None:
    """On a loaded machine a killed group's last step can be logged after the fault's
    time (the kill lands late): its rejoin is its first step in a later quorum."""
    def rec(group: str, step: int, quorum: int, t: float, healed: int | None = None):
        return StepRecord(step=step, loss=1.0, time=t, replica_group=group, quorum=quorum,
                          quorum_size=2 if quorum != 1 else 1, healed_bytes=healed)

    records = [rec(g, s, 0, s / 10) for s in range(1, 6) for g in ("node-0", "node-1")]
    ev = FaultEvent(index=0, kind=FaultKind.KILL_WORKER, trigger="step>=5", time=1.0,
                    step=5, node=0)
    recovery = QuorumRecovery(ev, records)
    later = [rec("node-0", 6, 0, 1.05), rec("node-1", 6, 0, 1.06),  # in flight at the kill
             rec("node-1", 7, 1, 1.5), rec("node-1", 8, 1, 1.7)]
    records += later
    assert not recovery.update(later)
    assert "rejoin_s" not in ev.detail
    assert ev.first_step_at == 1.5 and ev.detail["pause_s"] == 0.44
    back = [rec("node-0", 9, 2, 4.0, healed=4096), rec("node-1", 9, 2, 4.1)]
    records += back
    assert recovery.update(back)
    assert ev.detail["rejoin_s"] == 3.0 and ev.detail["healed_bytes"] == 4096
    assert ev.detail["join_pause_s"] == 2.4
