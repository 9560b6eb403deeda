"""The goodput planner against closed forms and a direct simulation."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.plan import PlanInputError, PlanInputs, daly_interval, expected_goodput, main, plan


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
