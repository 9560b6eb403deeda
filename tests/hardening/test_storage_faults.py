"""A transient storage error at call k, for every k of a save and of a load
(`storage.testing.FaultPlan(fail_at={k})`): a save either commits correct data or leaves no
commit marker, a load returns the right values or raises a typed error, and the older
checkpoint beside them is never touched."""

from __future__ import annotations

import uuid

import pytest

from relight import ckpt, storage
from relight.ckpt.format import COMMIT_KEY
from relight.ckpt.root_layout import step_dir
from relight.storage.testing import FaultPlan, FaultyStore

from ._util import (
    OPTIONS,
    TYPED,
    assert_bitwise,
    local_store,
    make_state,
    snapshot,
    tally,
    zeros_like,
)

NO_RETRY = storage.RetryPolicy(max_attempts=1)
FAST_RETRY = storage.RetryPolicy(max_attempts=3, base_delay_s=0.0, max_delay_s=0.0)


def _fresh_root(backend: str, tmp_path, request) -> storage.Store:
    if backend == "file":
        return local_store(tmp_path / uuid.uuid4().hex)
    if backend == "s3":
        return storage.open_store(f"{request.getfixturevalue('s3_url')}/{uuid.uuid4().hex}")
    return storage.open_store(f"memory://faults/{uuid.uuid4().hex}")


SWEEPS = [("file", "none"), ("memory", "none"), ("memory", "retried"),
          pytest.param(("s3", "none"), marks=[pytest.mark.s3, pytest.mark.slow, pytest.mark.long])]
"""(backend, retries): without retries every injected fault reaches the engine; with
them (memory only: the same code path, faster) every fault must be absorbed. The S3
sweep runs against the real server (SeaweedFS)."""
IDS = ["file-none", "memory-none", "memory-retried", "s3-none"]


@pytest.fixture
def template(request, tmp_path):
    """A run root holding committed step 1, as objects to copy into fresh roots."""
    backend = request.node.callspec.params["sweep"][0]
    root = _fresh_root(backend, tmp_path, request)
    ckpt.CheckpointManager(root, options=OPTIONS).save(1, make_state(1), async_save=False)
    objects = {k: root.get(k) for k in root.list()}

    def fresh() -> storage.Store:
        store = _fresh_root(backend, tmp_path, request)
        for key, data in objects.items():
            store.put(key, data)
        return store
    return fresh


def _ops(fn) -> int:
    """How many storage calls `fn(store)` makes through a counting wrapper."""
    counted = []

    def run(store: storage.Store) -> None:
        faulty = FaultyStore(store, FaultPlan())
        fn(faulty)
        counted.append(faulty.log.count)
    return run, counted


def _save(store: storage.Store) -> None:
    ckpt.CheckpointManager(store, options=OPTIONS).save(2, make_state(2), async_save=False)


def _check_root(root: storage.Store, older: dict[str, str]) -> bool:
    """Step 1 untouched and loadable; step 2 committed => bitwise. Returns committed."""
    assert snapshot(root, step_dir(1)) == older
    got = zeros_like(make_state(1))
    ckpt.load(got, root.child(step_dir(1)))
    assert_bitwise(got, make_state(1))
    mgr = ckpt.CheckpointManager(root)
    committed = root.exists(f"{step_dir(2)}/{COMMIT_KEY}")
    assert mgr.committed_steps() == ([1, 2] if committed else [1])
    if committed:
        got = zeros_like(make_state(2))
        ckpt.load(got, root.child(step_dir(2)))
        assert_bitwise(got, make_state(2))
    tally("checkpoints_checked", 1 + committed)
    return committed


@pytest.mark.parametrize("sweep", SWEEPS, ids=IDS)
def test_save_with_a_fault_at_every_call(template, sweep: tuple[str, str]) -> None:
    retry = sweep[1]
    count, n = _ops(_save)
    count(template())
    assert n[0] > 10
    outcomes = {"committed": 0, "no marker": 0}
    for k in range(n[0]):
        root = template()
        older = snapshot(root, step_dir(1))
        faulty = FaultyStore(root, FaultPlan(fail_at=frozenset({k})))
        faulty.retry = NO_RETRY if retry == "none" else FAST_RETRY
        error = None
        try:
            _save(faulty)
        except Exception as e:  # noqa: BLE001 - checked below
            error = e
        assert faulty.log.events and faulty.log.events[0][0] == k, "fault not injected"
        assert error is None or isinstance(error, TYPED), f"call {k}: untyped {error!r}"
        committed = _check_root(root, older)
        if retry == "retried":
            assert error is None and committed, f"call {k}: a retried fault lost the save"
        assert not (error and committed), f"call {k}: committed but reported {error!r}"
        outcomes["committed" if committed else "no marker"] += 1
        tally("faults_injected")
        tally("runs_completed")
    if retry == "none":
        assert outcomes["no marker"] > 0 and outcomes["committed"] > 0, outcomes


@pytest.mark.parametrize("sweep", SWEEPS, ids=IDS)
def test_load_with_a_fault_at_every_call(template, sweep: tuple[str, str]) -> None:
    retry = sweep[1]
    root = template()
    _save(root)
    url = step_dir(2)
    count, n = _ops(lambda s: ckpt.load(zeros_like(make_state(2)), s.child(url)))
    count(root)
    assert n[0] > 3
    failed = 0
    for k in range(n[0]):
        faulty = FaultyStore(root, FaultPlan(fail_at=frozenset({k})))
        faulty.retry = NO_RETRY if retry == "none" else FAST_RETRY
        got = zeros_like(make_state(2))
        try:
            ckpt.load(got, faulty.child(url))
        except Exception as e:  # noqa: BLE001 - checked below
            assert retry == "none" and isinstance(e, TYPED), f"call {k}: {e!r}"
            failed += 1
        else:
            assert_bitwise(got, make_state(2))
        assert faulty.log.events and faulty.log.events[0][0] == k
        tally("faults_injected")
        tally("runs_completed")
    assert failed == (n[0] if retry == "none" else 0)
