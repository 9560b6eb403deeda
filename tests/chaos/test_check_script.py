"""`relight chaos check-script`: which parts of the contract a script misses. The pure
parts on their own; the three launches on real scripts (`long`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relight.chaos.check_script import _metrics_fields, _saves, check_script, check_steps
from relight.chaos.scenario import parse_scenario

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_target_is_not_a_save_step() -> None:
    assert check_steps(5) == (7, 12)
    assert check_steps(2) == (3, 5)
    assert check_steps(1) == (2, 3)
    for interval in range(2, 20):
        t1, t2 = check_steps(interval)
        assert t1 % interval and t1 > interval and t2 == t1 + interval


def test_saves_missing_at_the_target_step() -> None:
    ok = {f.point: f.level for f in _saves({5, 7}, 5, 7)}
    assert set(ok.values()) == {"ok"}
    found = _saves({5}, 5, 7)
    assert found[0].level == "missing" and "RELIGHT_TARGET_STEP" in found[0].detail
    assert found[1].level == "ok"
    assert [f.level for f in _saves({7}, 2, 7)] == ["ok", "missing"]
    assert [f.level for f in _saves({4, 7}, 2, 7)] == ["ok", "warn"]  # 2, 6 not seen


def test_metrics_fields_named_when_missing() -> None:
    assert _metrics_fields([]).level == "missing"
    lacking = _metrics_fields([{"step": 1, "loss": 1.0, "restored_step": None}])
    assert lacking.level == "missing" and lacking.detail == "lines without data_position"
    full = {"step": 1, "loss": 1.0, "data_position": 0, "restored_step": None}
    assert _metrics_fields([full]).level == "ok"


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.etcd
@pytest.mark.multirank
@pytest.mark.timeout(400)
@pytest.mark.parametrize("script,missing", [
    ("examples/user_train.py", set()),
    ("tests/chaos/scripts/broken_resume_train.py",
     {"the resumed run's losses equal a fresh run's",
      "the resumed run reads the samples a fresh run reads (data position)",
      "the resumed run's final state equals a fresh run's"}),
])
def test_check_script_on_real_scripts(tmp_path: Path, script: str, missing: set[str]) -> None:
    scenario = parse_scenario({"name": "check", "training": {"command": [str(ROOT / script)]},
                               "checkpoint": {"interval": 3}})
    findings = check_script(scenario, tmp_path / "check", nproc=2)
    assert {f.point for f in findings if f.level == "missing"} == missing, findings
    assert any("a checkpoint at the target step" in f.point and f.level == "ok"
               for f in findings)
