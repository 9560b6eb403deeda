"""Reading, checking and describing a committed checkpoint's manifest."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from ckpt.errors import (
    AbsurdShapeError,
    CheckpointNotFoundError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from ckpt.format import (
    CHUNK_CRCS,
    COMMIT_KEY,
    DTYPES,
    MANIFEST_KEY,
    MAX_NUMEL,
    check_path,
    check_shape,
    check_version,
    chunk_keys,
    numel,
    zarr_metadata,
)
from storage import ObjectNotFoundError, Store
from storage.checksum import crc32c

logger = logging.getLogger(__name__)

__all__ = ["Manifest", "read_manifest", "read_commit", "crc32c", "chunk_objects", "validate"]

MAX_CHUNKS = 10_000_000


@dataclass
class Manifest:
    url: str
    raw: dict[str, Any]
    commit: dict[str, Any]

    @property
    def tensors(self) -> dict[str, dict[str, Any]]:
        return self.raw["tensors"]

    @property
    def values(self) -> dict[str, Any]:
        return self.raw["values"]

    @property
    def step(self) -> int | None:
        return self.raw.get("step")

    def meta_of(self, name: str, piece: dict[str, Any] | None = None) -> dict[str, Any]:
        """zarr metadata of a tensor's array (grid) or of one of its pieces."""
        t = self.tensors[name]
        comp = self.raw.get("compression")
        if piece is None:
            return zarr_metadata(t["shape"], t["dtype"], t["chunks"], t["inner"], comp)
        if t["storage"] == "packed":
            size = self.raw["packed"][piece["array"]]
            return zarr_metadata([size], "uint8", [size], [self.raw["packed_inner"]], comp)
        return zarr_metadata(piece["shape"], t["dtype"], piece["shape"], piece["inner"], comp)

    def chunk_crcs(self, key: str) -> list[int | None] | None:
        """The crc32c recorded at save for each inner chunk of data object `key`, in
        storage order (None: that chunk is not stored), or None for a checkpoint written
        before they were recorded (validate() made sure every object has its list)."""
        crcs = self.raw.get(CHUNK_CRCS)
        return None if crcs is None else crcs[key]

    def expected_objects(self) -> dict[str, str]:
        """Every object the checkpoint must hold -> the tensor (or '') it belongs to."""
        out: dict[str, str] = {}
        for name, t in self.tensors.items():
            if t["storage"] == "grid":
                out[f"{t['array']}/zarr.json"] = name
            else:
                for p in t["pieces"]:
                    out[f"{p['array']}/zarr.json"] = name if t["storage"] == "pieces" else ""
        for key, name, _n in chunk_objects(self.raw):
            out.setdefault(key, name)
        return out


def _inner_count(shape: list[int], inner: list[int]) -> int:
    n = 1
    for s, i in zip(shape, inner, strict=True):
        n *= -(-s // i)
    return n


def chunk_objects(m: dict[str, Any]):
    """(key, tensor or '' for a packed array, inner chunks) of every data object of a
    validated manifest: one per grid cell, piece array and packed array."""
    seen: set[str] = set()
    for name, t in m["tensors"].items():
        if t["storage"] == "grid":
            n = _inner_count(t["chunks"], t["inner"])
            for k in chunk_keys(t["array"], t["shape"], t["chunks"]):
                yield k, name, n
            continue
        for p in t["pieces"]:
            arr = p["array"]
            if t["storage"] == "packed":
                size, inner, who = [m["packed"][arr]], [m.get("packed_inner", 1)], ""
            else:
                size, inner, who = p["shape"], p["inner"], name
            for k in chunk_keys(arr, size, size):
                if k not in seen:
                    seen.add(k)
                    yield k, who, _inner_count(size, inner)


def _check_chunk_crcs(m: dict[str, Any], url: str) -> None:
    """`chunk_crc32c` (optional: older checkpoints lack it) must list, for every data
    object, one crc32c (an int in [0, 2^32), or null for a chunk not
    stored) per inner chunk: the reader compares each chunk it reads with it."""
    crcs = m.get(CHUNK_CRCS)
    if crcs is None:
        return
    if not isinstance(crcs, dict):
        raise _bad(url, "'chunk_crc32c' is not an object; the manifest is damaged")
    # Objects per array counted first, without listing a claimed 10^7-cell grid.
    got: dict[str, int] = {}
    for key in crcs:
        arr = key[:-2] if key.endswith("/c") else key.rpartition("/c/")[0]
        got[arr] = got.get(arr, 0) + 1
    seen: set[str] = set()
    for name, t in m["tensors"].items():
        if t["storage"] == "grid":
            arrays = {t["array"]: _inner_count(t["shape"], t["chunks"]) if t["shape"] else 1}
        else:
            arrays = {p["array"]: int(m["packed"].get(p["array"], 0) > 0
                                      if t["storage"] == "packed" else numel(p["shape"]) > 0)
                      for p in t["pieces"]}
        for arr, want in arrays.items():
            if arr in seen:  # a packed array several tensors share
                continue
            seen.add(arr)
            have = got.pop(arr, 0)
            if have != want:
                raise _bad(url, f"'chunk_crc32c' lists {have} objects of array {arr} of "
                           f"tensor {name!r}, which has {want}; the manifest is damaged", name)
    # Entries of arrays no tensor names are never read (a tensor dropped from the
    # manifest is the loader's MissingKeyError to report): left alone.
    for key, name, n in chunk_objects(m):
        v = crcs.get(key)
        if not (isinstance(v, list) and len(v) == n and all(
                c is None or (isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 32)
                for c in v)):
            what = "no entry" if v is None else f"{type(v).__name__} {str(v)[:60]}"
            raise CorruptCheckpointError(
                f"checkpoint {url}: 'chunk_crc32c' of object {key}"
                + (f" (tensor {name!r})" if name else " (packed small tensors)")
                + f" is {what}, not a list of {n} crc32c values; the manifest is damaged",
                url=url, tensor=name, obj=key)


def _bad(url: str, msg: str, tensor: str = "") -> CorruptCheckpointError:
    return CorruptCheckpointError(f"checkpoint {url}: {msg}", url=url, tensor=tensor,
                                  obj=MANIFEST_KEY)


def _check_cells(url: str, name: str, shape: Any, chunks: Any, what: str) -> None:
    """Refuse a grid of more than MAX_CHUNKS chunks: a reader would allocate its index
    (16 bytes a chunk) before reading a byte of data."""
    cells = 1
    for g, c in zip(shape, chunks, strict=True):
        cells *= -(-g // c) if c > 0 else 0
    if cells > MAX_CHUNKS:
        raise AbsurdShapeError(
            f"checkpoint {url}: {what} {name!r} claims {cells} chunks (limit {MAX_CHUNKS}); "
            "the manifest is damaged", url=url, tensor=name, obj=MANIFEST_KEY)


MAX_PAIRWISE_PIECES = 512
"""Up to this many pieces per tensor, every pair is checked for overlap (quadratic)."""


def _check_partition(url: str, name: str, shape: list[int],
                     boxes: list[tuple[list[int], list[int]]]) -> None:
    """A tensor's pieces must tile it exactly: a missing or overlapping piece would leave
    part of the target unwritten (wrong values, not an error) if it got past here."""
    total = sum(numel(s) for _, s in boxes)
    overlap = len(boxes) <= MAX_PAIRWISE_PIECES and any(
        all(o1 < o2 + s2 and o2 < o1 + s1 for o1, s1, o2, s2 in zip(a[0], a[1], b[0], b[1],
                                                                       strict=True))
        and numel(a[1]) and numel(b[1])
        for i, a in enumerate(boxes) for b in boxes[i + 1:])
    if total != numel(shape) or overlap:
        raise _bad(url, f"tensor {name!r}: its {len(boxes)} piece(s) cover {total} of "
                   f"{numel(shape)} elements{' and overlap' if overlap else ''}; the manifest "
                   "is damaged", name)


def validate(m: dict[str, Any], url: str) -> None:
    """Structural checks before anything is allocated or opened from the manifest."""
    check_version(m, url)
    if not isinstance(m.get("tensors"), dict) or not isinstance(m.get("values"), dict):
        raise _bad(url, "manifest lacks 'tensors' or 'values'")
    packed = m.get("packed", {})
    if not isinstance(packed, dict):
        raise _bad(url, "manifest 'packed' is not an object")
    inner = m.get("packed_inner", 1)
    if not isinstance(inner, int) or isinstance(inner, bool) or not 0 < inner <= MAX_NUMEL:
        raise AbsurdShapeError(
            f"checkpoint {url}: packed_inner {inner!r} is not an int in [1, {MAX_NUMEL}]; the "
            "manifest is damaged", url=url, obj=MANIFEST_KEY)
    for arr, size in packed.items():
        check_path(arr, url)
        check_shape([size], url, arr, "packed size")
        _check_cells(url, arr, [size], [inner], "packed array")
    for name, t in m["tensors"].items():
        if not isinstance(t, dict):
            raise _bad(url, f"tensor entry {name!r} is not an object", name)
        if not isinstance(t.get("dtype"), str) or t["dtype"] not in DTYPES:
            raise _bad(url, f"tensor {name!r} has unknown dtype {t.get('dtype')!r}", name)
        shape = check_shape(t.get("shape"), url, name)
        storage = t.get("storage")
        if storage == "grid":
            check_path(t.get("array"), url, name)
            chunks = check_shape(t.get("chunks"), url, name, "chunks")
            inner_s = check_shape(t.get("inner"), url, name, "inner chunks")
            if len(chunks) != len(shape) or len(inner_s) != len(shape) or any(
                c <= 0 or i <= 0 or c % i for c, i in zip(chunks, inner_s, strict=True)):
                raise AbsurdShapeError(
                    f"checkpoint {url}: tensor {name!r} has chunks {chunks} / inner {inner_s} "
                    f"that do not fit shape {shape}", url=url, tensor=name, obj=MANIFEST_KEY)
            _check_cells(url, name, shape, chunks, "tensor")
            _check_cells(url, name, chunks, inner_s, "shard of tensor")
        elif storage in ("pieces", "packed"):
            pieces = t.get("pieces")
            if not isinstance(pieces, list):
                raise _bad(url, f"tensor {name!r} has no piece list", name)
            boxes = []
            for p in pieces:
                if not isinstance(p, dict):
                    raise _bad(url, f"tensor {name!r} has a piece that is not an object", name)
                check_path(p.get("array"), url, name)
                off = check_shape(p.get("offset"), url, name, "piece offset")
                shp = check_shape(p.get("shape"), url, name, "piece shape")
                if len(off) != len(shape) or len(shp) != len(shape) or any(
                    o + s > g for o, s, g in zip(off, shp, shape, strict=True)):
                    raise AbsurdShapeError(
                        f"checkpoint {url}: tensor {name!r} has a piece at {off} of shape "
                        f"{shp} outside its shape {shape}", url=url, tensor=name,
                        obj=p.get("array"))
                if storage == "packed":
                    bo = p.get("byte_offset")
                    size = packed.get(p["array"])
                    nb = numel(shp) * DTYPES[t["dtype"]].itemsize
                    if not isinstance(bo, int) or size is None or bo < 0 or bo + nb > size:
                        raise AbsurdShapeError(
                            f"checkpoint {url}: packed piece of {name!r} at byte {bo!r} does "
                            f"not fit its array {p['array']!r}", url=url, tensor=name,
                            obj=p.get("array"))
                else:
                    inner_s = check_shape(p.get("inner"), url, name, "inner chunks")
                    if len(inner_s) != len(shp) or any(
                            i <= 0 or s % i for s, i in zip(shp, inner_s, strict=True)):
                        raise AbsurdShapeError(
                            f"checkpoint {url}: piece inner chunks {inner_s} do not divide "
                            f"{shp} for {name!r}", url=url, tensor=name, obj=p.get("array"))
                    _check_cells(url, name, shp, inner_s, "piece of tensor")
                boxes.append((off, shp))
            _check_partition(url, name, shape, boxes)
        else:
            raise _bad(url, f"tensor {name!r} has unknown storage {storage!r}", name)
    _check_chunk_crcs(m, url)


def read_commit(store: Store) -> dict[str, Any]:
    url = store.url
    try:
        raw = store.get(COMMIT_KEY)
    except ObjectNotFoundError:
        raise CheckpointNotFoundError(
            f"no committed checkpoint at {url} (no {COMMIT_KEY} marker): it does not exist, "
            "or its save did not finish; use an older checkpoint", url=url,
            obj=COMMIT_KEY) from None
    try:
        commit = json.loads(raw)
        if not isinstance(commit, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as e:
        raise CorruptCheckpointError(f"{url}/{COMMIT_KEY} is not valid JSON ({e})", url=url,
                                     obj=COMMIT_KEY) from None
    return commit


def read_manifest(store: Store) -> Manifest:
    """The manifest of the committed checkpoint at `store`, checked against its marker."""
    url = store.url
    commit = read_commit(store)
    try:
        raw = store.get(MANIFEST_KEY)
    except ObjectNotFoundError:
        raise CorruptCheckpointError(
            f"checkpoint {url} is committed but {MANIFEST_KEY} is missing", url=url,
            obj=MANIFEST_KEY) from None
    if len(raw) != commit.get("manifest_bytes") or crc32c(raw) != commit.get("manifest_crc32c"):
        raise ChecksumMismatchError(
            f"checkpoint {url}: {MANIFEST_KEY} ({len(raw)} bytes, crc32c {crc32c(raw)}) does not "
            f"match its commit marker ({commit.get('manifest_bytes')} bytes, crc32c "
            f"{commit.get('manifest_crc32c')}); the manifest is damaged", url=url,
            obj=MANIFEST_KEY)
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise CorruptCheckpointError(f"{url}/{MANIFEST_KEY} is not valid JSON ({e})", url=url,
                                     obj=MANIFEST_KEY) from None
    validate(m, url)
    return Manifest(url, m, commit)
