"""`relight ckpt` CLI: ls, inspect, verify, gc, JSON output and exit codes."""

from __future__ import annotations

import json

import torch

from relight import ckpt, storage
from relight.ckpt.cli import main
from relight.storage.testing import corrupt_object


def _run(tmp_path, steps=(1, 2, 3)) -> str:
    root = str(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, keep_last=5)
    for s in steps:
        mgr.save(s, {"w": torch.randn(300, 300), "step": s}, async_save=False,
                 layout={"dp": 1}, config={"lr": 0.1})
    return root


def test_ls_inspect_verify_gc(tmp_path, capsys) -> None:
    root = _run(tmp_path)
    storage.open_store(root).put("steps/000000000004.pending", b"0")
    assert main(["ls", root, "--json"]) == 0
    entries = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["committed"]) for e in entries] == [(1, True), (2, True), (3, True),
                                                              (4, False)]
    assert entries[0]["layout"] == {"dp": 1} and entries[0]["bytes"] == 300 * 300 * 4
    assert main(["ls", root]) == 0
    assert "uncommitted" in capsys.readouterr().out

    assert main(["inspect", root, "--json"]) == 0
    m = json.loads(capsys.readouterr().out)
    assert m["step"] == 3 and m["tensors"]["w"]["shape"] == [300, 300]
    assert main(["inspect", root, "--step", "1"]) == 0
    assert "float32" in capsys.readouterr().out

    assert main(["verify", root, "--step", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"] is True

    assert main(["gc", root, "--keep-last", "1", "--grace-s", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["deleted"] == [1, 2, 4]
    assert ckpt.CheckpointManager(root).committed_steps() == [3]


def test_exit_codes(tmp_path, capsys) -> None:
    root = _run(tmp_path, steps=(1,))
    ck = storage.open_store(root).child("step-000000000001")
    key = next(k for k in ck.list("data") if "/c/" in k)
    corrupt_object(ck, key, "flip", seed=99)
    assert main(["verify", root]) == 1
    assert "FAILED" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "nothing")]) == 3
    assert main(["inspect", root, "--step", "7"]) == 3
    assert main(["bogus"]) == 2
    assert main(["gc", root]) == 2  # --keep-last is required


def test_verify_checks_the_newest_step_or_all_steps(tmp_path, capsys) -> None:
    root = _run(tmp_path)
    ck = storage.open_store(root).child("step-000000000001")
    corrupt_object(ck, next(k for k in ck.list("data") if "/c/" in k), "flip", seed=3)
    assert main(["verify", root]) == 0  # the newest, step 3, is fine
    assert "step 3" in capsys.readouterr().out
    assert main(["verify", root, "--all-steps", "--json"]) == 1
    reports = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["ok"]) for r in reports] == [(1, False), (2, True), (3, True)]
    assert main(["verify", root, "--all-steps", "--step", "2"]) == 2
