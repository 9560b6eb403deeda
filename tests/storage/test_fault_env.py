"""The fault-plan hook: JSON checked field by field, a plan file that switches faults on
and off in a running process, and the start-up shim that wraps `storage.open_store`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relight import storage
from relight.storage.fault_env import (
    FaultPlanError,
    ReloadingFaultyStore,
    plan_from_json,
    wrap_store_from_env,
    write_plan_file,
)

ROOT = Path(__file__).resolve().parents[2]


def test_plan_from_json() -> None:
    plan = plan_from_json('{"fail_at": [1, 3], "ops": ["put"], "latency_s": 0.1, "seed": 2}')
    assert plan.fail_at == frozenset({1, 3}) and plan.ops == ("put",)
    for bad, word in [("[1]", "object"), ('{"boom": 1}', "unknown field"),
                      ('{"fail_fraction": "x"}', "wrong type"), ('{"ops": ["rm"]}', "unknown ops"),
                      ('{"fail_fraction": 2.0}', "must be in"), ("{", "not valid JSON")]:
        with pytest.raises(FaultPlanError, match=word):
            plan_from_json(bad)


def test_fault_injection_is_a_testing_surface_not_storage_api(tmp_path: Path,
                                                               monkeypatch) -> None:
    from relight import storage

    faults = {"FaultyStore", "FaultPlan", "FaultLog", "corrupt_object", "FaultPlanError",
              "plan_from_json", "wrap_store_from_env"}
    assert not faults & set(storage.__all__)
    assert faults <= set(storage.testing.__all__)
    monkeypatch.delenv(storage.testing.FAULT_PLAN_ENV, raising=False)
    plain = storage.open_store(tmp_path / "plain")
    assert not isinstance(plain, storage.testing.FaultyStore)
    monkeypatch.setenv(storage.testing.FAULT_PLAN_ENV, '{"fail_at": [0]}')
    assert isinstance(storage.open_store(tmp_path / "opted-in"), storage.testing.FaultyStore)


def test_unset_env_returns_the_store_itself(tmp_path: Path) -> None:
    store = storage.open_store(str(tmp_path))
    assert wrap_store_from_env(store, {}) is store
    wrapped = wrap_store_from_env(store, {"RELIGHT_FAULT_PLAN": '{"fail_at": [0]}'})
    wrapped.put("k", b"v")  # operation 0 fails once; the store's retry succeeds
    assert wrapped.log.events[0][1:] == ("put", str(tmp_path / "k"), "error")
    assert wrapped.stats.retries == 1


def test_plan_file_switches_faults_on_and_off(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    store = wrap_store_from_env(storage.open_store(str(tmp_path / "s")),
                                {"RELIGHT_FAULT_PLAN": f"@{plan}"})
    assert isinstance(store, ReloadingFaultyStore)
    store.put("a", b"1")  # no file: no faults
    write_plan_file(plan, {"fail_fraction": 1.0, "fail_times": 1000, "ops": ["put"]})
    time.sleep(0.25)
    with pytest.raises(storage.TransientStorageError):
        store.child("sub").put("b", b"2")  # children follow the same file
    write_plan_file(plan, None)
    time.sleep(0.25)
    store.put("c", b"3")
    assert store.get("a") == b"1" and store.get("c") == b"3"


def test_training_processes_follow_the_plan_file(tmp_path: Path) -> None:
    """What the runner relies on: a child process that merely calls open_store obeys the
    plan file the harness writes."""
    plan = tmp_path / "plan.json"
    write_plan_file(plan, {"fail_at": [0], "ops": ["put"]})
    target = str(tmp_path / "s")
    code = (f"import json; from relight import storage; s = storage.open_store({target!r}); "
            "print(json.dumps([type(s).__name__, s.plan.fail_at == frozenset({0})]))")
    env = {**os.environ, "RELIGHT_FAULT_PLAN": f"@{plan}"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["ReloadingFaultyStore", True]
