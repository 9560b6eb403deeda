"""The `relight` dispatcher: help, unknown commands, exit codes."""

from __future__ import annotations

import subprocess
import sys

from relight.cli import SUBCOMMANDS, main


def test_help_lists_every_command(capsys) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"  {name}" in out


def test_no_arguments_is_a_usage_error(capsys) -> None:
    assert main([]) == 2
    assert "usage: relight" in capsys.readouterr().out


def test_unknown_command_names_it(capsys) -> None:
    assert main(["teleport"]) == 2
    assert "unknown command 'teleport'" in capsys.readouterr().err


def test_console_script_is_installed() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relight.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "relight <command>" in out.stdout


def test_bench_lists_benchmarks_and_refuses_unknown(capsys) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "ckpt" in out and "recovery" in out
    assert main(["bench", "warp-drive"]) == 2
    assert "unknown benchmark 'warp-drive'" in capsys.readouterr().err


def test_every_subcommand_answers_help(capsys) -> None:
    for name in SUBCOMMANDS:
        try:
            status = main([name, "--help"])
        except SystemExit as e:  # argparse's --help exits 0 where it is not caught
            status = e.code
        assert status in (0, None), name
        assert capsys.readouterr().out.strip(), name


def test_every_help_states_the_exit_codes(capsys) -> None:
    for argv in (["train", "--help"], ["plan", "--help"], ["ckpt", "verify", "--help"],
                 ["ckpt", "ls", "--help"], ["chaos", "--help"], ["bench", "--help"]):
        try:
            main(argv)
        except SystemExit as e:  # argparse's --help exits 0 where it is not caught
            assert e.code == 0, argv
        assert "exit status" in capsys.readouterr().out.lower(), argv


def test_chaos_report_json(tmp_path, capsys) -> None:
    import importlib.util
    import json
    from pathlib import Path

    from relight.chaos.report import write_report

    spec = importlib.util.spec_from_file_location(
        "chaos_test_report", Path(__file__).parent / "chaos" / "test_report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # One report (each re-render draws the loss plot); the exit status carries the verdict.
    write_report(tmp_path / "bad", mod._report(broken=True))
    capsys.readouterr()
    assert main(["chaos", "report", str(tmp_path / "bad"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)  # stdout is exactly one JSON document
    assert out["passed"] is False and any(not inv["ok"] for inv in out["invariants"])
