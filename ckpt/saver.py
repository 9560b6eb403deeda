"""A save's phases, on every rank of the group (`Checkpointer.save` runs them):

1. local layout: flatten the state dict, wait for the checkpointer's previous save, find
   this rank's layout and its digest (memoized while the state's shapes stay).
2. handshake (`_handshake`): every rank's layout digest, cached plan, commit group and
   failure flag gathered to the coordinator; its verdict and the attempt id broadcast.
3. global plan: on a new layout, an exchange of layouts and `plan_save`, cached in the
   checkpointer with the staging buffers it reuses.
4. stage: copy this rank's write pieces into the staging buffers (an async save whose
   layout is the cached plan's copies before the handshake; pipelined, the background
   thread copies). This is all an async save blocks on.
5. write and commit (`ckpt.writer`, in the background or inline when synchronous): this
   rank's objects, its index object, then the commit protocol (`ckpt.commit`): the
   coordinator gathers every rank's index (over the caller's group when synchronous,
   the save's own gloo group when not, from storage when that fails), writes
   `manifest.json`, then `COMMIT`; every rank learns the outcome.

A failure anywhere leaves no `COMMIT`; the handle raises it from `wait()`. A problem
any rank finds before the handshake is raised on every rank.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from relight.ckpt.collective import all_or_raise, raise_if_any
from relight.ckpt.comm import Comm
from relight.ckpt.commit import CommitHooks, exists_error
from relight.ckpt.commit_group import NO_GROUP, CommitGroup, commit_group_for
from relight.ckpt.flatten import FlatState, flatten_state
from relight.ckpt.format import COMMIT_KEY
from relight.ckpt.handle import SaveHandle
from relight.ckpt.layout import Piece, local_view
from relight.ckpt.options import SaveOptions
from relight.ckpt.plan import (
    PieceWrite,
    RankLayout,
    SavePlan,
    TensorPlan,
    layouts_from_parts,
    plan_save,
)
from relight.ckpt.save_context import RankShare, SaveContext
from relight.ckpt.staging import Stager, StagingBuffers
from relight.ckpt.writer import _SaveJob
from relight.rank_log import rank_step_prefix
from relight.storage import Store, open_store

if TYPE_CHECKING:
    from relight.ckpt.checkpointer import Checkpointer

logger = logging.getLogger(__name__)

__all__ = ["CachedPlan", "save"]


@dataclass
class CachedPlan:
    """The save plan of the last layout seen, and the staging buffers it reuses."""

    ident: str
    """The attempt id of the save that made it: the same on every rank that holds it."""
    ranks: tuple[int, ...]
    """The group's global ranks."""
    mine: str
    """This rank's layout digest when the plan was made."""
    digests: tuple[str, ...] | None
    """Every rank's layout digest then, on the coordinator (the handshake compares them);
    None on the other ranks."""
    plan: SavePlan
    bufs: StagingBuffers = field(default_factory=StagingBuffers)
    _writes: dict[int, list[tuple[TensorPlan, PieceWrite]]] = field(default_factory=dict)

    def writes_of(self, rank: int) -> list[tuple[TensorPlan, PieceWrite]]:
        """`plan.writes_of(rank)`, computed once per plan: it walks every piece of every
        rank (millions at thousands of ranks), and a cached plan serves every save."""
        got = self._writes.get(rank)
        if got is None:
            got = self._writes[rank] = self.plan.writes_of(rank)
        return got




@dataclass
class _LocalLayout:
    """This rank's layout of the state, or why it cannot be saved."""

    layout: RankLayout | None = None
    pieces_of: dict[str, list[Piece]] = field(default_factory=dict)
    digest: str = ""
    error: BaseException | None = None


def save(checkpointer: Checkpointer, state_dict: Mapping[str, Any],
         url: str | os.PathLike[str] | Store, async_save: bool, *, step: int | None,
         config: dict[str, Any] | None, layout: dict[str, Any] | None, process_group: Any,
         options: SaveOptions | None, hooks: CommitHooks | None) -> SaveHandle:
    """Run a save's phases (see the module's doc); arguments as `Checkpointer.save`."""
    t0 = time.perf_counter()
    opts = options or SaveOptions()
    comm = Comm(process_group, opts.collective_timeout_s)
    store = open_store(url)
    handle = SaveHandle(store.url, step)
    handle._t0 = t0
    handle._exit_wait_s = opts.commit_timeout_s + 60.0
    ctx = SaveContext(checkpointer, store, comm, opts, async_save,
                      hooks or CommitHooks(), dict(step=step, config=config, layout=layout),
                      handle, rank_step_prefix(comm.rank, step))
    flat = flatten_state(state_dict)
    _wait_previous(ctx)
    local = _local_layout(ctx, flat)
    cached = checkpointer.cached
    early = None
    if (async_save and not ctx.pipelined and local.error is None and cached is not None
            and cached.ranks == comm.ranks and cached.mine == local.digest):
        # An async save whose layout is the cached plan's stages first: the handshake
        # then also says that every rank's copy is done, so the persist can start without
        # a second collective (every rank of the group has the same cached plan, so all
        # of them take this path or none). Should another rank's layout have changed,
        # the plan is made again below and this rank stages again.
        early = _stage(ctx, flat, local, cached)
    what = (f"the start of the save to {ctx.store.url} (step {step}; every rank of the "
            "group must call ckpt.save / CheckpointManager.save)")
    hand = _handshake(comm, local.digest, local.error is not None or (
        early is not None and early.error is not None), cached, checkpointer.commit_group,
        what)
    if hand.failed:
        all_or_raise(comm, local.error or (early.error if early is not None else None),
                     None, what, url=ctx.store.url)
    ctx.attempt = hand.attempt
    if async_save and opts.commit_over_group:
        checkpointer.commit_group = commit_group_for(
            checkpointer.commit_group, hand.same_group, ctx.attempt, comm,
            opts.commit_timeout_s)
        ctx.group = checkpointer.commit_group
    if not hand.same_plan:
        cached = _global_plan(ctx, local, hand.digests, what)
        early = None
    assert cached is not None  # the coordinator found that every rank holds it
    ctx.plan = cached.plan
    share = early if early is not None else _stage_all(ctx, flat, local, cached)
    share.values = {n: flat.values[n].value for n, r in ctx.plan.value_owner.items()
                    if r == comm.rank}
    return _write_and_commit(ctx, share)


def _wait_previous(ctx: SaveContext) -> None:
    """Wait for the checkpointer's previous save (one in flight at a time) and say once
    that it failed, if it did."""
    cp = ctx.checkpointer
    ctx.handle.waited_s = waited = cp.wait_inflight()
    if waited > 0.001:
        logger.info("%s save to %s waited %.3f s for the previous save", ctx.pre,
                    ctx.store.url, waited)
    prev = cp.inflight
    if prev is not None and prev.error is not None and not getattr(prev, "_reported", False):
        prev._reported = True  # type: ignore[attr-defined]
        logger.error("%s previous save to %s failed: %s", ctx.pre, prev.url, prev.error)


def _local_layout(ctx: SaveContext, flat: FlatState) -> _LocalLayout:
    """This rank's layout and digest; a local problem (bad value, unsupported placement,
    committed target) is returned, to be raised on every rank after the handshake, so
    that no rank is left waiting in a collective or for a commit."""
    out = _LocalLayout()
    opts, comm = ctx.opts, ctx.comm
    try:
        out.layout, out.pieces_of, out.digest = ctx.checkpointer.layouts.of(
            flat, comm.rank, [comm.ranks, opts.pack_bytes, opts.inner_bytes, opts.packed_inner])
        # Async saves check in the background thread (every rank, before writing): on S3
        # the request would otherwise hold every rank in the handshake.
        if not ctx.async_save and comm.is_coordinator and ctx.store.exists(COMMIT_KEY):
            raise exists_error(ctx.store.url)
    except Exception as e:  # noqa: BLE001 - re-raised after telling the others
        out.error = e
    return out


def _global_plan(ctx: SaveContext, local: _LocalLayout, digests: tuple[str, ...] | None,
                 what: str) -> CachedPlan:
    """Every rank's layout exchanged and the save plan made; cached in the checkpointer."""
    assert local.layout is not None
    comm, opts = ctx.comm, ctx.opts
    layouts = layouts_from_parts(comm.allgather_shared(*local.layout.compact(), what),
                                 comm.ranks)
    plan = plan_save(layouts, comm.ranks, pack_bytes=opts.pack_bytes,
                     inner_bytes=opts.inner_bytes, packed_inner=opts.packed_inner)
    cached = CachedPlan(ctx.attempt, comm.ranks, local.digest, digests, plan)
    ctx.checkpointer.cached = cached
    logger.info("%s new save plan: %d tensors, this rank writes %d bytes", ctx.pre,
                len(plan.tensors), plan.write_bytes_of(comm.rank))
    return cached


def _stage(ctx: SaveContext, flat: FlatState, local: _LocalLayout,
           cached: CachedPlan) -> RankShare:
    """This rank's pieces under `cached`'s plan, copied now unless pipelined. A failure
    is returned, not raised: the caller shares it with the group."""
    out = RankShare()
    t_copy = time.perf_counter()
    rank = ctx.rank
    try:
        out.writes = cached.writes_of(rank)
        need_copy = ctx.async_save or any(
            flat.tensors[t.name].tensor.device.type != "cpu" for t, _ in out.writes)
        held = {(name, x.offset, x.shape): x for name, xs in local.pieces_of.items()
                for x in xs}
        copies = [(t, p, local_view(flat.tensors[t.name].tensor,
                                    held[(t.name, p.offset, p.shape)]))
                  for t, p in out.writes]
        out.stager = Stager(copies, cached.bufs, need_copy=need_copy,
                            packed_size=cached.plan.packed_size.get(rank, 0),
                            packed_inner=cached.plan.packed_inner, background=ctx.pipelined)
        if not ctx.pipelined:
            out.staged, out.packed = out.stager.run()
    except Exception as e:  # noqa: BLE001 - shared with the group (async) or raised
        out.error = e
    if not ctx.pipelined:
        out.seconds = time.perf_counter() - t_copy
    return out


def _stage_all(ctx: SaveContext, flat: FlatState, local: _LocalLayout,
               cached: CachedPlan) -> RankShare:
    """Stage after the handshake: copy this rank's pieces into (reused) host buffers,
    here or (pipelined) in the background thread before it persists. An async save's
    ranks then agree that every copy is done (`_all_staged`)."""
    share = _stage(ctx, flat, local, cached)
    if ctx.async_save and not ctx.pipelined:
        _all_staged(ctx.comm, share.error, ctx.store.url, ctx.step)
    elif share.error is not None:
        raise share.error
    return share


def _write_and_commit(ctx: SaveContext, share: RankShare) -> SaveHandle:
    """Hand the write and the commit to the save worker (async) or run them here."""
    assert share.stager is not None  # a failed staging raised above
    cp, handle = ctx.checkpointer, ctx.handle
    job = _SaveJob(ctx, share)
    if not ctx.pipelined:
        share.stager = None  # staged: the job holds the copies, not the live tensors
        handle.stage_s = share.seconds
        handle._mark_staged()
    handle.stall_s = time.perf_counter() - handle._t0
    logger.debug("%s save stall %.3f s (waited %.3f, staging copy %.3f%s)",
                 ctx.pre, handle.stall_s, handle.waited_s, handle.stage_s,
                 ", pipelined" if ctx.pipelined else "")
    cp.inflight = handle
    if ctx.async_save:
        cp.note_crashes()
        cp.save_worker.submit(job.run, handle._tail)
    else:
        job.run()
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
