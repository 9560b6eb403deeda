"""`relight chaos`: exit codes and re-rendering, without starting a cluster."""

from __future__ import annotations

import sys
from pathlib import Path

from relight.chaos.cli import EXIT_BROKEN, EXIT_OK, EXIT_USAGE, main
from relight.chaos.report import write_report

sys.path.insert(0, str(Path(__file__).parent))
from test_report import _report  # noqa: E402


def test_report_exit_codes(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    write_report(tmp_path / "ok", _report())
    write_report(tmp_path / "bad", _report(broken=True))
    assert main(["report", str(tmp_path / "ok"), "--junit", str(tmp_path / "j.xml")]) == EXIT_OK
    assert (tmp_path / "j.xml").is_file()
    assert main(["report", str(tmp_path / "bad")]) == EXIT_BROKEN
    assert "BROKEN" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == EXIT_USAGE


def test_invalid_scenario_is_a_usage_error(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[cluster]\nnodes = 0\n')
    assert main(["run", str(bad), "--out", str(tmp_path / "out")]) == EXIT_USAGE
    assert "cluster.nodes" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_missing_training_file_is_a_usage_error(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    (tmp_path / "ci").mkdir()
    (tmp_path / "train.py").write_text("")  # beside the scenario's folder, not in it
    scenario = tmp_path / "ci" / "chaos.toml"
    scenario.write_text('name = "x"\n[training]\ncommand = ["train.py"]\n')
    assert main(["run", str(scenario), "--out", str(tmp_path / "out")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(tmp_path / "ci" / "train.py") in err and "scenario file's folder" in err
    assert not (tmp_path / "out").exists()
    assert main(["check-script", str(tmp_path / "nope.py")]) == EXIT_USAGE
