"""The `relight` dispatcher: help, unknown commands, exit codes."""

from __future__ import annotations

import subprocess
import sys

from runtime.cli import SUBCOMMANDS, main


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
        [sys.executable, "-m", "runtime.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "relight <command>" in out.stdout


def test_bench_lists_benchmarks_and_refuses_unknown(capsys) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert "ckpt" in out and "recovery" in out
    assert main(["bench", "warp-drive"]) == 2
    assert "unknown benchmark 'warp-drive'" in capsys.readouterr().err


def test_every_subcommand_module_imports() -> None:
    import importlib

    for module, _ in SUBCOMMANDS.values():
        assert callable(importlib.import_module(module).main), module
