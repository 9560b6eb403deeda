"""Live heal: copy a replica's state from a healthy group's memory to a joining group.

When a quorum includes a group that is healing (a replacement node, a restarted group,
a spare), every member of the quorum calls `transfer_state` right after the quorum's
process group is built, at the step boundary, before anyone trains the step. The source
(the first healthy member) publishes what it holds (every tensor's name, shape, dtype
and crc32c, and the JSON values: step, schedule, data position) in the quorum's store
and broadcasts each tensor over the process group; the joiner receives into its own
tensors, checks every crc32c, sets the JSON values and calls `load_state_dict` on the
stateful objects of its state dict, exactly as a checkpoint load would. Nothing is read
from object storage.

Every member takes part in the broadcasts (a gloo broadcast is a collective of the whole
group); a healthy member receives the bytes it already holds, since replicas are
bitwise identical. That path needs matching layouts (same names, shapes, dtypes, local
shards). When the joiner's layout differs from the source's (another number of ranks,
another split), `reshard_state` moves each box of the global tensors from the source
rank holding it to the joiner rank that needs it (`elastic.regions`: point-to-point on a
process group of every rank of the quorum, each message checked by crc32c), then sets the
JSON values and calls `load_state_dict` the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from relight.ckpt.state_layout import FlatState, Piece, flatten_state, set_value
from relight.elastic.regions import Transfer, copy_regions
from relight.errors import RelightError
from relight.storage.checksum import crc32c

__all__ = ["HealError", "HealMismatchError", "HealStats", "reshard_state", "transfer_state"]

_META_KEY = "heal/meta"


class HealError(RelightError, RuntimeError):
    """The live heal could not complete: the bytes arrived damaged, or a member failed
    during it. The joiner stays not ready and retries in the next quorum."""


class HealMismatchError(HealError):
    """The joiner's state dict has another structure than the source's (other tensors,
    shapes, dtypes or values): no retry can succeed. The joining group leaves the job
    and its training loop gets this error, naming what differs."""


@dataclass(frozen=True, slots=True)
class HealStats:
    tensors: int
    bytes: int
    seconds: float


def _local(t: torch.Tensor) -> torch.Tensor:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach()


def _crc(t: torch.Tensor) -> int:
    # A heal over NCCL moves device tensors; their checksum is taken on a host copy.
    flat = t.detach().cpu().contiguous().reshape(-1)
    return crc32c(flat.view(torch.uint8).numpy() if flat.numel() else b"")


def transfer_state(pg: dist.ProcessGroup, store: dist.Store, rank: int, source: int,
                   state_dict: Mapping[str, Any], *, receiving: bool) -> HealStats:
    """Send (`rank == source`) or receive `state_dict` over `pg`. Runs on every member;
    `receiving` marks the joiners, which check and load what arrived."""
    t0 = time.monotonic()
    flat = flatten_state(state_dict)
    names = sorted(flat.tensors)
    locals_ = {n: _local(flat.tensors[n].tensor) for n in names}
    if rank == source:
        meta = {"tensors": {n: {"shape": list(t.shape), "dtype": str(t.dtype), "crc": _crc(t)}
                            for n, t in locals_.items()},
                "values": {n: v.value for n, v in flat.values.items()}}
        store.set(_META_KEY, json.dumps(meta))
    else:
        meta = json.loads(store.get(_META_KEY))
        _check_layout(meta, locals_)
    sent = 0
    for n in names:
        t = locals_[n]
        buf = t if t.is_contiguous() else t.contiguous()
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = source, 0
        pg.broadcast([buf], opts).wait()
        if buf is not t:
            t.copy_(buf)
        sent += buf.numel() * buf.element_size()
    if receiving:
        for n in names:
            if _crc(locals_[n]) != meta["tensors"][n]["crc"]:
                raise HealError(f"live heal: tensor {n!r} arrived with a crc32c that differs "
                                "from the source's; the joiner stays not ready and retries")
        _load_values(flat, meta)
    return HealStats(len(names), sent, time.monotonic() - t0)


def reshard_state(pg: dist.ProcessGroup, store: dist.Store, flat: FlatState,
                  pieces: Mapping[str, list[Piece]], plan: Transfer, *, publishes: bool,
                  receiving: bool, timeout_s: float) -> HealStats:
    """The heal between layouts: carry out `plan` (`elastic.regions.plan_copy` from the
    source group's ranks to the joiners') on this rank's flattened state `flat` (its local
    `pieces` per tensor). `publishes`: this is the source group's first rank, which puts
    the JSON values in `store`; `receiving`: a joiner's rank, which then sets them and
    loads its stateful objects. Runs on every rank of the quorum's process group."""
    t0 = time.monotonic()
    if publishes:
        store.set(_META_KEY, json.dumps({"values": {n: v.value
                                                    for n, v in flat.values.items()}}))
    locals_ = {n: _local(ref.tensor) for n, ref in flat.tensors.items()}
    got = copy_regions(pg, plan, locals_, pieces, timeout_s=timeout_s)
    if receiving:
        _load_values(flat, json.loads(store.get(_META_KEY)))
    return HealStats(len(locals_), got, time.monotonic() - t0)


def _load_values(flat: FlatState, meta: dict[str, Any]) -> None:
    """Set the JSON values the source published, then load the stateful objects, as a
    checkpoint load does."""
    for n, ref in flat.values.items():
        if n not in meta["values"]:
            raise HealMismatchError(f"live heal: the source holds no value {n!r} (the "
                                    f"joiner's is {_short(ref.value)})")
        set_value(ref, meta["values"][n])
    for obj, sub, _name in flat.statefuls:
        obj.load_state_dict(sub)


def _check_layout(meta: dict[str, Any], locals_: dict[str, torch.Tensor]) -> None:
    theirs, mine = set(meta["tensors"]), set(locals_)
    if theirs != mine:
        only_src, only_me = sorted(theirs - mine), sorted(mine - theirs)
        raise HealMismatchError(
            f"live heal: the state dicts differ: {len(only_src)} tensor(s) only "
                        f"at the source (first: {only_src[:3]}), {len(only_me)} only here "
                        f"(first: {only_me[:3]})")
    for n, t in locals_.items():
        m = meta["tensors"][n]
        if list(t.shape) != m["shape"] or str(t.dtype) != m["dtype"]:
            raise HealMismatchError(
                f"live heal: tensor {n!r} is {list(t.shape)} {t.dtype} here and "
                f"{m['shape']} {m['dtype']} at the source: the layouts differ")


def _short(value: Any, limit: int = 80) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
