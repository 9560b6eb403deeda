"""`verify(url)`: is a checkpoint committed, complete and undamaged?

Reads the commit marker and manifest (checksummed), checks that every object the
manifest implies exists, and reads every chunk so each crc32c is checked, and checked
against the crc32c the manifest records for that chunk's place (`chunk_crc32c`, when
the checkpoint has it), the way a load reads them (`ckpt.shardio`). A geometry the
direct reader does not take (none Relight writes) is decoded by tensorstore and its
stored crcs then compared with the record. Problems are collected, each naming the
tensor and the object, not raised.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relight.ckpt.errors import CheckpointError
from relight.ckpt.format import DATA_PREFIX, StorageKind, chunk_keys
from relight.ckpt.manifest import Manifest, PieceEntry, TensorEntry, read_manifest
from relight.ckpt.shardio import (
    ShardGeometry,
    direct_read_ok,
    grid_geometry,
    misplaced,
    read_shard_region,
    stored_crcs,
)
from relight.ckpt.tsio import map_ts_error, open_array
from relight.storage import StorageError, Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    url: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    step: int | None = None
    tensors: int = 0
    objects: int = 0
    bytes: int = 0

    def add(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "ok": self.ok, "problems": self.problems, "step": self.step,
                "tensors": self.tensors, "objects": self.objects, "bytes": self.bytes}


def _regions(shape: list[int], chunks: list[int]):
    if not shape:
        yield ()
        return
    grids = [range(math.ceil(s / c)) for s, c in zip(shape, chunks, strict=True)]
    for cell in itertools.product(*grids):
        yield tuple(slice(i * c, min((i + 1) * c, s))
                    for i, c, s in zip(cell, chunks, shape, strict=True))


def _read_direct(store: Store, m: Manifest, key: str, geo: ShardGeometry, tensor: str) -> int:
    """Read a whole shard object the way a load does: index and every chunk's crc32c,
    and each chunk against the manifest's record for its place."""
    region = tuple(slice(0, v) for v in (geo.valid or geo.shape))
    out = np.empty([r.stop for r in region], dtype=f"<u{geo.itemsize}")
    read_shard_region(store, key, geo, region, out, url=store.url, tensor=tensor,
                      expect=m.chunk_crcs(key), compression=m.compression)
    return out.nbytes


def _check_binding(store: Store, m: Manifest, key: str, grid: list[int] | tuple[int, ...],
                   tensor: str) -> None:
    """An object tensorstore decoded: its stored chunk crcs against the
    manifest's record (the crcs themselves tensorstore checked while decoding)."""
    want = m.chunk_crcs(key)
    if want is None:
        return
    got = stored_crcs(store.get(key), len(want), url=store.url, key=key, tensor=tensor)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g != w:
            cell = tuple(int(c) for c in np.unravel_index(i, grid)) if grid else ()
            raise misplaced(store.url, key, tensor, f"inner chunk {cell}", g, w)


def _verify_grid(store: Store, m: Manifest, name: str, t: TensorEntry) -> int:
    assert t.array is not None and t.chunks is not None and t.inner is not None
    item = t.itemsize
    shape, chunks, inner = list(t.shape), list(t.chunks), list(t.inner)
    grid = [c // i for c, i in zip(chunks, inner, strict=True)]
    direct = direct_read_ok(chunks, inner, m.compression)
    arr = None if direct else open_array(store, t.array, m.meta_of(name), read=True).result()
    n = 0
    for key, region in zip(chunk_keys(t.array, shape, chunks), _regions(shape, chunks),
                           strict=True):
        if direct:
            cell = tuple(r.start // c for r, c in zip(region, chunks, strict=True))
            n += _read_direct(store, m, key,
                              grid_geometry(t.shape, t.chunks, t.inner, cell, item), name)
            continue
        try:
            n += (arr[region] if region else arr).read().result().nbytes
        except Exception as e:  # noqa: BLE001
            raise map_ts_error(e, store.url, name, t.array) from e
        _check_binding(store, m, key, grid, name)
    return n


def _verify_array(store: Store, m: Manifest, name: str, label: str, array: str,
                  shape: tuple[int, ...], inner: tuple[int, ...], item: int) -> int:
    """One single-shard array: a piece, or a packed array (`name` its first user)."""
    piece = PieceEntry((0,) * len(shape), shape, array, inner=inner)
    n = 0
    for key in chunk_keys(array, list(shape), list(shape)):
        if direct_read_ok(shape, inner, m.compression):
            n += _read_direct(store, m, key, ShardGeometry(tuple(shape), tuple(inner), item),
                              label)
            continue
        arr = open_array(store, array, m.meta_of(name, piece), read=True).result()
        try:
            n += arr.read().result().nbytes
        except Exception as e:  # noqa: BLE001
            raise map_ts_error(e, store.url, label, array) from e
        _check_binding(store, m, key, [s // i for s, i in zip(shape, inner, strict=True)],
                       label)
    return n


def verify(url: str | os.PathLike[str] | Store, *, read_data: bool = True,
           progress: Callable[[int, int, str], None] | None = None) -> VerifyReport:
    """Check the checkpoint at `url`; `read_data=False` skips reading chunk contents.
    `progress(done, total, tensor)` is called before each tensor is read (a CLI bar).

    Args:
        url: the checkpoint (a `storage` URL or `Store`).
        read_data: read every chunk and check its crc32c (else: marker, manifest and the
            existence of every object only).
        progress: called as `progress(done, total, tensor)` before each tensor.

    Returns:
        A `VerifyReport`: `ok`, and `problems`, each naming the tensor and the object.

    Raises:
        InvalidStorageURLError: `url` is not a storage URL. Everything found at `url`
            (missing marker, damage, storage errors) is reported, not raised.
    """
    store = open_store(url)
    report = VerifyReport(store.url)
    try:
        m: Manifest = read_manifest(store)
    except (CheckpointError, StorageError) as e:
        report.add(str(e))
        return report
    report.step = m.step
    report.tensors = len(m.tensors)
    try:
        present = set(store.list(f"{DATA_PREFIX}{m.attempt}/"))
        present |= set(store.list("index/"))
    except StorageError as e:
        report.add(f"cannot list {store.url}: {e}")
        return report
    expected = m.expected_objects()
    report.objects = len(expected)
    missing_tensors: set[str] = set()
    for key, tensor in sorted(expected.items()):
        if key not in present:
            report.add(f"missing object {store.url}/{key}"
                       + (f" of tensor {tensor!r}" if tensor else " (packed small tensors)"))
            missing_tensors.add(tensor)
    for rank, key in (m.index or {}).items():
        if key not in present:
            report.add(f"missing index object {store.url}/{key} of rank {rank}")
    if not read_data:
        return report
    for i, (name, t) in enumerate(m.tensors.items()):
        if progress is not None:
            progress(i, len(m.tensors), name)
        if name in missing_tensors:
            continue
        try:
            if t.storage is StorageKind.GRID:
                report.bytes += _verify_grid(store, m, name, t)
            elif t.storage is StorageKind.PIECES:
                for p in t.pieces:
                    assert p.inner is not None
                    report.bytes += _verify_array(store, m, name, name, p.array, p.shape,
                                                  p.inner, t.itemsize)
        except CheckpointError as e:
            report.add(str(e))
        except Exception as e:  # noqa: BLE001
            report.add(f"tensor {name!r}: {type(e).__name__}: {e}")
    for arr_path, size in m.packed.items():
        if f"{arr_path}/zarr.json" not in present:
            continue
        users = m.packed_users(arr_path)
        first = next(iter(users), "")
        label = ", ".join(users[:3]) + ("..." if len(users) > 3 else "")
        try:
            report.bytes += _verify_array(store, m, first, label, arr_path,
                                          (size,), (m.packed_inner,), 1)
        except CheckpointError as e:
            report.add(str(e))
        except Exception as e:  # noqa: BLE001
            report.add(str(map_ts_error(e, store.url, label, arr_path)))
    if not report.ok:
        logger.warning("verify %s: %d problem(s), first: %s", store.url, len(report.problems),
                       report.problems[0])
    return report
