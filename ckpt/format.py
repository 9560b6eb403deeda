"""The on-storage format: names, dtypes, zarr v3 metadata, manifest checks.

Layout of one checkpoint (a directory / prefix):

    COMMIT                      commit marker, written last by the coordinator
    manifest.json               versioned manifest (tensors, values, layout, config, step)
    index/<attempt>/r<rank>.json   per-rank index: what that rank persisted
    data/<attempt>/t<i>/        zarr v3 array of tensor i (global shape), or
    data/<attempt>/t<i>/p<k>/   zarr v3 array of piece k of tensor i (irregular sharding)
    data/<attempt>/packed/r<rank>/  zarr v3 uint8 array: small tensors packed by a writer

See docs/format.md for the full description.
"""

from __future__ import annotations

import itertools
import math
from enum import StrEnum
from typing import Any

import torch

from relight.ckpt.errors import AbsurdShapeError, UnsafePathError, UnsupportedVersionError

FORMAT_NAME = "relight-checkpoint"
FORMAT_VERSION = 2
"""The version this writer writes. 2: packed tensors may list their pieces as a grid
(`chunks`, `arrays`, `byte_offsets`); chunk crc32c in a table (also read in 1)."""
READ_VERSIONS = (1, 2)
WRITER_VERSION = "relight-ckpt 0.1.0"
MANIFEST_KEY = "manifest.json"
COMMIT_KEY = "COMMIT"
ABORT_PREFIX = "aborted/"
INDEX_PREFIX = "index/"
DATA_PREFIX = "data/"
CHUNK_CRCS = "chunk_crc32c"
"""Manifest (and rank index) field: data object key -> the crc32c of each of its inner
chunks in storage order, binding every chunk to its place (docs/format.md). Optional:
checkpoints written before it was added lack it and load without the check."""



class StorageKind(StrEnum):
    """How a tensor is stored (the manifest's and the plan's `storage` field)."""

    GRID = "grid"
    """One zarr array at global shape, chunked on the save-time shard boundaries."""
    PIECES = "pieces"
    """One array per distinct piece, at its global offset (an irregular sharding)."""
    PACKED = "packed"
    """Byte ranges of a writer's packed uint8 array (small tensors)."""


MAX_NUMEL = 1 << 44
"""No single tensor in a manifest may claim more elements than this (16 Ti elements)."""
MAX_NDIM = 32

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def dtype_name(dtype: torch.dtype, tensor: str = "") -> str:
    from relight.ckpt.errors import UnsupportedStateError

    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedStateError(
            f"tensor {tensor!r} has dtype {dtype}, which the checkpoint format does not "
            f"store; supported: {sorted(DTYPES)}", tensor=tensor) from None


def itemsize(name: str) -> int:
    return DTYPES[name].itemsize


def align(n: int, a: int = 64) -> int:
    """`n` rounded up to a multiple of `a`."""
    return (n + a - 1) // a * a


def numel(shape: tuple[int, ...] | list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def inner_chunk_shape(chunk: tuple[int, ...], item: int, target_bytes: int,
                      min_split_extent: int = 256) -> tuple[int, ...]:
    """Split an outer chunk (one save-time shard) into inner chunks that divide it exactly
    (zarr's sharding codec requires that): first every dim of at least `min_split_extent`
    is cut once (so a reader wanting half of a shard along any dim, the common
    dp/tp reshard, reads about half), then the largest extent is halved until a tile is at
    most `target_bytes`. Few, square-ish tiles keep requests per shard low on S3."""
    inner = list(chunk)
    for d, e in enumerate(chunk):
        p = _smallest_factor(e) if e > 1 else 1
        if e >= min_split_extent and p < e:
            inner[d] = e // p
    while numel(inner) * item > target_bytes:
        for d in sorted(range(len(inner)), key=lambda d: -inner[d]):
            e = inner[d]
            p = _smallest_factor(e) if e > 1 else 1
            # A large prime extent cannot be split evenly: leave it, split another dim.
            if e > 1 and (p < e or e <= 64):
                inner[d] = e // p
                break
        else:
            break
    return tuple(max(1, i) for i in inner)


def _smallest_factor(n: int) -> int:
    if n % 2 == 0:
        return 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return f
        f += 2
    return n


def zarr_metadata(shape: list[int], dtype: str, chunks: list[int], inner: list[int],
                  compression: str | None) -> dict[str, Any]:
    """zarr v3 array metadata: one sharded object per outer chunk (a save-time shard),
    inner chunks with crc32c, index with crc32c, optional zstd."""
    inner_codecs: list[dict[str, Any]] = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if compression == "zstd":
        inner_codecs.append({"name": "zstd", "configuration": {"level": 1, "checksum": False}})
    inner_codecs.append({"name": "crc32c"})
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": list(shape),
        "data_type": dtype,
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": False if dtype == "bool" else 0,
        "codecs": [{
            "name": "sharding_indexed",
            "configuration": {
                "chunk_shape": list(inner),
                "codecs": inner_codecs,
                "index_codecs": [
                    {"name": "bytes", "configuration": {"endian": "little"}},
                    {"name": "crc32c"},
                ],
                "index_location": "end",
            },
        }],
        "attributes": {"writer": WRITER_VERSION},
    }


def chunk_key(array: str, cell: tuple[int, ...] | list[int]) -> str:
    """Object key of (outer) chunk `cell` of an array: zarr v3's default key encoding
    with '/', where a 0-d array's one chunk is `c`."""
    return "/".join([f"{array}/c", *(str(int(c)) for c in cell)])


def chunk_keys(array: str, shape: list[int], chunks: list[int]) -> list[str]:
    """Object keys of every chunk of a regular-grid array."""
    grids = [range(math.ceil(s / c)) for s, c in zip(shape, chunks, strict=True)]
    return [chunk_key(array, cell) for cell in itertools.product(*grids)]


def check_path(path: Any, url: str, tensor: str = "") -> str:
    """A manifest path must stay below the checkpoint root."""
    # String searches, not a split: a manifest of 16,384 ranks names ~30,000 paths.
    # A segment is empty, "." or ".." exactly when one of these appears in /path/.
    bad = (
        not isinstance(path, str) or not path or "\\" in path or "\x00" in path
        or "://" in path or "//" in f"/{path}/" or "/./" in f"/{path}/"
        or "/../" in f"/{path}/"
    )
    if bad:
        raise UnsafePathError(
            f"checkpoint {url}: manifest path {path!r} of tensor {tensor!r} leaves the "
            "checkpoint root; the manifest is damaged or hostile, do not load it",
            url=url, tensor=tensor, obj=str(path))
    return path


def check_shape(shape: Any, url: str, tensor: str, what: str = "shape") -> tuple[int, ...]:
    ok = (type(shape) is list and len(shape) <= MAX_NDIM  # (type: a bool is an int too)
          and all(type(s) is int and 0 <= s < MAX_NUMEL for s in shape))
    if not ok or numel(shape) > MAX_NUMEL:
        raise AbsurdShapeError(
            f"checkpoint {url}: tensor {tensor!r} has {what} {shape!r} in its manifest, which "
            f"is not a list of at most {MAX_NDIM} non-negative ints with at most {MAX_NUMEL} "
            "elements; the manifest is damaged", url=url, tensor=tensor, obj=MANIFEST_KEY)
    return tuple(shape)


def check_version(manifest: Any, url: str) -> None:
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise UnsupportedVersionError(
            f"{url}/{MANIFEST_KEY} is not a {FORMAT_NAME} manifest", url=url, obj=MANIFEST_KEY)
    version = manifest.get("version")
    if type(version) is not int or version not in READ_VERSIONS:
        raise UnsupportedVersionError(
            f"{url}: checkpoint format version {version!r}, this reader knows versions "
            f"{', '.join(map(str, READ_VERSIONS))}; upgrade Relight to read it", url=url,
            obj=MANIFEST_KEY)
