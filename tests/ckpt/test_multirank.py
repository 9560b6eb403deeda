"""Multi-rank tests on real gloo processes: any layout saved, any layout loaded,
bytes read, replica dedupe, manager restore across layouts, and rank crashes."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from relight import ckpt, storage
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.storage.testing import corrupt_object
from tests.ckpt._pool import RankFailure, RankPool

pytestmark = pytest.mark.multirank

WORLD = 4
MESHES = [[1], [2], [3], [4], [2, 2], [1, 2, 2]]


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    try:
        p.run("tests.ckpt.cases:prepare", sizes=[1, 2, 3], meshes=MESHES, timeout=240)
        yield p
    finally:
        p.close()


@st.composite
def placements(draw, mesh: list[int], shape: list[int]) -> list[str]:
    ndim = len(shape)
    if draw(st.integers(0, 9)) == 0:
        return ["plain"]
    if len(mesh) == 2 and draw(st.booleans()):
        d = draw(st.integers(0, ndim - 1))
        # FSDP2 over TP on the same dim: strided sharding (DTensor builds it for even dims)
        if shape[d] % (mesh[0] * mesh[1]) == 0 and draw(st.booleans()):
            return [f"SS{d}:{mesh[1]}", f"S{d}"]
    return [draw(st.sampled_from(["R"] + [f"S{d}" for d in range(ndim)])) for _ in mesh]


@st.composite
def cases(draw) -> dict:
    n = draw(st.integers(1, 3))
    tensors = []
    for i in range(n):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 12, 13, 16, 24])) for _ in range(ndim)]
        dtype = draw(st.sampled_from(["float32", "bfloat16", "float16", "int64"]))
        tensors.append({"name": f"t{i}", "shape": shape, "dtype": dtype})
    save_mesh = draw(st.sampled_from(MESHES))
    load_mesh = draw(st.sampled_from(MESHES))
    return {
        "tensors": tensors,
        "seed": draw(st.integers(0, 10_000)),
        "save_mesh": save_mesh,
        "save_pl": [draw(placements(save_mesh, t["shape"])) for t in tensors],
        "load_mesh": load_mesh,
        "load_pl": [draw(placements(load_mesh, t["shape"])) for t in tensors],
        "async_save": draw(st.booleans()),
        "broadcast": draw(st.booleans()),
        # small thresholds so tiny tensors exercise grid, pieces, inner chunks and packing
        "options": {"pack_bytes": draw(st.sampled_from([0, 256, 1 << 20])),
                    "inner_bytes": draw(st.sampled_from([64, 512, 1 << 20])),
                    # zstd takes tensorstore's path, uncompressed shards the direct one
                    "compression": draw(st.sampled_from([None, "zstd"])),
                    "pipelined_staging": draw(st.booleans()),
                    "commit_timeout_s": 20.0},
        "values": {"step": draw(st.integers(0, 100)), "tag": "x"},
    }


def _check(results: list[dict], case: dict) -> None:
    n_load = 1
    for s in case["load_mesh"]:
        n_load *= s
    for r in results[:n_load]:
        assert r["mismatch"] == [], (r, case)
        assert r["values_ok"], (r, case)


_counter = iter(range(10**6))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_any_layout_to_any_layout_file(pool, tmp_path_factory, case) -> None:
    url = str(tmp_path_factory.mktemp("prop") / "ck")
    _check(pool.run("tests.ckpt.cases:save_load", url=url, **case), case)


@pytest.mark.s3
@pytest.mark.long  # the same layouts as the file variant; S3 saves and loads run in CI elsewhere
def test_any_layout_to_any_layout_s3(pool, s3_url) -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}

    @settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def prop(case):
        url = f"{s3_url}/ex{next(_counter)}"
        _check(pool.run("tests.ckpt.cases:save_load", url=url, env=env, **case), case)

    prop()


def test_reshard_reads_only_needed_bytes(pool, tmp_path) -> None:
    """FSDP-style Shard(0) over 4 saved, loaded as dp2 x tp2 (Shard(0), Shard(1)) with
    direct reads: every rank reads <= 1.1x the bytes of its region."""
    tensors = [{"name": "w", "shape": [2048, 2048], "dtype": "float32"},
               {"name": "e", "shape": [1000, 1536], "dtype": "bfloat16"}]
    res = pool.run("tests.ckpt.cases:save_load", url=str(tmp_path / "ck"), tensors=tensors,
                   seed=1, save_mesh=[4], save_pl=[["S0"], ["S0"]], load_mesh=[2, 2],
                   load_pl=[["S0", "S1"], ["S1", "S0"]], broadcast=False)
    for r in res:
        assert r["mismatch"] == []
        assert r["bytes_read"] <= 1.1 * r["bytes_needed"], r


def test_replicas_written_once_and_read_once(pool, tmp_path) -> None:
    """dp2 x tp2 with Replicate over dp: each distinct shard written once, the write work
    spread over both replicas; on load each replica group reads its region once."""
    tensors = [{"name": f"w{i}", "shape": [512, 512], "dtype": "float32"} for i in range(4)]
    pl = [["R", "S0"]] * 4
    res = pool.run("tests.ckpt.cases:save_load", url=str(tmp_path / "ck"), tensors=tensors,
                   seed=2, save_mesh=[2, 2], save_pl=pl, load_mesh=[2, 2], load_pl=pl,
                   broadcast=True)
    total = 4 * 512 * 512 * 4
    written = [r["bytes_written"] for r in res]
    assert sum(written) == total  # no duplicate writes
    assert all(w == total // 4 for w in written), written  # spread over replicas
    read = [r["bytes_read_info"] for r in res]
    assert sum(read) <= 1.1 * total, read  # each region read once, then sent
    assert all(r["mismatch"] == [] for r in res)


def test_manager_restore_into_new_layout_with_fallback(pool, tmp_path) -> None:
    root = str(tmp_path / "run")
    tensors = [{"name": "w", "shape": [64, 32], "dtype": "float32"},
               {"name": "m", "shape": [700, 300], "dtype": "float32"}]
    out = pool.run("tests.ckpt.cases:manager_save", root=root, steps=[1, 2, 3],
                   tensors=tensors, mesh=[2, 2], pl=[["S0", "S1"], ["R", "S0"]], keep_last=2)
    assert out[0] == {"latest": 3, "steps": [2, 3]}
    # Damage the newest: every rank must agree to fall back to step 2.
    store = storage.open_store(root).child("step-000000000003")
    m = json.loads(store.get(MANIFEST_KEY))
    arr = m["tensors"]["m"]["array"]
    corrupt_object(store, next(k for k in store.list(arr) if "/c/" in k), "flip", 3)
    res = pool.run("tests.ckpt.cases:manager_restore", root=root, tensors=tensors, mesh=[3],
                   pl=[["S1"], ["S0"]])
    assert [r["step"] for r in res[:3]] == [2, 2, 2]
    assert all(r["ok"] and r["value"] == 2 for r in res[:3])


def test_restore_listing_failure_on_the_coordinator_reaches_every_rank(pool, tmp_path
                                                                         ) -> None:
    # A rank left waiting in the gather would sit out the 300 s collective timeout; the
    # pool's 60 s fails the test first.
    out = pool.run("tests.ckpt.cases:restore_listing_fails_on_coordinator",
                   root=str(tmp_path / "run"), timeout=60)
    assert out[0]["raised"] == "TransientStorageError", out  # the retries gave up
    assert all(r["raised"] and r["storage"] for r in out), out


@pytest.mark.parametrize("victim,where", [(1, "persist"), (0, "commit")])
def test_rank_killed_mid_save(tmp_path, victim, where) -> None:
    root = str(tmp_path / "run")
    tensors = [{"name": "w", "shape": [256, 64], "dtype": "float32"}]
    p = RankPool(2)
    try:
        with pytest.raises(RankFailure) as e:
            p.run("tests.ckpt.cases:crash_save", root=root, tensors=tensors, mesh=[2],
                  pl=[["S0"]], victim=victim, where=where, timeout_s=4.0, timeout=60)
        # exactly the victim died; the survivor saw its save fail
        assert list(e.value.failures) == [victim] and "died" in e.value.failures[victim]
        (survivor,) = e.value.results.values()
        assert survivor["failed"], survivor
    finally:
        p.close(timeout=1.0)  # the survivor's process group is broken: do not wait on it
    store = storage.open_store(root)
    assert not store.exists(f"step-000000000002/{COMMIT_KEY}")
    mgr = ckpt.CheckpointManager(root, keep_last=3, gc_grace_s=0.0)
    assert mgr.latest_step() == 1
    import torch

    sd = {"w": torch.zeros(256, 64)}
    assert mgr.restore(sd) == 1
    from tests.ckpt.cases import global_tensor

    assert torch.equal(sd["w"], global_tensor(tensors[0], 1))
    assert 2 in mgr.gc()
    assert store.list("step-000000000002/") == []
    assert ckpt.verify(mgr.url_of(1)).ok


def test_no_collective_on_the_callers_groups_from_the_background_thread(pool, tmp_path
                                                                        ) -> None:
    res = pool.run("tests.ckpt.cases:collectives_stay_in_foreground", root=str(tmp_path / "r"))
    for r in res:
        assert r["latest"] == 2
        assert r["calls"] > 0 and r["threads"] == ["MainThread"], r


@pytest.mark.parametrize("broken_rank", [0, 2], ids=["coordinator", "other"])
def test_async_commit_goes_over_its_group_and_falls_back_to_storage(pool, tmp_path,
                                                                     broken_rank) -> None:
    """The coordinator of an async save reads no index object from storage while the
    commit group serves; with the group off, or failing on one rank, the save still
    commits through storage, and the next save builds a new group."""
    res = pool.run("tests.ckpt.cases:async_commit_paths", root=str(tmp_path / "r"),
                   broken_rank=broken_rank, timeout=240)
    for rank, r in enumerate(res):
        assert r["errors"] == [], r
        assert r["latest"] == 4 and r["equal"], r
        assert r["collects"] == ([0, 0, 1, 1, 0] if rank == 0 else [0] * 5), (rank, r)
        g = r["groups"]
        assert g[0] is not None and g[0] == g[1] == g[3] and g[4] not in (None, g[0]), r
    assert len({json.dumps(r["groups"]) for r in res}) == 1, res  # agreed on every rank
    assert len({p for r in res for p in r["plans"]}) == 1, res  # planned once, on every rank


def test_async_save_commits_after_the_script_destroys_its_process_group(pool, tmp_path
                                                                       ) -> None:
    res = pool.run("tests.ckpt.cases:async_save_outlives_destroy", root=str(tmp_path / "r"),
                   reinit=f"file://{tmp_path}/reinit", timeout=120)
    for r in res:
        assert r["error"] is None and r["restored"] == 1 and r["value"] == 1.0, res
        assert r["storage_collects"] == 0, res  # committed over the group, no fallback


def test_save_on_one_rank_only_says_every_rank_must_call(pool, tmp_path) -> None:
    out = pool.run("tests.ckpt.cases:save_on_one_rank_only", url=str(tmp_path / "ck"),
                   timeout_s=3.0, timeout=90)
    r = out[0]
    assert r["error"] is not None, r
    assert "the start of the save to" in r["error"] and "step None" in r["error"], r
    assert "Every rank of the process group must make the same ckpt call" in r["error"], r
    assert "ranks [0, 1]" in r["error"] and r["runtime_error"], r
    assert r["waited"] < 60, r


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_hf_llama_user_script_reshards_bitwise(pool, tmp_path, tie) -> None:
    """A user's script around a model the project did not write (HF LlamaForCausalLM
    from a tiny config, tied and untied embeddings), AdamW, state dicts from
    `get_state_dict`: saved under FSDP2 on 4 ranks, restored under FSDP2 on 2 ranks, as a
    plain module in one process and under TP x FSDP2 (2 x 2); the full model and
    optimizer state is bitwise the saved one in every layout."""
    root = str(tmp_path / "run")
    saved = pool.run("tests.ckpt.cases_hf:save_fsdp2", root=root, tie=tie, timeout=300)[0]
    ref = saved["digest"]
    assert any(k.endswith("/exp_avg") for k in ref) and "model/lm_head.weight" in ref
    for fn in ("restore_fsdp2", "restore_plain", "restore_tp"):
        got = pool.run(f"tests.ckpt.cases_hf:{fn}", root=root, tie=tie, timeout=300)[0]
        assert got["step"] == 2 and got["meta"] == {"step": 2, "epoch": 1}, (fn, got)
        assert set(got["digest"]) == set(ref), fn
        differ = sorted(k for k in ref if got["digest"][k] != ref[k])
        assert differ == [], (fn, differ)


def test_async_staging_failure_on_one_rank_raises_on_every_rank(pool, tmp_path) -> None:
    res = pool.run("tests.ckpt.cases:async_staging_fails_on_one_rank",
                   url=str(tmp_path / "ck"), failing=2, timeout=120)
    for rank, r in enumerate(res):
        # Raised by save() itself on every rank, naming the failure: not a commit that
        # times out waiting for rank 2's index. On a new plan and on the cached one.
        for error in r["errors"]:
            assert error is not None and "staging copy failed (injected)" in error, r
            assert rank == 2 or "rank 2" in error, (rank, r)
        assert r["committed"] == [True, True], (rank, r)


def test_gather_reaches_the_coordinator_only(pool) -> None:
    payloads = ["a" * 5000, "", "bc", "d" * 17]
    res = pool.run("tests.ckpt.cases:gather_to_coordinator", payloads=payloads, timeout=60)
    assert res[0]["raw"] == payloads
    assert res[0]["docs"] == [{"rank": r, "p": p} for r, p in enumerate(payloads)]
    for r in res[1:]:
        assert r["raw"] is None and r["docs"] is None, r


def test_sync_save_failure_on_one_rank_raises_on_every_rank(pool, tmp_path) -> None:
    res = pool.run("tests.ckpt.cases:sync_save_fails_on_one_rank",
                   url=str(tmp_path / "ck"), failing=2, timeout=120)
    for rank, r in enumerate(res):
        assert r["error"] is not None and "the disk is full (injected)" in r["error"], r
        assert ("rank 2" if rank == 2 else "rank(s) [2]") in r["error"], r
        assert not r["committed_after_failure"], r
        assert r["loaded_equal"] and r["values"] == {"rank_of_writer": 0}, r


def test_dtensor_layouts_have_their_closed_form(pool) -> None:
    # Which placements the save planner plans per tensor (`ckpt.grid`) rather than per
    # piece: one mesh dim per tensor dim (uneven sizes too), several splitting one dim
    # evenly, FSDP over TP (strided); an uneven nested split keeps its pieces.
    cases = [
        {"shape": [10, 3], "pl": ["S0"]},
        {"shape": [8, 6], "pl": ["S1", "S0"]},
        {"shape": [8, 6], "pl": ["R", "S1"]},
        {"shape": [8, 6], "pl": ["S0", "S0"]},
        {"shape": [8, 6], "pl": ["SS0:2", "S0"]},
        {"shape": [6, 6], "pl": ["S0", "S0"]},
    ]
    one = pool.run("tests.ckpt.cases:grid_forms", mesh=[4], cases=cases[:1], timeout=60)
    two = pool.run("tests.ckpt.cases:grid_forms", mesh=[2, 2], cases=cases[1:], timeout=60)
    splits = [[[0], []], [[1], [0]], [[], [1]], [[0, 1], []], [[1, 0], []]]
    for rank in range(WORLD):
        got = one[rank] + two[rank]
        assert [g is not None for g in got] == [True] * 5 + [False]
        assert all(g["exact"] for g in got[:5])
        assert [g["grid"][3] for g in got[:5]] == splits
        assert got[0]["grid"][:3] == [[4], 0, [1]] and got[1]["grid"][:3] == [[2, 2], 0, [2, 1]]


def test_shared_parts_reach_every_rank_once_each(pool) -> None:
    shared = ["stage-a" * 1000, "", "stage-a" * 1000, "stage-b"]
    own = ["", "x" * 300, "y", ""]
    res = pool.run("tests.ckpt.cases:shared_parts", shared=shared, own=own, timeout=60)
    for r in res:
        assert r["got"] == [list(p) for p in zip(shared, own, strict=True)]
        assert r["one_object_per_text"]
        # an own part over INLINE_BYTES takes a second all-gather; each non-empty text
        # some rank lacks is broadcast once
        assert r["calls"] == {"all_gather": 2, "broadcast": 2}


def test_a_text_every_rank_holds_crosses_as_its_digest_alone(pool) -> None:
    """A load's agreement on one mesh: every rank sends the same grid text and a short
    part of its own: one all-gather, no broadcast."""
    shared = ["mesh-text" * 500] * 4
    own = ['{"err":null,"needs":[]}', "", "z" * 90, "w"]
    res = pool.run("tests.ckpt.cases:shared_parts", shared=shared, own=own, timeout=60)
    for r in res:
        assert r["got"] == [list(p) for p in zip(shared, own, strict=True)]
        assert r["one_object_per_text"]
        assert r["calls"] == {"all_gather": 1, "broadcast": 0}
