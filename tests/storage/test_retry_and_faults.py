"""Retries, error classification, URL parsing and the fault-injecting wrapper."""

from __future__ import annotations

import socket

import pytest

from relight import storage
from relight.storage import (
    InjectedFaultError,
    InvalidStorageURLError,
    ObjectNotFoundError,
    RetryPolicy,
    TransientStorageError,
)
from relight.storage.testing import (
    FaultPlan,
    FaultPlanError,
    FaultyStore,
    corrupt_object,
    plan_from_json,
)

FAST = RetryPolicy(max_attempts=4, base_delay_s=0.0, max_delay_s=0.0)


@pytest.fixture
def store(tmp_path):
    return storage.open_store(tmp_path / "s", retry=FAST)


def test_url_forms() -> None:
    assert storage.parse_url("s3://b/p/q").bucket == "b"
    assert storage.parse_url("s3://b/p/q").root == "p/q"
    assert storage.parse_url("memory://m").scheme == "memory"
    assert storage.parse_url("/x/y").root == "/x/y"
    for bad in ("gs://b/x", "s3://", "", "s3://user:secret@bucket/x", "s3://b/../x"):
        with pytest.raises(storage.StorageError) as info:
            storage.parse_url(bad)
        assert isinstance(info.value, ValueError)


def test_credentials_in_url_are_refused_without_echoing_them() -> None:
    with pytest.raises(InvalidStorageURLError) as info:
        storage.parse_url("s3://AKIA:topsecret@bucket/x")
    assert "topsecret" not in str(info.value)
    assert "topsecret" not in str(info.value.url)


def test_transient_fault_is_retried_then_succeeds(store) -> None:
    faulty = FaultyStore(store, FaultPlan(fail_at=frozenset({0}), fail_times=2))
    faulty.put("k", b"v")
    assert store.get("k") == b"v"
    assert faulty.stats.retries == 2
    assert [e[3] for e in faulty.log.events] == ["error", "error-repeat"]


def test_retry_budget_exhausted_raises_transient(store) -> None:
    faulty = FaultyStore(store, FaultPlan(fail_at=frozenset({0}), fail_times=100))
    with pytest.raises(TransientStorageError) as info:
        faulty.put("k", b"v")
    assert "after 4 attempts" in str(info.value)
    assert not store.exists("k")


def test_permanent_errors_are_not_retried(store) -> None:
    with pytest.raises(ObjectNotFoundError):
        store.get("missing")
    assert store.stats.retries == 0


def test_fault_decisions_are_deterministic_under_a_seed(tmp_path) -> None:
    def run(seed: int) -> list[int]:
        inner = storage.open_store(tmp_path / f"d{seed}-{run.calls}", retry=RetryPolicy(1))
        run.calls += 1
        faulty = FaultyStore(inner, FaultPlan(seed=seed, fail_fraction=0.3, ops=("put",)))
        failed = []
        for i in range(50):
            try:
                faulty.put(f"k{i}", b"x")
            except InjectedFaultError:
                failed.append(i)
        return failed

    run.calls = 0
    first, again, other = run(7), run(7), run(8)
    assert first == again
    assert first != other
    assert 5 < len(first) < 30


def test_corrupt_and_truncate_on_write(store) -> None:
    flip = FaultyStore(store, FaultPlan(corrupt_writes=1.0, ops=("put",)))
    flip.put("a", b"\x00" * 64)
    stored = store.get("a")
    assert len(stored) == 64 and sum(bin(b).count("1") for b in stored) == 1
    cut = FaultyStore(store, FaultPlan(truncate_writes=1.0, ops=("put",)))
    cut.put("b", b"y" * 64)
    assert store.get("b") == b"y" * 32


def test_faults_only_on_matching_keys(store) -> None:
    faulty = FaultyStore(store, FaultPlan(fail_fraction=1.0, fail_times=100, key_contains="marker"))
    faulty.put("data", b"ok")
    with pytest.raises(TransientStorageError):
        faulty.put("commit-marker", b"no")
    assert store.list() == ["data"]


def test_corrupt_object_modes(store) -> None:
    store.put("obj", b"abcdefgh")
    corrupt_object(store, "obj", "truncate")
    assert store.get("obj") == b"abcd"
    corrupt_object(store, "obj", "empty")
    assert store.get("obj") == b""
    with pytest.raises(ValueError):
        corrupt_object(store, "obj", "melt")


def test_unreachable_s3_endpoint_is_transient_and_bounded(monkeypatch) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once we leave: connection refused
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-value")
    bad = storage.open_store(
        "s3://bucket/x", retry=FAST, endpoint_url=f"http://127.0.0.1:{port}"
    )
    with pytest.raises(TransientStorageError) as info:
        bad.get("k")
    assert bad.stats.retries == FAST.max_attempts - 1
    assert "s3cr3t-value" not in str(info.value)


def test_fault_plan_validates() -> None:
    with pytest.raises(ValueError, match="fail_fraction"):
        FaultPlan(fail_fraction=2.0)
    with pytest.raises(ValueError, match="unknown operations"):
        FaultPlan(ops=("teleport",))


def test_open_store_honours_the_fault_plan_env(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("RELIGHT_FAULT_PLAN", '{"fail_at": [0], "fail_times": 4}')
    store = storage.open_store(tmp_path / "env", retry=FAST)
    assert isinstance(store, FaultyStore)
    with pytest.raises(TransientStorageError):
        store.put("k", b"v")
    store.put("k", b"v")  # the failure outlasted exactly one retry budget
    monkeypatch.delenv("RELIGHT_FAULT_PLAN")
    assert not isinstance(storage.open_store(tmp_path / "env"), FaultyStore)


def test_fault_plan_file_is_reread_when_it_changes(tmp_path, monkeypatch) -> None:
    plan_file = tmp_path / "plan.json"
    plan_file.write_text("")
    monkeypatch.setenv("RELIGHT_FAULT_PLAN", f"@{plan_file}")
    store = storage.open_store(tmp_path / "live", retry=RetryPolicy(1))
    store.put("before", b"ok")
    plan_file.write_text('{"fail_fraction": 1.0, "ops": ["put"]}')
    import os
    import time
    os.utime(plan_file, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))
    time.sleep(0.25)
    with pytest.raises(InjectedFaultError):
        store.put("after", b"no")


@pytest.mark.parametrize("text,field", [('{"nope": 1}', "nope"), ('{"seed": "x"}', "seed"),
                                        ("[1]", "JSON object"), ("{", "not valid JSON")])
def test_bad_fault_plan_json_names_the_problem(text, field) -> None:
    with pytest.raises(FaultPlanError, match=field):
        plan_from_json(text)


def test_warming_the_s3_sdk_leaves_nothing_running(monkeypatch) -> None:
    """elastic.warm forks workers after it: no thread may outlive it, and it must not
    need a server or credentials (it sends nothing)."""
    import threading

    from relight.storage.settings import warm_s3_sdk

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    before = {t.ident for t in threading.enumerate()}
    assert warm_s3_sdk() is True
    # No thread started by it lives on; a thread of an earlier test may have ended
    # meanwhile, so the set may shrink.
    assert {t.ident for t in threading.enumerate()} <= before
