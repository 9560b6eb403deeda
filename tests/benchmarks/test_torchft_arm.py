"""The goodput figures every arm shares (`benchmarks.goodput_metrics`) on hand-made step
records, the torchft arm's schedule parsing, and (long tier, only where torchft's own
environment exists) one small real torchft run with a group killed and replaced."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from relight.benchmarks import torchft_arm
from relight.benchmarks.goodput_metrics import (
    MetricsError,
    fleet_goodput,
    heal_times,
    kept_steps,
    live_fraction,
    outage_pause,
    pauses,
    read_records,
    steps_in_window,
    window_start,
)

ROOT = Path(__file__).resolve().parents[2]


def rec(group: object, step: int, time: float, step_time_s: float = 1.0,
        participants: int = 2) -> dict[str, object]:
    return {"group": group, "step": step, "time": time, "step_time_s": step_time_s,
            "participants": participants}


def test_goodput_of_a_fault_free_run_is_one_not_more() -> None:
    # each step's latest record is another group's, and raw step times overlap:
    # step 1 by group 1 spans [0, 1.2], step 2 by group 0 spans [1.0, 2.3]
    records = [rec(0, 1, 1.0, 1.0), rec(1, 1, 1.2, 1.2),
               rec(0, 2, 2.3, 1.3), rec(1, 2, 2.25, 1.05)]
    assert window_start(records) == 0.0
    assert fleet_goodput(records, None, 2.3, 2) == pytest.approx(1.0)
    assert fleet_goodput(records, 0.0, 2.3, 4) == pytest.approx(0.5)


def test_goodput_counts_participants_and_only_the_window() -> None:
    records = [rec("a", 1, 1.0, participants=2), rec("a", 2, 2.0, participants=1),
               rec("a", 3, 3.0, participants=1), rec("a", 4, 7.0, participants=2)]
    # window [0, 4]: 1 s x 2 + 1 s x 1 + 1 s x 1 over 4 s x 2 groups
    assert fleet_goodput(records, 0.0, 4.0, 2) == pytest.approx(4 / 8)
    # window [0, 8]: step 4's 1 s x 2 joins; the idle 3 s before it count nothing
    assert fleet_goodput(records, 0.0, 8.0, 2) == pytest.approx(6 / 16)


def test_a_steps_wait_for_its_quorum_is_not_goodput() -> None:
    # step 2 waited 4 s of its 5 s for a new quorum after a fault
    records = [rec("a", 1, 1.0, participants=2), {**rec("a", 2, 6.0, 5.0, 1), "quorum_s": 4.0}]
    assert fleet_goodput(records, 0.0, 6.0, 2) == pytest.approx((2 + 1) / 12)


def test_steps_in_the_window_count_each_kept_step_once() -> None:
    # step 2 was redone (counted once); step 4 commits after the window
    records = [rec("a", 1, 1.0), rec("b", 1, 1.1), rec("a", 2, 2.0), rec("a", 2, 3.0),
               rec("a", 3, 3.5), rec("a", 4, 9.0)]
    assert steps_in_window(records, 0.0, 4.0) == 3
    assert steps_in_window(records, 1.15, 4.0) == 2  # step 1 (kept: b at 1.1) is before it
    assert steps_in_window(records, None, 4.0) == 0


def test_the_live_fraction_takes_each_lost_group_out_until_its_replacement() -> None:
    # 4 groups x 100 s; two faults, each group gone 10 s; the second's replacement
    # would come after the window's end (5 s of it inside); one fault before the window
    assert live_fraction([20.0, 95.0, -3.0], 10.0, 100.0, 4) == pytest.approx(1 - 15 / 400)
    assert live_fraction([], 10.0, 100.0, 4) == 1.0
    with pytest.raises(MetricsError, match="down_s"):
        live_fraction([1.0], -1.0, 100.0, 4)


def test_a_rolled_back_step_counts_once_as_its_redo() -> None:
    records = [rec("job", 1, 1.0, participants=1), rec("job", 2, 2.0, participants=1),
               rec("job", 2, 10.0, step_time_s=2.0, participants=1)]
    assert [r["time"] for r in kept_steps(records)] == [1.0, 10.0]
    assert fleet_goodput(records, 0.0, 10.0, 1) == pytest.approx(3 / 10)


def test_pause_is_the_longest_gap_after_the_fault_less_the_median_step() -> None:
    records = [rec(0, s, float(s)) for s in range(1, 6)]
    records += [rec(0, 6, 11.0), rec(0, 7, 12.0)]  # a 6 s gap across the fault at 5.5
    records += [rec(1, s, float(s)) for s in range(1, 6)]  # the victim
    out = pauses(records, [5.5], [[0]])
    assert out == [pytest.approx(6.0 - 1.0)]
    # a gap that ends beyond the window is not this fault's
    assert pauses(records, [5.5], [[0]], window_s=5.0) == [None]
    # no survivor with a step after the fault
    assert pauses(records, [5.5], [[1]]) == [None]
    with pytest.raises(MetricsError, match="survivor sets"):
        pauses(records, [5.5, 8.0], [[0]])


def test_heal_time_is_start_to_first_kept_step() -> None:
    records = [rec(0, 1, 1.0), rec(5, 9, 20.0), rec(5, 10, 21.0)]
    assert heal_times(records, {5: 12.5, 6: 30.0}) == {5: pytest.approx(7.5), 6: None}


def test_a_record_without_a_field_is_a_typed_error() -> None:
    with pytest.raises(MetricsError, match="participants"):
        fleet_goodput([{"group": 0, "step": 1, "time": 1.0, "step_time_s": 1.0}],
                      None, 1.0, 1)
    with pytest.raises(MetricsError, match="duration_s"):
        fleet_goodput([], 0.0, 0.0, 1)


def test_read_records_leaves_out_a_line_cut_mid_write(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert read_records(path) == []
    path.write_text(json.dumps(rec(0, 1, 1.0)) + "\n" + '{"group": 0, "st')
    assert read_records(path) == [rec(0, 1, 1.0)]


def test_schedule_parsing_and_mtbf_draws() -> None:
    faults = torchft_arm.parse_schedule(
        [{"time_s": 30, "kind": "kill_lighthouse", "replace_after_s": 2},
         {"time_s": 10, "replace_after_s": None}])
    assert [(f.time_s, f.kind, f.replace_after_s) for f in faults] == [
        (10.0, "kill_group", None), (30.0, "kill_lighthouse", 2.0)]
    for bad, match in [({"time_s": 1}, "JSON list"), ([{"kind": "kill_group"}], "time_s"),
                       ([{"time_s": 1, "kind": "kill_rank"}], "kind"),
                       ([{"time_s": -1}], ">= 0"), ([{"time_s": "soon"}], "numbers"),
                       ([{"time_s": 1, "at": 2}], "unknown")]:
        with pytest.raises(torchft_arm.ScheduleError, match=match):
            torchft_arm.parse_schedule(bad)
    a = torchft_arm.mtbf_schedule(15.0, 120.0, seed=3, replace_after_s=10.0)
    assert a == torchft_arm.mtbf_schedule(15.0, 120.0, seed=3, replace_after_s=10.0)
    assert a != torchft_arm.mtbf_schedule(15.0, 120.0, seed=4, replace_after_s=10.0)
    assert a and all(0 < f.time_s < 100.0 for f in a)
    assert [f.time_s for f in a] == sorted(f.time_s for f in a)


def _torchft_python() -> str | None:
    for candidate in (os.environ.get("RELIGHT_TORCHFT_PYTHON"),
                      "/work/venv-torchft/bin/python"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


@pytest.mark.long
def test_small_torchft_run_heals_a_replacement(tmp_path: Path) -> None:
    python = _torchft_python()
    if python is None:
        pytest.skip("no torchft environment: run scripts/torchft-env.sh and set "
                    "$RELIGHT_TORCHFT_PYTHON to its python")
    schedule = tmp_path / "schedule.json"
    # The replacement starts at 12 s and must import torch, build its Manager and heal
    # before the window closes: on a loaded 2-core machine the imports alone took 26 s.
    schedule.write_text(json.dumps([{"time_s": 10, "kind": "kill_group",
                                     "replace_after_s": 2}]))
    out = tmp_path / "out"
    proc = subprocess.run(
        [python, str(ROOT / "benchmarks" / "torchft_arm.py"), "--groups", "2",
         "--duration", "120", "--schedule", str(schedule), "--out", str(out)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["committed_steps"] > 0
    assert summary["faults_fired"] == 1
    (heal,) = summary["heal_times_s"].values()
    assert heal is not None and heal > 0
    # the replacement received the live state from a peer, at the step it joined
    (victim_fault,) = summary["faults"]
    replacement = victim_fault["replacement"]
    healed = [h for h in summary["heals"] if h["group"] == replacement]
    assert healed and healed[0]["bytes"] > 0 and healed[0]["step"] > 0
    (r,) = summary["replacements"]
    assert r["recv_bytes"] == healed[0]["bytes"] and r["first_step_s"] == heal
    assert 0.0 < summary["fleet_goodput"] <= 1.0
    assert summary["pauses_s"][0] is not None


def test_a_lighthouse_outage_is_every_live_groups_pause() -> None:
    import argparse

    # Two groups step every second; the lighthouse dies at t=10.5 and nobody commits
    # until t=16: a 6 s gap, less the 1 s median step.
    records = [rec(g, s, float(s)) for g in (0, 1) for s in range(1, 11)]
    records += [rec(g, s, float(s + 5)) for g in (0, 1) for s in range(11, 40)]
    for r in records:
        r["loss"] = 1.0
    fired = [{"kind": "kill_lighthouse", "time": 10.5, "time_s": 10.5, "survivors": [0, 1]}]
    args = argparse.Namespace(groups=2, duration=30.0, seed=0)
    summary = torchft_arm.summarize(records, [], [], fired, {}, args, 1.0, (0.0,), (0.0,))
    assert summary["coordinator_pauses_s"] == [5.0]
    assert summary["pauses_s"] == []  # no group was lost


def test_an_outage_nobody_recovers_from_counts_until_the_window_ends() -> None:
    records = [rec(g, s, float(s)) for g in (0, 1) for s in range(1, 11)]
    # group 1 stops at the outage (t=10.5) for good; the window ends at 40
    records += [rec(0, s, float(s)) for s in range(11, 41)]
    assert outage_pause(records, 10.5, [0], 40.0) == pytest.approx(0.0)
    assert outage_pause(records, 10.5, [0, 1], 40.0) == pytest.approx(30.0 - 1.0)
    assert outage_pause(records, 10.5, [7], 40.0) is None
