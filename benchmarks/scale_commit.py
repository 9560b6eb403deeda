"""Commit at simulated world sizes: N index objects, the coordinator's collection, the
manifest and marker, then the restore's manifest reads, on local disk and on S3.

A thread pool stands in for the N ranks and writes one index object each (as large as
a rank's index in the 70B layout: one crc32c list per data object it wrote); that part
is the ranks' work, reported apart. The commit overhead is what the coordinator does
after the last index is durable: `ckpt.commit.collect_indexes` (the code the engine
runs), then the put of the chunk crc32c table and `publish_commit` of the manifest
(what `ckpt.writer` does once the table is built). The restore side reads the manifest the
way `ckpt.load` does on every rank (`read_manifest`: marker, manifest, crc, validate),
from `READERS` threads at once, as ranks of one host would.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CommitConfig", "run_commit", "sync_exchange"]

READERS = 16


@dataclass(frozen=True, slots=True)
class CommitConfig:
    sizes: tuple[int, ...] = (64, 256, 1024, 4096)
    """Numbers of ranks (index objects)."""
    index_entries: int = 271
    """Data objects per rank in its index: the 70B layout on tp8 x pp8 holds 271 tensors."""
    writers: int = 32
    """Threads writing the index objects (the ranks)."""
    s3: bool = True
    """Also on a SeaweedFS S3 server on loopback."""
    manifest_for: dict[int, Path] | None = None
    """World size -> manifest file (from the planning arms) to publish and read back; a
    small one is built where none is given."""


def _index_doc(rank: int, attempt: str, entries: int) -> bytes:
    crcs = {f"data/{attempt}/t{k:05d}/c/{rank}/0": [zlib.crc32(f"{rank}/{k}".encode())]
            for k in range(entries)}
    return json.dumps({"rank": rank, "attempt": attempt, "bytes": 1 << 30, "values": {},
                       "chunk_crc32c": crcs, "time": time.time()}).encode()


def _small_manifest(world: int) -> tuple[bytes, bytes]:
    from benchmarks.scale_plan import relight_manifest
    from ckpt.plan import RankLayout, TensorLayout, plan_save

    lay = [RankLayout(r, (TensorLayout("w", ("w",), (world, 1024), "float32", "sim",
                                       (((r, 0), (1, 1024)),)),), ()) for r in range(world)]
    raw, _, table = relight_manifest(plan_save(lay, tuple(range(world))), world)
    return raw, table


def _one(store: Any, n: int, cfg: CommitConfig) -> dict[str, Any]:
    from benchmarks.scale_plan import table_path
    from ckpt.commit import collect_indexes, index_key, publish_commit
    from ckpt.crc_table import TABLE_FIELD
    from ckpt.manifest import crc32c, read_manifest

    attempt = uuid.uuid4().hex[:16]
    ranks = tuple(range(n))
    docs = [_index_doc(r, attempt, cfg.index_entries) for r in ranks]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(cfg.writers) as pool:
        list(pool.map(lambda r: store.put(index_key(attempt, r), docs[r]), ranks))
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    got = collect_indexes(store, attempt, ranks)
    collect_s = time.perf_counter() - t0
    assert got is not None and len(got) == n, "an index went missing"
    path = (cfg.manifest_for or {}).get(n)
    if path is not None and path.exists():
        raw, table = path.read_bytes(), table_path(path).read_bytes()
    else:
        raw, table = _small_manifest(n)
    t0 = time.perf_counter()
    store.put(json.loads(raw)[TABLE_FIELD]["object"], table)
    publish_commit(store, attempt, raw, {"attempt": attempt, "manifest_bytes": len(raw),
                                         "manifest_crc32c": crc32c(raw), "step": 1})
    publish_s = time.perf_counter() - t0
    readers = min(READERS, n)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(lambda _: read_manifest(store), range(readers)))
    read_wall_s = time.perf_counter() - t0
    return {"ranks": n, "index_bytes": len(docs[0]), "write_s": write_s,
            "collect_s": collect_s, "publish_s": publish_s,
            "commit_s": collect_s + publish_s, "manifest_bytes": len(raw),
            "crc_table_bytes": len(table),
            "readers": readers, "read_wall_s": read_wall_s,
            "read_per_rank_s": read_wall_s / readers}


def sync_exchange(n: int, entries: int) -> dict[str, Any]:
    """A synchronous save's index exchange at `n` ranks (`ckpt.collective.gather_or_raise`,
    no process group: the messages as they cross one): the bytes each side receives and
    the CPU seconds of parsing them. The coordinator receives every rank's index; any
    other rank receives the all-gather of errors and sizes only. (An all-gather of the
    indexes, which this replaced, gave every rank the coordinator's part.)"""
    from ckpt.comm import parse_json_list  # what the collectives parse with

    attempt = "0123456789abcdef"
    idx = [json.loads(_index_doc(r, attempt, entries)) for r in range(n)]
    blobs = [json.dumps({"values": d["values"], "chunk_crc32c": d["chunk_crc32c"]},
                        separators=(",", ":")).encode() for d in idx]
    sizes = [json.dumps({"err": None, "data": len(b)}, separators=(",", ":")).encode()
             for b in blobs]

    def parse(msgs: list[bytes]) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            kept = parse_json_list(msgs)
            best = min(best, time.process_time() - t0)
            del kept
        return best

    # gathers pad every message to the longest one
    size_bytes = n * max(len(m) for m in sizes)
    return {"ranks": n, "index_bytes": len(blobs[0]),
            "coordinator_bytes": size_bytes + n * max(len(b) for b in blobs),
            "coordinator_parse_s": parse(sizes) + parse(blobs),
            "other_bytes": size_bytes, "other_parse_s": parse(sizes)}


def run_commit(cfg: CommitConfig, log: Any = print) -> dict[str, list[dict[str, Any]]]:
    """{"local": rows, "s3": rows, "sync": rows}: one row per size ("sync": the
    synchronous save's index exchange, `sync_exchange`)."""
    from storage import open_store

    out: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="scale-commit-")))
        targets = {"local": lambda n: open_store(str(tmp / "local" / f"n{n}"))}
        if cfg.s3:
            from chaos.s3_server import S3Server

            server = S3Server(tmp / "s3").start()
            stack.callback(server.stop)
            os.environ.update(server.env())
            targets["s3"] = lambda n: open_store(server.url(f"scale/n{n}-{uuid.uuid4().hex[:6]}"))
        for name, make in targets.items():
            rows = out.setdefault(name, [])
            for n in cfg.sizes:
                row = _one(make(n), n, cfg)
                log(f"commit {name} {n} ranks: collect {row['collect_s']:.3f} s, publish "
                    f"{row['publish_s']:.3f} s ({row['manifest_bytes']} B manifest)")
                rows.append(row)
    for n in cfg.sizes:
        row = sync_exchange(n, cfg.index_entries)
        log(f"commit sync {n} ranks: coordinator {row['coordinator_bytes']} B, "
            f"{row['coordinator_parse_s']:.3f} s; other ranks {row['other_bytes']} B, "
            f"{row['other_parse_s']:.4f} s")
        out.setdefault("sync", []).append(row)
    return out
