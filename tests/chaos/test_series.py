"""A series of runs summed up: per-seed rows, pooled recovery, Daly's prediction."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from relight.chaos.series import main, predicted_goodput, seed_row
from relight.runtime.goodput_plan import expected_goodput

sys.path.insert(0, str(Path(__file__).parent))
from test_report import _report  # noqa: E402


def _run_dir(tmp_path: Path, name: str, broken: bool = False) -> Path:
    d = tmp_path / name
    rep = _report(broken=broken)
    rep["scenario_config"] = {"mtbf": {"mean_s": 30.0, "count": 2}}
    d.mkdir()
    (d / "report.json").write_text(json.dumps(rep))  # all a row reads
    # Two process lifetimes: steps 1-12 (saving every 5 steps, 0.2 s stall), a fault, a
    # 7 s gap, and steps 11-20 resumed from step 10; 0.5 s per step.
    lines, t = [], 1000.0
    for step in range(1, 13):
        t += 0.5
        lines.append({"step": step, "loss": 1.0, "time": t, "step_time_s": 0.5,
                      "ckpt_stall_s": 0.2 if step % 5 == 0 else 0.0,
                      "ckpt_saved": step % 5 == 0, **({"startup_s": 3.0} if step == 1 else {})})
    t += 7.0
    for step in range(11, 21):
        t += 0.5
        lines.append({"step": step, "loss": 1.0, "time": t, "step_time_s": 0.5,
                      "ckpt_stall_s": 0.2 if step % 5 == 0 else 0.0, "ckpt_saved": step % 5 == 0,
                      **({"startup_s": 4.0, "restore_s": 1.0} if step == 11 else {})})
    (d / "chaos").mkdir()
    (d / "chaos" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return d


def test_row_measures_and_predicts(tmp_path: Path) -> None:
    row = seed_row(_run_dir(tmp_path, "s1"))
    assert row.passed and row.seed == 3 and row.restarting_faults == 1
    assert row.recoveries_s == (3.0,) and row.goodput == 0.25
    assert (row.save_stall_s, row.restore_time_s, row.step_time_s) == (0.2, 7.0, 0.5)
    assert row.interval_s == 2.5 and row.measured_mtbf_s == 40.0  # 40 s wall / 1 restart
    assert math.isclose(row.predicted_goodput, expected_goodput(2.5, 0.2, 7.0, 40.0))
    assert math.isclose(row.predicted_goodput_nominal, expected_goodput(2.5, 0.2, 7.0, 30.0))
    assert row.interruptions == 1 and row.interruption_mtbf_s == 40.0
    assert math.isclose(row.predicted_goodput_interruptions, row.predicted_goodput)
    assert predicted_goodput(None, 0.2, 7.0, 40.0) is None


def test_cli_table_and_exit_status(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    good, bad = _run_dir(tmp_path, "a"), _run_dir(tmp_path, "b", broken=True)
    assert main([str(good)]) == 0
    assert "1 of 1 run(s) passed" in capsys.readouterr().out
    assert main([str(good), str(bad)]) == 1
    out = capsys.readouterr().out
    assert "1 of 2 run(s) passed" in out and "**no**" in out
    assert main([str(tmp_path / "missing")]) == 2
