"""A Prometheus endpoint for a node agent (`relight run --metrics-port`).

The agent (torchrun's elastic agent, in the `relight run` process) outlives its
workers, so it can report what a dead rank 0 cannot: restarts, membership, the
rendezvous round, the nodes waiting to join, and (given the checkpoint URL) the newest
committed step and its age. Series, on 127.0.0.1 unless told otherwise:

    relight_restarts                     worker-group restarts on this node (re-rendezvous)
    relight_worker_group_restarts_total  the same, by reason: `fault` or `membership`
    relight_world_size                   ranks in the current round (nodes x nproc-per-node)
    relight_nodes                        nodes in the current round
    relight_rendezvous_round             the round this node last joined
    relight_nodes_waiting                the agent's last `num_nodes_waiting()` answer
    relight_last_committed_step          newest committed checkpoint step (NaN: none yet)
    relight_last_commit_timestamp_seconds its `created_unix` (when its state was taken)
    relight_last_commit_age_seconds      seconds since then, computed at scrape

The names match rank 0's exporter (`runtime.observability`), so one dashboard reads
either; Prometheus tells them apart by instance. Everything is fed by rendezvous
events (`elastic.rendezvous.add_listener`) and by a thread that lists the checkpoint
root's commit records every `ckpt_poll_s`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from relight.elastic.rendezvous import add_listener, remove_listener

__all__ = ["AgentMetrics", "AgentMetricsConfig"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class AgentMetricsConfig:
    port: int
    """TCP port of the endpoint; 0 picks a free one (logged)."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: expose it only on a trusted network."""
    nproc_per_node: int = 1
    """Ranks per node, to turn the number of nodes into a world size."""
    ckpt_url: str | None = None
    """Checkpoint root (as given to the trainer); None: no checkpoint series."""
    ckpt_poll_s: float = 10.0
    """Seconds between two listings of the checkpoint root's commit records."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--metrics-port must be 0..65535, got {self.port}")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be >= 1, got {self.nproc_per_node}")
        if self.ckpt_poll_s <= 0:
            raise ValueError(f"ckpt_poll_s must be > 0, got {self.ckpt_poll_s}")


class AgentMetrics:
    """Call order: `start()` (serves, subscribes, starts the checkpoint poller), then
    `close()`. `on_event` and `poll_checkpoint` are public for tests."""

    def __init__(self, cfg: AgentMetricsConfig) -> None:
        self.cfg = cfg
        self.registry = r = CollectorRegistry()
        self._lock = threading.Lock()
        self._commit_unix: float | None = None
        self.restarts = Gauge("relight_restarts", "Worker-group restarts on this node",
                              registry=r)
        self.by_reason = Counter("relight_worker_group_restarts",
                                 "Worker-group restarts on this node by reason",
                                 ["reason"], registry=r)
        self.world_size = Gauge("relight_world_size", "Ranks in the current round",
                                registry=r)
        self.nodes = Gauge("relight_nodes", "Nodes in the current round", registry=r)
        self.round = Gauge("relight_rendezvous_round", "Rendezvous round last joined",
                           registry=r)
        self.waiting = Gauge("relight_nodes_waiting", "Nodes waiting for a new round",
                             registry=r)
        self.last_step = Gauge("relight_last_committed_step",
                               "Step of the newest committed checkpoint", registry=r)
        self.last_commit = Gauge("relight_last_commit_timestamp_seconds",
                                 "Unix time of the newest committed checkpoint's state",
                                 registry=r)
        self.commit_age = Gauge("relight_last_commit_age_seconds",
                                "Seconds since the newest committed checkpoint's state",
                                registry=r)
        for g in (self.world_size, self.nodes, self.round, self.last_step, self.last_commit):
            g.set(math.nan)
        self.commit_age.set_function(self._age)
        self._server: Any = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._store: Any = None
        self.port: int | None = None

    def _age(self) -> float:
        with self._lock:
            t = self._commit_unix
        return math.nan if t is None else max(0.0, time.time() - t)

    # -- feeding ------------------------------------------------------------------------

    def on_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "rdzv_done":
            nodes = int(fields["world"])
            self.nodes.set(nodes)
            self.world_size.set(nodes * self.cfg.nproc_per_node)
            self.round.set(int(fields["round"]))
            reason = fields.get("reason", "start")
            if reason != "start":
                self.by_reason.labels(reason=reason).inc()
                self.restarts.inc()
            self.waiting.set(0)
        elif kind == "nodes_waiting":
            self.waiting.set(int(fields["waiting"]))

    def poll_checkpoint(self) -> int | None:
        """List the commit records once; update the checkpoint series. Returns the step."""
        from relight.ckpt import list_records
        from relight.storage import open_store

        if self._store is None:
            self._store = open_store(self.cfg.ckpt_url)
        committed = [r for r in list_records(self._store).values() if r.committed]
        if not committed:
            return None
        newest = max(committed, key=lambda r: r.step)
        self.last_step.set(newest.step)
        if newest.created:
            self.last_commit.set(newest.created)
            with self._lock:
                self._commit_unix = newest.created
        return newest.step

    def _poll_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.poll_checkpoint()
            except Exception as exc:  # noqa: BLE001 - storage down must not kill the agent
                logger.warning("metrics: could not list checkpoints at %s: %s",
                               self.cfg.ckpt_url, exc)
            self._stop.wait(self.cfg.ckpt_poll_s)

    # -- serving ------------------------------------------------------------------------

    def start(self) -> int:
        """Serve, subscribe to rendezvous events, start the poller; returns the port."""
        try:
            self._server, _ = start_http_server(self.cfg.port, addr=self.cfg.host,
                                                registry=self.registry)
        except OSError as exc:
            raise OSError(exc.errno, f"cannot serve agent metrics on "
                                     f"{self.cfg.host}:{self.cfg.port}: {exc}") from exc
        self.port = int(self._server.server_port)
        add_listener(self.on_event)
        if self.cfg.ckpt_url:
            self._poller = threading.Thread(target=self._poll_loop, daemon=True,
                                            name="relight-metrics-ckpt")
            self._poller.start()
        logger.info("agent metrics on http://%s:%d/metrics", self.cfg.host, self.port)
        return self.port

    def close(self) -> None:
        remove_listener(self.on_event)
        self._stop.set()
        if self._poller is not None:
            self._poller.join(5)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
