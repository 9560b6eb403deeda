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
    group_procs: int = 8
    """Processes of the commit group's measured collectives (`group_transfer`); 0: none."""
    manifest_for: dict[int, Path] | None = None
    """World size -> manifest file (from the planning arms) to publish and read back; a
    small one is built where none is given."""


def _index_doc(rank: int, attempt: str, entries: int) -> bytes:
    crcs = {f"data/{attempt}/t{k:05d}/c/{rank}/0": [zlib.crc32(f"{rank}/{k}".encode())]
            for k in range(entries)}
    return json.dumps({"rank": rank, "attempt": attempt, "bytes": 1 << 30, "values": {},
                       "chunk_crc32c": crcs, "time": time.time()}).encode()


def _small_manifest(world: int) -> tuple[bytes, bytes]:
    from relight.benchmarks.scale_plan import relight_manifest
    from relight.ckpt.plan import RankLayout, TensorLayout, plan_save

    lay = [RankLayout(r, (TensorLayout("w", ("w",), (world, 1024), "float32", "sim",
                                       (((r, 0), (1, 1024)),)),), ()) for r in range(world)]
    raw, _, table = relight_manifest(plan_save(lay, tuple(range(world))), world)
    return raw, table


def _one(store: Any, n: int, cfg: CommitConfig) -> dict[str, Any]:
    from relight.benchmarks.scale_plan import table_path
    from relight.ckpt.commit import collect_indexes, index_key, publish_commit
    from relight.ckpt.crc_table import TABLE_FIELD
    from relight.ckpt.manifest import crc32c, read_manifest

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
    """A commit's index exchange over a process group at `n` ranks
    (`ckpt.collective.gather_or_raise`, then `coordinator_outcome`; no process group:
    the messages as they cross one): the bytes each side receives and the CPU seconds
    of parsing them. The coordinator receives every rank's flag, size and index; any
    other rank receives the coordinator's verdict and the outcome only. (An all-gather
    of the indexes, which this replaced, gave every rank the coordinator's part.)"""
    from relight.ckpt.comm import parse_json_list  # what the collectives parse with

    attempt = "0123456789abcdef"
    idx = [json.loads(_index_doc(r, attempt, entries)) for r in range(n)]
    blobs = [json.dumps({"values": d["values"], "chunk_crc32c": d["chunk_crc32c"]},
                        separators=(",", ":")).encode() for d in idx]
    heads = [b"-" + len(b).to_bytes(8, "little") for b in blobs]  # gather_or_raise's first

    def parse(msgs: list[bytes]) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.process_time()
            kept = parse_json_list(msgs)
            best = min(best, time.process_time() - t0)
            del kept
        return best

    def lengths(msgs: list[bytes]) -> float:
        t0 = time.process_time()
        for _ in range(3):
            assert not any(h[:1] == b"E" for h in msgs)
            assert max(int.from_bytes(h[1:9], "little") for h in msgs) > 0
        return (time.process_time() - t0) / 3

    # gathers pad every message to the longest one; the others receive the
    # coordinator's verdict (9 bytes) and the commit's outcome (1 byte)
    return {"ranks": n, "index_bytes": len(blobs[0]),
            "coordinator_bytes": n * len(heads[0]) + n * max(len(b) for b in blobs),
            "coordinator_parse_s": lengths(heads) + parse(blobs),
            "other_bytes": 10, "other_parse_s": 0.0}


def _group_member(rank: int, procs: int, port: int, payload_bytes: int, rounds: int,
                  out: Any) -> None:
    """One process of `group_transfer`: a real `CommitGroup` (gloo over a TCPStore),
    timed through the `Comm` calls a commit makes (`gather_or_raise`,
    `coordinator_outcome`)."""
    from datetime import timedelta

    import torch.distributed as dist

    from relight.ckpt.commit_group import CommitGroup

    store = dist.TCPStore("127.0.0.1", port, procs + 1, is_master=False,
                          timeout=timedelta(seconds=120))
    comm = CommitGroup("bench", store, tuple(range(procs)), rank, 120.0).comm()
    head = b"-" + payload_bytes.to_bytes(8, "little")
    blob = bytes(payload_bytes)
    comm.allgather_fixed(b"-", 1)  # warm: every pair connected
    times: dict[str, list[float]] = {"head_s": [], "gather_s": [], "outcome_s": []}
    for _ in range(rounds):
        comm.allgather_fixed(b"-", 1)  # line up
        t0 = time.perf_counter()
        decision = comm.ask_coordinator(head, 9, lambda heads: heads[0], 9)
        t1 = time.perf_counter()
        got = comm.gather_bytes(blob, [int.from_bytes(decision[1:9], "little")] * procs)
        t2 = time.perf_counter()
        comm.broadcast_fixed(b"-", 1)
        t3 = time.perf_counter()
        assert got is None or sum(map(len, got)) == payload_bytes * procs
        for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[k].append(v)
    if rank == 0:
        out.put({k: sorted(v)[len(v) // 2] for k, v in times.items()})


def group_transfer(total_bytes: int, procs: int = 8, rounds: int = 5) -> dict[str, Any]:
    """A commit's collectives on `procs` real processes of this machine, one
    `CommitGroup` each, seen from the coordinator: the gather of every rank's failure
    flag and size with the coordinator's broadcast of the verdict (`head_s`), the gather
    of `total_bytes` of indexes split evenly (`gather_s`: what the coordinator receives
    at the world size that produced `total_bytes`), and the broadcast of the commit's
    outcome (`outcome_s`). Medians of `rounds`. `procs` senders, not one per rank: the
    per-sender cost at thousands of ranks is not measured here."""
    import multiprocessing as mp
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, procs + 1, is_master=True,
                          timeout=timedelta(seconds=120), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    members = [ctx.Process(target=_group_member,
                           args=(r, procs, store.port, total_bytes // procs, rounds, out))
               for r in range(procs)]
    for p in members:
        p.start()
    try:
        res = out.get(timeout=600)  # spawning and importing torch in each, then the rounds
    finally:
        for p in members:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    del store
    return {"procs": procs, "total_bytes": total_bytes, **res}


def run_commit(cfg: CommitConfig, log: Any = print) -> dict[str, list[dict[str, Any]]]:
    """{"local": rows, "s3": rows, "sync": rows}: one row per size ("sync": the
    synchronous save's index exchange, `sync_exchange`)."""
    from relight.storage import open_store

    out: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="scale-commit-")))
        targets = {"local": lambda n: open_store(str(tmp / "local" / f"n{n}"))}
        if cfg.s3:
            from relight.chaos.s3_server import S3Server

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
    publish = {r["ranks"]: r["publish_s"] for r in out.get("s3", [])}
    for n in cfg.sizes:
        row = sync_exchange(n, cfg.index_entries)
        if cfg.group_procs:
            row.update(group_transfer(row["coordinator_bytes"], cfg.group_procs))
            row["group_commit_s"] = (row["head_s"] + row["gather_s"] + row["outcome_s"]
                                     + row["coordinator_parse_s"])
            if n in publish:
                row["group_commit_s3_s"] = row["group_commit_s"] + publish[n]
        log(f"commit over a group, {n} ranks: coordinator {row['coordinator_bytes']} B, "
            f"parse {row['coordinator_parse_s']:.3f} s; other ranks {row['other_bytes']} B"
            + (f"; {cfg.group_procs} processes: head {row['head_s']:.4f} s, gather "
               f"{row['gather_s']:.3f} s, outcome {row['outcome_s']:.4f} s"
               if cfg.group_procs else ""))
        out.setdefault("sync", []).append(row)
    return out
