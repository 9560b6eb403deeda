"""Rendezvous of N simulated agents joining one round against one real etcd.

Each agent is Relight's own `EtcdRendezvousHandler` (the torchrun backend) in a thread
of this process, with its own client, lease and keepalive, as N torchrun agents would
have; all call `next_rendezvous()` at once for a group of exactly N (min = max, so the
round completes as soon as the last one is in). Requests are counted by wrapping the
etcd client's one request method (`EtcdClient.call`, per API path) and its watch
(`wait_for_change`); a CAS conflict is a transaction that came back not succeeded.
"""

from __future__ import annotations

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


class RequestCounter:
    """Counts etcd requests of every `EtcdClient` while installed (a context manager)."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.conflicts = 0
        self._lock = threading.Lock()
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> RequestCounter:
        from elastic.etcd_client import EtcdClient

        call, txn, watch = EtcdClient.call, EtcdClient.txn, EtcdClient.wait_for_change
        self._saved = {"call": call, "txn": txn, "wait_for_change": watch}
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

        def counted_watch(client: Any, *args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                counter.calls["watch"] += 1
            return watch(client, *args, **kwargs)

        EtcdClient.call = counted_call  # type: ignore[method-assign]
        EtcdClient.txn = counted_txn  # type: ignore[method-assign]
        EtcdClient.wait_for_change = counted_watch  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from elastic.etcd_client import EtcdClient

        for name, fn in self._saved.items():
            setattr(EtcdClient, name, fn)

    def snapshot(self) -> tuple[Counter[str], int]:
        with self._lock:
            return Counter(self.calls), self.conflicts


def _one_round(endpoint: str, n: int, cfg: RdzvConfig) -> dict[str, Any]:
    from elastic.etcd_client import EtcdSettings
    from elastic.rendezvous import EtcdRendezvousHandler, RendezvousSettings

    run_id = f"scale-{n}-{uuid.uuid4().hex[:6]}"
    settings = RendezvousSettings(
        run_id=run_id, min_nodes=n, max_nodes=n, join_timeout=cfg.timeout_s,
        lease_ttl=cfg.lease_ttl_s, etcd=EtcdSettings(endpoints=(endpoint,), prefix="/scale",
                                                     timeout=30.0))
    handlers = [EtcdRendezvousHandler(settings, node_id=f"agent-{i:05d}") for i in range(n)]
    done: list[float | None] = [None] * n
    errors: list[str] = []
    start = threading.Barrier(n + 1)

    def agent(i: int) -> None:
        start.wait()
        try:
            info = handlers[i].next_rendezvous()
            assert info.world_size == n
            done[i] = time.perf_counter()
        except Exception as e:  # noqa: BLE001 - reported in the row
            errors.append(f"{type(e).__name__}: {e}"[:200])

    threads = [threading.Thread(target=agent, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    with RequestCounter() as counter:
        start.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join(cfg.timeout_s + 30)
        calls, conflicts = counter.snapshot()
    finished = [d for d in done if d is not None]
    for h in handlers:
        h.leave("benchmark round done")
    requests = sum(v for k, v in calls.items() if k != "lease/keepalive")
    return {
        "agents": n, "complete": len(finished) == n and not errors,
        "round_s": (max(finished) - t0) if finished else None,
        "requests": requests, "requests_per_agent": requests / n,
        "keepalives": calls.get("lease/keepalive", 0), "cas_conflicts": conflicts,
        "by_path": dict(calls), "errors": errors[:3],
    }


def run_rendezvous(cfg: RdzvConfig, log: Any = print) -> list[dict[str, Any]]:
    import logging

    from elastic.etcd_server import EtcdServer

    # Every agent logs its join and its leaving: 1,024 lines per round say nothing here.
    logging.getLogger("elastic.rendezvous").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-etcd-") as tmp:
        server = EtcdServer(Path(tmp) / "data").start()
        try:
            for n in cfg.agents:
                row = _one_round(server.endpoint, n, cfg)
                log(f"rendezvous {n} agents: {row['round_s']} s, {row['requests']} requests, "
                    f"{row['cas_conflicts']} CAS conflicts")
                rows.append(row)
                if not row["complete"]:
                    break
        finally:
            server.stop()
    return rows
