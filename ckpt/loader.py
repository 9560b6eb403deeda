"""Load: read a committed checkpoint into a state dict, resharded to its layout, on
every rank of the group.

A load reads the manifest (`ckpt.manifest`), agrees with the other ranks on who reads
which region (`plan_load`), reads them (`ckpt.reader`) and sends shared regions to the
ranks that need them too. A problem any rank finds is raised on every rank.
"""


from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from relight.ckpt.collective import encode_error, raise_gathered, raise_if_any
from relight.ckpt.comm import Comm, parse_json_list
from relight.ckpt.errors import (
    CheckpointError,
    DtypeMismatchError,
    MissingKeyError,
    ShapeMismatchError,
    UnexpectedKeyError,
)
from relight.ckpt.flatten import FlatState, flatten_state, name_of, set_value
from relight.ckpt.format import dtype_name, numel
from relight.ckpt.layout import Piece, local_pieces, local_view, mesh_grid
from relight.ckpt.manifest import Manifest, read_manifest
from relight.ckpt.plan import (
    GridNeed,
    LoadPlan,
    grid_needs_json,
    needs_from_json,
    parse_grid_needs,
    plan_load,
)
from relight.ckpt.read_pools import read_pools
from relight.ckpt.reader import RegionReader
from relight.storage import Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["LoadInfo", "load"]

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
    # One agreement: the tensors with a grid and the wanted names are the same text on
    # every rank of a mesh that loads the same state dict, so they travel as a digest
    # (each distinct text once, and only to ranks that lack it) beside each rank's own
    # part: its failure, if any, and its regions without a grid.
    own = json.dumps({"err": encode_error(error) if error is not None else None,
                      "needs": needs if error is None else None},
                     separators=(",", ":")).encode()
    shared = comm.allgather_shared(
        grid_needs_json(grid_needs, wanted) if error is None else b"", own, what)
    gathered = parse_json_list([o for _, o in shared])
    raise_gathered(comm, error, [g["err"] for g in gathered], url=store.url)
    assert m is not None
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
    read_pools().buffers.clear()  # the load's reads are done: no fetch memory kept
    # Every rank's failure flag in one 1-byte all-gather (one collective on the load's
    # path, not two); the errors' texts cross only when some rank failed.
    raise_if_any(comm, error, f"the reads of the load of {store.url}", url=store.url,
                 all_gather=True)

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

