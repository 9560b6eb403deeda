"""Single-process tests: round trips, format readability, typed errors, retention, faults."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
import tensorstore as ts
import torch

from relight import ckpt, storage
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.ckpt.manifest import crc32c
from relight.storage.testing import FaultPlan, FaultyStore, corrupt_object


class Counter:
    def __init__(self) -> None:
        self.n = 0
        self.buf = torch.zeros(4)

    def state_dict(self):
        return {"n": self.n, "buf": self.buf}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.buf.copy_(sd["buf"])


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    c = Counter()
    c.n = seed + 5
    c.buf += seed
    return {
        "model": {"w": torch.randn(300, 500, generator=g), "b": torch.randn(500, generator=g)},
        "half": torch.randn(40, 30, generator=g).half(),
        "bf": torch.randn(700, 400, generator=g).bfloat16(),
        "idx": torch.randint(0, 1 << 50, (17,), generator=g),
        "flag": torch.tensor([True, False]),
        "scalar": torch.tensor(3.5 + seed),
        "cfg": {"lr": 0.1 * (seed + 1), "betas": [0.9, 0.95], "name": "x", "none": None},
        "list": [torch.ones(3) * seed, 7],
        "counter": c,
    }


def zeros_like_state() -> dict:
    s = make_state(0)

    def z(v):
        if isinstance(v, torch.Tensor):
            return torch.zeros_like(v)
        if isinstance(v, dict):
            return {k: z(x) for k, x in v.items()}
        if isinstance(v, list):
            return [z(x) for x in v]
        return v
    out = {k: (z(v) if k != "counter" else Counter()) for k, v in s.items()}
    out["cfg"] = None
    out["list"][1] = 0
    return out


def assert_state_equal(a: dict, b: dict) -> None:
    for k in ("half", "bf", "idx", "flag", "scalar"):
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(a["model"]["w"], b["model"]["w"])
    assert torch.equal(a["model"]["b"], b["model"]["b"])
    assert a["cfg"] == b["cfg"]
    assert torch.equal(a["list"][0], b["list"][0]) and a["list"][1] == b["list"][1]
    assert a["counter"].n == b["counter"].n and torch.equal(a["counter"].buf, b["counter"].buf)


@pytest.fixture(params=["file", "memory"])
def url(request, tmp_path) -> str:
    if request.param == "file":
        return str(tmp_path / "ck")
    return f"memory://single-{id(request)}/ck"


@pytest.mark.parametrize("async_save", [False, True])
def test_roundtrip(url: str, async_save: bool) -> None:
    src = make_state(1)
    h = ckpt.save(src, url, async_save=async_save, step=3, config={"run": "a"})
    h.wait()
    assert h.done()
    dst = zeros_like_state()
    info = ckpt.load(dst, url)
    assert_state_equal(dst, src)
    assert info.step == 3 and info.config == {"run": "a"}
    assert ckpt.verify(url).ok


def test_never_overwrites_committed(tmp_path) -> None:
    ckpt.save(make_state(), tmp_path / "c")
    with pytest.raises(ckpt.CheckpointExistsError):
        ckpt.save(make_state(1), tmp_path / "c")
    h = ckpt.save(make_state(1), tmp_path / "c", async_save=True)  # checked in the background
    with pytest.raises(ckpt.CheckpointExistsError):
        h.wait(timeout=60)
    dst = zeros_like_state()
    ckpt.load(dst, tmp_path / "c")
    assert_state_equal(dst, make_state(0))


def test_readable_with_plain_tensorstore_and_zarr(tmp_path) -> None:
    import zarr

    src = {"big": torch.randn(512, 384), "small": torch.arange(10, dtype=torch.float32)}
    ckpt.save(src, tmp_path / "c")
    m = json.loads((tmp_path / "c" / MANIFEST_KEY).read_text())
    big = m["tensors"]["big"]
    assert big["storage"] == "grid"
    arr = zarr.open_array(str(tmp_path / "c" / big["array"]), mode="r")
    np.testing.assert_array_equal(arr[...], src["big"].numpy())
    t = ts.open({"driver": "zarr3", "kvstore": {"driver": "file",
                 "path": str(tmp_path / "c" / big["array"])}}).result()
    np.testing.assert_array_equal(t.read().result(), src["big"].numpy())
    small = m["tensors"]["small"]  # packed, in grid form (docs/format.md)
    assert small["storage"] == "packed" and small["chunks"] == [10]
    (array,), (offset,) = small["arrays"], small["byte_offsets"]
    path = sorted(m["packed"])[array]
    packed = zarr.open_array(str(tmp_path / "c" / path), mode="r")
    raw = packed[offset: offset + 40]
    np.testing.assert_array_equal(np.frombuffer(raw.tobytes(), "<f4"), src["small"].numpy())


def test_small_tensors_are_packed(tmp_path) -> None:
    src = {f"layer{i}": {"norm": torch.randn(64), "bias": torch.randn(32)} for i in range(500)}
    ckpt.save(src, tmp_path / "c")
    store = storage.open_store(tmp_path / "c")
    objects = store.list()
    assert len(objects) < 10, objects  # 1000 tensors -> a handful of objects
    dst = {k: {kk: torch.zeros_like(vv) for kk, vv in v.items()} for k, v in src.items()}
    ckpt.load(dst, store)
    assert all(torch.equal(dst[k]["norm"], src[k]["norm"]) for k in src)


# ---------------------------------------------------------------------------- bad inputs


def _rewrite_manifest(store: storage.Store, edit) -> None:
    m = json.loads(store.get(MANIFEST_KEY))
    edit(m)
    raw = json.dumps(m).encode()
    store.put(MANIFEST_KEY, raw)
    commit = json.loads(store.get(COMMIT_KEY))
    commit.update(manifest_bytes=len(raw), manifest_crc32c=crc32c(raw))
    store.put(COMMIT_KEY, json.dumps(commit).encode())


@pytest.fixture
def saved(tmp_path) -> storage.Store:
    store = storage.open_store(tmp_path / "c")
    ckpt.save({"w": torch.randn(600, 600), "v": torch.randn(8), "n": 3}, store)
    return store


def _target() -> dict:
    return {"w": torch.zeros(600, 600), "v": torch.zeros(8), "n": 0}


def test_not_found(tmp_path) -> None:
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        ckpt.load(_target(), tmp_path / "nothing")
    assert isinstance(e.value, FileNotFoundError)


def test_uncommitted_is_not_loaded(saved) -> None:
    saved.delete(COMMIT_KEY)
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.load(_target(), saved)
    assert not ckpt.verify(saved).ok


def test_missing_key(saved) -> None:
    t = _target()
    t["extra_in_target"] = torch.zeros(2)
    with pytest.raises(ckpt.MissingKeyError, match="extra_in_target"):
        ckpt.load(t, saved)


def test_unexpected_key_strict_and_lenient(saved) -> None:
    t = _target()
    del t["v"]
    with pytest.raises(ckpt.UnexpectedKeyError, match="'v'"):
        ckpt.load(t, saved)
    ckpt.load(t, saved, strict=False)
    assert t["n"] == 3


def test_shape_mismatch(saved) -> None:
    t = _target()
    t["w"] = torch.zeros(600, 601)
    with pytest.raises(ckpt.ShapeMismatchError, match="'w'"):
        ckpt.load(t, saved)


def test_dtype_mismatch(saved) -> None:
    t = _target()
    t["w"] = torch.zeros(600, 600, dtype=torch.float64)
    with pytest.raises(ckpt.DtypeMismatchError, match="'w'"):
        ckpt.load(t, saved)


def _chunk_of(store: storage.Store, tensor: str) -> str:
    m = json.loads(store.get(MANIFEST_KEY))
    arr = m["tensors"][tensor]["array"]
    return next(k for k in store.list(arr) if "/c/" in k)


def test_checksum_mismatch(saved) -> None:
    key = _chunk_of(saved, "w")
    corrupt_object(saved, key, "flip", seed=12345)
    with pytest.raises(ckpt.CorruptCheckpointError) as e:
        ckpt.load(_target(), saved)
    assert isinstance(e.value, ckpt.ChecksumMismatchError)
    assert "'w'" in str(e.value) and e.value.tensor == "w"
    report = ckpt.verify(saved)
    assert not report.ok and any("'w'" in p for p in report.problems)


def test_truncated_chunk(saved) -> None:
    key = _chunk_of(saved, "w")
    corrupt_object(saved, key, "truncate")
    with pytest.raises(ckpt.CorruptCheckpointError, match="'w'"):
        ckpt.load(_target(), saved)
    assert not ckpt.verify(saved).ok


def test_missing_chunk(saved) -> None:
    key = _chunk_of(saved, "w")
    saved.delete(key)
    with pytest.raises(ckpt.MissingChunkError, match="'w'"):
        ckpt.load(_target(), saved)
    report = ckpt.verify(saved, read_data=False)
    assert not report.ok and any(key in p for p in report.problems)


def test_damaged_manifest(saved) -> None:
    raw = saved.get(MANIFEST_KEY)
    saved.put(MANIFEST_KEY, raw.replace(b'"w"', b'"W"'))
    with pytest.raises(ckpt.ChecksumMismatchError, match="manifest"):
        ckpt.load(_target(), saved)


def test_unknown_version(saved) -> None:
    _rewrite_manifest(saved, lambda m: m.update(version=99))
    with pytest.raises(ckpt.UnsupportedVersionError, match="99"):
        ckpt.load(_target(), saved)


def test_path_traversal(saved) -> None:
    _rewrite_manifest(saved, lambda m: m["tensors"]["w"].update(array="../../../../etc"))
    with pytest.raises(ckpt.UnsafePathError, match="'w'"):
        ckpt.load(_target(), saved)


def test_absurd_shape(saved) -> None:
    _rewrite_manifest(saved, lambda m: m["tensors"]["w"].update(shape=[2**62, 2**62]))
    with pytest.raises(ckpt.AbsurdShapeError, match="'w'"):
        ckpt.load(_target(), saved)


def test_unsupported_values(tmp_path) -> None:
    with pytest.raises(ckpt.UnsupportedStateError, match="obj"):
        ckpt.save({"obj": object()}, tmp_path / "c")
    with pytest.raises(ckpt.UnsupportedStateError):
        ckpt.save({"c": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "c")


# ---------------------------------------------------------------------------- faults


def test_storage_failing_mid_save_leaves_no_commit(tmp_path, caplog) -> None:
    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, keep_last=2)
    mgr.save(1, make_state(1), async_save=False)
    assert mgr.latest_step() == 1
    # Every put of the next save fails beyond the retry budget.
    faulty = FaultyStore(root, FaultPlan(fail_fraction=1.0, fail_times=100,
                                         ops=("put",), key_contains="step-"))
    faulty.retry = storage.RetryPolicy(max_attempts=2, base_delay_s=0.0, max_delay_s=0.0)
    bad = ckpt.CheckpointManager(faulty, keep_last=2)
    h = bad.save(2, make_state(2), async_save=True)
    with pytest.raises(ckpt.CheckpointSaveError):
        h.wait()
    assert not root.exists(f"step-{2:012d}/{COMMIT_KEY}")
    assert mgr.latest_step() == 1
    dst = zeros_like_state()
    assert mgr.restore(dst) == 1
    assert_state_equal(dst, make_state(1))
    # A later save goes through and GC removes the stale attempt (grace 0).
    mgr2 = ckpt.CheckpointManager(root, keep_last=2, gc_grace_s=0.0)
    mgr2.save(3, make_state(3), async_save=False)
    assert mgr2.committed_steps() == [1, 3]
    assert not root.list(f"step-{2:012d}/")


def test_failed_async_save_reported_by_next_save(tmp_path, caplog) -> None:
    root = storage.open_store(tmp_path / "run")
    faulty = FaultyStore(root, FaultPlan(fail_fraction=1.0, fail_times=100,
                                         ops=("put",), key_contains="COMMIT"))
    mgr = ckpt.CheckpointManager(faulty, keep_last=2)
    mgr.save(1, make_state(1))
    with caplog.at_level(logging.ERROR):
        mgr.save(2, make_state(2))
    assert mgr.failed_saves == 1
    assert "checkpoint step 1 failed" in caplog.text
    with pytest.raises(ckpt.CheckpointSaveError):
        mgr.wait()
    assert mgr.latest_step() is None


# ---------------------------------------------------------------------------- manager


def test_manager_retention_and_latest(tmp_path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path / "run", keep_last=2, keep_every=4)
    for s in range(1, 10):
        mgr.save(s, make_state(s))
    mgr.wait()
    assert mgr.committed_steps() == [4, 8, 9]
    assert mgr.latest_step() == 9
    # an uncommitted newer step is invisible
    store = storage.open_store(tmp_path / "run")
    store.put("step-000000000010/manifest.json", b"{}")
    store.put("steps/000000000010.pending", b"0")
    assert mgr.latest_step() == 9
    # a coordinator killed between its record and COMMIT: newest record, still invisible
    store.put("steps/000000000011.json", b'{"created_unix": 0}')
    assert mgr.latest_step() == 9
    assert mgr.committed_steps() == [4, 8, 9]
    store.put(f"step-000000000011/{COMMIT_KEY}", b"{}")
    assert mgr.latest_step() == 11


def test_restore_falls_back_when_newest_is_damaged(tmp_path, caplog) -> None:
    mgr = ckpt.CheckpointManager(tmp_path / "run", keep_last=3)
    for s in (1, 2):
        mgr.save(s, make_state(s), async_save=False)
    store = storage.open_store(tmp_path / "run/step-000000000002")
    key = _chunk_of(store, "bf")
    corrupt_object(store, key, "flip", seed=7)
    dst = zeros_like_state()
    with caplog.at_level(logging.WARNING):
        assert mgr.restore(dst) == 1
    assert "step 2" in caplog.text and "falling back" in caplog.text
    assert_state_equal(dst, make_state(1))
    with pytest.raises(ckpt.CorruptCheckpointError):
        mgr.restore(zeros_like_state(), step=2)


def test_restore_with_every_checkpoint_damaged_is_not_retryable(tmp_path) -> None:
    """Every committed step damaged: `NoLoadableCheckpointError` (the runtime exits 65 and
    `relight run` stops). Storage failing on the reads instead: the plain, retryable
    `CheckpointNotFoundError`. Either way nothing is deleted."""
    root = storage.open_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, keep_last=3)
    for s in (1, 2):
        mgr.save(s, make_state(s), async_save=False)
    faulty = FaultyStore(root, FaultPlan(fail_fraction=1.0, fail_times=100,
                                         ops=("get",), key_contains="/data/"))
    faulty.retry = storage.RetryPolicy(max_attempts=1, base_delay_s=0.0, max_delay_s=0.0)
    with pytest.raises(ckpt.CheckpointNotFoundError) as e:
        ckpt.CheckpointManager(faulty, keep_last=3).restore(zeros_like_state())
    assert not isinstance(e.value, ckpt.NoLoadableCheckpointError)
    for s in (1, 2):
        step = storage.open_store(tmp_path / f"run/step-{s:012d}")
        corrupt_object(step, _chunk_of(step, "bf"), "flip", seed=7)
    with pytest.raises(ckpt.NoLoadableCheckpointError, match="step 2: .*step 1: ") as e:
        mgr.restore(zeros_like_state())
    assert "relight ckpt verify" in str(e.value)
    assert mgr.committed_steps() == [1, 2]


def test_restore_nothing(tmp_path) -> None:
    with pytest.raises(ckpt.CheckpointNotFoundError):
        ckpt.CheckpointManager(tmp_path / "empty").restore(zeros_like_state())


def test_async_stall_is_a_copy_and_one_save_in_flight(tmp_path) -> None:
    mgr = ckpt.CheckpointManager(tmp_path / "run", keep_last=5)
    state = {"w": torch.randn(2048, 2048)}
    h1 = mgr.save(1, state)
    h2 = mgr.save(2, state)  # waits for h1 first
    assert h1.done()
    mgr.wait()
    assert h2.done() and mgr.committed_steps() == [1, 2]
    assert h2.stall_s < h2.total_s


# ---------------------------------------------------------------------------- pipelined staging


def _slow_staging(monkeypatch, delay: float = 0.5) -> None:
    """Staging that starts late, so a mutation racing it would land in the snapshot."""
    from relight.ckpt.staging import Stager

    real = Stager.run

    def slow(self):
        time.sleep(delay)
        return real(self)
    monkeypatch.setattr(Stager, "run", slow)


def test_pipelined_staging_with_guarded_optimizer_is_not_torn(tmp_path, monkeypatch) -> None:
    _slow_staging(monkeypatch)
    model = torch.nn.Linear(256, 128)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    hook = ckpt.guard_optimizer(opt)
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    opts = ckpt.SaveOptions(pipelined_staging=True)
    h = ckpt.save({"model": model.state_dict()}, tmp_path / "c", async_save=True, options=opts)
    assert not h.staged()  # returned before the copy ran
    model(torch.randn(4, 256)).sum().backward()
    opt.step()  # the guard makes this wait for the copy
    assert opt.ckpt_waited_s > 0 and h.staged()
    h.wait()
    assert h.staged_s >= h.stage_s and h.staged_s > h.stall_s
    assert not torch.equal(model.weight, snap["weight"])
    dst = {"model": {k: torch.zeros_like(v) for k, v in snap.items()}}
    ckpt.load(dst, tmp_path / "c")
    assert all(torch.equal(dst["model"][k], snap[k]) for k in snap)
    hook.remove()


def test_wait_staged_and_default_staging(tmp_path) -> None:
    w = torch.randn(300, 300)
    h = ckpt.save({"w": w}, tmp_path / "a", async_save=True)
    assert h.staged() and h.wait_staged() == 0.0  # default: staged before save() returns
    h.wait()
    before = w.clone()
    h = ckpt.save({"w": w}, tmp_path / "b", async_save=True,
                  options=ckpt.SaveOptions(pipelined_staging=True))
    ckpt.wait_staged()
    assert h.staged()
    w.add_(1)  # allowed now
    h.wait()
    dst = {"w": torch.zeros(300, 300)}
    ckpt.load(dst, tmp_path / "b")
    assert torch.equal(dst["w"], before)


def test_pipelined_staging_failure_is_reported_and_releases_waiters(tmp_path,
                                                                    monkeypatch) -> None:
    from relight.ckpt.staging import Stager

    def broken(self):
        raise RuntimeError("staging copy failed")
    monkeypatch.setattr(Stager, "run", broken)
    h = ckpt.save({"w": torch.randn(300, 300)}, tmp_path / "c", async_save=True,
                  options=ckpt.SaveOptions(pipelined_staging=True, commit_timeout_s=10))
    h.wait_staged(timeout=10)
    with pytest.raises(ckpt.CheckpointSaveError, match="staging copy failed"):
        h.wait(timeout=20)
    assert not storage.open_store(tmp_path / "c").exists(COMMIT_KEY)
