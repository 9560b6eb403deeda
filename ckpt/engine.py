"""Save and load: the doing half (I/O and collectives) over the pure plans.

Call order of a save, on every rank of the group:

1. foreground: flatten the state dict; wait for the previous save of this process;
   one small all-gather (layout digest, attempt id, "already committed?"); on a new
   layout a second all-gather of layouts and `plan_save` (cached afterwards);
   copy this rank's write pieces into reusable staging buffers. This is all an async
   save blocks on.
2. background (or inline when synchronous), no collectives: write this rank's
   arrays through tensorstore, then its index object `index/<attempt>/r<rank>.json`.
3. coordinator only: poll storage until every rank's index is there (or one reported
   an error, or the timeout passes), then write `manifest.json`, then `COMMIT`.
   Other ranks poll for `COMMIT` (or the coordinator's abort note) so that `wait()`
   returns on every rank once the checkpoint is committed.

A failure anywhere leaves no `COMMIT`; the handle raises it from `wait()`.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorstore as ts
import torch

from ckpt.comm import Comm
from ckpt.commit import build_manifest, collect_indexes, encode_manifest, index_key
from ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointSaveError,
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingKeyError,
    ShapeMismatchError,
    UnexpectedKeyError,
)
from ckpt.flatten import FlatState, flatten_state, name_of, set_value
from ckpt.format import (
    ABORT_PREFIX,
    CHUNK_CRCS,
    COMMIT_KEY,
    DATA_PREFIX,
    chunk_key,
    dtype_name,
    inner_chunk_shape,
    itemsize,
    numel,
    zarr_metadata,
)
from ckpt.layout import Piece, describe_placements, local_pieces, local_view
from ckpt.manifest import Manifest, crc32c, publish_commit, read_manifest, validate
from ckpt.plan import (
    LoadPlan,
    RankLayout,
    SavePlan,
    TensorLayout,
    TensorPlan,
    layout_digest,
    plan_load,
    plan_save,
)
from ckpt.shardio import (
    ShardGeometry,
    direct_ok,
    direct_read_ok,
    encode_shard,
    grid_geometry,
    read_shard_region,
    stored_crcs,
)
from ckpt.staging import Stager, StagingBuffers
from ckpt.tsio import map_ts_error, open_array, put_metadata, to_numpy
from storage import ObjectNotFoundError, StorageError, Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["SaveOptions", "SaveHandle", "LoadInfo", "save", "load", "wait_staged"]


@dataclass(kw_only=True)
class SaveOptions:
    """How a save is planned and persisted."""

    compression: str | None = None
    """None (default) or "zstd" (level 1) on every inner chunk; see docs/ckpt.md."""
    pack_bytes: int = 512 * 1024
    """Tensors no larger than this are packed into one byte array per writer."""
    inner_bytes: int = 4 << 20
    """Target size of the inner (crc32c-checked, separately readable) chunks of a shard:
    the granularity of partial reads when loading into another layout."""
    packed_inner: int = 64 * 1024
    """Inner chunk size of packed arrays."""
    pipelined_staging: bool = False
    """Async saves only: `save()` returns once the staging copy is scheduled and the copy
    runs in the background thread. The saved tensors must not change in place until
    `handle.wait_staged()` (or `ckpt.wait_staged()`) returns; `ckpt.guard_optimizer`
    makes an optimizer's next step wait for it. See docs/ckpt.md."""
    commit_timeout_s: float = 600.0
    """How long the coordinator waits for every rank's index before giving up."""
    collective_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")


def _exists(url: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{url} already holds a committed checkpoint; saves never overwrite one "
        "(choose another URL or delete it first)", url=url)


def _err_json(e: BaseException) -> dict[str, Any]:
    return {"type": type(e).__name__, "msg": str(e)}


def _log_prefix(comm: Comm, step: int | None) -> str:
    return f"[rank {comm.rank} step {step}]"


# ------------------------------------------------------------------------ handle


class SaveHandle(Future):
    """A save in progress: a `concurrent.futures.Future` (as DCP's `async_save` returns)
    whose result is None once the checkpoint is committed, and whose exception is the
    save's failure: `result()`, `exception()`, `done()`, `add_done_callback()` work as
    on any future (callbacks run in the save's thread). `wait()` blocks until committed
    and raises the failure; `wait_staged()` until the state may change. A save cannot be
    cancelled once started."""

    def __init__(self, url: str, step: int | None) -> None:
        super().__init__()
        self.set_running_or_notify_cancel()  # started: cancel() returns False
        self.url = url
        self.step = step
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.stall_s = 0.0
        """Seconds the caller was blocked (wait for the previous save + plan + staging,
        unless the staging is pipelined)."""
        self.stage_s = 0.0
        """Seconds copying into the staging buffers (in the caller's thread, or in the
        background with pipelined staging)."""
        self.staged_s = 0.0
        """Seconds from the call until the state was no longer read (staging done)."""
        self._staged = threading.Event()
        self._t0 = time.perf_counter()
        self.waited_s = 0.0
        self.total_s = 0.0
        self.bytes_written = 0
        self._thread: threading.Thread | None = None
        self._exit_wait_s = 600.0
        """How long interpreter exit waits for this save if it is still running."""

    def staged(self) -> bool:
        """Whether the save no longer reads the state (it may be changed)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> float:
        """Block until the save no longer reads the state; returns seconds waited. A
        staging failure is raised by `wait()`, not here."""
        if self._staged.is_set():
            return 0.0
        t0 = time.perf_counter()
        if not self._staged.wait(timeout):
            raise TimeoutError(f"save to {self.url} still staging after {timeout} s")
        return time.perf_counter() - t0

    def _mark_staged(self) -> None:
        if not self._staged.is_set():
            self.staged_s = time.perf_counter() - self._t0
            self._staged.set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"save to {self.url} still running after {timeout} s")
        if self._error is not None:
            raise self._error

    @property
    def error(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._mark_staged()
        self._done.set()
        # After `_done`: a done-callback that calls `wait()` must not block on itself.
        if error is None:
            self.set_result(None)
        else:
            self.set_exception(error)


# ------------------------------------------------------------------------ engine state


@dataclass
class _Cached:
    key: tuple[Any, ...]
    plan: SavePlan
    bufs: StagingBuffers = field(default_factory=StagingBuffers)


class _EngineState:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight: SaveHandle | None = None
        self.cached: _Cached | None = None
        self.crashed = False
        """The main thread died of an uncaught exception (see `_note_crash`)."""
        self.hooked = False


def _note_crash_hook() -> None:
    """Chain `sys.excepthook` once (at the first async save) to note an uncaught
    exception, so that exit does not wait for a save that may never commit."""
    if _STATE.hooked:
        return
    _STATE.hooked = True
    previous = sys.excepthook

    def hook(tp: type[BaseException], value: BaseException, tb: Any) -> None:
        _STATE.crashed = True
        previous(tp, value, tb)

    sys.excepthook = hook


_STATE = _EngineState()


def wait_staged() -> float:
    """Wait until this process's latest save no longer reads the state (pipelined
    staging); returns seconds waited. Returns at once when nothing is staging."""
    h = _STATE.inflight
    return 0.0 if h is None else h.wait_staged()


def _finish_at_exit() -> None:
    """At interpreter exit, let this process's async save in flight commit instead of
    dying with its (daemon) thread, and say so: the script forgot `wait()`. Not when the
    process dies of an uncaught exception (a fault: its peers may be gone, the commit may
    never come, and a supervisor waits for this process to exit before restarting)."""
    h = _STATE.inflight
    if h is None or h._done.is_set():
        return
    if _STATE.crashed:
        logger.warning("exiting on an uncaught exception while the async save of step %s to "
                       "%s is still running: not waiting for it (it stays uncommitted)",
                       h.step, h.url)
        return
    limit = h._exit_wait_s
    logger.warning("the async save of step %s to %s is still running at interpreter exit; "
                   "waiting up to %.0f s for it to commit (call CheckpointManager.wait() or "
                   "handle.wait() before the script ends)", h.step, h.url, limit)
    if not h._done.wait(limit):
        logger.error("the save of step %s to %s did not finish within %.0f s: the process "
                     "exits and leaves it uncommitted", h.step, h.url, limit)
    elif h._error is not None:
        logger.error("the save of step %s to %s failed: %s", h.step, h.url, h._error)
    else:
        logger.warning("the save of step %s to %s committed before exit", h.step, h.url)


# Before `concurrent.futures` refuses new work at shutdown (the save's thread pools would
# fail with "cannot schedule new futures after interpreter shutdown"): threading's exit
# hooks run newest first, ahead of `atexit`, and the executors registered theirs when
# this module imported them.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_finish_at_exit)
else:  # pragma: no cover - CPython < 3.9
    atexit.register(_finish_at_exit)


def wait_inflight() -> float:
    """Wait for this process's save in flight (if any); returns seconds waited."""
    h = _STATE.inflight
    if h is None or h.done():
        return 0.0
    t0 = time.perf_counter()
    h._done.wait()
    return time.perf_counter() - t0


# ------------------------------------------------------------------------ save


def _rank_layout(flat: FlatState, rank: int) -> tuple[RankLayout, dict[str, list[Piece]]]:
    tensors = []
    pieces_of: dict[str, list[Piece]] = {}
    for name, ref in sorted(flat.tensors.items()):
        shape, pieces = local_pieces(ref.tensor, name)
        pieces_of[name] = pieces
        tensors.append(TensorLayout(
            name, ref.path, shape, dtype_name(ref.tensor.dtype, name),
            describe_placements(ref.tensor),
            tuple((p.offset, p.shape) for p in pieces)))
    return RankLayout(rank, tuple(tensors), tuple(sorted(flat.values))), pieces_of


PERSIST_THREADS = 8
"""Objects a rank publishes concurrently. Encoding (a copy and a crc32c pass) runs in
one thread per rank: ranks share a host's cores, and more CPU-bound threads than cores
only add switching (measured: 4 ranks x 8 encoding threads on 2 cores made sync saves
several times slower than one encoder per rank)."""


def save(
    state_dict: Mapping[str, Any],
    url: str | os.PathLike[str] | Store,
    async_save: bool = False,
    *,
    step: int | None = None,
    config: dict[str, Any] | None = None,
    layout: dict[str, Any] | None = None,
    process_group: Any = None,
    options: SaveOptions | None = None,
    on_commit: Callable[[dict[str, Any]], None] | None = None,
    on_start: Callable[[], None] | None = None,
    before_commit: Callable[[dict[str, Any]], None] | None = None,
) -> SaveHandle:
    """Save `state_dict` as one checkpoint at `url`; every rank of the group calls.

    With `async_save` only the staging copy blocks; the returned handle's `wait()`
    raises any failure. `config` (JSON) and `layout` (JSON, how the run was
    parallelized) go into the manifest. `on_commit(manifest_dict)` runs on the
    coordinator right after the commit marker is written, `on_start()` on the coordinator
    before anything is persisted (both in the background thread when asynchronous).
    """
    opts = options or SaveOptions()
    t0 = time.perf_counter()
    comm = Comm(process_group, opts.collective_timeout_s)
    store = open_store(url)
    pre = _log_prefix(comm, step)
    flat = flatten_state(state_dict)

    waited = wait_inflight()
    if waited > 0.001:
        logger.info("%s save to %s waited %.3f s for the previous save", pre, store.url, waited)
    prev = _STATE.inflight
    if prev is not None and prev.error is not None and not getattr(prev, "_reported", False):
        prev._reported = True  # type: ignore[attr-defined]
        logger.error("%s previous save to %s failed: %s", pre, prev.url, prev.error)

    # Any rank's local problem (bad value, unsupported placement, committed target) is
    # raised on every rank, so no rank is left waiting in a collective or for a commit.
    error: BaseException | None = None
    digest = ""
    lay: RankLayout | None = None
    pieces_of: dict[str, list[Piece]] = {}
    try:
        lay, pieces_of = _rank_layout(flat, comm.rank)
        digest = layout_digest(lay, [comm.ranks, opts.pack_bytes, opts.inner_bytes,
                                     opts.packed_inner])
        # Async saves check in the background thread (every rank, before writing): on S3
        # the request would otherwise hold every rank in the handshake.
        if not async_save and comm.is_coordinator and store.exists(COMMIT_KEY):
            raise _exists(store.url)
    except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
        error = e
    attempt = uuid.uuid4().hex[:16]
    # One fixed-size all-gather per save: layout digest, attempt id, "I failed" flag.
    what = (f"the start of the save to {store.url} (step {step}; every rank of the group "
            "must call ckpt.save / CheckpointManager.save)")
    hand = comm.allgather_fixed(f"{digest:32}{attempt}{'E' if error else '-'}".encode(), 49,
                                what)
    got = [(h[:32].decode(), h[32:48].decode(), h[48:49] == b"E") for h in hand]
    if any(g[2] for g in got):
        errors = comm.allgather_json(_err_json(error) if error else None, what)
        if error is not None:
            raise error
        _raise_first(errors, comm.ranks, store.url)
    assert lay is not None
    attempt = got[0][1]
    key = (tuple(g[0] for g in got), comm.ranks)
    cached = _STATE.cached
    if cached is None or cached.key != key:
        layouts = [RankLayout.from_json(j) for j in comm.allgather_json(lay.to_json(), what)]
        plan = plan_save(layouts, comm.ranks, pack_bytes=opts.pack_bytes,
                         inner_bytes=opts.inner_bytes, packed_inner=opts.packed_inner)
        cached = _Cached(key, plan)
        _STATE.cached = cached
        logger.info("%s new save plan: %d tensors, this rank writes %d bytes", pre,
                    len(plan.tensors), plan.write_bytes.get(comm.rank, 0))
    plan = cached.plan

    t_planned = time.perf_counter()
    # Stage: copy this rank's pieces into (reused) host buffers, here or (pipelined) in
    # the background thread before it persists.
    my_writes = plan.writes_of(comm.rank)
    need_copy = async_save or any(
        flat.tensors[t.name].tensor.device.type != "cpu" for t, _ in my_writes)
    copies = []
    for t, p in my_writes:
        piece = next(x for x in pieces_of[t.name] if x.offset == p.offset and x.shape == p.shape)
        copies.append((t, p, local_view(flat.tensors[t.name].tensor, piece)))
    background = async_save and opts.pipelined_staging
    stager = Stager(copies, cached.bufs, need_copy=need_copy,
                    packed_size=plan.packed_size.get(comm.rank, 0),
                    packed_inner=plan.packed_inner, background=background)
    staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    packed_buf: np.ndarray | None = None
    if not background:
        staged, packed_buf = stager.run()
    values = {n: flat.values[n].value for n, r in plan.value_owner.items() if r == comm.rank}

    handle = SaveHandle(store.url, step)
    handle._t0 = t0
    handle._exit_wait_s = opts.commit_timeout_s + 60.0
    job = _SaveJob(store, plan, attempt, comm.rank, staged, packed_buf, values, opts,
                   dict(step=step, config=config, layout=layout), handle, on_commit, pre)
    job.on_start = on_start if comm.is_coordinator else None
    job.before_commit = before_commit
    if background:
        job.stager = stager
    else:
        handle.stage_s = time.perf_counter() - t_planned
        handle._mark_staged()
    handle.stall_s = time.perf_counter() - t0
    handle.waited_s = waited
    logger.debug("%s save stall %.3f s (waited %.3f, plan+handshake %.3f, staging %.3f%s)",
                 pre, handle.stall_s, waited, t_planned - t0 - waited, handle.stage_s,
                 ", pipelined" if background else "")
    _STATE.inflight = handle
    if async_save:
        _note_crash_hook()
        th = threading.Thread(target=job.run, name=f"ckpt-save-{step}", daemon=True)
        handle._thread = th
        th.start()
    else:
        job.run(comm)
        handle.wait()
    return handle


class _SaveJob:
    """Persist + commit; runs in the background thread. Never touches a process group."""

    def __init__(self, store: Store, plan: SavePlan, attempt: str, rank: int,
                 staged: dict[tuple[str, tuple[int, ...]], torch.Tensor],
                 packed: np.ndarray | None, values: dict[str, Any], opts: SaveOptions,
                 meta: dict[str, Any], handle: SaveHandle,
                 on_commit: Callable[[dict[str, Any]], None] | None, pre: str) -> None:
        self.store, self.plan, self.attempt, self.rank = store, plan, attempt, rank
        self.staged, self.packed, self.values, self.opts = staged, packed, values, opts
        self.meta, self.handle, self.on_commit, self.pre = meta, handle, on_commit, pre
        self.data = f"{DATA_PREFIX}{attempt}"
        self.t0 = time.perf_counter()
        self.chunk_crcs: dict[str, list[int | None]] = {}
        """Data object key -> crc32c of each inner chunk (the manifest's CHUNK_CRCS)."""
        self.ts_objects: dict[str, int] = {}
        """Data object key -> inner chunk count of the objects tensorstore wrote."""

    # -- persist ---------------------------------------------------------------------

    def _meta_of(self, t: TensorPlan, piece_shape: tuple[int, ...] | None) -> dict[str, Any]:
        comp = self.opts.compression
        if piece_shape is None:
            return zarr_metadata(list(t.shape), t.dtype, list(t.chunks), list(t.inner), comp)
        inner = inner_chunk_shape(piece_shape, itemsize(t.dtype), self.opts.inner_bytes)
        return zarr_metadata(list(piece_shape), t.dtype, list(piece_shape), list(inner), comp)

    def persist(self) -> int:
        """Write this rank's shard objects and zarr.json files; returns payload bytes.
        Whole uncompressed shards go straight to storage (`ckpt.shardio`), the rest
        (zstd, partial edge shards, 0-d arrays) through tensorstore, whose objects are
        noted in `ts_objects` for `_bind_stored_objects`."""
        comp = self.opts.compression
        futures = []
        direct: list[tuple[str, np.ndarray, ShardGeometry]] = []
        nbytes = ts_bytes = 0
        opened: dict[str, Any] = {}
        metas: list[tuple[str, dict[str, Any]]] = []
        for t, p in self.plan.writes_of(self.rank):
            if t.storage == "packed":
                continue
            arr = self.staged[(t.name, p.offset)]
            size = arr.numel() * arr.element_size()
            nbytes += size
            if t.storage == "grid":
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
            if t.storage == "grid" and t.meta_writer == self.rank:
                metas.append((f"{self.data}/{t.array}", self._meta_of(t, None)))
        if self.packed is not None:
            path = f"{self.data}/packed/r{self.rank:05d}"
            size = self.packed.shape[0]
            meta = zarr_metadata([size], "uint8", [size], [self.plan.packed_inner], comp)
            metas.append((path, meta))
            nbytes += size
            key, geo = chunk_key(path, (0,)), ShardGeometry((size,), (self.plan.packed_inner,), 1)
            if direct_ok(geo.shape, geo.inner, comp):
                direct.append((key, self.packed, geo))
            else:
                arr = open_array(self.store, path, meta, read=False).result()
                futures.append(arr.write(self.packed))
                ts_bytes += size
                self.ts_objects[key] = geo.n_chunks
        # Objects are independent: publish them concurrently (atomic, not yet flushed)
        # while tensorstore finishes its chunks (it fsyncs each one itself), then make
        # them all durable with one sync: the rank's index, put after this returns,
        # never names an object a power cut could lose.
        batch = self.store.deferred()
        with ThreadPoolExecutor(max_workers=PERSIST_THREADS,
                                thread_name_prefix="ckpt-put") as pool:
            done = [pool.submit(put_metadata, batch, path, meta) for path, meta in metas]
            pending: deque[Any] = deque()
            for key, a, geo in direct:
                while len(pending) >= PERSIST_THREADS:  # bounds the memory of encoded objects
                    pending.popleft().result()
                pending.append(pool.submit(batch.put, key, encode_shard(
                    a, geo, self.chunk_crcs.setdefault(key, []))))
            for f in futures:
                f.result()
            for d in (*done, *pending):
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

    def _index_key(self, rank: int, error: bool = False) -> str:
        return index_key(self.attempt, rank, error)

    def _poll(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self.opts.commit_timeout_s
        delay = 0.005
        while True:
            result = check()
            if result is not None:
                return result
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{what} not done after {self.opts.commit_timeout_s:.0f} s (a rank died "
                    "or is stuck?)")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.05)

    def _all_indexes(self) -> dict[int, dict[str, Any]] | None:
        return collect_indexes(self.store, self.attempt, self.plan.ranks)

    def _manifest(self, indexes: dict[int, dict[str, Any]]) -> dict[str, Any]:
        return build_manifest(self.plan, self.attempt, self.data, indexes,
                              inner_bytes=self.opts.inner_bytes,
                              compression=self.opts.compression, meta=self.meta)

    def _committed(self) -> bool | None:
        try:
            commit = json.loads(self.store.get(COMMIT_KEY))
            if commit.get("attempt") == self.attempt:
                return True
        except ObjectNotFoundError:
            pass
        if self.store.exists(f"{ABORT_PREFIX}{self.attempt}.json"):
            note = json.loads(self.store.get(f"{ABORT_PREFIX}{self.attempt}.json"))
            raise CheckpointSaveError(
                f"save to {self.store.url} aborted by the coordinator: {note.get('reason')}",
                url=self.store.url)
        return None

    def _commit(self, indexes: dict[int, dict[str, Any]]) -> None:
        """Coordinator: manifest, then the commit marker, then the post-commit hook."""
        try:
            manifest = self._manifest(indexes)
            try:  # what every load checks first: never commit a checkpoint it would refuse
                validate(manifest, self.store.url)
            except CheckpointError as e:
                raise CheckpointSaveError(
                    f"save to {self.store.url}: the manifest built from the ranks' indexes "
                    f"does not validate ({e}); nothing was committed", url=self.store.url,
                    failures={self.rank: str(e)}) from e
            raw = encode_manifest(manifest)
            hook = self.before_commit
            publish_commit(self.store, self.attempt, raw, {
                "attempt": self.attempt, "manifest_bytes": len(raw),
                "manifest_crc32c": crc32c(raw), "step": self.meta["step"],
                "created": manifest["created"]},
                (lambda: hook(manifest)) if hook is not None else None)
            logger.info("%s committed %s (%d tensors, %.3f s)", self.pre, self.store.url,
                        len(manifest["tensors"]), time.perf_counter() - self.t0)
        except BaseException as e:
            try:
                self.store.put(f"{ABORT_PREFIX}{self.attempt}.json",
                               json.dumps({"reason": str(e)}).encode())
            except Exception:  # noqa: BLE001
                logger.warning("%s could not write the abort note", self.pre)
            raise
        if self.on_commit is not None:
            try:
                self.on_commit(manifest)
            except Exception as e:  # noqa: BLE001 - the checkpoint is committed
                logger.error("%s post-commit hook failed: %s", self.pre, e)

    on_start: Callable[[], None] | None = None
    before_commit: Callable[[dict[str, Any]], None] | None = None
    stager: Stager | None = None
    """Pipelined staging: the copy this thread makes before persisting."""

    def _stage(self) -> None:
        assert self.stager is not None
        t0 = time.perf_counter()
        try:
            self.staged, self.packed = self.stager.run()
        finally:
            self.handle.stage_s = time.perf_counter() - t0
            self.handle._mark_staged()
            self.stager = None  # drop the references to the live tensors

    def _persist_and_index(self, check_exists: bool = False) -> BaseException | None:
        try:
            if self.stager is not None:  # first: the caller waits for it, not for storage
                self._stage()
            if check_exists and self.store.exists(COMMIT_KEY):
                raise _exists(self.store.url)
            if self.on_start is not None:
                self.on_start()
            nbytes = self.persist()
            self._bind_stored_objects()
            self.handle.bytes_written = nbytes
            self.store.put(self._index_key(self.rank), json.dumps({
                "rank": self.rank, "attempt": self.attempt, "bytes": nbytes,
                "values": self.values, CHUNK_CRCS: self.chunk_crcs,
                "time": time.time()}).encode())
            return None
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            logger.error("%s persisting to %s failed: %s", self.pre, self.store.url, e)
            try:
                self.store.put(self._index_key(self.rank, error=True), json.dumps(
                    {"rank": self.rank, "error": f"{type(e).__name__}: {e}"}).encode())
            except Exception:  # noqa: BLE001 - storage may be what failed
                logger.warning("%s could not record the failure in storage", self.pre)
            return e

    def _run_sync(self, comm: Comm) -> None:
        """Synchronous save: the foreground thread may use collectives instead of polling."""
        local = self._persist_and_index()
        what = f"the synchronous save to {self.store.url} (every rank's write)"
        status = comm.allgather_json(
            {"err": f"{type(local).__name__}: {local}" if local else None,
             "values": self.values if not local else {},
             CHUNK_CRCS: self.chunk_crcs if not local else {}}, what)
        if local is not None:
            raise local
        failures = {r: s["err"] for r, s in zip(comm.ranks, status, strict=True) if s["err"]}
        if failures:
            raise CheckpointSaveError(
                f"save to {self.store.url} failed on rank(s) {sorted(failures)}: {failures}",
                url=self.store.url, failures=failures)
        err: BaseException | None = None
        if comm.is_coordinator:
            try:
                self._commit({r: {"values": s["values"], CHUNK_CRCS: s[CHUNK_CRCS]}
                              for r, s in zip(comm.ranks, status, strict=True)})
            except BaseException as e:  # noqa: BLE001 - shared below, then raised
                err = e
        outcome = comm.allgather_json(str(err) if err else None,
                                      f"the commit of the synchronous save to {self.store.url}")
        if err is not None:
            raise err
        if outcome[0]:
            raise CheckpointSaveError(
                f"save to {self.store.url}: the coordinator failed to commit: {outcome[0]}",
                url=self.store.url, failures={comm.coordinator: outcome[0]})

    def _run_async(self) -> None:
        local = self._persist_and_index(check_exists=True)
        if local is not None:
            raise local
        if self.rank == self.plan.coordinator:
            self._commit(self._poll(self._all_indexes, "waiting for every rank's index"))
        else:
            self._poll(self._committed, "waiting for the commit marker")

    def run(self, comm: Comm | None = None) -> None:
        error: BaseException | None = None
        try:
            if comm is not None:
                self._run_sync(comm)
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
            logger.error("%s save to %s failed: %s", self.pre, self.store.url, e)
            error = e
        self.handle.total_s = time.perf_counter() - self.t0 + self.handle.stall_s
        self.handle._finish(error)


# ------------------------------------------------------------------------ load


@dataclass
class LoadInfo:
    """What a load did: the checkpoint's step and config, bytes this rank read."""

    url: str
    step: int | None
    config: dict[str, Any] | None
    bytes_read: int
    bytes_needed: int
    missing: list[str] = field(default_factory=list)
    """Entries of this rank's state dict the checkpoint lacks (`strict=False` leaves them
    as they were), JSON dict keys included as `name/key`."""
    unexpected: list[str] = field(default_factory=list)
    """Entries of the checkpoint no rank asked for (`strict=False` ignores them)."""


def _box_slices(inter_off, inter_shape, base_off) -> tuple[slice, ...]:
    return tuple(slice(o - b, o - b + s) for o, s, b in zip(inter_off, inter_shape, base_off,
                                                          strict=True))


def _intersect(a_off, a_shape, b_off, b_shape):
    off, shp = [], []
    for ao, as_, bo, bs in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def _chunk_bytes(off, shape, chunks, item) -> int:
    """Bytes of the chunks of grid `chunks` that a box overlaps."""
    n = item
    for o, s, c in zip(off, shape, chunks, strict=True):
        first, last = o // c, (o + s - 1) // c
        n *= (last - first + 1) * c
    return n


PACKED_WHOLE_READ = 32 << 20


_READ_POOL_LOCK = threading.Lock()
_READ_POOLS: dict[bool, ThreadPoolExecutor] = {}
READ_THREADS = {False: 2, True: 8}
"""Direct-read threads per process, for local stores (files, memory: a read is a copy
in the kernel, CPU work, and ranks share the cores) and remote ones (S3: requests wait
on the network, so more in flight hide latency)."""


def _read_pool(store: Store) -> ThreadPoolExecutor:
    """Threads for direct shard reads, shared by every load of this process."""
    remote = store.location.scheme not in ("file", "memory")
    with _READ_POOL_LOCK:
        if remote not in _READ_POOLS:
            _READ_POOLS[remote] = ThreadPoolExecutor(max_workers=READ_THREADS[remote],
                                                     thread_name_prefix="ckpt-read")
        return _READ_POOLS[remote]


_DECODE = threading.Lock()
"""One thread per process checks and copies fetched chunks (CPU); fetches overlap."""


def _read_bytes(store: Store, key: str, geo: ShardGeometry, lo: int, hi: int, url: str,
                tensor: str, expect: list[int | None] | None,
                compression: str | None) -> np.ndarray:
    out = np.empty(hi - lo, dtype=np.uint8)
    read_shard_region(store, key, geo, (slice(lo, hi),), out, url=url, tensor=tensor,
                      cpu=_DECODE, expect=expect, compression=compression)
    return out


class _Reader:
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
        item = itemsize(t["dtype"])
        comp = m.raw.get("compression")
        try:
            if t["storage"] == "grid":
                n = _chunk_bytes(self.off, self.shape, t["inner"], item) if self.shape else item
                self.bytes += n
                if direct_read_ok(t["chunks"], t["inner"], comp):
                    self._direct_grid(t, item, comp)
                    return
                self.ts_bytes += n
                arr = open_array(store, t["array"], m.meta_of(name), read=True).result()
                region = _box_slices(self.off, self.shape, (0,) * len(self.off))
                self._ts(arr[region] if region else arr, (), t["array"])
                return
            for p in t["pieces"]:
                inter = _intersect(self.off, self.shape, p["offset"], p["shape"])
                if inter is None:
                    continue
                dst = _box_slices(inter[0], inter[1], self.off)
                src = _box_slices(inter[0], inter[1], p["offset"])
                if t["storage"] == "pieces":
                    n = _chunk_bytes(inter[0], inter[1], p["inner"], item) if inter[1] else item
                    self.bytes += n
                    if direct_read_ok(p["shape"], p["inner"], comp):
                        geo = ShardGeometry(tuple(p["shape"]), tuple(p["inner"]), item)
                        self._direct(chunk_key(p["array"], (0,) * len(src)), geo, src, dst,
                                     comp)
                        continue
                    self.ts_bytes += n
                    arr = open_array(store, p["array"], m.meta_of(name, p), read=True).result()
                    self._ts(arr[src] if src else arr, dst, p["array"])
                    continue
                self._packed(p, src, dst, item, comp, packed_cache)
        except (CheckpointError, StorageError):  # storage failing is not damage: retryable
            raise
        except Exception as e:  # noqa: BLE001
            raise map_ts_error(e, store.url, name, t.get("array") or "pieces") from e

    def _packed(self, p: dict[str, Any], src: tuple[slice, ...], dst: tuple[slice, ...],
                item: int, comp: str | None, packed_cache: dict[str, Any] | None) -> None:
        m, arr_path = self.m, p["array"]
        nb = numel(p["shape"]) * item
        bo = p["byte_offset"]
        pshape = tuple(p["shape"])
        size = m.raw["packed"][arr_path]
        pi = m.raw["packed_inner"]
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
                fut = _read_pool(self.store).submit(_read_bytes, self.store, key, geo, lo_b, hi_b,
                                          self.store.url, self.name, m.chunk_crcs(key), comp)
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

    def _direct_grid(self, t: dict[str, Any], item: int, comp: str | None) -> None:
        chunks = t["chunks"]
        ranges = [range(o // c, (o + s - 1) // c + 1)
                  for o, s, c in zip(self.off, self.shape, chunks, strict=True)]
        for cell in itertools.product(*ranges):
            s_off = tuple(c * k for c, k in zip(cell, chunks, strict=True))
            inter = _intersect(self.off, self.shape, s_off, chunks)
            if inter is None:
                continue
            self._direct(chunk_key(t["array"], cell), grid_geometry(t, cell, item),
                         _box_slices(*inter, s_off), _box_slices(*inter, self.off), comp)

    def _direct(self, key: str, geo: ShardGeometry, src: tuple[slice, ...],
                dst: tuple[slice, ...], comp: str | None) -> None:
        view = to_numpy(self.out[dst] if dst else self.out)
        fut = _read_pool(self.store).submit(read_shard_region, self.store, key, geo, src, view,
                                  url=self.store.url, tensor=self.name, cpu=_DECODE,
                                  expect=self.m.chunk_crcs(key), compression=comp)
        self.parts.append((fut, dst, None, key))

    def _ts(self, src: Any, dst: tuple[slice, ...], obj: str) -> None:
        view = self.out[dst] if dst else self.out
        target = ts.array(to_numpy(view), copy=False, write=True)
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


def _raise_first(errors: list[Any], ranks: tuple[int, ...], url: str) -> None:
    """Raise another rank's error as the same type: a storage failure stays a
    `StorageError` (retryable), damage a `CheckpointError`."""
    import ckpt.errors as errs
    import storage.errors as storage_errs

    for rank, e in zip(ranks, errors, strict=True):
        if e:
            msg = f"rank {rank}: {e['msg']}"
            cls = getattr(errs, e["type"], None)
            if isinstance(cls, type) and issubclass(cls, CheckpointError):
                raise cls(msg, url=url)
            cls = getattr(storage_errs, e["type"], None)
            if isinstance(cls, type) and issubclass(cls, StorageError):
                raise cls(msg, url=url)
            raise CorruptCheckpointError(f"rank {rank}: {e['type']}: {e['msg']}", url=url)


def load(
    state_dict: dict[str, Any],
    url: str | os.PathLike[str] | Store,
    *,
    strict: bool = True,
    process_group: Any = None,
    broadcast: bool = True,
    collective_timeout_s: float = 300.0,
) -> LoadInfo:
    """Load the committed checkpoint at `url` into `state_dict`, in place, resharded to
    whatever layout its tensors have now. Every rank of the group calls.

    `strict`: every checkpoint entry must be wanted by some rank and every wanted entry
    must exist (JSON dicts: every key of the target's dict); with `strict=False` missing
    entries keep their current values and extra ones are ignored, both listed in the
    returned `LoadInfo` (`missing`, `unexpected`). A JSON dict is merged into the target's
    dict (the checkpoint's keys win); other JSON values are replaced.

    `broadcast`: a region needed by several ranks is read by one of them and sent to the
    others (else every rank reads its own). Raises typed errors from
    `ckpt.errors` on every rank when any rank finds a problem.
    """
    comm = Comm(process_group, collective_timeout_s)
    store = open_store(url)
    flat = flatten_state(state_dict)
    error: BaseException | None = None
    m: Manifest | None = None
    needs: list[tuple[str, Any, int]] = []
    local: dict[str, list[Piece]] = {}
    missing: list[str] = []
    try:
        m = read_manifest(store)
        shapes_bad: list[tuple[str, str]] = []
        dtypes_bad: list[tuple[str, str]] = []
        for name, ref in sorted(flat.tensors.items()):
            if name not in m.tensors:
                missing.append(name)
                continue
            e = m.tensors[name]
            shape, pieces = local_pieces(ref.tensor, name)
            if list(shape) != e["shape"]:
                shapes_bad.append((name, f"{name!r}: checkpoint {tuple(e['shape'])}, "
                                         f"state dict {tuple(shape)}"))
                continue
            if dtype_name(ref.tensor.dtype, name) != e["dtype"]:
                dtypes_bad.append((name, f"{name!r}: checkpoint {e['dtype']}, state dict "
                                         f"{dtype_name(ref.tensor.dtype, name)}"))
                continue
            local[name] = pieces
            for p in pieces:
                needs.append((name, [list(p.offset), list(p.shape)], itemsize(e["dtype"])))
        if shapes_bad:
            raise ShapeMismatchError(
                f"{_few(shapes_bad, 'tensor')} of the state dict of another global shape "
                f"than in checkpoint {store.url}: {_first([b for _, b in shapes_bad])}",
                url=store.url, tensor=shapes_bad[0][0])
        if dtypes_bad:
            raise DtypeMismatchError(
                f"{_few(dtypes_bad, 'tensor')} of the state dict of another dtype than in "
                f"checkpoint {store.url}: {_first([b for _, b in dtypes_bad])}; load into "
                "tensors of the checkpoint's dtype and cast after loading", url=store.url,
                tensor=dtypes_bad[0][0])
        missing += [n for n in sorted(flat.values) if n not in m.values]
        missing += _missing_json_keys(flat, m)
        if missing and strict:
            raise MissingKeyError(
                f"{_few(missing, 'entry')} of the state dict not in checkpoint {store.url}: "
                f"{_first([repr(n) for n in missing])}{_fresh_state_hint(flat, m, missing)}; "
                "load with strict=False to leave them as they are (LoadInfo.missing lists "
                "them), or check the state dict keys", url=store.url, tensor=missing[0])
    except CheckpointError as e:
        error = e
    except Exception as e:  # noqa: BLE001 - storage errors etc. are reported on every rank
        error = e
    wanted = sorted(set(flat.tensors) | set(flat.values))
    gathered = comm.allgather_json({"err": _err_json(error) if error else None,
                                    "needs": needs, "wanted": wanted},
                                   what=f"the load of {store.url} (every rank of the group "
                                   "must call ckpt.load / CheckpointManager.restore)")
    if error is not None:
        raise error
    _raise_first([g["err"] for g in gathered], comm.ranks, store.url)
    assert m is not None
    all_wanted = set().union(*(set(g["wanted"]) for g in gathered))
    unexpected = sorted((set(m.tensors) | set(m.values)) - all_wanted)
    if strict and unexpected:
        raise UnexpectedKeyError(
            f"checkpoint {store.url} holds {_few(unexpected, 'entry', verb=False)} no rank "
            "asked for: "
            f"{_first([repr(n) for n in unexpected])}; load with strict=False to ignore them",
            url=store.url, tensor=unexpected[0])
    all_needs = {
        r: [(n, (tuple(b[0]), tuple(b[1])), i) for n, b, i in g["needs"]]
        for r, g in zip(comm.ranks, gathered, strict=True)
    }
    plan: LoadPlan = plan_load(all_needs, broadcast=broadcast)

    # Read what this rank reads, straight into its tensors; report failures on every
    # rank before exchanging.
    views = {(name, (p.offset, p.shape)): p for name, ps in local.items() for p in ps}
    got: dict[tuple[str, Any], torch.Tensor] = {}
    nbytes = ts_bytes = 0
    readers: list[tuple[Any, _Reader]] = []
    try:
        packed_cache: dict[str, Any] = {}
        for task in plan.tasks:
            if task.reader == comm.rank:
                t = flat.tensors[task.name].tensor
                piece = views[(task.name, task.box)]
                r = _Reader(store, m, task.name, task.box, t.dtype, local_view(t, piece),
                            packed_cache)
                readers.append((task, r))
                nbytes += r.bytes
                ts_bytes += r.ts_bytes
        for task, r in readers:
            got[(task.name, task.box)] = r.result()
        if ts_bytes:  # tensorstore's reads do not pass through Store.get
            store.stats.record_read(ts_bytes, ops=len(readers))
        error = None
    except Exception as e:  # noqa: BLE001
        error = e
        # Reads still in flight write straight into the target tensors: let them finish
        # before raising, or they land after a retry (restore's fallback to an older step).
        for _, r in readers:
            r.drain()
    errs = comm.allgather_json(_err_json(error) if error else None,
                               f"the reads of the load of {store.url}")
    if error is not None:
        raise error
    _raise_first(errs, comm.ranks, store.url)

    sends, recvs, copies = [], [], []
    for tag, task in enumerate(plan.tasks):
        if task.reader == comm.rank:
            data = got[(task.name, task.box)]
            for peer in task.receivers:
                sends.append((data if data.is_contiguous() else data.contiguous(), peer, tag))
        elif comm.rank in task.receivers:
            t = flat.tensors[task.name].tensor
            view = local_view(t, views[(task.name, task.box)])
            if view.is_contiguous():
                buf = view
            else:
                buf = torch.empty(task.box[1], dtype=t.dtype, device=view.device)
                copies.append((view, buf))
            recvs.append((buf, task.reader, tag))
    comm.exchange(sends, recvs, f"the exchange of regions read for the load of {store.url}")
    with torch.no_grad():
        for view, buf in copies:
            view.copy_(buf)
        for (name, box), data in got.items():  # read into a host buffer (CUDA targets)
            t = flat.tensors[name].tensor
            view = local_view(t, views[(name, box)])
            if view.data_ptr() != data.data_ptr():
                view.copy_(data)
    needed = sum(numel(p.shape) * flat.tensors[n].tensor.element_size()
                 for n, ps in local.items() for p in ps)
    for name, ref in flat.values.items():
        if name in m.values:
            set_value(ref, m.values[name])
    for obj, sub, _name in reversed(flat.statefuls):
        obj.load_state_dict(sub)
    return LoadInfo(store.url, m.step, m.raw.get("config"), nbytes, needed, missing=missing,
                    unexpected=unexpected)


FEW = 5
"""How many offenders an error about several entries names."""


def _few(items: list[Any], noun: str, verb: bool = True) -> str:
    """'1 tensor is' / '3 entries are' (without `verb`: '3 entries') for error messages."""
    plural = noun[:-1] + "ies" if noun.endswith("y") else noun + "s"
    out = f"{len(items)} {noun if len(items) == 1 else plural}"
    return f"{out} {'is' if len(items) == 1 else 'are'}" if verb else out


def _first(items: list[str]) -> str:
    shown = ", ".join(items[:FEW])
    return shown + (f", and {len(items) - FEW} more" if len(items) > FEW else "")


def _missing_json_keys(flat: FlatState, m: Manifest) -> list[str]:
    """Keys of the state dict's JSON dicts that the checkpoint's dicts lack, as
    `name/key/...`: a dict value is merged into the target's dict on load (see
    `set_value`), so these keep the target's values."""
    out: list[str] = []

    def walk(target: Any, stored: Any, name: str) -> None:
        if not (isinstance(target, dict) and isinstance(stored, dict)):
            return
        for k, v in target.items():
            sub = f"{name}/{name_of((k,))}"
            if k not in stored:
                out.append(sub)
            else:
                walk(v, stored[k], sub)

    for name, ref in sorted(flat.values.items()):
        if name in m.values:
            walk(ref.value, m.values[name], name)
    return out


def _fresh_state_hint(flat: FlatState, m: Manifest, missing: list[str]) -> str:
    """What to do when an empty container of the target (an optimizer without state yet:
    `optimizer.state_dict()["state"] == {}`) stands where the checkpoint holds entries."""
    for name in missing:
        ref = flat.values.get(name)
        if ref is None or ref.value not in ({}, [], None):
            continue
        under = [n for n in (*m.tensors, *m.values) if n.startswith(name + "/")]
        if under:
            return (f". {name!r} is empty in the state dict but the checkpoint holds "
                    f"{len(under)} entries under it (e.g. {under[0]!r}): an optimizer "
                    "without state yet; build the state dict with "
                    "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer),"
                    " which creates the optimizer's state (or take one step first)")
    return ""

