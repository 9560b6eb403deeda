"""`RegionReader`: read one region of one tensor of a committed checkpoint.

Used by every load (`ckpt.loader.load`), by exports (`ckpt.export`) and by anything
else that wants part of a stored tensor without loading a state dict.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from relight.ckpt.errors import CheckpointError
from relight.ckpt.format import StorageKind, chunk_key, numel
from relight.ckpt.manifest import Manifest, PieceEntry, TensorEntry
from relight.ckpt.plan import intersect
from relight.ckpt.read_pools import read_pools
from relight.ckpt.shardio import ShardGeometry, direct_read_ok, grid_geometry, read_shard_region
from relight.ckpt.tsio import map_ts_error, open_array, tensorstore, to_numpy
from relight.storage import StorageError, Store

__all__ = ["PACKED_WHOLE_READ", "RegionReader"]


def _box_slices(inter_off, inter_shape, base_off) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(inter_off, inter_shape, base_off,
                                                          strict=True))




def _chunk_bytes(off, shape, chunks, item) -> int:
    """Bytes of the chunks of grid `chunks` that a box overlaps."""
    n = item
    for o, s, c in zip(off, shape, chunks, strict=True):
        first, last = o // c, (o + s - 1) // c
        n *= (last - first + 1) * c
    return n


PACKED_WHOLE_READ = 32 << 20


def _read_bytes(store: Store, key: str, geo: ShardGeometry, lo: int, hi: int, url: str,
                tensor: str, expect: list[int | None] | None,
                compression: str | None) -> np.ndarray:
    out = np.empty(hi - lo, dtype=np.uint8)
    read_shard_region(store, key, geo, (slice(lo, hi),), out, url=url, tensor=tensor,
                      cpu=read_pools().decode_lock, expect=expect, compression=compression)
    return out


class RegionReader:
    """Issues the reads for one region of one tensor: whole uncompressed shards straight
    from storage (`ckpt.shardio`, on a thread pool), the rest through tensorstore. With
    `out` (a tensor of the region's shape, e.g. the target's own local view) the data
    is decoded straight into it; `result()` waits and returns the filled tensor."""

    def __init__(self, store: Store, m: Manifest, name: str, box, dtype: torch.dtype,
                 out: torch.Tensor | None = None,
                 packed_cache: dict[str, Any] | None = None) -> None:
        self.store, self.m, self.name = store, m, name
        self.off, self.shape = box
        self.out = out if out is not None and out.device.type == "cpu" else \
            torch.empty(self.shape, dtype=dtype)
        self.parts: list[tuple[Any, tuple[slice, ...], Callable[[Any], torch.Tensor] | None,
                               str]] = []
        self.bytes = 0
        """Bytes of the chunks this region overlaps (what a read fetches, + metadata)."""
        self.ts_bytes = 0
        """Of which through tensorstore (direct reads are counted by the store itself)."""
        t = m.tensors[name]
        item = t.itemsize
        comp = m.compression
        try:
            if t.storage is StorageKind.GRID:
                assert t.array is not None and t.chunks is not None and t.inner is not None
                n = _chunk_bytes(self.off, self.shape, t.inner, item) if self.shape else item
                self.bytes += n
                if direct_read_ok(t.chunks, t.inner, comp):
                    self._direct_grid(t, item, comp)
                    return
                self.ts_bytes += n
                arr = open_array(store, t.array, m.meta_of(name), read=True).result()
                region = _box_slices(self.off, self.shape, (0,) * len(self.off))
                self._ts(arr[region] if region else arr, (), t.array)
                return
            for p in t.piece_list():
                inter = intersect(self.off, self.shape, p.offset, p.shape)
                if inter is None:
                    continue
                dst = _box_slices(inter[0], inter[1], self.off)
                src = _box_slices(inter[0], inter[1], p.offset)
                if t.storage is StorageKind.PIECES:
                    assert p.inner is not None
                    n = _chunk_bytes(inter[0], inter[1], p.inner, item) if inter[1] else item
                    self.bytes += n
                    if direct_read_ok(p.shape, p.inner, comp):
                        geo = ShardGeometry(p.shape, p.inner, item)
                        self._direct(chunk_key(p.array, (0,) * len(src)), geo, src, dst,
                                     comp)
                        continue
                    self.ts_bytes += n
                    arr = open_array(store, p.array, m.meta_of(name, p), read=True).result()
                    self._ts(arr[src] if src else arr, dst, p.array)
                    continue
                self._packed(p, src, dst, item, comp, packed_cache)
        except (CheckpointError, StorageError):  # storage failing is not damage: retryable
            raise
        except Exception as e:  # noqa: BLE001
            raise map_ts_error(e, store.url, name, t.array or "pieces") from e

    def _packed(self, p: PieceEntry, src: tuple[slice, ...], dst: tuple[slice, ...],
                item: int, comp: str | None, packed_cache: dict[str, Any] | None) -> None:
        m, arr_path = self.m, p.array
        nb = numel(p.shape) * item
        bo = p.byte_offset
        assert bo is not None
        pshape = p.shape
        size = m.packed[arr_path]
        pi = m.packed_inner
        direct = direct_read_ok([size], [pi], comp)
        geo = ShardGeometry((size,), (pi,), 1)
        key = chunk_key(arr_path, (0,))
        whole = packed_cache is not None and size <= PACKED_WHOLE_READ
        if whole and arr_path in packed_cache:
            fut, lo = packed_cache[arr_path], bo
        else:
            # Small packed arrays are fetched once per load, whole: many small tensors
            # would otherwise each cost a request.
            lo_b, hi_b = (0, size) if whole else (bo, bo + nb)
            n = size if whole else (((bo + nb - 1) // pi - bo // pi + 1) * pi if nb else 0)
            self.bytes += n
            if direct:
                fut = read_pools().pool(self.store).submit(
                    _read_bytes, self.store, key, geo, lo_b, hi_b, self.store.url, self.name,
                    m.chunk_crcs(key), comp)
            else:
                self.ts_bytes += n
                arr = open_array(self.store, arr_path, m.meta_of(self.name, p),
                                 read=True).result()
                fut = (arr if whole else arr[lo_b:hi_b]).read()
            lo = bo if whole else 0
            if whole:
                assert packed_cache is not None
                packed_cache[arr_path] = fut

        def convert(a, pshape=pshape, src=src, lo=lo, nb=nb):
            full = torch.from_numpy(a[lo: lo + nb]).view(self.out.dtype)
            full = full.reshape(pshape)
            return full[src] if src else full
        self.parts.append((fut, dst, convert, arr_path))

    def _direct_grid(self, t: TensorEntry, item: int, comp: str | None) -> None:
        assert t.array is not None and t.chunks is not None and t.inner is not None
        chunks = t.chunks
        ranges = [range(o // c, (o + s - 1) // c + 1)
                  for o, s, c in zip(self.off, self.shape, chunks, strict=True)]
        for cell in itertools.product(*ranges):
            s_off = tuple(c * k for c, k in zip(cell, chunks, strict=True))
            inter = intersect(self.off, self.shape, s_off, chunks)
            if inter is None:
                continue
            self._direct(chunk_key(t.array, cell),
                         grid_geometry(t.shape, chunks, t.inner, cell, item),
                         _box_slices(*inter, s_off), _box_slices(*inter, self.off), comp)

    def _direct(self, key: str, geo: ShardGeometry, src: tuple[slice, ...],
                dst: tuple[slice, ...], comp: str | None) -> None:
        view = to_numpy(self.out[dst] if dst else self.out)
        reads = read_pools()
        fut = reads.pool(self.store).submit(
            read_shard_region, self.store, key, geo, src, view, url=self.store.url,
            tensor=self.name, cpu=reads.decode_lock, expect=self.m.chunk_crcs(key),
            compression=comp, buffers=reads.buffers, gap_bytes=reads.gap_bytes(self.store))
        self.parts.append((fut, dst, None, key))

    def _ts(self, src: Any, dst: tuple[slice, ...], obj: str) -> None:
        view = self.out[dst] if dst else self.out
        target = tensorstore().array(to_numpy(view), copy=False, write=True)
        self.parts.append((target.write(src), dst, None, obj))

    def drain(self) -> None:
        """Wait for every read of this reader, ignoring their errors."""
        for fut, *_ in self.parts:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the load already failed; its error is raised
                pass

    def result(self) -> torch.Tensor:
        for fut, dst, convert, obj in self.parts:
            try:
                a = fut.result()
            except (CheckpointError, StorageError):
                raise
            except Exception as e:  # noqa: BLE001
                raise map_ts_error(e, self.store.url, self.name, obj) from e
            if convert is not None:
                part = convert(a)
                if dst:
                    self.out[dst] = part
                else:
                    self.out.copy_(part)
        return self.out
