"""The report renders what the verifier found: JSON, Markdown, a real PNG, JUnit XML."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from xml.etree import ElementTree as ET

from relight.chaos.faults import FaultEvent, FaultKind
from relight.chaos.report import build_report, load_report, percentile, write_junit, write_report
from relight.chaos.verifier import verify

sys.path.insert(0, str(Path(__file__).parent))
from test_verifier import simulate  # noqa: E402


def _report(broken: bool = False) -> dict:
    ev = simulate([8.5])
    if broken:
        ev.verified[10] = "crc mismatch"
    fault = FaultEvent(index=0, kind=FaultKind.KILL_WORKER, trigger="step>=8", time=8.5, step=8,
                       node=0, pids=[123])
    fault.detected_at, fault.rendezvous_at, fault.first_step_at = 9.0, 10.5, 11.5
    return build_report(
        scenario={"name": "unit", "target_step": 20}, seed=3, results=verify(ev),
        faults=[fault.to_dict()], records=ev.records, reference=ev.reference,
        started_at=0.0, ended_at=40.0, reference_wall_s=20.0,
    )


def test_report_files(tmp_path: Path) -> None:
    rep = _report()
    assert rep["passed"]
    assert rep["recovery"]["first_step"]["median_s"] == 3.0
    assert rep["faults"][0]["detect_s"] == 0.5
    # 20 surviving steps x 0.5 s each over 40 s of wall time.
    assert rep["goodput"]["goodput"] == 0.25
    paths = write_report(tmp_path, rep)
    assert load_report(tmp_path)["seed"] == 3
    png = paths["png"].read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000
    md = paths["markdown"].read_text()
    assert "PASSED" in md and "kill_worker" in md
    json.loads(paths["json"].read_text())


def test_junit_marks_broken_invariant(tmp_path: Path) -> None:
    rep = _report(broken=True)
    assert not rep["passed"]
    write_junit(tmp_path / "j.xml", rep)
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert suite.get("tests") == "7" and suite.get("failures") == "1"
    failed = [c.get("name") for c in suite.iter("testcase") if c.find("failure") is not None]
    assert failed == ["invariant_3_committed_checkpoints_verify,_only_committed_ones_load"]


def test_percentile() -> None:
    assert percentile([], 90) is None
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9
    assert percentile([5.0], 50) == 5.0
