"""One rank's half of a save: persist its objects, record its index, take part in the
commit (`ckpt.commit`).

`_SaveJob.run` runs in the save's background thread (async save) or in the caller's
(sync save). Either way every rank writes its index object and the commit marker
decides. Synchronous, the ranks' indexes reach the coordinator in one gather over the
caller's group. Asynchronous, the same gather runs over the save's own gloo group
(`ckpt.commit_group`), never the caller's; without one, or when it fails, ranks meet
through storage: the coordinator reads every index object, the others poll for the
marker.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from relight.ckpt.collective import coordinator_outcome, gather_or_raise
from relight.ckpt.comm import Comm
from relight.ckpt.commit import (
    build_manifest,
    commit,
    exists_error,
    wait_for_commit,
    wait_for_indexes,
    write_index,
    write_index_error,
)
from relight.ckpt.errors import CheckpointError, CheckpointSaveError, CollectiveError
from relight.ckpt.format import (
    CHUNK_CRCS,
    COMMIT_KEY,
    DATA_PREFIX,
    StorageKind,
    chunk_key,
    inner_chunk_shape,
    itemsize,
    zarr_metadata,
)
from relight.ckpt.manifest import Manifest
from relight.ckpt.plan import TensorPlan
from relight.ckpt.save_context import RankShare, SaveContext
from relight.ckpt.shardio import ShardGeometry, direct_ok, encode_shard, stored_crcs
from relight.ckpt.tsio import open_array, put_metadata, to_numpy
from relight.storage.direct_io import BufferPool

logger = logging.getLogger(__name__)

__all__ = ["PERSIST_THREADS"]

PERSIST_THREADS = 8
"""Objects a rank publishes concurrently. Encoding (a copy and a crc32c pass) runs in
one thread per rank: ranks share a host's cores, and more CPU-bound threads than cores
only add switching (measured: 4 ranks x 8 encoding threads on 2 cores made sync saves
several times slower than one encoder per rank)."""


class _SaveJob:
    """Persist, index and commit one rank's part of a save; `run()` once."""

    def __init__(self, ctx: SaveContext, share: RankShare) -> None:
        self.ctx, self.share = ctx, share
        self.store, self.plan, self.rank = ctx.store, ctx.the_plan(), ctx.rank
        self.committed: BaseException | bool | None = None
        """Coordinator: True once it committed, or why it failed to; None before."""
        self.recycled: object | None = None
        """This save's token with the page recycler (`ckpt.page_recycle`), once it writes."""
        self.data = f"{DATA_PREFIX}{ctx.attempt}"
        self.t0 = time.perf_counter()
        self.chunk_crcs: dict[str, list[int | None]] = {}
        """Data object key -> crc32c of each inner chunk (the manifest's CHUNK_CRCS)."""
        self.ts_objects: dict[str, int] = {}
        """Data object key -> inner chunk count of the objects tensorstore wrote."""

    # -- persist ---------------------------------------------------------------------

    def _meta_of(self, t: TensorPlan, piece_shape: tuple[int, ...] | None) -> dict[str, Any]:
        comp = self.ctx.opts.compression
        if piece_shape is None:
            return zarr_metadata(list(t.shape), t.dtype, list(t.chunks), list(t.inner), comp)
        inner = inner_chunk_shape(piece_shape, itemsize(t.dtype), self.ctx.opts.inner_bytes)
        return zarr_metadata(list(piece_shape), t.dtype, list(piece_shape), list(inner), comp)

    def persist(self) -> int:
        """Write this rank's shard objects and zarr.json files; returns payload bytes.
        Whole uncompressed shards go straight to storage (`ckpt.shardio`), the rest
        (zstd, partial edge shards, 0-d arrays) through tensorstore, whose objects are
        noted in `ts_objects` for `_bind_stored_objects`."""
        comp = self.ctx.opts.compression
        futures = []
        direct: list[tuple[str, np.ndarray, ShardGeometry]] = []
        nbytes = ts_bytes = 0
        opened: dict[str, Any] = {}
        metas: list[tuple[str, dict[str, Any]]] = []
        for t, p in self.share.writes:
            if t.storage is StorageKind.PACKED:
                continue
            arr = self.share.staged[(t.name, p.offset)]
            size = arr.numel() * arr.element_size()
            nbytes += size
            if t.storage is StorageKind.GRID:
                path = f"{self.data}/{t.array}"
                key = chunk_key(path, [o // c for o, c in zip(p.offset, t.chunks, strict=True)])
                geo = ShardGeometry(tuple(t.chunks), tuple(t.inner), itemsize(t.dtype))
                if tuple(p.shape) == tuple(t.chunks) and direct_ok(t.chunks, t.inner, comp):
                    direct.append((key, to_numpy(arr), geo))
                    continue
                meta = self._meta_of(t, None)
                if path not in opened:
                    opened[path] = open_array(self.store, path, meta, read=False).result()
                region = tuple(slice(o, o + s) for o, s in zip(p.offset, p.shape, strict=True))
                store_arr = opened[path][region] if region else opened[path]
            else:
                path = f"{self.data}/{p.array}"
                meta = self._meta_of(t, p.shape)
                metas.append((path, meta))
                key = chunk_key(path, (0,) * len(p.shape))
                geo = ShardGeometry(tuple(p.shape),
                                    tuple(meta["codecs"][0]["configuration"]["chunk_shape"]),
                                    itemsize(t.dtype))
                if direct_ok(geo.shape, geo.inner, comp):
                    direct.append((key, to_numpy(arr), geo))
                    continue
                store_arr = open_array(self.store, path, meta, read=False).result()
            futures.append(store_arr.write(to_numpy(arr)))
            ts_bytes += size
            if size:  # an empty array has no chunk objects
                self.ts_objects[key] = geo.n_chunks
        for t in self.plan.tensors.values():
            if t.storage is StorageKind.GRID and t.meta_writer == self.rank:
                metas.append((f"{self.data}/{t.array}", self._meta_of(t, None)))
        if self.share.packed is not None:
            path = f"{self.data}/packed/r{self.rank:05d}"
            size = self.share.packed.shape[0]
            meta = zarr_metadata([size], "uint8", [size], [self.plan.packed_inner], comp)
            metas.append((path, meta))
            nbytes += size
            key, geo = chunk_key(path, (0,)), ShardGeometry((size,), (self.plan.packed_inner,), 1)
            if direct_ok(geo.shape, geo.inner, comp):
                direct.append((key, self.share.packed, geo))
            else:
                arr = open_array(self.store, path, meta, read=False).result()
                futures.append(arr.write(self.share.packed))
                ts_bytes += size
                self.ts_objects[key] = geo.n_chunks
        # Objects are independent: publish them concurrently (atomic, not yet flushed)
        # while tensorstore finishes its chunks (it fsyncs each one itself), then make
        # them all durable with one sync: the rank's index, put after this returns,
        # never names an object a power cut could lose.
        batch = self.store.deferred()
        # Encoded objects go into at most PERSIST_THREADS aligned buffers (the puts in
        # flight and the one being filled), each reused once its put has returned.
        buffers = BufferPool()
        recycler = self.ctx.checkpointer.recycler
        self.recycled = recycler.begin_save()
        with ThreadPoolExecutor(max_workers=PERSIST_THREADS,
                                thread_name_prefix="ckpt-put") as pool:
            done = [pool.submit(put_metadata, batch, path, meta) for path, meta in metas]
            pending: deque[tuple[Any, np.ndarray | None]] = deque()
            for key, a, geo in direct:
                while len(pending) >= PERSIST_THREADS:  # bounds the memory of encoded objects
                    put, used = pending.popleft()
                    put.result()
                    if used is not None:
                        buffers.give_back(used)
                # A store that copies what it is given gets a fresh `bytes` instead.
                buf = None if batch.copies_put_buffers else buffers.take(geo.object_bytes)
                blob = encode_shard(a, geo, self.chunk_crcs.setdefault(key, []), into=buf)
                recycler.make_room(self.store, key, len(blob))
                pending.append((pool.submit(batch.put, key, blob), buf))
            for f in futures:
                f.result()
            for d in (*done, *(put for put, _ in pending)):
                d.result()
        batch.sync()
        if futures:  # tensorstore's bytes do not pass through Store.put
            self.store.stats.record_write(ts_bytes, ops=len(futures))
        return nbytes

    def _bind_stored_objects(self) -> None:
        """Record the chunk crc32c of the objects tensorstore wrote (zstd, edge shards,
        0-d arrays): read each back whole and take the crcs from its index, no pass over
        the data (the direct path recorded its own while encoding)."""
        todo = self.ts_objects
        if not todo:
            return

        def read(key: str) -> None:
            self.chunk_crcs[key] = stored_crcs(self.store.get(key), todo[key],
                                               url=self.store.url, key=key, tensor="")
        with ThreadPoolExecutor(max_workers=min(PERSIST_THREADS, len(todo)),
                                thread_name_prefix="ckpt-bind") as pool:
            for f in [pool.submit(read, k) for k in todo]:
                f.result()

    # -- commit ----------------------------------------------------------------------

    def _manifest(self, indexes: dict[int, dict[str, Any]]) -> Manifest:
        """The manifest, once its chunk crc32c table is durable (the manifest binds it)."""
        opts = self.ctx.opts
        manifest, table = build_manifest(self.plan, self.ctx.attempt, self.data, indexes,
                                         inner_bytes=opts.inner_bytes,
                                         compression=opts.compression, meta=self.ctx.meta)
        assert manifest.chunk_crc32c_table is not None
        self.store.put(manifest.chunk_crc32c_table["object"], table)
        return manifest

    def _commit(self, indexes: dict[int, dict[str, Any]]) -> None:
        """Coordinator: manifest, then the commit marker, then the post-commit hook."""
        manifest = commit(self.store, self.ctx.attempt, lambda: self._manifest(indexes),
                          self.ctx.hooks, rank=self.rank, pre=self.ctx.pre)
        logger.info("%s committed %s (%d tensors, %.3f s)", self.ctx.pre, self.store.url,
                    len(manifest.tensors), time.perf_counter() - self.t0)

    def _stage(self) -> None:
        share, handle = self.share, self.ctx.handle
        assert share.stager is not None
        t0 = time.perf_counter()
        try:
            share.staged, share.packed = self.ctx.checkpointer.save_worker.run_staging(
                share.stager.run)
        finally:
            handle.stage_s = time.perf_counter() - t0
            handle._mark_staged()
            share.stager = None  # drop the references to the live tensors

    def _persist_and_index(self, check_exists: bool = False) -> BaseException | None:
        ctx = self.ctx
        try:
            if ctx.pipelined:  # first: the caller waits for it, not for storage
                self._stage()
            if check_exists and self.store.exists(COMMIT_KEY):
                raise exists_error(self.store.url)
            if ctx.hooks.on_start is not None and self.rank == self.plan.coordinator:
                ctx.hooks.on_start()
            nbytes = self.persist()
            self._bind_stored_objects()
            ctx.handle.bytes_written = nbytes
            write_index(self.store, ctx.attempt, self.rank, nbytes, self.share.values,
                        self.chunk_crcs)
            return None
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            logger.error("%s persisting to %s failed: %s", ctx.pre, self.store.url, e)
            write_index_error(self.store, ctx.attempt, self.rank, e, ctx.pre)
            return e

    def _run_sync(self, comm: Comm) -> None:
        """Synchronous save: the foreground thread may use collectives instead of polling."""
        self._commit_over(comm, self._persist_and_index())

    def _commit_over(self, comm: Comm, local: BaseException | None) -> None:
        """The commit over `comm`'s collectives: every rank learns whether any rank
        failed, the coordinator gathers the indexes and commits, and every rank learns
        the outcome. A `CollectiveError` means the group failed, not the save."""
        url = self.store.url

        def failed(failures: dict[int, Any]) -> BaseException:
            msgs = {r: f"{e['type']}: {e['msg']}" for r, e in failures.items()}
            return CheckpointSaveError(
                f"save to {url} failed on rank(s) {sorted(msgs)}: {msgs}", url=url,
                failures=msgs)

        indexes = gather_or_raise(comm, local, {"values": self.share.values,
                                                CHUNK_CRCS: self.chunk_crcs},
                                  f"the save to {url} (every rank's write)",
                                  url=url, remote=failed)
        err: BaseException | None = None
        if indexes is not None:  # the coordinator
            try:
                self._commit(dict(zip(comm.ranks, indexes, strict=True)))
            except BaseException as e:  # noqa: BLE001 - shared below, then raised
                err = e
            self.committed = err or True

        def not_committed(failures: dict[int, Any]) -> BaseException:
            msg = failures[comm.coordinator]["msg"]
            return CheckpointSaveError(
                f"save to {url}: the coordinator failed to commit: {msg}", url=url,
                failures={comm.coordinator: msg})

        coordinator_outcome(comm, err, f"the commit of the save to {url}", url=url,
                            remote=not_committed)

    def _run_async(self) -> None:
        local = self._persist_and_index(check_exists=True)
        deadline = time.monotonic() + self.ctx.opts.commit_timeout_s
        group = self.ctx.group
        if group is not None:
            try:
                self._commit_over(group.comm(), local)
                return
            except CollectiveError as e:
                # The group failed (a peer gone, a timeout), not the save: storage, which
                # holds every rank's index and decides by the commit marker, finishes it.
                group.mark_broken(e, self.ctx.pre)
        if local is not None:
            raise local
        left = max(0.0, deadline - time.monotonic())
        if self.rank != self.plan.coordinator:
            wait_for_commit(self.store, self.ctx.attempt, left)
        elif self.committed is not None:  # it did commit (or failed to) before the group did
            if isinstance(self.committed, BaseException):
                raise self.committed
        else:
            self._commit(wait_for_indexes(self.store, self.ctx.attempt, self.plan.ranks, left))

    def run(self) -> None:
        error: BaseException | None = None
        try:
            if not self.ctx.async_save:
                self._run_sync(self.ctx.comm)
            else:
                self._run_async()
        except BaseException as e:  # noqa: BLE001 - surfaced through the handle
            if not isinstance(e, CheckpointError):
                err = CheckpointSaveError(
                    f"save to {self.store.url} failed on rank {self.rank}: "
                    f"{type(e).__name__}: {e}", url=self.store.url,
                    failures={self.rank: str(e)})
                err.__cause__ = e
                e = err
            logger.error("%s save to %s failed: %s", self.ctx.pre, self.store.url, e)
            error = e
        if error is None and self.recycled is not None:
            # Every rank knows the checkpoint committed: its pages are the ones kept.
            self.ctx.checkpointer.recycler.committed(self.recycled)
        handle = self.ctx.handle
        handle.total_s = time.perf_counter() - self.t0 + handle.stall_s
        handle._finish(error)
