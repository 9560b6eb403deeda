"""The coordinator's half of a commit, apart from the save job that drives it: collect
every rank's index object, and build the manifest from the plan and those indexes.

Both are plain functions over a `Store` and a `SavePlan`, so the scale benchmark drives
the same code at thousands of simulated ranks that `ckpt.engine` runs at commit.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ckpt.errors import CheckpointSaveError
from ckpt.format import (
    CHUNK_CRCS,
    FORMAT_NAME,
    FORMAT_VERSION,
    INDEX_PREFIX,
    WRITER_VERSION,
    align,
    inner_chunk_shape,
    itemsize,
)
from ckpt.plan import SavePlan
from storage import Store

__all__ = ["COLLECT_THREADS", "encode_manifest", "build_manifest", "collect_indexes", "index_key"]

COLLECT_THREADS = 16
"""Index objects the coordinator reads at once. Each is a small GET whose cost on object
storage is the round trip, not the bytes: one after another, 4,096 of them took 75 s on
a loopback S3 server. More threads than this gained nothing there (the server was the
limit: about 150 GETs/s on 2 cores); on a remote S3, latency-bound, they would."""


def index_key(attempt: str, rank: int, error: bool = False) -> str:
    return f"{INDEX_PREFIX}{attempt}/r{rank:05d}{'.error' if error else ''}.json"


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
    return {r: json.loads(raw) for r, raw in zip(ranks, raws, strict=True)}


def encode_manifest(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes: compact JSON. Indented, one crc32c per line, it was twice
    the size (4.8 MB for the 70B layout at 64 ranks) for no reader's benefit:
    `relight ckpt show` prints what a person wants to see."""
    return json.dumps(manifest, separators=(",", ":")).encode()


def build_manifest(plan: SavePlan, attempt: str, data: str,
                   indexes: dict[int, dict[str, Any]], *, inner_bytes: int,
                   compression: str | None, meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest of `plan` saved as `attempt` under data prefix `data`, with the values
    and chunk crc32c the ranks reported in `indexes`; `meta` holds step, config, layout."""
    values: dict[str, Any] = {}
    crcs: dict[str, list[int | None]] = {}
    for idx in indexes.values():
        values.update(idx["values"])
        crcs.update(idx.get(CHUNK_CRCS, {}))
    tensors: dict[str, Any] = {}
    for t in plan.tensors.values():
        e: dict[str, Any] = {"path": list(t.path), "shape": list(t.shape), "dtype": t.dtype,
                             "storage": t.storage, "placements": t.placements}
        if t.storage == "grid":
            e.update(array=f"{data}/{t.array}", chunks=list(t.chunks), inner=list(t.inner))
        else:
            ps = []
            for p in t.pieces:
                pe: dict[str, Any] = {"offset": list(p.offset), "shape": list(p.shape),
                                      "array": f"{data}/{p.array}"}
                if t.storage == "packed":
                    pe["byte_offset"] = p.byte_offset
                else:
                    pe["inner"] = list(inner_chunk_shape(p.shape, itemsize(t.dtype),
                                                         inner_bytes))
                ps.append(pe)
            e["pieces"] = ps
        tensors[t.name] = e
    packed = {f"{data}/packed/r{r:05d}": align(s, plan.packed_inner)
              for r, s in plan.packed_size.items() if s}
    now = time.time()
    return {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "writer": {"version": WRITER_VERSION, "torch": torch.__version__},
        "step": meta["step"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "created_unix": now,
        "attempt": attempt,
        "compression": compression,
        "world_size": len(plan.ranks),
        "ranks": list(plan.ranks),
        "config": meta["config"],
        "layout": meta["layout"],
        "tensors": tensors,
        "values": {k: values[k] for k in sorted(values)},
        "packed": packed,
        "packed_inner": plan.packed_inner,
        "bytes": sum(t.nbytes for t in plan.tensors.values()),
        "index": {str(r): index_key(attempt, r) for r in plan.ranks},
        CHUNK_CRCS: {k: crcs[k] for k in sorted(crcs)},
    }
