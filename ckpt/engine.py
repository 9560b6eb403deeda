"""Save and load: the orchestration of both, on every rank of the group.

Call order of a save, on every rank of the group:

1. foreground (here): flatten the state dict; wait for the previous save of this
   process; the handshake (`_handshake`: every rank's layout digest, cached plan, commit
   group and failure flag gathered to the coordinator, its verdict and the attempt id
   broadcast); on a new layout an exchange of layouts and `plan_save` (cached in
   `ckpt.resources`); copy this rank's write pieces into reusable staging buffers. This
   is all an async save blocks on.
2. background (or inline when synchronous), no collectives on the caller's groups:
   `ckpt.writer` writes this rank's objects, then its index object
   `index/<attempt>/r<rank>.json`.
3. the commit protocol (`ckpt.commit`): the coordinator gathers every rank's index
   (over the caller's group when synchronous, the save's own gloo group when not, from
   storage when that fails), then writes `manifest.json`, then `COMMIT`; every rank
   learns the outcome, so that `wait()` returns on every rank once the checkpoint is
   committed.

A failure anywhere leaves no `COMMIT`; the handle raises it from `wait()`.

A load reads the manifest (`ckpt.manifest`), agrees with the other ranks on who reads
which region (`plan_load`), reads them (`ckpt.reader`) and sends shared regions to the
ranks that need them too.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from relight.ckpt.collective import all_or_raise, raise_if_any
from relight.ckpt.comm import Comm
from relight.ckpt.commit import CommitHooks, exists_error
from relight.ckpt.commit_group import NO_GROUP, CommitGroup, commit_group_for
from relight.ckpt.errors import (
    CheckpointError,
    DtypeMismatchError,
    MissingKeyError,
    ShapeMismatchError,
    UnexpectedKeyError,
)
from relight.ckpt.flatten import FlatState, flatten_state, name_of, set_value
from relight.ckpt.format import COMMIT_KEY, dtype_name, numel
from relight.ckpt.handle import SaveHandle
from relight.ckpt.layout import Piece, local_pieces, local_view, mesh_grid
from relight.ckpt.manifest import Manifest, read_manifest
from relight.ckpt.options import SaveOptions
from relight.ckpt.plan import (
    GridNeed,
    LoadPlan,
    RankLayout,
    grid_needs_json,
    layouts_from_parts,
    needs_from_json,
    parse_grid_needs,
    plan_load,
    plan_save,
)
from relight.ckpt.rank_log import rank_step_prefix
from relight.ckpt.reader import RegionReader
from relight.ckpt.resources import CachedPlan, resources, wait_inflight, wait_staged
from relight.ckpt.staging import Stager
from relight.ckpt.writer import _SaveJob
from relight.storage import Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["SaveOptions", "SaveHandle", "LoadInfo", "save", "load", "wait_staged"]


# ------------------------------------------------------------------------ save


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
    hooks: CommitHooks | None = None,
) -> SaveHandle:
    """Save `state_dict` as one checkpoint at `url`; every rank of the group calls.

    Args:
        state_dict: nested dicts/lists of tensors (plain or DTensor), objects with
            `state_dict()`/`load_state_dict()`, and JSON values.
        url: where the checkpoint goes (a `storage` URL or `Store`); it must not hold a
            committed checkpoint.
        async_save: return once the state is staged (the only blocking part) and persist
            and commit in a background thread; else return once committed.
        step: recorded in the manifest and the commit marker.
        config: JSON recorded in the manifest (`LoadInfo.config` on load).
        layout: JSON recorded in the manifest: how the run was parallelized.
        process_group: the group saving together (default: the default group, or this
            process alone when torch.distributed is not initialized).
        options: how the save is planned and persisted (`SaveOptions`).
        hooks: writes of the caller at fixed points of the commit (`ckpt.commit.CommitHooks`),
            run on the coordinator (in the background thread when asynchronous).

    Returns:
        A `SaveHandle` (a `concurrent.futures.Future`): `wait()` blocks until committed
        and raises the save's failure; `wait_staged()` until the state may change.

    Raises:
        CheckpointExistsError: `url` holds a committed checkpoint (synchronous saves
            here; asynchronous ones from `wait()`).
        UnsupportedStateError: a value cannot be checkpointed (e.g. a Partial DTensor,
            an unsupported dtype, a non-JSON value), raised on every rank.
        CollectiveError: a rank of the group did not make the same call in time.
        CheckpointSaveError: persisting or committing failed (synchronous saves here,
            asynchronous ones from `wait()`); `failures` names the ranks.
    """
    opts = options or SaveOptions()
    t0 = time.perf_counter()
    comm = Comm(process_group, opts.collective_timeout_s)
    store = open_store(url)
    pre = rank_step_prefix(comm.rank, step)
    flat = flatten_state(state_dict)

    waited = wait_inflight()
    if waited > 0.001:
        logger.info("%s save to %s waited %.3f s for the previous save", pre, store.url, waited)
    res = resources()
    prev = res.inflight
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
        lay, pieces_of, digest = res.layouts.of(
            flat, comm.rank, [comm.ranks, opts.pack_bytes, opts.inner_bytes, opts.packed_inner])
        # Async saves check in the background thread (every rank, before writing): on S3
        # the request would otherwise hold every rank in the handshake.
        if not async_save and comm.is_coordinator and store.exists(COMMIT_KEY):
            raise exists_error(store.url)
    except Exception as e:  # noqa: BLE001 - re-raised below, after telling the others
        error = e
    background = async_save and opts.pipelined_staging

    def stage(cached: CachedPlan) -> _Staging:
        """This rank's pieces under `cached`'s plan, copied now unless pipelined. A
        failure is returned, not raised: the caller shares it with the group."""
        out = _Staging()
        t_copy = time.perf_counter()
        try:
            out.writes = cached.writes_of(comm.rank)
            need_copy = async_save or any(
                flat.tensors[t.name].tensor.device.type != "cpu" for t, _ in out.writes)
            held = {(name, x.offset, x.shape): x for name, xs in pieces_of.items() for x in xs}
            copies = [(t, p, local_view(flat.tensors[t.name].tensor,
                                        held[(t.name, p.offset, p.shape)]))
                      for t, p in out.writes]
            out.stager = Stager(copies, cached.bufs, need_copy=need_copy,
                                packed_size=cached.plan.packed_size.get(comm.rank, 0),
                                packed_inner=cached.plan.packed_inner, background=background)
            if not background:
                out.staged, out.packed = out.stager.run()
        except Exception as e:  # noqa: BLE001 - shared with the group (async) or raised
            out.error = e
        if not background:
            out.seconds = time.perf_counter() - t_copy
        return out

    # An async save whose layout is the cached plan's stages first: the handshake below
    # then also says that every rank's copy is done, so the persist can start without a
    # second collective (every rank of the group has the same cached plan, so all of
    # them take this path or none). Should another rank's layout have changed, the plan
    # is made again below and this rank stages again.
    cached = res.cached
    early: _Staging | None = None
    if (async_save and not background and error is None and cached is not None
            and cached.ranks == comm.ranks and cached.mine == digest):
        early = stage(cached)
    failed = error is not None or (early is not None and early.error is not None)
    what = (f"the start of the save to {store.url} (step {step}; every rank of the group "
            "must call ckpt.save / CheckpointManager.save)")
    hand = _handshake(comm, digest, failed, cached, res.commit_group, what)
    if hand.failed:
        all_or_raise(comm, error or (early.error if early is not None else None), None, what,
                     url=store.url)
    assert lay is not None
    attempt = hand.attempt
    if async_save and opts.commit_over_group:
        res.commit_group = commit_group_for(res.commit_group, hand.same_group, attempt,
                                            comm, opts.commit_timeout_s)
    if not hand.same_plan:
        layouts = layouts_from_parts(comm.allgather_shared(*lay.compact(), what), comm.ranks)
        plan = plan_save(layouts, comm.ranks, pack_bytes=opts.pack_bytes,
                         inner_bytes=opts.inner_bytes, packed_inner=opts.packed_inner)
        cached = CachedPlan(attempt, comm.ranks, digest, hand.digests, plan)
        res.cached = cached
        logger.info("%s new save plan: %d tensors, this rank writes %d bytes", pre,
                    len(plan.tensors), plan.write_bytes_of(comm.rank))
        early = None
    assert cached is not None  # the coordinator found that every rank holds it
    if early is not None:
        done = early
    else:
        # Stage: copy this rank's pieces into (reused) host buffers, here or (pipelined)
        # in the background thread before it persists.
        done = stage(cached)
        if async_save and not background:
            _all_staged(comm, done.error, store.url, step)
        elif done.error is not None:
            raise done.error
    plan, my_writes, stager = cached.plan, done.writes, done.stager
    assert stager is not None  # a failed staging raised above
    staged, packed_buf = done.staged, done.packed
    values = {n: flat.values[n].value for n, r in plan.value_owner.items() if r == comm.rank}

    handle = SaveHandle(store.url, step)
    handle._t0 = t0
    handle._exit_wait_s = opts.commit_timeout_s + 60.0
    job = _SaveJob(store, plan, attempt, comm.rank, staged, packed_buf, values, opts,
                   dict(step=step, config=config, layout=layout), handle,
                   hooks or CommitHooks(), pre, stager if background else None,
                   writes=my_writes,
                   group=res.commit_group if async_save and opts.commit_over_group else None)
    if not background:
        handle.stage_s = done.seconds
        handle._mark_staged()
    handle.stall_s = time.perf_counter() - t0
    handle.waited_s = waited
    logger.debug("%s save stall %.3f s (waited %.3f, staging copy %.3f%s%s)",
                 pre, handle.stall_s, waited, handle.stage_s,
                 ", before the handshake" if done is early else "",
                 ", pipelined" if background else "")
    res.inflight = handle
    if async_save:
        res.note_crashes()
        res.save_worker.submit(job.run, handle._tail)
    else:
        job.run(comm)
        handle._tail.set()
        handle.wait()
    return handle


NO_PLAN = "-" * 16
"""What a rank without a cached plan for the save's ranks sends in the handshake."""


@dataclass(frozen=True)
class _Handshake:
    """What the coordinator decided from every rank's handshake, on every rank."""

    failed: bool
    """Some rank failed before the save could start."""
    same_plan: bool
    """Every rank holds the cached plan and its layout is still the one planned."""
    same_group: bool
    """Every rank holds the same healthy commit group."""
    attempt: str
    digests: tuple[str, ...] | None
    """Every rank's layout digest, on the coordinator; None on the others."""


def _handshake(comm: Comm, digest: str, failed: bool, cached: CachedPlan | None,
               group: CommitGroup | None, what: str) -> _Handshake:
    """The start of every save: each rank sends its layout digest, the cached plan and
    commit group it holds and whether it failed, in one gather to the coordinator; the
    coordinator broadcasts its verdict and the attempt id. Not an all-gather: its ring
    takes as many hops as the group has ranks, on every save's stall."""
    plan_id = cached.ident if cached is not None and cached.ranks == comm.ranks else NO_PLAN
    group_id = group.handshake_id(comm.ranks) if group is not None else NO_GROUP
    digests: tuple[str, ...] | None = None

    def decide(heads: list[bytes]) -> bytes:  # on the coordinator
        nonlocal digests
        digests = tuple(h[:32].decode().rstrip() for h in heads)
        same_plan = (cached is not None and cached.digests == digests
                     and all(h[32:48].decode() == plan_id != NO_PLAN for h in heads))
        same_group = all(h[48:64].decode() == group_id != NO_GROUP for h in heads)
        any_failed = any(h[64:65] == b"E" for h in heads)
        return (f"{'E' if any_failed else '-'}{'P' if same_plan else '-'}"
                f"{'G' if same_group else '-'}{uuid.uuid4().hex[:16]}").encode()

    head = f"{digest:32}{plan_id}{group_id}{'E' if failed else '-'}".encode()
    v = comm.ask_coordinator(head, 65, decide, 19, what).decode()
    return _Handshake(v[0] == "E", v[1] == "P", v[2] == "G", v[3:19], digests)


@dataclass
class _Staging:
    """One rank's staging under one cached plan: its writes, the copy job, and (unless
    pipelined) what the copy produced or why it failed."""

    writes: list[Any] = field(default_factory=list)
    stager: Stager | None = None
    staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    packed: np.ndarray | None = None
    error: BaseException | None = None
    seconds: float = 0.0
    """How long the copy took (0 when pipelined: the background thread copies)."""


def _all_staged(comm: Comm, error: BaseException | None, url: str, step: int | None) -> None:
    """An async save's background persist starts once every rank of the group has
    staged. Started at once, the first ranks' encoding and writes (a copy and a crc32c
    pass over every byte, then the kernel's copy into the page cache) run on the cores
    and the memory bandwidth their peers' staging copies still need, and every rank's
    `save()` returns no sooner than the slowest copy anyway: the group is in step at the
    next collective of training. One 1-byte flag to the coordinator and its verdict
    back; a rank whose copy failed sends it too, so every rank raises that failure
    instead of a commit waiting for the rank."""
    what = (f"the end of staging of the save to {url} (step {step}; every rank copies its "
            "pieces before any persists them)")
    raise_if_any(comm, error, what, url=url)


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

    Args:
        state_dict: the target, as for `save`; its tensors are filled in place (their
            shapes and placements say which regions this rank reads).
        url: the committed checkpoint (a `storage` URL or `Store`).
        strict: refuse missing and unexpected entries (see above).
        process_group: the group loading together (default: the world).
        broadcast: read a region shared by several ranks once and send it.
        collective_timeout_s: how long each collective waits for the other ranks.

    Returns:
        A `LoadInfo`: the checkpoint's step and config, bytes read and needed by this
        rank, and (with `strict=False`) the `missing` and `unexpected` entries.

    Raises:
        CheckpointNotFoundError: no committed checkpoint at `url`.
        CorruptCheckpointError: the manifest or a chunk is damaged (its subclasses
            `ChecksumMismatchError`, `MissingChunkError`, `UnsafePathError`,
            `AbsurdShapeError` say how).
        UnsupportedVersionError: written by a format version this reader does not know.
        MissingKeyError, UnexpectedKeyError: with `strict`, entries missing or extra.
        ShapeMismatchError, DtypeMismatchError: a tensor's global shape or dtype differs.
        StorageError: storage failed (retryable), raised on every rank.
        CollectiveError: a rank of the group did not make the same call in time.
    """
    comm = Comm(process_group, collective_timeout_s)
    store = open_store(url)
    flat = flatten_state(state_dict)
    error: BaseException | None = None
    m: Manifest | None = None
    needs: list[tuple[str, Any, int]] = []
    grid_needs: list[GridNeed] = []
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
            if tuple(shape) != e.shape:
                shapes_bad.append((name, f"{name!r}: checkpoint {e.shape}, "
                                         f"state dict {tuple(shape)}"))
                continue
            if dtype_name(ref.tensor.dtype, name) != e.dtype:
                dtypes_bad.append((name, f"{name!r}: checkpoint {e.dtype}, state dict "
                                         f"{dtype_name(ref.tensor.dtype, name)}"))
                continue
            local[name] = pieces
            boxes = tuple((p.offset, p.shape) for p in pieces)
            grid = mesh_grid(ref.tensor, comm.rank, boxes)
            if grid is not None:
                grid_needs.append((name, tuple(shape), e.itemsize, grid))
                continue
            for p in pieces:
                needs.append((name, [list(p.offset), list(p.shape)], e.itemsize))
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
    what = (f"the load of {store.url} (every rank of the group must call ckpt.load / "
            "CheckpointManager.restore)")
    gathered = all_or_raise(comm, error, {"needs": needs}, what, url=store.url)
    assert m is not None
    # The tensors with a grid and the wanted names: the same text on every rank of a
    # mesh that loads the same state dict, so each distinct one travels and parses once.
    shared = comm.allgather_shared(grid_needs_json(grid_needs, wanted), b"", what)
    grids = parse_grid_needs([text for text, _ in shared], comm.ranks)
    all_wanted = set().union(*(set(w) for _, w, _ in grids))
    unexpected = sorted((set(m.tensors) | set(m.values)) - all_wanted)
    if strict and unexpected:
        raise UnexpectedKeyError(
            f"checkpoint {store.url} holds {_few(unexpected, 'entry', verb=False)} no rank "
            "asked for: "
            f"{_first([repr(n) for n in unexpected])}; load with strict=False to ignore them",
            url=store.url, tensor=unexpected[0])
    plan: LoadPlan = plan_load(needs_from_json([g["needs"] for g in gathered], comm.ranks),
                               broadcast=broadcast, grids=grids)
    mine = plan.mine(comm.rank)

    # Read what this rank reads, straight into its tensors; report failures on every
    # rank before exchanging.
    views = {(name, (p.offset, p.shape)): p for name, ps in local.items() for p in ps}
    got: dict[tuple[str, Any], torch.Tensor] = {}
    nbytes = ts_bytes = 0
    readers: list[tuple[Any, RegionReader]] = []
    try:
        packed_cache: dict[str, Any] = {}
        for _, task in mine:
            if task.reader == comm.rank:
                t = flat.tensors[task.name].tensor
                piece = views[(task.name, task.box)]
                r = RegionReader(store, m, task.name, task.box, t.dtype, local_view(t, piece),
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
    resources().read_buffers.clear()  # the load's reads are done: no fetch memory kept
    all_or_raise(comm, error, None, f"the reads of the load of {store.url}", url=store.url)

    sends, recvs, copies = [], [], []
    for tag, task in mine:
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
    return LoadInfo(store.url, m.step, m.config, nbytes, needed, missing=missing,
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

