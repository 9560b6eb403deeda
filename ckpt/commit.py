"""The commit protocol of a save: how a checkpoint becomes committed, atomically.

Objects, in the order they are written (keys from `ckpt.format`):

1. every rank: its data objects, then its index `index/<attempt>/r<rank>.json`
   (`index_key`), or `index/<attempt>/r<rank>.error.json` when it failed;
2. the coordinator: polls until every rank's index is there (`wait_for_indexes`,
   failing as soon as one rank recorded an error), builds the manifest from the plan and
   the indexes (`build_manifest`), checks it as a load would, and publishes it with the
   commit marker `COMMIT`, created exclusively (`publish_commit`); on any failure it
   leaves `aborted/<attempt>.json` instead (`write_abort`);
3. every other rank: polls for the marker of its attempt, or the abort note
   (`wait_for_commit`).

A checkpoint is committed exactly when `COMMIT` exists; `CommitHooks` lets a caller (the
`CheckpointManager`) run its own writes at fixed points of the protocol. The functions
are plain functions over a `Store` and a `SavePlan`, so the scale benchmarks drive the
same code at thousands of simulated ranks that a save runs.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from relight.ckpt.comm import parse_json_list
from relight.ckpt.crc_table import TABLE_FIELD, TABLE_NAME, encode_table
from relight.ckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptCheckpointError,
)
from relight.ckpt.format import (
    ABORT_PREFIX,
    CHUNK_CRCS,
    COMMIT_KEY,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_PREFIX,
    MANIFEST_KEY,
    WRITER_VERSION,
    StorageKind,
    align,
    inner_chunk_shape,
    itemsize,
)
from relight.ckpt.manifest import (
    Manifest,
    PieceEntry,
    TensorEntry,
    data_arrays,
    read_commit,
    validate,
)
from relight.ckpt.plan import GridPieces, SavePlan, regular_grid
from relight.storage import ObjectNotFoundError, StorageError, Store
from relight.storage.checksum import crc32c

logger = logging.getLogger(__name__)

__all__ = ["COLLECT_THREADS", "CommitHooks", "bind_chunk_crcs", "build_manifest",
           "collect_indexes", "commit", "plan_manifest",
           "encode_manifest", "exists_error", "index_key", "publish_commit",
           "wait_for_commit", "wait_for_indexes", "write_abort", "write_index",
           "write_index_error"]


@dataclass(frozen=True, slots=True)
class CommitHooks:
    """A caller's writes at fixed points of one save's commit protocol. Each runs on
    the coordinator only, in the save's thread (the background thread of an async save);
    none may use a process group."""

    on_start: Callable[[], None] | None = None
    """Before this save persists anything."""
    before_commit: Callable[[Manifest], None] | None = None
    """With the manifest, after it is published and before the commit marker is created:
    what it writes is there for every rank that sees the marker. Raising aborts the save."""
    on_commit: Callable[[Manifest], None] | None = None
    """With the manifest, right after the commit marker is written. An error is logged,
    not raised: the checkpoint is committed."""


def exists_error(url: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{url} already holds a committed checkpoint; saves never overwrite one "
        "(choose another URL or delete it first)", url=url)

COLLECT_THREADS = 16
"""Index objects the coordinator reads at once. Each is a small GET whose cost on object
storage is the round trip, not the bytes: one after another, 4,096 of them took 75 s on
a loopback S3 server. More threads than this gained nothing there (the server was the
limit: about 150 GETs/s on 2 cores); on a remote S3, latency-bound, they would."""


def index_key(attempt: str, rank: int, error: bool = False) -> str:
    return f"{INDEX_PREFIX}{attempt}/r{rank:05d}{'.error' if error else ''}.json"


def write_index(store: Store, attempt: str, rank: int, nbytes: int, values: dict[str, Any],
                chunk_crcs: dict[str, list[int | None]]) -> None:
    """Every rank, once its objects are durable: the index naming what it persisted (its
    JSON values, the chunk crc32c of its objects). The coordinator waits for these."""
    store.put(index_key(attempt, rank), json.dumps({
        "rank": rank, "attempt": attempt, "bytes": nbytes, "values": values,
        CHUNK_CRCS: chunk_crcs, "time": time.time()}).encode())


def write_index_error(store: Store, attempt: str, rank: int, error: BaseException,
                      pre: str = "") -> None:
    """A rank whose part failed: the error index, so the coordinator fails the save at once
    instead of waiting out its timeout (best effort: storage may be what failed)."""
    try:
        store.put(index_key(attempt, rank, error=True), json.dumps(
            {"rank": rank, "error": f"{type(error).__name__}: {error}"}).encode())
    except Exception:  # noqa: BLE001 - storage may be what failed
        logger.warning("%s could not record the failure in storage", pre)


def collect_indexes(store: Store, attempt: str,
                    ranks: tuple[int, ...]) -> dict[int, dict[str, Any]] | None:
    """Every rank's index of `attempt`, or None while some are missing; raises
    `CheckpointSaveError` as soon as any rank recorded a failure instead."""
    keys = set(store.list(f"{INDEX_PREFIX}{attempt}/"))
    errors = [k for k in keys if k.endswith(".error.json")]
    if errors:
        failures = {}
        for k in errors:
            try:
                e = json.loads(store.get(k))
                failures[int(e["rank"])] = str(e["error"])
            except Exception as exc:  # noqa: BLE001 - best effort description
                failures[-1] = f"{k}: {exc}"
        raise CheckpointSaveError(
            f"save to {store.url} failed on rank(s) {sorted(failures)}: {failures}",
            url=store.url, failures=failures)
    wanted = [index_key(attempt, r) for r in ranks]
    if not all(k in keys for k in wanted):
        return None
    if len(wanted) == 1:
        return {ranks[0]: json.loads(store.get(wanted[0]))}
    with ThreadPoolExecutor(max_workers=min(COLLECT_THREADS, len(wanted)),
                            thread_name_prefix="ckpt-collect") as pool:
        raws = list(pool.map(store.get, wanted))
    return dict(zip(ranks, parse_json_list(raws), strict=True))


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest's bytes: compact JSON. Indented, one crc32c per line, it was twice
    the size (4.8 MB for the 70B layout at 64 ranks) for no reader's benefit:
    `relight ckpt show` prints what a person wants to see."""
    return json.dumps(manifest.to_json(), separators=(",", ":")).encode()


def plan_manifest(plan: SavePlan, attempt: str, data: str, values: dict[str, Any], *,
                  inner_bytes: int, compression: str | None, meta: dict[str, Any]) -> Manifest:
    """The manifest of `plan` saved as `attempt` under data prefix `data`, with the JSON
    `values`, before its chunk crc32c are bound (`build_manifest`); `meta` holds step,
    config, layout."""
    tensors: dict[str, TensorEntry] = {}
    for t in plan.tensors.values():
        if t.storage is StorageKind.GRID:
            e = TensorEntry(t.shape, t.dtype, t.storage, t.path, t.placements,
                            array=f"{data}/{t.array}", chunks=t.chunks, inner=t.inner)
        elif t.storage is StorageKind.PACKED:
            # The cells of a regular grid (any even split) are listed by position: two
            # ints per piece instead of an object each, which at thousands of ranks is
            # most of the manifest (every rank's slice of every norm weight).
            if isinstance(t.pieces, GridPieces):
                chunks: tuple[int, ...] | None = t.pieces.chunks
            else:
                chunks = regular_grid(t.shape, [(p.offset, p.shape) for p in t.pieces]) \
                    if t.pieces else None
            if chunks is not None:
                e = TensorEntry(t.shape, t.dtype, t.storage, t.path, t.placements,
                                chunks=chunks,
                                cell_arrays=tuple(f"{data}/{p.array}" for p in t.pieces),
                                cell_byte_offsets=tuple(p.byte_offset for p in t.pieces))
            else:
                e = TensorEntry(t.shape, t.dtype, t.storage, t.path, t.placements,
                                pieces=tuple(PieceEntry(p.offset, p.shape, f"{data}/{p.array}",
                                                        byte_offset=p.byte_offset)
                                             for p in t.pieces))
        else:
            e = TensorEntry(t.shape, t.dtype, t.storage, t.path, t.placements, pieces=tuple(
                PieceEntry(p.offset, p.shape, f"{data}/{p.array}", inner=inner_chunk_shape(
                    p.shape, itemsize(t.dtype), inner_bytes))
                for p in t.pieces))
        tensors[t.name] = e
    now = time.time()
    return Manifest(
        format=FORMAT_NAME, version=FORMAT_VERSION,
        writer={"version": WRITER_VERSION, "torch": torch.__version__},
        step=meta["step"], created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        created_unix=now, attempt=attempt, compression=compression,
        world_size=len(plan.ranks), ranks=list(plan.ranks), config=meta["config"],
        layout=meta["layout"], tensors=tensors, values={k: values[k] for k in sorted(values)},
        packed={f"{data}/packed/r{r:05d}": align(s, plan.packed_inner)
                for r, s in plan.packed_size.items() if s},
        packed_inner=plan.packed_inner, bytes=sum(t.nbytes for t in plan.tensors.values()),
        index={str(r): index_key(attempt, r) for r in plan.ranks},
        absent=frozenset({CHUNK_CRCS, TABLE_FIELD}))


def bind_chunk_crcs(manifest: Manifest, crcs: dict[str, list[int | None]],
                    data: str) -> tuple[Manifest, bytes]:
    """`manifest` with the record of its chunk crc32c table (`ckpt.crc_table`), and the
    table's bytes, to be stored at the record's object before the manifest is published.
    Raises `CheckpointSaveError` naming a data object the ranks reported no crcs for."""
    try:
        blob, record = encode_table(data_arrays(manifest), crcs, f"{data}/{TABLE_NAME}")
    except (KeyError, ValueError) as e:
        raise CheckpointSaveError(
            f"the ranks' chunk_crc32c do not cover the save plan ({e.args[0]}); nothing "
            "was committed") from e
    return replace(manifest, chunk_crc32c_table=record,
                   absent=manifest.absent - {TABLE_FIELD}), blob


def build_manifest(plan: SavePlan, attempt: str, data: str,
                   indexes: dict[int, dict[str, Any]], *, inner_bytes: int,
                   compression: str | None, meta: dict[str, Any]) -> tuple[Manifest, bytes]:
    """The manifest of `plan` with the values and chunk crc32c the ranks reported in
    `indexes`, and its chunk crc32c table's bytes (`bind_chunk_crcs`)."""
    values: dict[str, Any] = {}
    crcs: dict[str, list[int | None]] = {}
    for idx in indexes.values():
        values.update(idx["values"])
        crcs.update(idx.get(CHUNK_CRCS, {}))
    bare = plan_manifest(plan, attempt, data, values, inner_bytes=inner_bytes,
                         compression=compression, meta=meta)
    return bind_chunk_crcs(bare, crcs, data)


def _poll(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    delay = 0.005
    while True:
        result = check()
        if result is not None:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{what} not done after {timeout_s:.0f} s (a rank died or is stuck?)")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.05)


def wait_for_indexes(store: Store, attempt: str, ranks: tuple[int, ...],
                     timeout_s: float) -> dict[int, dict[str, Any]]:
    """Coordinator: every rank's index of `attempt`, polling up to `timeout_s`."""
    return _poll(lambda: collect_indexes(store, attempt, ranks), timeout_s,
                 "waiting for every rank's index")


def _abort_key(attempt: str) -> str:
    return f"{ABORT_PREFIX}{attempt}.json"


def _committed(store: Store, attempt: str) -> bool | None:
    """True once `attempt` is committed, None while not yet; raises on its abort note."""
    try:
        marker = json.loads(store.get(COMMIT_KEY))
        if marker.get("attempt") == attempt:
            return True
    except ObjectNotFoundError:
        pass
    if store.exists(_abort_key(attempt)):
        note = json.loads(store.get(_abort_key(attempt)))
        raise CheckpointSaveError(
            f"save to {store.url} aborted by the coordinator: {note.get('reason')}",
            url=store.url)
    return None


def wait_for_commit(store: Store, attempt: str, timeout_s: float) -> None:
    """Any rank but the coordinator: until `attempt` is committed, polling up to
    `timeout_s`; raises `CheckpointSaveError` once the coordinator aborted it."""
    _poll(lambda: _committed(store, attempt), timeout_s, "waiting for the commit marker")


def write_abort(store: Store, attempt: str, reason: BaseException, pre: str = "") -> None:
    """Coordinator: tell the other ranks that `attempt` will never commit."""
    try:
        store.put(_abort_key(attempt), json.dumps({"reason": str(reason)}).encode())
    except Exception:  # noqa: BLE001 - storage may be what failed
        logger.warning("%s could not write the abort note", pre)


def _attempt_copy(attempt: str) -> str:
    return f"{INDEX_PREFIX}{attempt}/{MANIFEST_KEY}"


def _exists_error(url: str, attempt: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{url}/{COMMIT_KEY}: another writer committed this checkpoint first (this save, "
        f"attempt {attempt}, is dropped and changed nothing it had committed); two jobs or "
        "two runs are saving to the same URL: give each its own checkpoint root",
        url=url, obj=COMMIT_KEY)


def publish_commit(store: Store, attempt: str, raw: bytes, marker: dict[str, Any],
                   before_commit: Callable[[], None] | None = None) -> None:
    """Coordinator: publish the manifest `raw`, then create the commit marker `marker`.

    The marker is created exclusively (`put_if_absent`), so of two writers racing on one
    checkpoint URL (a split brain, two runs sharing a root) exactly one commits and the
    other raises `CheckpointExistsError`. The manifest is also kept at
    `index/<attempt>/manifest.json`, so a loser that replaced `manifest.json` after the
    winner wrote it puts the winner's back, and the winner re-checks it after committing.
    """
    url = store.url
    if store.exists(COMMIT_KEY):
        raise _exists_error(url, attempt)
    store.put(_attempt_copy(attempt), raw)
    store.put(MANIFEST_KEY, raw)
    if before_commit is not None:
        before_commit()
    data = json.dumps(marker).encode()
    if not store.put_if_absent(COMMIT_KEY, data) and read_commit(store).get("attempt") != attempt:
        _restore_winner_manifest(store)
        raise _exists_error(url, attempt)
    try:
        if store.get(MANIFEST_KEY) != raw:
            logger.warning("%s: %s was replaced by a racing writer; restoring this commit's",
                           url, MANIFEST_KEY)
            store.put(MANIFEST_KEY, raw)
    except StorageError as e:  # committed already: a failed check must not fail the save
        logger.warning("%s: committed, but could not re-check %s: %s", url, MANIFEST_KEY, e)


def _restore_winner_manifest(store: Store) -> None:
    """After losing a commit race: make `manifest.json` the winner's again."""
    try:
        marker = read_commit(store)
        want = marker.get("manifest_crc32c")
        if crc32c(store.get(MANIFEST_KEY)) == want:
            return
        copy = store.get(_attempt_copy(str(marker.get("attempt"))))
        if crc32c(copy) == want:
            store.put(MANIFEST_KEY, copy)
            logger.warning("%s: restored the committed %s after a racing writer replaced it",
                           store.url, MANIFEST_KEY)
    except (StorageError, CheckpointNotFoundError, CorruptCheckpointError) as e:
        logger.warning("%s: could not check %s after losing a commit race: %s", store.url,
                       MANIFEST_KEY, e)


def commit(store: Store, attempt: str, build: Callable[[], Manifest],
           hooks: CommitHooks, *, rank: int, pre: str = "") -> Manifest:
    """Coordinator: build the manifest (`build()`), check it as every load will, publish
    it and create the commit marker; then `hooks.on_commit`. Any failure before the
    marker leaves the abort note and is raised. Returns the manifest."""
    try:
        manifest = build()
        try:  # what every load checks first: never commit a checkpoint it would refuse
            validate(manifest.to_json(), store.url)
        except CheckpointError as e:
            raise CheckpointSaveError(
                f"save to {store.url}: the manifest built from the ranks' indexes "
                f"does not validate ({e}); nothing was committed", url=store.url,
                failures={rank: str(e)}) from e
        raw = encode_manifest(manifest)
        hook = hooks.before_commit
        publish_commit(store, attempt, raw, {
            "attempt": attempt, "manifest_bytes": len(raw),
            "manifest_crc32c": crc32c(raw), "step": manifest.step,
            "created": manifest.created},
            (lambda: hook(manifest)) if hook is not None else None)
    except BaseException as e:
        write_abort(store, attempt, e, pre)
        raise
    if hooks.on_commit is not None:
        try:
            hooks.on_commit(manifest)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed
            logger.error("%s post-commit hook failed: %s", pre, e)
    return manifest
