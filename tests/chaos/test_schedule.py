"""The fault schedule: when each fault is due, from what the watch has measured."""

from __future__ import annotations

from types import SimpleNamespace

from relight.chaos.faults import FaultKind
from relight.chaos.measure import Recoveries
from relight.chaos.scenario import Scenario, parse_scenario
from relight.chaos.schedule import FaultSchedule, Pending, mtbf_spec

BASE = {"name": "t", "training": {"config": "configs/tiny.toml"}}


def _schedule(s: Scenario, cluster: object = None, high: int = -1,
              first_step_time: float | None = None) -> FaultSchedule:
    """A schedule over stand-ins for what the watch measures: the steps logged, the
    commits seen, the recoveries still open."""
    metrics = SimpleNamespace(high=high, first_step_time=first_step_time, records=[])
    commits = SimpleNamespace(committed=set(), events=[])
    recoveries = Recoveries(s.cluster.replica_groups, s.cluster.ranks_per_node)
    return FaultSchedule(s, cluster, None, metrics, commits, recoveries)


def test_drawn_faults_wait_until_they_can_happen() -> None:
    s = parse_scenario({**BASE, "cluster": {"nodes": 2, "min_nodes": 1, "max_nodes": 2},
                        "mtbf": {"count": 3, "kinds": ["scale_up"]}})

    class Fleet:
        live = [0, 1]

        def live_nodes(self) -> list[int]:
            return self.live

    fleet = Fleet()
    schedule = _schedule(s, fleet, high=10, first_step_time=0.0)

    def due(kind: FaultKind) -> bool:
        return schedule.due(Pending(0, mtbf_spec(kind, s.mtbf, 5), "mtbf", 1.0), 100.0, None)

    assert not due(FaultKind.SCALE_UP)          # full fleet: nothing to grow into
    assert due(FaultKind.SCALE_DOWN)
    assert not due(FaultKind.CORRUPT_CHECKPOINT)  # nothing committed yet
    schedule.commits.committed.add((5, "a"))
    fleet.live = [1]
    assert due(FaultKind.SCALE_UP)
    # One checkpoint: damaging it would leave nothing to fall back to (seed 9).
    assert not due(FaultKind.CORRUPT_CHECKPOINT)
    schedule.commits.committed.add((10, "b"))
    assert due(FaultKind.CORRUPT_CHECKPOINT) and due(FaultKind.TRUNCATE_CHECKPOINT)
    assert not due(FaultKind.SCALE_DOWN)        # at min_nodes: shrinking would stop the job


def test_a_fault_after_recovery_waits_for_the_earlier_fault_to_recover() -> None:
    s = parse_scenario({**BASE, "cluster": {"nodes": 2, "min_nodes": 1, "max_nodes": 2},
                        "faults": [{"kind": "kill_worker", "at_step": 2},
                                   {"kind": "kill_node", "at_step": 5,
                                    "after_recovery": True}]})
    schedule = _schedule(s, high=6, first_step_time=0.0)
    second = Pending(1, s.faults[1], "timeline", None)
    schedule.recoveries.open.append(object())  # the first fault's group is not back yet
    assert not schedule.due(second, 10.0, None)
    schedule.recoveries.open.clear()  # it trains again
    assert schedule.due(second, 10.0, None)
    schedule.metrics.high = 4
    assert not schedule.due(second, 10.0, None)  # and the step must still be reached


def test_a_fault_can_wait_steps_after_the_recovery() -> None:
    """steps_after_recovery counts from the step logged when the last recovery ended,
    however late that was."""
    s = parse_scenario({**BASE, "cluster": {"nodes": 2, "min_nodes": 1, "max_nodes": 2},
                        "faults": [{"kind": "kill_worker", "at_step": 2},
                                   {"kind": "kill_node", "at_step": 5, "after_recovery": True,
                                    "steps_after_recovery": 3}]})
    schedule = _schedule(s, high=9, first_step_time=0.0)
    schedule.recoveries.recovered_at = 8  # back at step 8
    second = Pending(1, s.faults[1], "timeline", None)
    assert not schedule.due(second, 10.0, None)
    schedule.metrics.high = 11
    assert schedule.due(second, 10.0, None)
