"""Rendezvous of N simulated agents joining one round against one real etcd.

Each agent is Relight's own `EtcdRendezvousHandler` (the torchrun backend) with its own
client, lease and keepalive thread, as N torchrun agents would have. The agents are
spread over `agent_procs` worker processes (N/P threads each, one interpreter lock per
process, as agents on separate hosts do not share one); the workers are started and
their handlers built before the clock, then all are released together and call
`next_rendezvous()` for a group of exactly N (min = max, so the round completes as
soon as the last one is in). The round time runs from the release to the last agent's
return, on the system-wide monotonic clock. Requests are counted in every worker by
wrapping the etcd client's one request method (`EtcdClient.call`, per API path) and its
watches; a CAS conflict is a transaction that came back not succeeded. The counts of
all workers are summed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RdzvConfig", "run_rendezvous", "RequestCounter"]


@dataclass(frozen=True, slots=True)
class RdzvConfig:
    agents: tuple[int, ...] = (64, 256, 1024)
    timeout_s: float = 120.0
    """Join timeout of each agent: a round not complete by then is reported as such."""
    lease_ttl_s: float = 10.0
    agent_procs: int = 0
    """Worker processes the agents are spread over; 0: min(8, N) per round size."""
    agent_nice: int = 10
    """Niceness of the worker processes. etcd runs on a machine of its own in a real job;
    here it shares 2 cores with every agent's interpreter, and N runnable agent threads
    would otherwise take its CPU away (the etcd server stays at the default 0)."""

    def procs_for(self, n: int) -> int:
        return max(1, min(n, self.agent_procs or 8))


class RequestCounter:
    """Counts etcd requests of every `EtcdClient` while installed (a context manager)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.conflicts = 0
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> RequestCounter:
        from relight.elastic.etcd_client import EtcdClient

        call, txn = EtcdClient.call, EtcdClient.txn
        watches = {name: getattr(EtcdClient, name) for name in ("wait_for_change",
                                                                 "wait_for_event")
                   if hasattr(EtcdClient, name)}
        self._saved = {"call": call, "txn": txn, **watches}
        counter = self

        def counted_call(client: Any, path: str, body: dict[str, Any], *, what: str) -> Any:
            with counter._lock:
                counter.calls[path] += 1
            return call(client, path, body, what=what)

        def counted_txn(client: Any, *args: Any, **kwargs: Any) -> Any:
            result = txn(client, *args, **kwargs)
            if not result.succeeded:
                with counter._lock:
                    counter.conflicts += 1
            return result

        def counted(watch: Any) -> Any:
            def counted_watch(client: Any, *args: Any, **kwargs: Any) -> Any:
                with counter._lock:
                    counter.calls["watch"] += 1
                return watch(client, *args, **kwargs)
            return counted_watch

        EtcdClient.call = counted_call  # type: ignore[method-assign]
        EtcdClient.txn = counted_txn  # type: ignore[method-assign]
        for name, fn in watches.items():
            setattr(EtcdClient, name, counted(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        from relight.elastic.etcd_client import EtcdClient

        for name, fn in self._saved.items():
            setattr(EtcdClient, name, fn)

    def snapshot(self) -> tuple[Counter[str], int]:
        with self._lock:
            return Counter(self.calls), self.conflicts


def _agent(handler: Any, n: int, go: threading.Event, done: list[float | None], j: int,
           errors: list[str]) -> None:
    go.wait()
    try:
        info = handler.next_rendezvous()
        if info.world_size != n:
            raise RuntimeError(f"world size {info.world_size}, expected {n}")
        done[j] = time.monotonic()
    except Exception as e:  # noqa: BLE001 - reported in the row
        errors.append(f"{type(e).__name__}: {e}"[:200])


def _worker(conn: Any, nice: int) -> None:
    """One worker process: builds its share of handlers per round, runs them on "go",
    reports, and revokes their leases on "leave" (only once every worker is done: rank
    0's store key lives on its lease)."""
    import logging

    from relight.elastic.etcd_client import EtcdSettings
    from relight.elastic.rendezvous import EtcdRendezvousHandler, RendezvousSettings

    # Every agent logs its join and its leaving: 1,024 lines per round say nothing here.
    logging.getLogger("relight.elastic.rendezvous").setLevel(logging.ERROR)
    logging.getLogger("relight.elastic.etcd_client").setLevel(logging.ERROR)
    os.nice(nice)
    conn.send(("started", os.getpid()))
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        _, endpoint, run_id, n, ids, timeout_s, lease_ttl_s = msg
        settings = RendezvousSettings(
            run_id=run_id, min_nodes=n, max_nodes=n, join_timeout=timeout_s,
            lease_ttl=lease_ttl_s, etcd=EtcdSettings(endpoints=(endpoint,), prefix="/scale",
                                                     timeout=30.0))
        handlers = [EtcdRendezvousHandler(settings, node_id=f"agent-{i:05d}") for i in ids]
        done: list[float | None] = [None] * len(ids)
        errors: list[str] = []
        go = threading.Event()
        threads = [threading.Thread(target=_agent, args=(h, n, go, done, j, errors),
                                    daemon=True) for j, h in enumerate(handlers)]
        for t in threads:
            t.start()
        conn.send(("ready",))
        if conn.recv()[0] != "go":
            return
        with RequestCounter() as counter:
            go.set()
            for t in threads:
                t.join(timeout_s + 30)
            calls, conflicts = counter.snapshot()
        conn.send(("done", [d for d in done if d is not None], dict(calls), conflicts,
                   errors[:3]))
        conn.recv()  # "leave"
        for h in handlers:
            h.leave("benchmark round done")
        conn.send(("left",))


class _Pool:
    """P worker processes (spawned: the parent holds threads), reused across sizes."""

    def __init__(self, procs: int, nice: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(child, nice), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for c in self.conns:
            if not c.poll(300):
                raise RuntimeError("a rendezvous benchmark worker did not start in 300 s")
            c.recv()

    def close(self) -> None:
        for c, p in zip(self.conns, self.procs, strict=True):
            try:
                c.send(("exit",))
            except OSError:
                pass
            p.join(10)
            if p.is_alive():
                p.kill()


def _one_round(conns: list[Any], endpoint: str, n: int, cfg: RdzvConfig) -> dict[str, Any]:
    run_id = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    shares = [list(range(n))[k::len(conns)] for k in range(len(conns))]
    used = [(c, s) for c, s in zip(conns, shares, strict=True) if s]
    for c, ids in used:
        c.send(("round", endpoint, run_id, n, ids, cfg.timeout_s, cfg.lease_ttl_s))
    for c, _ in used:
        c.recv()  # "ready": handlers built, threads waiting
    load_start = os.getloadavg()[0]
    t0 = time.monotonic()
    for c, _ in used:
        c.send(("go",))
    finished: list[float] = []
    calls: Counter[str] = Counter()
    conflicts, errors = 0, []
    for c, _ in used:
        _, done, by_path, conf, errs = c.recv()
        finished += done
        calls.update(by_path)
        conflicts += conf
        errors += errs
    load_end = os.getloadavg()[0]
    for c, _ in used:
        c.send(("leave",))
    for c, _ in used:
        c.recv()
    requests = sum(v for k, v in calls.items() if k != "lease/keepalive")
    return {
        "agents": n, "agent_procs": len(used), "complete": len(finished) == n and not errors,
        "round_s": (max(finished) - t0) if len(finished) == n else None,
        "requests": requests, "requests_per_agent": requests / n,
        "keepalives": calls.get("lease/keepalive", 0), "cas_conflicts": conflicts,
        "by_path": dict(calls), "errors": errors[:3], "load_avg": [load_start, load_end],
    }


def run_rendezvous(cfg: RdzvConfig, log: Any = print) -> list[dict[str, Any]]:
    from relight.elastic.etcd_server import EtcdServer

    rows = []
    pool = _Pool(max(cfg.procs_for(n) for n in cfg.agents), cfg.agent_nice)
    try:
        with tempfile.TemporaryDirectory(prefix="scale-etcd-") as tmp:
            server = EtcdServer(Path(tmp) / "data").start()
            try:
                for n in cfg.agents:
                    row = _one_round(pool.conns[:cfg.procs_for(n)], server.endpoint, n, cfg)
                    log(f"rendezvous {n} agents in {row['agent_procs']} processes: "
                        f"{row['round_s']} s, {row['requests']} requests "
                        f"({row['requests_per_agent']:.1f}/agent), {row['cas_conflicts']} "
                        f"CAS conflicts, load avg {row['load_avg'][0]:.1f}-"
                        f"{row['load_avg'][1]:.1f}, by path {row['by_path']}"
                        + (f", errors {row['errors']}" if row["errors"] else ""))
                    rows.append(row)
                    if not row["complete"]:
                        break
            finally:
                server.stop()
    finally:
        pool.close()
    return rows
