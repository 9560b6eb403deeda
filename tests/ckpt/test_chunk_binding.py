"""Every stored chunk is bound to its place: the save records each inner chunk's crc32c
in the chunk crc32c table, which the manifest binds (`chunk_crc32c_table`); a load
compares every chunk it reads with it, `verify` every chunk. Checkpoints with the record
inline in the manifest (`chunk_crc32c`, written before the table) are checked the same
way, and checkpoints without any record still load."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from relight import ckpt, storage
from relight.ckpt.crc_table import TABLE_FIELD, array_of_key
from relight.ckpt.format import CHUNK_CRCS, MANIFEST_KEY, zarr_metadata
from relight.ckpt.manifest import Manifest, chunk_objects, crc32c, data_arrays, read_manifest
from relight.ckpt.shardio import ShardGeometry, encode_shard, read_shard_region, stored_crcs
from relight.ckpt.tsio import open_array

OPTS = ckpt.SaveOptions(pack_bytes=1 << 10, inner_bytes=4 << 10)


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(64, 48, generator=g), "b": torch.randn(64, 48, generator=g),
            "s": torch.randn(8, generator=g), "t": torch.randn(6, generator=g)}


def _resign(store: storage.Store, m: dict) -> None:
    raw = json.dumps(m).encode()
    store.put(MANIFEST_KEY, raw)
    commit = json.loads(store.get(ckpt.format.COMMIT_KEY))
    commit.update(manifest_bytes=len(raw), manifest_crc32c=crc32c(raw))
    store.put(ckpt.format.COMMIT_KEY, json.dumps(commit).encode())


@pytest.fixture
def saved(tmp_path) -> tuple[storage.Store, dict]:
    store = storage.open_store(tmp_path / "c")
    ckpt.save(_state(1), store, options=OPTS)
    return store, json.loads(store.get(MANIFEST_KEY))


def _crcs(store: storage.Store, key: str) -> list[int | None]:
    crcs = read_manifest(store).chunk_crcs(key)
    assert crcs is not None
    return crcs


def _data_objects(store: storage.Store, m: dict) -> set[str]:
    table = m[TABLE_FIELD]["object"]
    return {k for k in store.list("data/") if not k.endswith(".json") and k != table}


def _key(m: dict, name: str) -> str:
    t = m["tensors"][name]
    if "array" in t:
        arr = t["array"]
    else:
        arr = t["pieces"][0]["array"] if "pieces" in t else sorted(m["packed"])[t["arrays"][0]]
    return arr + ("/c/0/0" if t["storage"] == "grid" else "/c/0")


def test_encode_records_the_crcs_it_stores() -> None:
    geo = ShardGeometry((8, 12), (4, 6), 4)
    crcs: list[int | None] = []
    blob = encode_shard(np.arange(96, dtype=np.float32).reshape(8, 12), geo, crcs)
    assert len(crcs) == geo.n_chunks and len(set(crcs)) == geo.n_chunks
    assert stored_crcs(blob, geo.n_chunks, url="u", key="k", tensor="t") == crcs


def test_tensorstore_edge_shard_read_directly_and_bound(tmp_path) -> None:
    """The partial edge shard of an uneven grid, as tensorstore writes it (inner chunks
    wholly outside the array not stored), read by the direct reader and checked."""
    store = storage.open_store(tmp_path / "e")
    x = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    arr = open_array(store, "a", zarr_metadata([10, 6], "float32", [4, 6], [2, 3], None),
                     read=False).result()
    arr.write(x).result()
    key = "a/c/2/0"  # rows 8-9 of a 4-row shard: 2 of its 4 inner chunks stored
    geo = ShardGeometry((4, 6), (2, 3), 4, valid=(2, 6))
    assert geo.object_bytes == store.size(key)
    crcs = stored_crcs(store.get(key), geo.n_chunks, url=store.url, key=key, tensor="t")
    assert crcs[2:] == [None, None] and None not in crcs[:2]
    for region in [(slice(0, 2), slice(0, 6)), (slice(1, 2), slice(2, 5))]:
        out = np.zeros([r.stop - r.start for r in region], np.float32)
        read_shard_region(store, key, geo, region, out, url=store.url, tensor="t", expect=crcs)
        np.testing.assert_array_equal(out, x[8:10][region])
    wrong = [crcs[1], crcs[0], None, None]
    with pytest.raises(ckpt.ChecksumMismatchError, match=r"inner chunk \(0, 0\)"):
        read_shard_region(store, key, geo, (slice(0, 2), slice(0, 6)),
                          np.zeros((2, 6), np.float32), url=store.url, tensor="t", expect=wrong)


@pytest.fixture(params=["whole", "ranged"])
def fetch(request, monkeypatch) -> str:
    """How a load reads the table: whole (a small table), or one ranged read per array."""
    if request.param == "ranged":
        monkeypatch.setattr(ckpt.crc_table, "WHOLE_BYTES", 0)
    return request.param


def test_every_object_recorded(saved, fetch) -> None:
    """The table gives every stored object the crcs its chunks carry, and the manifest
    holds no inline list."""
    store, m = saved
    man = read_manifest(store)
    assert CHUNK_CRCS not in m and store.exists(m[TABLE_FIELD]["object"])
    assert {k for k, _, _ in chunk_objects(man)} == _data_objects(store, m)
    for key, _, n in chunk_objects(man):
        assert man.chunk_crcs(key) == stored_crcs(store.get(key), n, url="u", key=key, tensor="")


@pytest.mark.parametrize("what", ["other-tensor", "same-tensor", "packed-other-writer"])
def test_misplaced_chunk_refused_by_load_and_verify(saved, tmp_path, what) -> None:
    store, m = saved
    if what == "other-tensor":  # a and b: same shape and chunking, whole object copied
        key = _key(m, "a")
        store.put(key, store.get(_key(m, "b")))
        tensor = "'a'"
    elif what == "same-tensor":  # two of a's inner chunks at each other's place
        key = _key(m, "a")
        blob = bytearray(store.get(key))
        n = len(_crcs(store, key))
        idx = np.frombuffer(bytes(blob[-(16 * n + 4):-4]), "<u8").reshape(-1, 2)
        (o1, nb), (o2, _) = idx[1].tolist(), idx[2].tolist()
        blob[o1:o1 + nb], blob[o2:o2 + nb] = blob[o2:o2 + nb], blob[o1:o1 + nb]
        store.put(key, bytes(blob))
        tensor = "'a'"
    else:  # the packed array of the same checkpoint saved with other values
        other = storage.open_store(tmp_path / "other")
        ckpt.save(_state(2), other, options=OPTS)
        om = json.loads(other.get(MANIFEST_KEY))
        key = _key(m, "s")
        store.put(key, other.get(_key(om, "s")))
        tensor = "packed"
    with pytest.raises(ckpt.ChecksumMismatchError, match="records") as e:
        ckpt.load({k: torch.zeros_like(v) for k, v in _state(1).items()}, store)
    assert e.value.obj == key and tensor in str(e.value)
    report = ckpt.verify(store)
    assert not report.ok and any(key in p and "records" in p for p in report.problems)


ZSTD = ckpt.SaveOptions(compression="zstd", pack_bytes=1 << 10, inner_bytes=4 << 10)


def _swap_inner_chunks(store: storage.Store, key: str, n: int) -> None:
    """Swap the index entries of inner chunks 1 and 2 (index re-signed): both chunks
    stay well formed, each at the other's place. Works for any frame sizes."""
    blob = bytearray(store.get(key))
    at = len(blob) - (16 * n + 4)
    idx = np.frombuffer(bytes(blob[at:-4]), "<u8").reshape(-1, 2).copy()
    idx[[1, 2]] = idx[[2, 1]]
    blob[at:-4] = idx.tobytes()
    blob[-4:] = crc32c(bytes(blob[at:-4])).to_bytes(4, "little")
    store.put(key, bytes(blob))


def test_zstd_checkpoint_loads_through_the_direct_reader(tmp_path) -> None:
    """zstd objects are written by tensorstore and read by `ckpt.shardio`: exact values,
    resharded regions too (a row slice of each tensor), and the bytes really are zstd."""
    store = storage.open_store(tmp_path / "z")
    ckpt.save(_state(1), store, options=ZSTD)
    m = json.loads(store.get(MANIFEST_KEY))
    blob = store.get(_key(m, "a"))
    assert blob[:4] == b"\x28\xb5\x2f\xfd"  # the first inner chunk is a zstd frame
    got = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    ckpt.load(got, store)
    assert all(torch.equal(got[k], v) for k, v in _state(1).items())
    # A region that starts mid-chunk: the reader decodes whole chunks and copies parts.
    from relight.ckpt.manifest import read_manifest
    from relight.ckpt.reader import RegionReader as _Reader
    region = _Reader(store, read_manifest(store), "a", ((5, 7), (50, 30)), torch.float32)
    assert torch.equal(region.result(), _state(1)["a"][5:55, 7:37])


@pytest.mark.parametrize("what", ["zstd-swapped-in-object", "zstd-object-copied",
                                  "0-d-object-copied"])
def test_tensorstore_written_objects_bound_on_load(tmp_path, what) -> None:
    """Objects tensorstore writes (zstd, a lone 0-d tensor) are checked against the
    manifest on load as well as by verify: a well-formed chunk at the wrong place is a
    typed error naming the object, never wrong values."""
    store = storage.open_store(tmp_path / "z")
    state = _state(1)
    if what.startswith("0-d"):
        state = {**state, "u": torch.tensor(1.5), "v": torch.tensor(-2.5)}
        ckpt.save(state, store, options=ckpt.SaveOptions(pack_bytes=0))
    else:
        ckpt.save(state, store, options=ZSTD)
    m = json.loads(store.get(MANIFEST_KEY))
    man = read_manifest(store)
    assert {k for k, _, _ in chunk_objects(man)} == _data_objects(store, m)
    assert ckpt.verify(store).ok
    if what == "zstd-swapped-in-object":
        key = _key(m, "a")
        _swap_inner_chunks(store, key, len(_crcs(store, key)))
        tensor = "'a'"
    elif what == "zstd-object-copied":
        key = _key(m, "a")
        store.put(key, store.get(_key(m, "b")))
        tensor = "'a'"
    else:
        key, other = m["tensors"]["u"]["array"] + "/c", m["tensors"]["v"]["array"] + "/c"
        assert m["tensors"]["u"]["storage"] == "grid" and store.exists(key)
        store.put(key, store.get(other))
        tensor = "'u'"
    with pytest.raises(ckpt.ChecksumMismatchError, match="records") as e:
        ckpt.load({k: torch.zeros_like(v) for k, v in state.items()}, store)
    assert e.value.obj == key and tensor in str(e.value)
    report = ckpt.verify(store)
    assert not report.ok and any(key in p and "records" in p for p in report.problems)


def _inline(store: storage.Store, m: dict) -> dict:
    """`m` in the form written before the table: every object's crcs in the manifest."""
    man = read_manifest(store)
    out = {k: v for k, v in m.items() if k != TABLE_FIELD}
    out[CHUNK_CRCS] = {k: man.chunk_crcs(k) for k, _, _ in chunk_objects(man)}
    return out


@pytest.mark.parametrize("form", ["none", "inline"])
def test_checkpoint_without_table_still_loads(saved, form) -> None:
    store, m = saved
    m = _inline(store, m) if form == "inline" else {k: v for k, v in m.items()
                                                     if k != TABLE_FIELD}
    _resign(store, m)
    got = {k: torch.zeros_like(v) for k, v in _state(1).items()}
    ckpt.load(got, store)
    assert all(torch.equal(got[k], v) for k, v in _state(1).items())
    assert ckpt.verify(store).ok
    assert (read_manifest(store).chunk_crcs(_key(m, "a")) is None) == (form == "none")


def test_inline_record_still_binds(saved) -> None:
    """The inline form is still checked: a copied object is refused by load and verify."""
    store, m = saved
    _resign(store, _inline(store, m))
    store.put(_key(m, "a"), store.get(_key(m, "b")))
    with pytest.raises(ckpt.ChecksumMismatchError, match="records"):
        ckpt.load({k: torch.zeros_like(v) for k, v in _state(1).items()}, store)
    assert not ckpt.verify(store).ok


def _set(m: dict, value) -> None:
    m[CHUNK_CRCS][_key(m, "a")] = value


def _position(m: dict, name: str) -> int:
    """Where the array of tensor `name` is in the table's order."""
    arrays = [g.array for g in data_arrays(Manifest.from_json(m, "x://"))]
    return arrays.index(array_of_key(_key(m, name)))


def _set_crc(m: dict, value) -> None:
    m[TABLE_FIELD]["crc32c"][_position(m, "a")] = value


BAD_INLINE = {
    "not-an-object": lambda m: m.__setitem__(CHUNK_CRCS, [1, 2]),
    "entry-missing": lambda m: m[CHUNK_CRCS].pop(_key(m, "a")),
    "entry-too-short": lambda m: _set(m, m[CHUNK_CRCS][_key(m, "a")][:-1]),
    "entry-not-a-list": lambda m: _set(m, "deadbeef"),
    "crc-negative": lambda m: _set(m, [-1] * len(m[CHUNK_CRCS][_key(m, "a")])),
    "crc-2^32": lambda m: _set(m, [1 << 32] * len(m[CHUNK_CRCS][_key(m, "a")])),
    "crc-bool": lambda m: _set(m, [True] * len(m[CHUNK_CRCS][_key(m, "a")])),
    "crc-float": lambda m: _set(m, [1.5] * len(m[CHUNK_CRCS][_key(m, "a")])),
}

BAD_TABLE = {
    "not-an-object": lambda m: m.__setitem__(TABLE_FIELD, [1, 2]),
    "object-outside-root": lambda m: m[TABLE_FIELD].__setitem__("object", "../x.bin"),
    "bytes-not-whole-entries": lambda m: m[TABLE_FIELD].__setitem__("bytes", 6),
    "bytes-one-entry-short": lambda m: m[TABLE_FIELD].__setitem__(
        "bytes", m[TABLE_FIELD]["bytes"] - 4),
    "crcs-one-short": lambda m: m[TABLE_FIELD]["crc32c"].pop(),
    "crcs-not-a-list": lambda m: m[TABLE_FIELD].__setitem__("crc32c", "deadbeef"),
    "crc-2^32": lambda m: _set_crc(m, 1 << 32),
    "crc-negative": lambda m: _set_crc(m, -1),
    "crc-bool": lambda m: _set_crc(m, True),
    "crc-float": lambda m: _set_crc(m, 1.5),
    "not-stored-outside": lambda m: m[TABLE_FIELD].__setitem__(
        "not_stored", [[_position(m, "a"), [10**6]]]),
    "position-past-the-end": lambda m: m[TABLE_FIELD].__setitem__("not_stored", [[10**6, [0]]]),
    "both-forms": lambda m: m.__setitem__(CHUNK_CRCS, {}),
}


@pytest.mark.parametrize("form,case", [("inline", c) for c in sorted(BAD_INLINE)]
                         + [("table", c) for c in sorted(BAD_TABLE)])
def test_malformed_record_is_typed_error(saved, form, case) -> None:
    store, m = saved
    if form == "inline":
        m = _inline(store, m)
        BAD_INLINE[case](m)
    else:
        BAD_TABLE[case](m)
    _resign(store, m)
    with pytest.raises(ckpt.CorruptCheckpointError, match="chunk_crc32c") as e:
        ckpt.load({k: torch.zeros_like(v) for k, v in _state(1).items()}, store)
    if case.startswith(("entry", "crc-", "not-stored")):
        assert "'a'" in str(e.value)
    assert not ckpt.verify(store).ok


@pytest.mark.parametrize("damage", ["flipped", "truncated", "deleted"])
def test_damaged_table_is_typed_error_and_nothing_loads_unchecked(saved, damage,
                                                                  fetch) -> None:
    """The table's bytes are checked against the manifest's record before use."""
    store, m = saved
    key = m[TABLE_FIELD]["object"]
    blob = bytearray(store.get(key))
    if damage == "flipped":
        table = read_manifest(store).crc_table
        assert table is not None
        blob[4 * table.blocks[array_of_key(_key(m, "a"))].start] ^= 1
        store.put(key, bytes(blob))
    elif damage == "truncated":
        store.put(key, bytes(blob[:-4]))
    else:
        store.delete(key)
    err = ckpt.ChecksumMismatchError if damage == "flipped" else ckpt.CorruptCheckpointError
    with pytest.raises(err, match="chunk_crc32c") as e:
        ckpt.load({k: torch.zeros_like(v) for k, v in _state(1).items()}, store)
    assert e.value.obj == key
    report = ckpt.verify(store)
    assert not report.ok and any(key in p for p in report.problems)


def test_save_missing_a_record_does_not_commit(tmp_path, monkeypatch) -> None:
    """The coordinator validates the manifest it built: a rank that recorded no crcs
    fails the save instead of committing a checkpoint every load would refuse."""
    import relight.ckpt.writer as eng

    monkeypatch.setattr(eng._SaveJob, "_bind_stored_objects",
                        lambda self: self.chunk_crcs.clear())
    store = storage.open_store(tmp_path / "c")
    with pytest.raises(ckpt.CheckpointSaveError, match="chunk_crc32c"):
        ckpt.save(_state(1), store, options=OPTS)
    assert not store.exists(ckpt.format.COMMIT_KEY)
