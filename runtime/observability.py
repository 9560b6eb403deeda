"""What a training job tells its operators: a Prometheus endpoint, TensorBoard scalars,
and the job context (restarts, rendezvous round) read from the agent's environment.

Rank 0 (or a node agent) serves, on 127.0.0.1 unless told otherwise, these series:

    relight_last_committed_step            step of the newest committed checkpoint
    relight_last_commit_timestamp_seconds  unix time of that commit
    relight_last_commit_age_seconds        seconds since that commit, computed at scrape
    relight_checkpoint_save_seconds        histogram: start of a save to its commit
    relight_checkpoint_bytes_written_total bytes of committed checkpoints written
    relight_checkpoint_saves_total         committed saves
    relight_checkpoint_save_failures_total failed saves
    relight_restarts                       restarts of the job so far (set by the runtime,
                                           which knows it across process lifetimes)
    relight_world_size                     current number of ranks
    relight_rendezvous_round               current elastic rendezvous round

Each exporter has its own registry, so several can live in one process (tests) and the
process-global default registry is left alone.

TensorBoard (``train.tensorboard_dir``): rank 0 writes one scalar per metric per step, under
the tags of ``TB_SCALARS`` (``train/loss``, ``perf/tokens_per_s``, ``perf/mfu``,
``perf/step_time_s``, ``ckpt/stall_s``, ``ckpt/since_commit_s``, ``job/restarts``, ...).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = [
    "RDZV_ROUND_ENV",
    "RESTART_COUNT_ENV",
    "TB_SCALARS",
    "PrometheusConfig",
    "PrometheusExporter",
    "TensorBoardWriter",
    "rdzv_round_from_env",
    "restarts_from_env",
    "start_prometheus",
]

log = logging.getLogger(__name__)

SAVE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
                1800.0, math.inf)


@dataclass(kw_only=True, slots=True)
class PrometheusConfig:
    port: int | None = None
    """TCP port of the endpoint on rank 0; 0 or None disables it."""
    host: str = "127.0.0.1"
    """Address to bind. Loopback by default: expose it (0.0.0.0) only on a trusted network."""

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"metrics.prometheus_port must be 0..65535, got {self.port}")


class PrometheusExporter:
    """Holds the metrics; `serve()` starts the HTTP endpoint in a daemon thread.

    Call order: construct, `serve(port)`, then the `record_*`/`set_*` calls from the
    training loop (thread-safe), `close()` at exit.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._lock = threading.Lock()
        self._last_commit_unix: float | None = None
        self.last_step = Gauge("relight_last_committed_step",
                               "Step of the newest committed checkpoint", registry=r)
        self.last_step.set(math.nan)
        self.last_commit = Gauge("relight_last_commit_timestamp_seconds",
                                 "Unix time of the newest committed checkpoint", registry=r)
        self.last_commit.set(math.nan)
        self.commit_age = Gauge("relight_last_commit_age_seconds",
                                "Seconds since the newest committed checkpoint", registry=r)
        self.commit_age.set_function(self._age)
        self.save_seconds = Histogram("relight_checkpoint_save_seconds",
                                      "Duration of a checkpoint save, start to commit",
                                      buckets=SAVE_BUCKETS, registry=r)
        self.bytes_written = Counter("relight_checkpoint_bytes_written",
                                     "Bytes of committed checkpoints written", registry=r)
        self.saves = Counter("relight_checkpoint_saves", "Committed checkpoint saves",
                             registry=r)
        self.save_failures = Counter("relight_checkpoint_save_failures",
                                     "Checkpoint saves that failed", registry=r)
        self.restarts = Gauge("relight_restarts", "Restarts of this job so far", registry=r)
        self.world_size = Gauge("relight_world_size", "Current number of ranks", registry=r)
        self.rdzv_round = Gauge("relight_rendezvous_round", "Current rendezvous round",
                                registry=r)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.port: int | None = None

    def _age(self) -> float:
        with self._lock:
            t = self._last_commit_unix
        return math.nan if t is None else max(0.0, time.time() - t)

    # -- recording ------------------------------------------------------------------------

    def record_commit(self, step: int, nbytes: int, duration_s: float,
                      committed_unix: float | None = None) -> None:
        """A checkpoint of `step` committed: `nbytes` written, `duration_s` from start."""
        t = time.time() if committed_unix is None else committed_unix
        with self._lock:
            self._last_commit_unix = t
        self.last_step.set(step)
        self.last_commit.set(t)
        self.save_seconds.observe(duration_s)
        self.bytes_written.inc(nbytes)
        self.saves.inc()

    def set_last_commit(self, step: int, committed_unix: float) -> None:
        """The newest committed checkpoint found at start (a restore): no save is counted."""
        with self._lock:
            self._last_commit_unix = committed_unix
        self.last_step.set(step)
        self.last_commit.set(committed_unix)

    def record_save_failure(self) -> None:
        self.save_failures.inc()

    def set_restarts(self, n: int) -> None:
        self.restarts.set(n)

    def set_world_size(self, n: int) -> None:
        self.world_size.set(n)

    def set_rendezvous_round(self, r: int) -> None:
        self.rdzv_round.set(r)

    # -- serving --------------------------------------------------------------------------

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Start the endpoint; `port=0` picks a free port. Returns the bound port."""
        if self._server is not None:
            raise RuntimeError(f"Prometheus endpoint already serving on {host}:{self.port}")
        try:
            self._server, self._thread = start_http_server(port, addr=host,
                                                           registry=self.registry)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve Prometheus metrics on {host}:{port}: {e}") \
                from e
        self.port = int(self._server.server_port)
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


def start_prometheus(cfg: PrometheusConfig, rank: int) -> PrometheusExporter | None:
    """The exporter on rank 0 when a port is configured; None elsewhere (0/None disables)."""
    if rank != 0 or not cfg.port:
        return None
    exporter = PrometheusExporter()
    exporter.serve(cfg.port, cfg.host)
    return exporter


# ------------------------------------------------------------------ job context

RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
"""Set by torchrun's agent in every worker: restarts of the worker group so far."""
RDZV_ROUND_ENV = "RELIGHT_RDZV_ROUND"
"""Set by Relight's node agent in every worker: the rendezvous round that formed the group."""


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        log.warning("ignoring %s=%r: not an integer", name, raw)
        return None


def restarts_from_env() -> int:
    """Restarts of the worker group so far (0 outside an elastic agent)."""
    return _env_int(RESTART_COUNT_ENV) or 0


def rdzv_round_from_env() -> int | None:
    """The rendezvous round of this worker group, or None when no agent said."""
    return _env_int(RDZV_ROUND_ENV)


# ------------------------------------------------------------------ TensorBoard

TB_SCALARS: dict[str, str] = {
    "loss": "train/loss",
    "eval_loss": "eval/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "step_time_s": "perf/step_time_s",
    "mem_max_mb": "perf/mem_max_mb",
    "ckpt_stall_s": "ckpt/stall_s",
    "ckpt_age_s": "ckpt/since_commit_s",
    "restarts": "job/restarts",
    "world_size": "job/world_size",
    "rdzv_round": "job/rdzv_round",
}
"""Metrics-record key -> TensorBoard tag. A key absent or null in a record (MFU on a CPU,
the commit age before the first commit) is not written for that step."""


class TensorBoardWriter:
    """Per-step scalars into an event file under `log_dir` (rank 0 only).

    The event file is flushed every `flush_every` steps and at `close()`, so a killed
    process loses at most that many steps of scalars; the JSONL metrics hold every step.
    """

    def __init__(self, log_dir: str, *, flush_every: int = 10) -> None:
        from torch.utils.tensorboard import SummaryWriter  # lazy: only runs that ask pay

        self.log_dir = log_dir
        self.flush_every = max(1, flush_every)
        self._writer: Any = SummaryWriter(log_dir=log_dir)
        self._n = 0

    def write(self, record: dict[str, Any]) -> None:
        if self._writer is None:
            return
        step, wall = int(record["step"]), record.get("time")
        for key, tag in TB_SCALARS.items():
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            self._writer.add_scalar(tag, float(value), step, walltime=wall)
        self._n += 1
        if self._n % self.flush_every == 0:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
