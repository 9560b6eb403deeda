"""Helpers shared by the rendezvous tests (not fixtures: plain functions)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousInfo, RendezvousParameters

from relight.elastic.rendezvous import EtcdRendezvousHandler, create_handler

FAST = {
    "join_timeout": "30",
    "last_call_timeout": "0.5",
    "rejoin_timeout": "10",
    "lease_ttl": "2",
    "etcd_timeout": "5",
    "store_timeout": "20",
    "poll_interval": "0.1",
}


def job_id() -> str:
    return "job-" + uuid.uuid4().hex[:10]


def handler(endpoint: str, run_id: str, min_nodes: int, max_nodes: int,
            **conf: Any) -> EtcdRendezvousHandler:
    params = RendezvousParameters(backend="relight-etcd", endpoint=endpoint, run_id=run_id,
                                  min_nodes=min_nodes, max_nodes=max_nodes,
                                  **{**FAST, "prefix": "/relight-test", **conf})
    return create_handler(params)


def join_all(handlers: list[EtcdRendezvousHandler],
             timeout: float = 60) -> list[RendezvousInfo | BaseException]:
    """next_rendezvous() on every handler at once, from threads."""
    results: list[Any] = [None] * len(handlers)

    def run(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a next_rendezvous() call never returned"
    return results


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def shutdown_all(handlers: list[EtcdRendezvousHandler]) -> None:
    for h in handlers:
        h.shutdown()
