"""What the watch of a launch measures while it runs: the metrics as they are written
(`MetricsTail`, each line stamped with when the harness saw it), the commits in the
checkpoint store (`CommitPoll`, each dated by a listing), and each fault's recovery
(`Recovery`; `QuorumRecovery` with replica groups, where survivors do not restart).

Nothing here starts, stops or signals a process; the watch loop (`runner`) feeds these
what it reads from the cluster each poll.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from relight.chaos.cluster import node_name
from relight.chaos.faults import FaultEvent, FaultKind
from relight.chaos.logs import StepRecord, parse_metrics
from relight.chaos.proc_clock import started_after
from relight.chaos.verifier import CheckpointEvent
from relight.storage import StorageError

logger = logging.getLogger(__name__)

__all__ = ["CKPT_POLL_S", "CommitPoll", "MetricsTail", "QuorumRecovery", "Recoveries",
           "Recovery", "metrics_tail"]

CKPT_POLL_S = 0.5


class Recovery:
    """Measures one restarting fault: detected (a pre-fault worker of the survivors gone,
    or a new worker up), re-rendezvous (every live node runs only post-fault workers),
    first step (first metrics line seen after that)."""

    def __init__(self, event: FaultEvent, before: dict[int, list[Any]]) -> None:
        self.event = event
        self.before = {w.pid for ws in before.values() for w in ws} - set(event.pids)
        self.group: set[int] = set()
        self.restarts = 0

    def update(self, workers: dict[int, list[Any]], ranks_per_node: int, now: float,
               new_record_at: float | None) -> bool:
        e = self.event
        current = {w.pid for ws in workers.values() for w in ws}
        # Start times exact to a clock tick (`proc_clock`): a group restarted within
        # milliseconds of the fault still counts as started after it.
        fresh = [w for ws in workers.values() for w in ws if started_after(w.started_at, e.time)]
        if e.detected_at is None and ((self.before - current) or fresh):
            e.detected_at = now
        complete = bool(workers) and all(
            len(ws) == ranks_per_node and all(started_after(w.started_at, e.time) for w in ws)
            for ws in workers.values())
        if e.detected_at is not None and complete and current != self.group:
            # A group that fails again before its first step (a stale peer address, a
            # rendezvous race) is replaced: recovery counts from the group that trains.
            if self.group:
                self.restarts += 1
                e.detail["extra_restarts"] = self.restarts
            self.group = current
            e.rendezvous_at = now
        if e.rendezvous_at is not None and new_record_at is not None and (
            new_record_at >= e.rendezvous_at
        ):
            e.first_step_at = new_record_at
            return True
        return False


class QuorumRecovery:
    """Measures one fault when replica groups are on, where survivors do not restart.

    - `first_step_at` (the report's recovery): when the fault hit a member of the
      quorum, the survivors' first step in a quorum formed after it;
    - `detail["pause_s"]`: the survivors' longest stall the fault caused: the gap
      between their last step before a new quorum and their first step in it (at the
      loss, and again when the hit or replacement group heals in);
    - `detail["rejoin_s"]`: fault -> the first step of the group that comes back: the
      hit group (restarted by its agent), the replacement (`detail["replacement"]`,
      set when it starts) or the spare a scale-up added.
    """

    def __init__(self, event: FaultEvent, records: list[StepRecord]) -> None:
        self.event = event
        self.records = records
        """The launch's records so far (the watch's own list: it grows)."""
        self.victim = node_name(event.node) if event.node is not None else None
        self.quorum = records[-1].quorum if records else None
        in_quorum = {r.replica_group for r in records if r.quorum == self.quorum}
        self.member = self.victim in in_quorum and event.kind is not FaultKind.SCALE_UP
        if not self.member:
            event.detail["quorum_member"] = False
        self.join_quorum: int | None = None
        self.rejoins = event.kind in (FaultKind.SCALE_UP, FaultKind.KILL_WORKER,
                                      FaultKind.STOP_WORKER, FaultKind.KILL_DURING_PERSIST,
                                      FaultKind.KILL_COORDINATOR_BEFORE_COMMIT) or bool(
            event.detail.get("replaced_after_s") is not None)

    def _joiner(self) -> str | None:
        e = self.event
        if e.kind in (FaultKind.KILL_NODE, FaultKind.PREEMPT, FaultKind.SCALE_DOWN):
            new = e.detail.get("replacement")
            return node_name(new) if new is not None else None
        return self.victim

    def _pause(self, rec: StepRecord) -> float | None:
        """Gap before survivor record `rec` (the first of its group in a new quorum)."""
        mine = [r for r in self.records if r.replica_group == rec.replica_group
                and r.time is not None and r.time < rec.time]
        return round(rec.time - mine[-1].time, 3) if mine else None

    def update(self, new_records: list[StepRecord]) -> bool:
        e = self.event
        joiner = self._joiner()
        for rec in new_records:
            if rec.time is None or rec.time < e.time:
                continue
            if rec.replica_group in (self.victim, joiner):
                # A record of the quorum the fault met is a step the victim finished
                # before the kill landed (logged late on a loaded machine): a group that
                # comes back enters a quorum formed after the fault.
                if (self.rejoins and rec.replica_group == joiner and rec.quorum != self.quorum
                        and "rejoin_s" not in e.detail):
                    e.detail.update(rejoin_s=round(rec.time - e.time, 3),
                                    rejoined_group=rec.replica_group,
                                    healed_bytes=rec.healed_bytes)
                    self.join_quorum = rec.quorum
                continue
            if rec.quorum == self.quorum:
                continue
            if self.member and e.first_step_at is None:
                e.detected_at = e.rendezvous_at = e.first_step_at = rec.time
                e.detail["pause_s"] = self._pause(rec)
        if self.join_quorum is not None and "join_pause_s" not in e.detail:
            # The survivors' first step in the quorum the joiner entered (its log line may
            # come before or after the joiner's).
            first = next((r for r in self.records if r.quorum == self.join_quorum
                          and r.replica_group not in (self.victim, joiner)), None)
            if first is not None:
                e.detail["join_pause_s"] = self._pause(first)
        lost_done = not self.member or e.first_step_at is not None
        join_done = not self.rejoins or "join_pause_s" in e.detail
        return lost_done and join_done


def metrics_tail(path: Path, offset: int) -> tuple[list[str], int]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return data[: end + 1].decode(errors="replace").splitlines(), offset + end + 1


class Recoveries:
    """The recoveries still open, and the highest step logged when the last one ended.
    A fault that restarts a group opens one (`start`); each poll updates them all."""

    def __init__(self, replica_groups: bool, ranks_per_node: int) -> None:
        self.replica_groups = replica_groups
        self.ranks_per_node = ranks_per_node
        self.open: list[Recovery | QuorumRecovery] = []
        self.recovered_at = -1
        """The highest step logged when the last recovery ended (-1: none has)."""

    def start(self, event: FaultEvent, before: dict[int, list[Any]],
              records: list[StepRecord]) -> None:
        """Measure `event`'s recovery: `before`, the workers just before it; `records`,
        the launch's records (the list that grows)."""
        self.open.append(QuorumRecovery(event, records) if self.replica_groups
                         else Recovery(event, before))

    def update(self, workers: dict[int, list[Any]], now: float, new_at: float | None,
               new_records: list[StepRecord], high: int) -> None:
        for rc in list(self.open):
            done = (rc.update(new_records) if isinstance(rc, QuorumRecovery)
                    else rc.update(workers, self.ranks_per_node, now, new_at))
            if done:
                self.open.remove(rc)
                if not self.open:
                    self.recovered_at = high

    def restoring(self) -> bool:
        """A restarted group is up and has not logged a step yet."""
        return any(rc.event.rendezvous_at is not None and rc.event.first_step_at is None
                   for rc in self.open)


class MetricsTail:
    """The launch's metrics file read as it grows: each new line, stamped with the time
    the harness saw it (`seen`), goes to the observed file and, when it is a step, to
    `records`."""

    def __init__(self, metrics: Path, observed: Path) -> None:
        self.metrics = metrics
        self.observed = open(observed, "a")  # noqa: SIM115 - closed in close()
        self.records: list[StepRecord] = []
        self.offset = self.line_no = 0
        self.high = -1
        """The highest step logged."""
        self.first_step_time: float | None = None
        """When the harness saw the first step."""

    def close(self) -> None:
        self.observed.close()

    def read(self, now: float, each: Callable[[], None] | None = None) -> float | None:
        """New metrics lines -> records, calling `each` after each new record (the watch
        fires step-triggered faults line by line). Returns the time of the first new
        record (or None)."""
        lines, self.offset = metrics_tail(self.metrics, self.offset)
        new_at = None
        for line in lines:
            self.line_no += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            obj.setdefault("seen", now)
            self.observed.write(json.dumps(obj) + "\n")
            parsed = parse_metrics([json.dumps(obj)]).records
            if not parsed:
                continue
            rec = replace(parsed[0], line=self.line_no)
            self.records.append(rec)
            self.high = max(self.high, rec.step)
            new_at = rec.time if new_at is None else new_at
            if self.first_step_time is None:
                self.first_step_time = now
            if each is not None:
                each()
        self.observed.flush()
        return new_at


class CommitPoll:
    """The commits in the checkpoint store, listed about every `CKPT_POLL_S` through the
    probe (`ckpt_probe.CheckpointProbe.commits`). `events` holds each commit as first
    seen, and the damage faults did to checkpoints (the schedule adds those)."""

    def __init__(self, probe: Any) -> None:
        self.probe = probe
        self.events: list[CheckpointEvent] = []
        self.committed: set[tuple[int, str | None]] = set()
        self.next_poll = 0.0
        self.last_listing = time.time()
        """When the newest listing of the checkpoint root that succeeded began (at first,
        the poll's start: before any node started, so before any commit)."""

    def poll(self, force: bool = False) -> None:
        """New commits in the store, each dated by the end of the listing that first
        showed it (a time it was committed by, never one before the commit) and bounded
        below by the start of the listing before (it was not committed when that one
        began)."""
        if not force and time.monotonic() < self.next_poll:
            return
        self.next_poll = time.monotonic() + CKPT_POLL_S
        began = time.time()
        try:
            seen = self.probe.commits()
        except StorageError as exc:
            logger.debug("commit poll: %s", exc)
            return  # a listing that failed shows nothing, not the absence of commits
        listed = time.time()
        for step, _ in sorted(seen - self.committed, key=lambda c: c[0]):
            self.events.append(CheckpointEvent(step, listed, "commit",
                                               since=self.last_listing))
        self.committed |= seen
        self.last_listing = began
