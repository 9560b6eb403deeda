"""The files a scenario's training runs: one rule for relative paths (the scenario file's
folder), and a reference-cache key that follows the script's content and its imports."""

from __future__ import annotations

from pathlib import Path

import pytest

from relight.chaos.commands import TrainingFileError, check_training_files, training_command
from relight.chaos.fingerprint import local_imports
from relight.chaos.reference import reference_key
from relight.chaos.scenario import Scenario, parse_scenario


def _project(root: Path) -> Path:
    """A user's repository: ci/chaos.toml next to train.py's folder, helpers beside it."""
    (root / "ci").mkdir(parents=True)
    (root / "train.py").write_text(
        "import os, json\nimport helpers\nfrom pkg import sub\nfrom pkg.mod import f\n")
    (root / "helpers.py").write_text("from . import nothing_here\nimport torch\nX = 1\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "sub.py").write_text("Y = 2\n")
    (root / "pkg" / "mod.py").write_text("def f(): return 3\n")
    (root / "unused.py").write_text("Z = 4\n")
    return root


def _scenario(root: Path, command: list[str]) -> Scenario:
    return parse_scenario({"name": "user", "training": {"command": command}},
                          source=str(root / "ci" / "chaos.toml"))


def test_local_imports_follow_the_scripts_own_modules(tmp_path: Path) -> None:
    root = _project(tmp_path)
    got = [p.relative_to(root.resolve()).as_posix() for p in local_imports(root / "train.py")]
    assert got == ["helpers.py", "pkg/__init__.py", "pkg/mod.py", "pkg/sub.py", "train.py"]


def test_a_relative_script_is_found_beside_the_scenario_and_only_there(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _project(tmp_path / "repo")
    scenario = _scenario(root, ["../train.py", "--flag"])
    argv, env = training_command(scenario, "/ckpt", Path("/m.jsonl"))
    assert argv[1:] == [str((root / "train.py").resolve()), "--flag"]
    assert env["RELIGHT_CKPT_URL"] == "/ckpt" and env["RELIGHT_TARGET_STEP"] == "20"
    # A file of the same name in the current directory is never taken instead.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "train.py").write_text("")
    monkeypatch.chdir(elsewhere)
    with pytest.raises(TrainingFileError, match="scenario file's folder"):
        check_training_files(_scenario(root, ["train.py"]))
    assert training_command(scenario, "/c", Path("/m"))[0][1] == str(
        (root / "train.py").resolve())


def test_placeholders_and_overrides_reach_the_script(tmp_path: Path) -> None:
    root = _project(tmp_path)
    scenario = parse_scenario({
        "name": "user", "target_step": 40,
        "training": {"command": ["../train.py", "--out={scenario_dir}/o", "{target_step}"],
                     "overrides": {"lr": 0.1, "name": "a b", "on": True}},
        "checkpoint": {"interval": 4, "keep_last": 2},
    }, source=str(root / "ci" / "chaos.toml"))
    argv, env = training_command(scenario, "/ckpt", Path("/m.jsonl"))
    assert argv[2:] == [f"--out={root / 'ci'}/o", "40", "--lr=0.1", '--name="a b"',
                        "--on=true"]
    assert env["RELIGHT_CKPT_INTERVAL"] == "4" and env["RELIGHT_CKPT_KEEP_LAST"] == "2"


def test_the_reference_key_follows_the_scripts_content(tmp_path: Path) -> None:
    root = _project(tmp_path)
    scenario = _scenario(root, ["../train.py"])
    key = reference_key(scenario, root)
    assert reference_key(scenario.with_seed(7), root) == key  # the seed moves only faults
    (root / "unused.py").write_text("Z = 5\n")
    assert reference_key(scenario, root) == key  # not imported: not part of the run
    (root / "pkg" / "sub.py").write_text("Y = 3\n")
    edited = reference_key(scenario, root)
    assert edited != key
    (root / "train.py").write_text((root / "train.py").read_text() + "# lr warm-up 10\n")
    assert reference_key(scenario, root) != edited


def test_a_file_argument_is_part_of_the_key(tmp_path: Path) -> None:
    root = _project(tmp_path)
    (root / "conf.toml").write_text("lr = 1\n")
    scenario = _scenario(root, ["../train.py", "conf.toml"])
    key = reference_key(scenario, root)
    (root / "conf.toml").write_text("lr = 2\n")
    assert reference_key(scenario, root) != key
