"""The goodput planner against closed forms and a direct simulation."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relight.runtime.goodput_plan import (
    PlanInputError,
    PlanInputs,
    daly_interval,
    expected_goodput,
    main,
    plan,
)


def test_daly_reduces_to_young_when_saves_are_cheap() -> None:
    m, delta = 1e6, 1.0
    assert daly_interval(delta, m) == pytest.approx(math.sqrt(2 * delta * m), rel=2e-3)


@settings(max_examples=50, deadline=None)
@given(
    delta=st.floats(0.1, 300), restore=st.floats(0, 600), mtbf=st.floats(600, 1e6),
)
def test_daly_interval_is_near_the_true_optimum(delta, restore, mtbf) -> None:
    best = daly_interval(delta, mtbf)
    g_best = expected_goodput(best, delta, restore, mtbf)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert expected_goodput(best * factor, delta, restore, mtbf) <= g_best * (1 + 1e-3)


def test_goodput_matches_a_monte_carlo_run() -> None:
    # Simulate Poisson failures: a segment of tau work + delta save restarts (after R)
    # when a failure lands inside it; compare measured useful/wall with the model.
    rng = random.Random(3)
    m, tau, delta, restore = 1000.0, 150.0, 10.0, 30.0
    useful = wall = 0.0
    for _ in range(40_000):
        while True:
            t_fail = rng.expovariate(1 / m)
            if t_fail >= tau + delta:
                wall += tau + delta
                useful += tau
                break
            wall += t_fail + restore
    # The model also charges R's own exposure to failures; at R << M the difference is small.
    assert useful / wall == pytest.approx(expected_goodput(tau, delta, restore, m), rel=0.03)


def test_plan_reports_steps_and_current_interval() -> None:
    result = plan(PlanInputs(gpus=2048, mtbf_hours_per_gpu=50_000, save_stall_s=2.0,
                             restore_time_s=60.0, step_time_s=1.5, current_interval_s=3600))
    assert result.job_mtbf_s == pytest.approx(50_000 * 3600 / 2048)
    assert result.optimal_interval_steps == round(result.optimal_interval_s / 1.5)
    assert result.current_goodput < result.optimal_goodput < 1.0


@pytest.mark.parametrize("field,value", [("gpus", 0), ("mtbf_hours_per_gpu", -1.0),
                                         ("save_stall_s", -2.0), ("step_time_s", 0.0)])
def test_bad_inputs_name_the_field(field, value) -> None:
    kwargs = dict(gpus=8, mtbf_hours_per_gpu=1000.0, save_stall_s=1.0, restore_time_s=10.0)
    kwargs[field] = value
    with pytest.raises(PlanInputError, match=field):
        PlanInputs(**kwargs)


def test_cli_json(capsys) -> None:
    rc = main(["--gpus", "64", "--mtbf-hours-per-gpu", "10000", "--save-stall", "3",
               "--restore-time", "90", "--interval", "1800", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["current_interval_s"] == 1800 and 0 < out["optimal_goodput"] < 1


def test_cli_rejects_bad_input(capsys) -> None:
    rc = main(["--gpus", "0", "--mtbf-hours-per-gpu", "1", "--save-stall", "1",
               "--restore-time", "1"])
    assert rc == 2 and "gpus" in capsys.readouterr().err


def test_heal_in_place_model() -> None:
    from relight.runtime.goodput_plan import heal_goodput

    m, tau, delta = 3600.0, 300.0, 2.0
    # Free faults: only the save stalls cost.
    assert heal_goodput(tau, delta, m, 4, 0.0, 0.0) == pytest.approx(tau / (tau + delta))
    # Each fault: the fleet pauses 2 s, one of 4 groups idles 60 s: 17 s of fleet time
    # per fault, one fault an hour.
    assert heal_goodput(tau, delta, m, 4, 2.0, 60.0) == pytest.approx(
        tau / (tau + delta) * (1 - 17.0 / m))
    # More groups: the lost share is smaller.
    assert heal_goodput(tau, delta, m, 8, 2.0, 60.0) > heal_goodput(tau, delta, m, 4, 2.0, 60.0)
    # Against the restart path with the same save stall and a 36 s restart + the rollback.
    inputs = PlanInputs(gpus=64, mtbf_hours_per_gpu=64.0, save_stall_s=delta,
                        restore_time_s=36.0, replica_groups=4, heal_pause_s=2.0,
                        heal_time_s=60.0)
    result = plan(inputs)
    assert result.heal_goodput > result.optimal_goodput
    with pytest.raises(PlanInputError, match="heal_pause_s"):
        PlanInputs(gpus=8, mtbf_hours_per_gpu=1.0, save_stall_s=1.0, restore_time_s=1.0,
                   replica_groups=2, heal_time_s=3.0)


def test_cli_heal_in_place(capsys) -> None:
    assert main(["--gpus", "64", "--mtbf-hours-per-gpu", "64", "--save-stall", "2",
                 "--restore-time", "36", "--replica-groups", "4", "--heal-pause", "2",
                 "--heal-time", "60"]) == 0
    out = capsys.readouterr().out
    assert "heal in place (4 replica groups" in out and "goodput" in out


def test_heal_scale_adds_the_membership_change_at_the_job_size(tmp_path, capsys) -> None:
    from relight.runtime.goodput_plan import PlanInputError, heal_scale_costs, main

    rows = [{"groups": 4, "lost": {"settle_s": 0.1}, "joined": {"settle_s": 0.2}},
            {"groups": 64, "lost": {"settle_s": 1.3}, "joined": {"settle_s": 0.8}},
            {"groups": 256, "lost": {"settle_s": 3.7}, "joined": {"settle_s": 2.0}}]
    assert heal_scale_costs(rows, 4) == (0.0, 0.0)
    lost, joined = heal_scale_costs(rows, 160)  # halfway between 64 and 256
    assert lost == pytest.approx(2.5 - 0.1) and joined == pytest.approx(1.4 - 0.2)
    with pytest.raises(PlanInputError, match="outside the measured sizes 4..256"):
        heal_scale_costs(rows, 1024)
    results = tmp_path / "scale.json"
    results.write_text(json.dumps(rows))
    base = ["--gpus", "2048", "--mtbf-hours-per-gpu", "5000", "--save-stall", "1",
            "--restore-time", "36", "--replica-groups", "256", "--heal-pause", "2",
            "--heal-time", "60", "--json"]
    assert main(base) == 0
    small = json.loads(capsys.readouterr().out)
    assert main([*base, "--heal-scale", str(results)]) == 0
    scaled = json.loads(capsys.readouterr().out)
    assert scaled["inputs"]["heal_pause_s"] == pytest.approx(2 + 3.6)
    assert scaled["inputs"]["heal_time_s"] == pytest.approx(60 + 1.8)
    assert scaled["heal_goodput"] < small["heal_goodput"]
    assert main([*base[:-7], "--replica-groups", "1024", "--heal-pause", "2",
                 "--heal-time", "60", "--heal-scale", str(results)]) == 2
    assert "outside the measured sizes" in capsys.readouterr().err
