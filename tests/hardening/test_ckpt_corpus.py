"""A corpus of bad checkpoints: every case is damaged on purpose, and each must give a
typed error naming what is wrong, while the older checkpoint beside it stays untouched
and still loads bitwise (`CheckpointManager.restore` falls back to it)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import psutil
import pytest

from relight import ckpt, storage
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.ckpt.manifest import read_manifest
from relight.ckpt.root_layout import step_dir

from ._util import (
    OPTIONS,
    assert_bitwise,
    edit_manifest,
    local_store,
    make_state,
    resign,
    snapshot,
    tally,
    zeros_like,
)

Damage = Callable[[storage.Store, dict], None]
"""(the newer checkpoint's store, its manifest as saved) -> damage it."""


@dataclass(frozen=True)
class Case:
    damage: Damage
    error: type[BaseException]
    names: str
    """Text the error message must contain: the tensor, key or object at fault."""
    falls_back: bool = True
    """restore() skips the damaged step (else it raises: a state-dict mismatch is the
    caller's to fix, and an older checkpoint would not match either)."""


def _tensor(m: dict, name: str) -> dict:
    return m["tensors"][name]


def _array(m: dict, name: str) -> str:
    """The tensor's (first) array: its own, its first piece's, or its first cell's."""
    t = _tensor(m, name)
    if "array" in t:
        return t["array"]
    return t["pieces"][0]["array"] if "pieces" in t else sorted(m["packed"])[t["arrays"][0]]


def _chunk(store: storage.Store, m: dict, name: str) -> str:
    arr = _array(m, name)
    return next(k for k in store.list(arr) if "/c" in k[len(arr):])


def set_in(name: str, key: str, value) -> Damage:
    return lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, name).__setitem__(key, value))


def set_top(key: str, value) -> Damage:
    return lambda s, m: edit_manifest(s, lambda mm: mm.__setitem__(key, value))


def _as_piece_list(m: dict, name: str) -> list[dict]:
    """A packed tensor in grid form rewritten in list form (format version 1's), which
    the reader still takes: its piece list."""
    t = _tensor(m, name)
    if "pieces" not in t:
        names, shape, chunks = sorted(m["packed"]), t["shape"], t["chunks"]
        offsets = itertools.product(*(range(0, s, c) for s, c in zip(shape, chunks,
                                                                     strict=True)))
        t["pieces"] = [{"offset": list(o), "shape": [min(c, s - x) for x, c, s in
                                                     zip(o, chunks, shape, strict=True)],
                        "array": names[a], "byte_offset": b}
                       for o, a, b in zip(offsets, t.pop("arrays"), t.pop("byte_offsets"),
                                          strict=True)]
        del t["chunks"]
    return t["pieces"]


def set_piece(name: str, key: str, value) -> Damage:
    return lambda s, m: edit_manifest(
        s, lambda mm: _as_piece_list(mm, name)[0].__setitem__(key, value))


def set_cell(name: str, key: str, value) -> Damage:
    """Entry 0 of a packed grid tensor's list `key` ('arrays', 'byte_offsets') = value."""
    return lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, name)[key].__setitem__(0, value))


def rewrite_chunk(name: str, change: Callable[[bytes], bytes]) -> Damage:
    def damage(s: storage.Store, m: dict) -> None:
        key = _chunk(s, m, name)
        s.put(key, change(s.get(key)))
    return damage


def flip(pos: float) -> Callable[[bytes], bytes]:
    def change(b: bytes) -> bytes:
        i = min(int(len(b) * pos), len(b) - 1)
        return b[:i] + bytes([b[i] ^ 0x10]) + b[i + 1:]
    return change


def chunk_from(src: str, dst: str) -> Damage:
    def damage(s: storage.Store, m: dict) -> None:
        s.put(_chunk(s, m, dst), s.get(_chunk(s, m, src)))
    return damage


def delete_array(name: str) -> Damage:
    def damage(s: storage.Store, m: dict) -> None:
        s.delete_prefix(_array(m, name))
    return damage


def drop(section: str, name: str) -> Damage:
    return lambda s, m: edit_manifest(s, lambda mm: mm[section].pop(name))


def _table(m: dict) -> str:
    return m["chunk_crc32c_table"]["object"]


def _packed_path(m: dict) -> str:
    return next(iter(m["packed"]))


CORRUPT = ckpt.CorruptCheckpointError
ABSURD = ckpt.AbsurdShapeError
UNSAFE = ckpt.UnsafePathError
CASES: dict[str, Case] = {
    # -- the manifest itself
    "manifest-not-json": Case(lambda s, m: resign(s, b"{not json"), CORRUPT, MANIFEST_KEY),
    "manifest-not-json-unsigned": Case(lambda s, m: s.put(MANIFEST_KEY, b"{not json"),
                                       ckpt.ChecksumMismatchError, MANIFEST_KEY),
    "manifest-empty": Case(lambda s, m: resign(s, b""), CORRUPT, MANIFEST_KEY),
    "manifest-binary": Case(lambda s, m: resign(s, os.urandom(512)), CORRUPT, MANIFEST_KEY),
    "manifest-json-list": Case(lambda s, m: resign(s, b"[1, 2]"), ckpt.UnsupportedVersionError,
                               MANIFEST_KEY),
    "manifest-deeply-nested": Case(lambda s, m: resign(s, b"[" * 200_000 + b"]" * 200_000),
                                   CORRUPT, MANIFEST_KEY),
    "manifest-huge-number": Case(set_top("packed_inner", 10**4000), CORRUPT, "packed_inner"),
    "version-99": Case(set_top("version", 99), ckpt.UnsupportedVersionError, "99"),
    "version-as-string": Case(set_top("version", "1"), ckpt.UnsupportedVersionError, "'1'"),
    "version-missing": Case(lambda s, m: edit_manifest(s, lambda mm: mm.pop("version")),
                            ckpt.UnsupportedVersionError, "None"),
    "format-foreign": Case(set_top("format", "dcp"), ckpt.UnsupportedVersionError,
                           MANIFEST_KEY),
    "tensors-not-object": Case(set_top("tensors", []), CORRUPT, "tensors"),
    "tensor-entry-not-object": Case(lambda s, m: edit_manifest(
        s, lambda mm: mm["tensors"].__setitem__("w", 7)), CORRUPT, "'w'"),
    # -- absurd shapes: refused before anything is allocated
    "shape-2^124-elements": Case(set_in("w", "shape", [2**62, 2**62]), ABSURD, "'w'"),
    "shape-negative": Case(set_in("w", "shape", [-1, 192]), ABSURD, "'w'"),
    "shape-float": Case(set_in("w", "shape", [256.0, 192]), ABSURD, "'w'"),
    "shape-bool": Case(set_in("w", "shape", [True, 192]), ABSURD, "'w'"),
    "shape-string": Case(set_in("w", "shape", "256x192"), ABSURD, "'w'"),
    "shape-64-dims": Case(set_in("w", "shape", [1] * 64), ABSURD, "'w'"),
    "chunks-zero": Case(set_in("w", "chunks", [0, 192]), ABSURD, "'w'"),
    "chunks-2^62-cells": Case(lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, "w").update(
        shape=[2**31, 2**31], chunks=[1, 1], inner=[1, 1])), ABSURD, "'w'"),
    "inner-2^62-per-shard": Case(lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, "w").update(
        shape=[2**31, 2**31], chunks=[2**31, 2**31], inner=[1, 1])), ABSURD, "'w'"),
    "inner-not-dividing": Case(set_in("w", "inner", [7, 48]), ABSURD, "'w'"),
    "packed-size-2^43": Case(lambda s, m: edit_manifest(
        s, lambda mm: mm["packed"].__setitem__(_packed_path(m), 2**43)), CORRUPT, "packed"),
    "packed-piece-outside": Case(set_piece("idx", "offset", [5]), ABSURD, "'idx'"),
    "packed-byte-offset-negative": Case(set_piece("idx", "byte_offset", -8), ABSURD, "'idx'"),
    "packed-byte-offset-past-end": Case(set_piece("idx", "byte_offset", 2**40), ABSURD,
                                        "'idx'"),
    # (the packed grid form: two lists of ints instead of a piece list)
    "packed-grid-offset-past-end": Case(set_cell("idx", "byte_offsets", 2**40), ABSURD,
                                        "'idx'"),
    "packed-grid-offset-negative": Case(set_cell("idx", "byte_offsets", -8), CORRUPT, "'idx'"),
    "packed-grid-offset-bool": Case(set_cell("idx", "byte_offsets", True), CORRUPT, "'idx'"),
    "packed-grid-offset-2^70": Case(set_cell("idx", "byte_offsets", 2**70), CORRUPT, "'idx'"),
    "packed-grid-array-past-end": Case(set_cell("idx", "arrays", 10**6), CORRUPT, "'idx'"),
    "packed-grid-cells-miscounted": Case(set_in("idx", "byte_offsets", []), CORRUPT, "'idx'"),
    "packed-grid-chunks-zero": Case(set_in("idx", "chunks", [0]), ABSURD, "'idx'"),
    "packed-grid-2^62-cells": Case(lambda s, m: edit_manifest(
        s, lambda mm: _tensor(mm, "idx").update(shape=[2**62], chunks=[1])), ABSURD, "'idx'"),
    "dtype-unknown": Case(set_in("w", "dtype", "complex128"), CORRUPT, "'w'"),
    "dtype-changed": Case(set_in("w", "dtype", "float64"), ckpt.DtypeMismatchError, "'w'",
                          falls_back=False),
    # (chunks and inner chunks turned with it: a consistent checkpoint of another shape;
    # the shape alone changed leaves the grid's objects unlike chunk_crc32c's: CORRUPT)
    "shape-changed": Case(lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, "w").update(
        shape=[192, 256], chunks=[192, 256], inner=_tensor(mm, "w")["inner"][::-1])),
        ckpt.ShapeMismatchError, "'w'", falls_back=False),
    # (the chunk crc32c table's record no longer fits the tensors' grids)
    "shape-changed-alone": Case(set_in("w", "shape", [192, 256]), CORRUPT, "chunk_crc32c"),
    "storage-unknown": Case(set_in("w", "storage", "magic"), CORRUPT, "'w'"),
    # -- paths that leave the checkpoint root
    "path-dotdot": Case(set_in("w", "array", "../../../../etc"), UNSAFE, "'w'"),
    "path-into-older-step": Case(lambda s, m: edit_manifest(s, lambda mm: _tensor(mm, "w").update(
        array="data/../../" + step_dir(1) + "/" + m["tensors"]["w"]["array"])), UNSAFE, "'w'"),
    "path-absolute": Case(set_in("w", "array", "/etc/passwd"), UNSAFE, "'w'"),
    "path-other-bucket": Case(set_in("w", "array", "s3://other-bucket/ck/t0"), UNSAFE, "'w'"),
    "path-backslash": Case(set_in("w", "array", "data\\..\\..\\x"), UNSAFE, "'w'"),
    "path-nul": Case(set_in("w", "array", "data/t\x00"), UNSAFE, "'w'"),
    "path-empty": Case(set_in("w", "array", ""), UNSAFE, "'w'"),
    "path-not-string": Case(set_in("w", "array", 42), UNSAFE, "'w'"),
    "path-packed-absolute": Case(lambda s, m: edit_manifest(s, lambda mm: mm.__setitem__(
        "packed", {"/tmp/x": 64})), UNSAFE, "/tmp/x"),
    "path-piece-dotdot": Case(set_piece("idx", "array", "../x"), UNSAFE, "'idx'"),
    # -- listed arrays that are missing
    "array-missing": Case(delete_array("w"), ckpt.MissingChunkError, "'w'"),
    "packed-array-missing": Case(delete_array("idx"), ckpt.MissingChunkError, "packed"),
    # (a checkpoint saved without w: its table has no block for w either, so the record
    # goes too; the table's own checks are the cases above)
    "tensor-not-in-manifest": Case(lambda s, m: edit_manifest(s, lambda mm: (
        mm["tensors"].pop("w"), mm.pop("chunk_crc32c_table"))), ckpt.MissingKeyError, "'w'",
        falls_back=False),
    "value-not-in-manifest": Case(drop("values", "n"), ckpt.MissingKeyError, "'n'",
                                  falls_back=False),
    "tensor-nobody-wants": Case(lambda s, m: edit_manifest(s, lambda mm: mm["tensors"].__setitem__(
        "ghost", mm["tensors"]["b"])), ckpt.UnexpectedKeyError, "ghost", falls_back=False),
    # -- damaged chunks
    "chunk-truncated-half": Case(rewrite_chunk("w", lambda b: b[: len(b) // 2]), CORRUPT, "'w'"),
    "chunk-truncated-1-byte": Case(rewrite_chunk("w", lambda b: b[:-1]), CORRUPT, "'w'"),
    "chunk-shifted-one-byte": Case(rewrite_chunk("w", lambda b: b"\0" + b[:-1]), CORRUPT, "'w'"),
    "chunk-zero-length": Case(rewrite_chunk("w", lambda b: b""), CORRUPT, "'w'"),
    "chunk-flip-first-byte": Case(rewrite_chunk("w", flip(0.0)), ckpt.ChecksumMismatchError,
                                  "'w'"),
    "chunk-flip-middle": Case(rewrite_chunk("w", flip(0.5)), ckpt.ChecksumMismatchError, "'w'"),
    "chunk-flip-in-index": Case(rewrite_chunk("w", flip(0.9999)), CORRUPT, "'w'"),
    "chunk-flip-last-byte": Case(rewrite_chunk("w", flip(1.0)), CORRUPT, "'w'"),
    "chunk-random-bytes": Case(rewrite_chunk("w", lambda b: os.urandom(len(b))), CORRUPT, "'w'"),
    "packed-chunk-flip": Case(rewrite_chunk("idx", flip(0.001)), CORRUPT, "packed"),
    "chunk-of-another-dtype-and-size": Case(chunk_from("bf", "w"), CORRUPT, "'w'"),
    # -- the chunk crc32c table the manifest binds
    "crc-table-flipped": Case(lambda s, m: s.put(_table(m), flip(0.5)(s.get(_table(m)))),
                              ckpt.ChecksumMismatchError, "chunk_crc32c"),
    "crc-table-missing": Case(lambda s, m: s.delete(_table(m)), CORRUPT, "chunk_crc32c"),
    # -- the commit marker
    "commit-without-manifest": Case(lambda s, m: s.delete(MANIFEST_KEY), CORRUPT, MANIFEST_KEY),
    "commit-not-json": Case(lambda s, m: s.put(COMMIT_KEY, b"\x00garbage"), CORRUPT, COMMIT_KEY),
    "commit-empty": Case(lambda s, m: s.put(COMMIT_KEY, b""), CORRUPT, COMMIT_KEY),
    "commit-json-list": Case(lambda s, m: s.put(COMMIT_KEY, b"[]"), CORRUPT, COMMIT_KEY),
    "commit-wrong-crc": Case(lambda s, m: s.put(COMMIT_KEY, json.dumps(
        {**json.loads(s.get(COMMIT_KEY)), "manifest_crc32c": 1}).encode()),
        ckpt.ChecksumMismatchError, MANIFEST_KEY),
    "commit-missing": Case(lambda s, m: s.delete(COMMIT_KEY), ckpt.CheckpointNotFoundError,
                           COMMIT_KEY),
}


@pytest.fixture
def two_steps(tmp_path):
    root = local_store(tmp_path / "run")
    mgr = ckpt.CheckpointManager(root, keep_last=5, options=OPTIONS)
    for step in (1, 2):
        mgr.save(step, make_state(step), async_save=False)
    return mgr, root


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_checkpoint(name: str, two_steps) -> None:
    case = CASES[name]
    mgr, root = two_steps
    older = snapshot(root, step_dir(1))
    newer = root.child(step_dir(2))
    case.damage(newer, json.loads(newer.get(MANIFEST_KEY)))
    rss = psutil.Process().memory_info().rss

    with pytest.raises(case.error) as info:
        ckpt.load(zeros_like(make_state(2)), newer)
    err = info.value
    assert isinstance(err, ckpt.CheckpointError)
    assert case.names in str(err), f"{type(err).__name__} does not name {case.names!r}: {err}"
    assert newer.url in str(err) or (err.url or "").startswith(root.url)
    if case.falls_back:  # (a state-dict mismatch is a consistent checkpoint)
        assert not ckpt.verify(newer).ok
    # No allocation bomb: a claimed 2^124 elements allocates nothing.
    assert psutil.Process().memory_info().rss - rss < 256 << 20

    # The older checkpoint: untouched, and what a restart gets.
    got = zeros_like(make_state(1))
    if case.falls_back:
        assert mgr.restore(got) == 1
    else:
        with pytest.raises(case.error):
            mgr.restore(got)
        assert mgr.restore(got, step=1) == 1
    assert_bitwise(got, make_state(1))
    assert snapshot(root, step_dir(1)) == older
    tally("bad_inputs")
    tally("checkpoints_checked")


def swap_inner_chunks(name: str, a: int, b: int) -> Damage:
    """Exchange inner chunks `a` and `b` of the tensor's first object: both stay
    well-formed (their own crc32c, the index untouched), only their places change."""
    def damage(s: storage.Store, m: dict) -> None:
        key = _chunk(s, m, name)
        blob = s.get(key)
        n = len(read_manifest(s).chunk_crcs(key) or [])
        index = np.frombuffer(blob[-(16 * n + 4):-4], "<u8").reshape(-1, 2).tolist()
        (oa, na), (ob, nb) = index[a], index[b]
        assert na == nb
        out = bytearray(blob)
        out[oa: oa + na], out[ob: ob + nb] = blob[ob: ob + nb], blob[oa: oa + na]
        s.put(key, bytes(out))
    return damage


# Well-formed chunks in the wrong place: each chunk's own crc32c holds, only the save's
# record of which crc32c belongs where (the chunk crc32c table) tells them apart.
MISPLACED: dict[str, Damage] = {
    # h (float16) and hi (int16): same shape, same byte size, one inner chunk each
    "chunk-swapped-with-same-size-chunk-of-another-dtype": chunk_from("hi", "h"),
    "two-chunks-of-one-tensor-exchanged": swap_inner_chunks("w", 0, 1),
}


@pytest.mark.parametrize("name", sorted(MISPLACED))
def test_misplaced_chunk_is_refused(name: str, two_steps) -> None:
    mgr, root = two_steps
    newer = root.child(step_dir(2))
    tensor = "'h'" if "another" in name else "'w'"
    MISPLACED[name](newer, json.loads(newer.get(MANIFEST_KEY)))
    with pytest.raises(ckpt.ChecksumMismatchError, match="records") as info:
        ckpt.load(zeros_like(make_state(2)), newer)
    assert tensor in str(info.value) and "inner chunk (0, " in str(info.value)
    report = ckpt.verify(newer)
    assert not report.ok and any(tensor in p and "records" in p for p in report.problems)
    got = zeros_like(make_state(1))
    assert mgr.restore(got) == 1
    assert_bitwise(got, make_state(1))
    tally("bad_inputs")
    tally("checkpoints_checked")


def test_failed_load_leaves_no_read_in_flight(two_steps) -> None:
    """A load that fails on one tensor must not let its other reads land later: restore
    reuses the same target for the older step (found by this corpus: h and hi came back
    with the newer step's values)."""
    _, root = two_steps
    newer = root.child(step_dir(2))
    rewrite_chunk("w", flip(0.5))(newer, json.loads(newer.get(MANIFEST_KEY)))
    got = zeros_like(make_state(1))
    for _ in range(5):
        with pytest.raises(ckpt.ChecksumMismatchError):
            ckpt.load(got, newer)
        ckpt.load(got, root.child(step_dir(1)))
        assert_bitwise(got, make_state(1))
    tally("bad_inputs")
