"""The typed manifest against the on-disk format: `data/manifest-v2.json` and
`data/chunk_crc32c-v2.bin` are the manifest and chunk crc32c table the writer produced
for one plan holding all three storage kinds (grid, pieces, packed in grid and in list
form), with the clock, the attempt and the torch version fixed; the writer must keep
producing exactly these bytes, and reading them back must give them again.
`data/manifest-v1.json` is the same checkpoint in format version 1 (crc32c inline,
packed pieces listed one by one): it must still read, to the same pieces."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from relight import ckpt
from relight.ckpt.commit import build_manifest, encode_manifest, plan_manifest
from relight.ckpt.crc_table import TABLE_FIELD
from relight.ckpt.errors import CorruptCheckpointError
from relight.ckpt.format import CHUNK_CRCS, StorageKind
from relight.ckpt.manifest import Manifest, chunk_objects
from relight.ckpt.plan import RankLayout, TensorLayout, plan_save
from relight.storage import open_store

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "manifest-v2.json"
GOLDEN_TABLE = DATA / "chunk_crc32c-v2.bin"
GOLDEN_INLINE = DATA / "manifest-v1.json"
ATTEMPT = "0123456789abcdef"
META = {"step": 3, "config": {"lr": 0.1}, "layout": {"dp": 4}}


def _t(name: str, shape, pieces, dtype: str = "float32") -> TensorLayout:
    return TensorLayout(name, ("model", name), tuple(shape), dtype, "Shard(0)",
                        tuple((tuple(o), tuple(s)) for o, s in pieces))


def _plan():
    grid_rows = [(0, 3), (3, 3), (6, 3), (9, 1)]  # a regular grid with a partial edge
    piece_rows = [(0, 3), (3, 2), (5, 3), (8, 2)]  # no regular grid: pieces
    layouts = [RankLayout(r, (_t("grid", (10, 1000), [((o, 0), (n, 1000))]),
                              _t("pieces", (10, 1000), [((p, 0), (m, 1000))], "bfloat16"),
                              _t("small", (8,), [((0,), (8,))], "int64"),
                              _t("scalar", (), [((), ())]),
                              # packed, split evenly (grid form) and unevenly (list form)
                              _t("split", (10, 3), [((o, 0), (n, 3))]),
                              _t("uneven", (10,), [((p,), (m,))], "int16")), ("step",))
               for r, ((o, n), (p, m)) in enumerate(zip(grid_rows, piece_rows, strict=True))]
    return plan_save(layouts, (0, 1, 2, 3), pack_bytes=1024)


def test_writer_produces_the_golden_bytes(monkeypatch) -> None:
    monkeypatch.setattr(ckpt.commit.time, "time", lambda: 1700000000.25)
    monkeypatch.setattr(torch, "__version__", "TORCH")
    plan, data = _plan(), f"data/{ATTEMPT}"
    m, table = build_manifest(plan, ATTEMPT, data, _indexes(plan, data), inner_bytes=4096,
                              compression=None, meta=META)
    assert {t.storage for t in m.tensors.values()} == set(StorageKind)
    assert encode_manifest(m) == GOLDEN.read_bytes()
    assert table == GOLDEN_TABLE.read_bytes()


def _indexes(plan, data: str) -> dict[int, dict]:
    bare = plan_manifest(plan, ATTEMPT, data, {}, inner_bytes=4096, compression=None,
                         meta=META)
    crcs = {k: [(zlib.crc32(k.encode()) + i) % (1 << 32) for i in range(n)]
            for k, _, n in chunk_objects(bare)}
    return {r: {"values": {"step": 3} if r == 0 else {},
                CHUNK_CRCS: crcs if r == 0 else {}} for r in range(4)}


def test_table_gives_each_object_the_crcs_its_rank_reported(tmp_path) -> None:
    """Read from storage, the manifest serves every object's crcs from the table, the
    same lists the ranks reported, and the inline form of the same checkpoint agrees."""
    plan, data = _plan(), f"data/{ATTEMPT}"
    crcs = _indexes(plan, data)[0][CHUNK_CRCS]
    store = open_store(str(tmp_path))
    m, table = build_manifest(plan, ATTEMPT, data, _indexes(plan, data), inner_bytes=4096,
                              compression=None, meta=META)
    store.put(m.chunk_crc32c_table["object"], table)
    read = Manifest.from_json(json.loads(encode_manifest(m)), store.url, store)
    inline = Manifest.from_json(json.loads(GOLDEN_INLINE.read_bytes()), "golden://")
    keys = [k for k, _, _ in chunk_objects(read)]
    assert keys and {k: read.chunk_crcs(k) for k in keys} == {k: crcs[k] for k in keys}
    assert all(inline.chunk_crcs(k) == crcs[k] for k, _, _ in chunk_objects(inline))
    assert m.chunk_crc32c_table["object"] in read.expected_objects()


def test_golden_reads_back_to_the_same_bytes() -> None:
    for golden in (GOLDEN, GOLDEN_INLINE):
        raw = golden.read_bytes()
        assert encode_manifest(Manifest.from_json(json.loads(raw), "golden://")) == raw
    m = Manifest.from_json(json.loads(GOLDEN.read_bytes()), "golden://")
    assert TABLE_FIELD in m.to_json() and CHUNK_CRCS not in m.to_json()
    split, uneven = m.tensors["split"], m.tensors["uneven"]
    assert split.packed_grid and split.chunks == (3, 3) and not split.pieces
    assert [(p.offset, p.shape) for p in split.piece_list()] == [
        ((0, 0), (3, 3)), ((3, 0), (3, 3)), ((6, 0), (3, 3)), ((9, 0), (1, 3))]
    assert not uneven.packed_grid and len(uneven.piece_list()) == 4
    g, p, s = m.tensors["grid"], m.tensors["pieces"], m.tensors["small"]
    assert (g.storage, g.chunks, g.shape, g.path) == (StorageKind.GRID, (3, 1000), (10, 1000),
                                                      ("model", "grid"))
    assert p.storage is StorageKind.PIECES and [x.offset for x in p.pieces] == [
        (0, 0), (3, 0), (5, 0), (8, 0)]
    assert s.storage is StorageKind.PACKED and s.piece_list()[0].byte_offset is not None
    assert m.values == {"step": 3} and m.step == 3


def test_version_1_packed_pieces_read_as_the_same_pieces() -> None:
    """Version 1 lists every packed piece; version 2 gives the same ones from the grid."""
    v1 = Manifest.from_json(json.loads(GOLDEN_INLINE.read_bytes()), "golden://")
    v2 = Manifest.from_json(json.loads(GOLDEN.read_bytes()), "golden://")
    assert (v1.version, v2.version) == (1, 2)
    for name in ("small", "scalar"):
        assert not v1.tensors[name].packed_grid and v2.tensors[name].packed_grid
        assert v1.tensors[name].piece_list() == v2.tensors[name].piece_list()


def test_checkpoint_without_chunk_crcs_reads_back_unchanged() -> None:
    """A checkpoint written before `chunk_crc32c` existed: the field stays absent."""
    obj = json.loads(GOLDEN_INLINE.read_bytes())
    del obj[CHUNK_CRCS]
    m = Manifest.from_json(obj, "golden://")
    assert m.chunk_crcs(next(iter(m.expected_objects()))) is None
    assert m.to_json() == obj and list(m.to_json()) == list(obj)


def test_unknown_storage_kind_is_a_typed_error_naming_the_tensor() -> None:
    obj = json.loads(GOLDEN.read_bytes())
    obj["tensors"]["grid"]["storage"] = "tiles"
    with pytest.raises(CorruptCheckpointError, match="unknown storage 'tiles'") as e:
        Manifest.from_json(obj, "golden://")
    assert e.value.tensor == "grid"


def test_overlapping_pieces_with_the_right_element_count_are_refused() -> None:
    """A piece moved onto its neighbour (the element count unchanged, a gap elsewhere)."""
    obj = json.loads(GOLDEN.read_bytes())
    obj["tensors"]["pieces"]["pieces"][1]["offset"] = [2, 0]
    with pytest.raises(CorruptCheckpointError, match="overlap") as e:
        Manifest.from_json(obj, "golden://")
    assert e.value.tensor == "pieces"


@pytest.mark.parametrize("boxes,want", [
    ([((0, 0), (2, 3)), ((0, 3), (2, 3)), ((2, 0), (2, 6))], False),   # a tiling
    ([((0, 0), (2, 4)), ((0, 3), (2, 3)), ((2, 0), (2, 6))], True),    # one column shared
    ([((0, 0), (4, 6)), ((1, 1), (0, 2))], False),                     # empty pieces ignored
    ([((i,), (1,)) for i in range(5000)], False),                      # many 1-D pieces
    ([((i,), (1,)) for i in range(5000)] + [((4999,), (1,))], True),
])
def test_overlap_check_is_exact(boxes, want) -> None:
    from relight.ckpt.manifest import _overlap
    assert _overlap([(list(o), list(s)) for o, s in boxes]) is want
