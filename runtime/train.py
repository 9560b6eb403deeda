"""The training loop: ``python -m runtime.train --config configs/tiny.toml [--key=value ...]``.

Runs as a single process or under torchrun (one process per rank). Order of a run:

1. init the process group (gloo on CPU, NCCL on CUDA; a 1-rank group when run alone),
2. plan the layout and build the mesh, build the full model with its deterministic init,
   parallelize it, build AdamW,
3. restore the newest committed checkpoint (when ``checkpoint.url`` is set),
4. per step: reseed from ``(seed, step)``, forward/backward every local micro-batch (or one
   pipeline schedule step), clip, optimizer step, metrics, maybe an async checkpoint,
5. wait for the last checkpoint to commit.

A watchdog thread exits the process with status 75 when no step completes in
``train.watchdog_timeout_s``.

What operators see: every log line of the trainer is prefixed ``[rank R step S]``; one line
per event that matters (restore from step S at layout L, save committed on rank 0 or failed,
fault detected, preemption); rank 0 writes the per-step metrics JSONL (``train.metrics_path``),
TensorBoard scalars (``train.tensorboard_dir``) and serves Prometheus
(``train.prometheus_port``). The first record of each process also holds ``startup_s``
(process start to the first step) and ``restore_s``, which ``relight plan --from-run`` reads.

Preemption (``[preemption]``, docs/preemption.md): every step's one small all-gather also
carries each rank's notice flag and grace left, so all ranks see a notice at the same step
boundary. They then finish that step, let the async save in flight commit, agree whether a
synchronous save of the step fits in the grace left, save and commit it (or say that the
newest committed checkpoint will be used), and exit with status 76
(``runtime.preemption.PREEMPTED_EXIT_CODE``).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from runtime import state as st
from runtime.config import Config, ConfigError, config_to_dict, load_config
from runtime.data import BatchPlan, DataLoader, build_corpus
from runtime.device import Device, bound_mesh_timeouts, init_process_group, resolve_device
from runtime.evaluate import eval_loss
from runtime.exit_codes import (
    CONFIG_EXIT_CODE,
    NO_LOADABLE_CHECKPOINT_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
)
from runtime.mesh import LayoutError, ParallelMesh, build_mesh, plan_layout
from runtime.metrics import MetricsWriter, flops_per_token, memory_mb, peak_flops
from runtime.model import Transformer
from runtime.models import create_model, model_vocab_size
from runtime.observability import (
    PrometheusConfig,
    PrometheusExporter,
    TensorBoardWriter,
    rdzv_round_from_env,
    restarts_from_env,
    start_prometheus,
)
from runtime.optim import LRSchedule, build_optimizer, clip_grad_norm_
from runtime.parallel.pp import build_pipeline
from runtime.preemption import NoticeWatcher, decide, estimate_save_s
from runtime.watchdog import Watchdog

__all__ = ["PREEMPTED_EXIT_CODE", "TrainResult", "Trainer", "main", "run_training"]

log = logging.getLogger(__name__)


class _RankStep(logging.LoggerAdapter):
    """Prefixes every message with ``[rank R step S]``."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        return f"[rank {self.extra['rank']} step {self.extra['step']}] {msg}", kwargs


@dataclass(slots=True)
class TrainResult:
    losses: list[float] = field(default_factory=list)
    """Mean loss of each step run by this process (same on every rank)."""
    final_step: int = 0
    restored_step: int | None = None
    layout: str = ""
    world_size: int = 1
    rank: int = 0
    checkpoint_failures: int = 0
    preempted: bool = False
    """The run stopped on a preemption notice before its last step (``main`` exits 76)."""
    notice_ranks: list[int] = field(default_factory=list)
    """Ranks that had a notice when the ranks agreed to stop."""
    emergency_step: int | None = None
    """Step of the emergency checkpoint committed on the notice (None: none written)."""
    emergency_save_s: float | None = None
    """Seconds the synchronous emergency save took on this rank."""
    emergency_wait_s: float | None = None
    """Seconds spent letting the async save in flight commit first."""
    emergency_note: str = ""
    """Why the emergency save was or was not written."""


def init_distributed(cfg: Config) -> tuple[Device, bool]:
    """Init the default process group unless one exists; returns (device, whether we own it).
    The device and its backend come from `runtime.device` (gloo on CPU, NCCL on CUDA)."""
    device = resolve_device(cfg.train.device)
    device.activate()
    if dist.is_initialized():
        return device, False
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        init_process_group(device, cfg.train.collective_timeout_s)
    else:
        init_process_group(device, cfg.train.collective_timeout_s, store=dist.HashStore(),
                           rank=0, world_size=1)
    return device, True


def _all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


_ROW = 5
"""Values per rank in the step's all-gather: loss, reports-loss, memory, notice, grace."""
_NO_DEADLINE = 1e18


def _process_age_s() -> float | None:
    """Seconds since this process started (imports, init, restore: all part of a restart)."""
    try:
        import psutil

        return max(0.0, time.time() - psutil.Process(os.getpid()).create_time())
    except Exception:  # noqa: BLE001 - a metric, never fatal
        return None


def _step_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63)


class Trainer:
    """Owns the model, optimizer, data and checkpoint manager of one run on this rank."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.dev, self._owns_pg = init_distributed(cfg)
        self.device = self.dev.torch
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.log = _RankStep(log, {"rank": self.rank, "step": 0})
        self.layout = plan_layout(self.world, cfg)
        self.pmesh: ParallelMesh = build_mesh(self.layout, self.device.type)
        bound_mesh_timeouts(self.pmesh.meshes.values(), cfg.train.collective_timeout_s)
        # The registered model (built on the meta device, sharded, then materialised) or
        # the user's factory model (runtime.models).
        self.model: Transformer = create_model(cfg, self.pmesh, self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.lr = LRSchedule(cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps,
                             cfg.optim.min_lr_ratio)
        self.plan = BatchPlan(
            global_batch=cfg.data.global_batch_size, micro_batch=cfg.data.micro_batch_size,
            dp=self.layout.dp, dp_rank=self.pmesh.dp_rank,
        )
        corpus = build_corpus(cfg.data, model_vocab=model_vocab_size(self.model, cfg),
                              model=cfg.model.factory or cfg.model.name)
        self.data = DataLoader(corpus, self.plan)
        self.step = 0
        self.replicas: Any = None
        """`runtime.replicas.ReplicaTraining` when replica groups are on (`replica.job`)."""
        if cfg.replica.enabled:
            from runtime.replicas import ReplicaTraining

            self.replicas = ReplicaTraining(cfg.replica, self.plan, state=self.state_dict,
                                            load=self.load_state_dict)
        n_micro = self.plan.local_microbatches
        self.model.set_aux_scale(1.0 / n_micro)
        self.schedule = None
        if self.layout.pp > 1:
            self.schedule = build_pipeline(
                self.model, self.pmesh["pp"], device=self.device, n_microbatches=n_micro,
                loss_fn=lambda out, tgt: self._loss(out, tgt) / n_micro,
                schedule=cfg.parallel.pp_schedule,
            )
        self.pp_group = self.pmesh["pp"].get_group() if self.layout.pp > 1 else None
        # The rank that reports the loss for its data shard: last stage, first tp rank.
        self.reports_loss = (self.pmesh.pp_rank == self.layout.pp - 1
                             and self.pmesh.coord("tp") == 0)
        self.fsdp = isinstance(self.model, FSDPModule)
        self.autocast = (cfg.train.mixed_precision == "bf16" and not self.fsdp)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_flops(self.device, cfg.train.peak_tflops)
        self.ckpt_mgr: Any = None
        self.restored_step: int | None = None
        self.on_grads: Callable[[Trainer], None] | None = None
        """Called after backward, before clipping, each step (tests inspect gradients)."""
        self.watcher: NoticeWatcher | None = None
        self.restarts = restarts_from_env()
        self.rdzv_round = rdzv_round_from_env()
        self.restore_s: float | None = None
        """Seconds the checkpoint restore took at start (None: nothing restored)."""
        self._peer_server: Any = None
        """This node's replica server (`storage.peer`), run by the node's first rank."""
        self.restore_started_at: float | None = None
        """Unix time the restore began (a checkpoint damaged after it may have been read
        intact); in the first metrics record after a restore."""
        self.restore_tier_bytes: dict[str, int] | None = None
        """Data bytes each checkpoint tier served to the restore, summed over the ranks
        (None without a local tier); in the first metrics record after a restore."""
        self.restore_io: dict[str, Any] | None = None
        """Bytes the restore read from the persistent store (all of them: data, manifests,
        markers) and, with a local tier, what each tier served."""
        self._pending: tuple[Any, float] | None = None
        """(handle, unix time the save began) of the save not yet seen finished."""
        self._last_commit_unix: float | None = None
        self._save_timings: list[tuple[int, float]] = []
        """(bytes written, seconds to commit) of this run's saves on this rank."""
        self.prometheus = self._start_prometheus()

    # ---- state ---------------------------------------------------------------------------

    def state_dict(self, *, with_optimizer: bool = True) -> dict[str, Any]:
        return st.build_state_dict(
            self.model, self.optimizer if with_optimizer else None,
            st.TrainState(step=self.step, data_position=self.data.position),
            lr_schedule=self.lr.state_dict(),
            rng={"kind": "reseed_per_step", "seed": self.cfg.train.seed},
            layout=self.layout.describe(),
        )

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ts = st.apply_state_dict(self.model, self.optimizer, sd)
        self.step = ts.step
        self.data.position = ts.data_position

    def _open_checkpoints(self) -> None:
        c = self.cfg.checkpoint
        if not c.url:
            return
        import ckpt  # the checkpoint engine; imported lazily so the runtime works without it

        self.ckpt_mgr = ckpt.CheckpointManager(
            self._checkpoint_store(), keep_last=c.keep_last, config=config_to_dict(self.cfg),
            layout=self.layout.as_dict(), busy=c.busy,
            options=ckpt.SaveOptions(pipelined_staging=c.pipelined_staging),
            # The runtime keeps training through failed saves (a storage outage must not
            # stop the job; the chaos invariant): it logs each one, counts it in the
            # metrics, and the next committed save recovers. A user's script gets the
            # default policy instead, which stops after three failures in a row.
            on_failures=ckpt.SaveFailurePolicy(max_consecutive=None),
        )
        if c.pipelined_staging:  # the snapshot copy may still read the state: guard updates
            ckpt.guard_optimizer(self.optimizer)
        if not c.resume:
            return
        if self.replicas is not None and self.replicas.healing:
            self.log.info("replica groups are training: this group's state comes from a "
                          "live group's memory, nothing is read from %s", c.url)
            return
        if self.ckpt_mgr.latest_step() is None:
            self.log.info("no committed checkpoint under %s; starting from scratch", c.url)
            return
        sd = self.state_dict(with_optimizer=True)
        read0 = self.ckpt_mgr.store.stats.snapshot()["bytes_read"]
        t0 = time.perf_counter()
        self.restore_started_at = time.time()
        # step=None: the newest committed step that loads cleanly (older ones if damaged).
        restored = self.ckpt_mgr.restore(sd, step=c.restore_step or None)
        self.load_state_dict(sd)
        if self.step != restored:
            raise st.StateError(
                f"checkpoint step {restored} under {c.url} holds train/step={self.step}"
            )
        self.restored_step = restored
        self.restore_s = time.perf_counter() - t0
        self.log.extra["step"] = self.step
        rnd = "" if self.rdzv_round is None else f", rendezvous round {self.rdzv_round}"
        self.log.info("restore from step %d at layout %s (saved at layout %s) from %s in "
                      "%.2f s%s", restored, self.layout.describe(), sd[st.TRAIN].get("layout"),
                      c.url, self.restore_s, rnd)
        tiers = self.tier_stats()
        self.restore_io = {"persistent_bytes_read":
                           self.ckpt_mgr.store.stats.snapshot()["bytes_read"] - read0,
                           "tiers": tiers}
        if tiers is not None:
            self.log.info("restore served %s bytes per tier (local tier misses: %s)",
                          tiers["served"], tiers["misses"] or "none")
            from ckpt.comm import Comm

            # Every rank's figures, summed: what the metrics (and the chaos verifier) see.
            self.restore_tier_bytes = {}
            for served in Comm(None).allgather_json(tiers["served"]):
                for tier, n in served.items():
                    self.restore_tier_bytes[tier] = self.restore_tier_bytes.get(tier, 0) + n
        if self.rank == 0:
            self._note_restored_commit(restored)

    def _checkpoint_store(self) -> Any:
        """The checkpoint root: the persistent store, fronted by the node-local tier when
        ``checkpoint.local_tier_dir`` is set (its budget split over this host's ranks)."""
        from storage import open_store

        c = self.cfg.checkpoint
        store = open_store(c.url)
        if not c.local_tier_dir:
            return store
        from ckpt.comm import Comm
        from storage.tiered import TieredStore, local_tier_dir, tier_node

        comm = Comm(None)
        node = tier_node(c.local_tier_node)
        # With peers, rank 0 draws the token the replica servers will ask for; it rides
        # on the gather of node names.
        token = secrets.token_hex(32) if self.rank == 0 and c.peer_replicas > 0 else None
        gathered = comm.allgather_json([node, token])
        nodes = [n for n, _ in gathered]
        budget = c.local_tier_budget_mb * (1 << 20) // nodes.count(node)
        tiered = TieredStore(store, local_tier_dir(c.local_tier_dir, store.url, node), budget,
                             writer=self.rank)
        self.log.info("local tier %s, %d MiB for this rank", tiered.local_dir, budget >> 20)
        if c.peer_replicas > 0:
            self._attach_peers(tiered, comm, node, nodes, gathered[0][1])
        return tiered

    def _attach_peers(self, tiered: Any, comm: Any, node: str, nodes: list[str],
                      token: str) -> None:
        """The node's first rank serves the node's replicas (`storage.peer`); every rank
        learns the servers' addresses (one all-gather here, on the main thread) and copies
        to the next `peer_replicas` nodes in name order. The servers answer only requests
        carrying `token` (rank 0's secret, shared with every rank)."""
        from storage.peer import PeerServer
        from storage.tiered import REPLICA_DIR

        if nodes.index(node) == self.rank:
            # Each of the k nodes pushing here holds at most local_tier_budget_mb: the
            # node's memory stays within (1 + k) x the budget (docs/tiers.md).
            c = self.cfg.checkpoint
            self._peer_server = PeerServer(
                os.path.join(tiered.local_dir, REPLICA_DIR), host=c.peer_host or "0.0.0.0",
                toward=os.environ.get("MASTER_ADDR"), also_serve=(tiered.local_dir,),
                budget_bytes=c.peer_replicas * c.local_tier_budget_mb * (1 << 20),
                token=token)
        mine = self._peer_server.address if self._peer_server is not None else None
        addrs = {n: a for n, a in comm.allgather_json([node, mine]) if a is not None}
        ring = sorted(addrs)
        others = [ring[(ring.index(node) + i) % len(ring)] for i in range(1, len(ring))]
        push_to = [addrs[n] for n in others[:self.cfg.checkpoint.peer_replicas]]
        tiered.attach_peers(push_to, [addrs[n] for n in others], token)
        self.log.info("peer tier: replicas to %s, %d peer(s) to fetch from",
                      others[:self.cfg.checkpoint.peer_replicas] or "no other node",
                      len(others))

    def _drop_local_tier(self) -> None:
        """The run is complete: free the node memory its local tier holds (after every
        rank has flushed its copies, so none lands after the delete)."""
        store = self.ckpt_mgr.store
        if not hasattr(store, "drop_local"):
            return
        store.flush()
        dist.barrier()
        store.drop_local()
        self.log.info("run complete: dropped the local tier %s", store.local_dir)

    def tier_stats(self) -> dict[str, Any] | None:
        """What each checkpoint tier served (None without a local tier)."""
        store = getattr(self.ckpt_mgr, "store", None)
        stats = getattr(store, "tier_stats", None)
        return None if stats is None else stats.snapshot()

    def _note_restored_commit(self, step: int) -> None:
        """The restored checkpoint is the newest commit until this run commits one."""
        from ckpt.manager import list_records

        try:
            rec = list_records(self.ckpt_mgr.store).get(step)
        except Exception:  # noqa: BLE001 - only the commit-age metric depends on it
            self.log.warning("could not read the commit record of step %d", step)
            return
        if rec is not None and rec.created > 0:
            self._last_commit_unix = rec.created
            if self.prometheus is not None:
                self.prometheus.set_last_commit(step, rec.created)

    def _maybe_save(self) -> tuple[float, bool, bool]:
        """Start this step's checkpoint when one is due: (stall seconds, ok, whether due)."""
        c = self.cfg.checkpoint
        last = self.step in (self.cfg.train.steps, self.cfg.train.stop_at)
        if self.ckpt_mgr is None or (self.step % c.every and not last):
            return 0.0, True, False
        if self.replicas is not None and not self.replicas.saves_checkpoints:
            return 0.0, True, False  # the replicas hold the same state: one group writes it
        t0, began = time.perf_counter(), time.time()
        try:
            handle = self.ckpt_mgr.save(self.step, self.state_dict(), async_save=c.async_save,
                                        busy="wait" if last else None)
        except Exception:  # a failed save must not stop training; older checkpoints remain
            self.log.exception("checkpoint save of step %d failed; training continues and "
                               "older checkpoints are untouched", self.step)
            self._poll_save()
            return time.perf_counter() - t0, False, True
        self._poll_save()  # the manager waited for the previous save: report it first
        if handle is None:  # skipped by the manager's busy="skip" policy: nothing started
            return time.perf_counter() - t0, True, False
        self._pending = (handle, began)
        return time.perf_counter() - t0, True, True

    def _poll_save(self) -> None:
        """Report the save in flight once it has finished: one log line (committed on rank 0,
        failed on every rank), the commit age, Prometheus, the timings preemption uses."""
        if self._pending is None or not self._pending[0].done():
            return
        (h, began), self._pending = self._pending, None
        if h.error is not None:
            if self.prometheus is not None:
                self.prometheus.record_save_failure()
            self.log.error("checkpoint save of step %s failed: %s: %s; training continues "
                           "and older checkpoints are untouched", h.step,
                           type(h.error).__name__, h.error)
            return
        committed = min(time.time(), began + float(h.total_s))
        self._last_commit_unix = committed
        if h.total_s > 0:
            self._save_timings.append((int(h.bytes_written), float(h.total_s)))
        if self.prometheus is not None:
            self.prometheus.record_commit(h.step, int(h.bytes_written), float(h.total_s),
                                          committed_unix=committed)
        if self.rank == 0:
            self.log.info("checkpoint step %s committed: %.1f MiB from this rank, %.2f s from "
                          "start to commit (training stalled %.3f s)", h.step,
                          h.bytes_written / 2**20, h.total_s, h.stall_s)

    def _start_prometheus(self) -> PrometheusExporter | None:
        """Rank 0's metrics endpoint, when configured. A port that cannot be bound is
        logged, not fatal: observability must never stop a healthy run."""
        try:
            exporter = start_prometheus(PrometheusConfig(port=self.cfg.train.prometheus_port,
                                                         host=self.cfg.train.prometheus_host),
                                        self.rank)
        except OSError:
            self.log.exception("Prometheus endpoint not started; training continues")
            return None
        if exporter is not None:
            exporter.set_world_size(self.world)
            exporter.set_restarts(self.restarts)
            if self.rdzv_round is not None:
                exporter.set_rendezvous_round(self.rdzv_round)
        return exporter

    def _start_tensorboard(self) -> TensorBoardWriter | None:
        """Rank 0's TensorBoard writer, when configured; a failure is logged, not fatal."""
        path = self.cfg.train.tensorboard_dir
        if self.rank != 0 or not path:
            return None
        try:
            return TensorBoardWriter(path, flush_every=self.cfg.train.log_every)
        except Exception:  # noqa: BLE001 - observability must never stop a healthy run
            self.log.exception("TensorBoard writer not started at %s; training continues", path)
            return None

    # ---- preemption ----------------------------------------------------------------------

    def _notice_row(self) -> tuple[float, float]:
        """(1.0 if this rank has a notice, seconds of grace left) for the step's gather."""
        w = self.watcher
        if w is None:
            return 0.0, _NO_DEADLINE
        w.check()
        if not w.board.pending:
            return 0.0, _NO_DEADLINE
        return 1.0, w.board.deadline_unix() - time.time()

    def _local_state_bytes(self, sd: dict[str, Any]) -> int:
        total = 0

        def walk(v: Any) -> None:
            nonlocal total
            if isinstance(v, dict):
                for x in v.values():
                    walk(x)
            elif isinstance(v, list | tuple):
                for x in v:
                    walk(x)
            elif isinstance(v, torch.Tensor):
                t = v.to_local() if hasattr(v, "to_local") else v
                total += t.numel() * t.element_size()

        walk(sd)
        return total

    def _fallback_note(self, mgr: Any) -> str:
        latest = mgr.latest_step()
        if latest is None:
            return (f"no committed checkpoint exists: the resume starts from scratch "
                    f"({self.step} steps lost)")
        return (f"the resume will use the newest committed checkpoint, step {latest} "
                f"({self.step - latest} steps lost)")

    def emergency_checkpoint(self, remaining_s: float, result: TrainResult) -> None:
        """Every rank, at the same step boundary after the ranks agreed on a notice: let the
        async save in flight commit, agree whether a synchronous save of this step fits in
        the grace left, and write it (a collective save; it commits before returning)."""
        pcfg = self.cfg.preemption
        if self.watcher is not None:
            self.watcher.phase = "emergency"
        deadline = time.monotonic() + remaining_s
        mgr = self.ckpt_mgr
        if mgr is None:
            result.emergency_note = "checkpoint.url is not set: nothing to save"
            self.log.warning("preemption: %s", result.emergency_note)
            return
        t0 = time.perf_counter()
        try:
            mgr.wait()  # the async save in flight commits first (or fails on its own)
        except Exception:
            self.log.exception("preemption: the checkpoint in flight failed; the emergency "
                               "save goes on")
        result.emergency_wait_s = time.perf_counter() - t0
        self._poll_save()
        sd = self.state_dict()
        nbytes = self._local_state_bytes(sd)
        est = estimate_save_s(nbytes, self._save_timings, pcfg.assumed_write_mb_s)
        # The go / no-go must be the same on every rank: decide from gathered values.
        mine = torch.tensor([est, deadline - time.monotonic()], dtype=torch.float64,
                            device=self.device)
        both = torch.empty(self.world * 2, dtype=torch.float64, device=self.device)
        _all_gather(both, mine)
        both = both.view(self.world, 2).cpu()
        decision = decide(both[:, 0].tolist(), both[:, 1].tolist(),
                          safety_factor=pcfg.safety_factor, margin_s=pcfg.save_margin_s)
        if not decision.save:
            result.emergency_note = (f"{decision.reason}: skipping the emergency save; "
                                     + self._fallback_note(mgr))
            self.log.warning("preemption: %s", result.emergency_note)
            return
        self.log.info("preemption: emergency save of step %d starts (%.1f MiB on this rank; "
                      "%s)", self.step, nbytes / 2**20, decision.reason)
        t0 = time.perf_counter()
        try:
            mgr.save(self.step, sd, async_save=False, busy="wait")
            mgr.wait()
        except Exception as e:
            result.emergency_note = (f"emergency save failed ({type(e).__name__}: {e}); "
                                     + self._fallback_note(mgr))
            self.log.exception("preemption: %s", result.emergency_note)
            return
        result.emergency_save_s = time.perf_counter() - t0
        result.emergency_step = self.step
        result.emergency_note = (f"committed step {self.step}: {nbytes / 2**20:.1f} MiB on "
                                 f"this rank in {result.emergency_save_s:.2f} s "
                                 f"(estimated {est:.2f} s)")
        self.log.info("preemption: emergency checkpoint %s", result.emergency_note)

    # ---- one step ------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Returns this rank's mean micro-batch loss (0 on ranks that do not compute it)."""
        n = len(micro)
        if self.schedule is not None:
            x = torch.cat([m[0] for m in micro]).to(self.device)
            y = torch.cat([m[1] for m in micro]).to(self.device)
            first = self.pmesh.pp_rank == 0
            last = self.pmesh.pp_rank == self.layout.pp - 1
            losses: list[torch.Tensor] = []
            args = (x,) if first else ()
            self.schedule.step(*args, target=y if last else None, losses=losses if last else None)
            if last:
                return torch.stack([t.detach().float() for t in losses]).sum()
            return torch.zeros((), device=self.device)
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == n - 1)
            with self.dev.autocast(torch.bfloat16 if self.autocast else None):
                logits = self.model(x.to(self.device))
            loss = self._loss(logits, y.to(self.device))
            (loss / n).backward()
            total += loss.detach().float() / n
        return total

    def _state_digests(self) -> list[int]:
        """Every rank's crc32c of its parameter shards, in rank order (replica groups of
        the same layout hold equal lists after every committed step)."""
        from storage.checksum import crc32c

        crc = 0
        for p in self.params:
            local = p.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            crc = crc32c(local.contiguous().cpu().reshape(-1).view(torch.uint8).numpy(), crc)
        mine = torch.tensor([float(crc)], dtype=torch.float64, device=self.device)
        every = torch.empty(self.world, dtype=torch.float64, device=self.device)
        _all_gather(every, mine)
        return [int(v) for v in every.cpu().tolist()]

    def _replica_plan(self) -> None:
        """Agree on the step's quorum (a heal may set the state first) and take this
        group's share of the global batch in it."""
        plan = self.replicas.begin_step()
        if plan != self.plan:
            self.plan = self.data.plan = plan
            self.model.set_aux_scale(1.0 / plan.local_microbatches)

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step; None when replica groups abandoned it (a member of the
        quorum failed): nothing was applied, and the same samples are redone."""
        if self.replicas is not None:
            self._replica_plan()
        torch.manual_seed(_step_seed(self.cfg.train.seed, self.step))
        lr = self.lr(self.step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        position = self.data.position
        micro = self.data.next_step()
        local_loss = self._forward_backward(micro)
        if self.replicas is not None:
            # The loss rides in the gradients' cross-group sum, weighted like them: every
            # group then logs the job's global mean loss, not its own share's.
            local_loss = local_loss.detach().float().reshape(1).clone()
            self.replicas.reduce(self.params, self.plan.share, extra=[local_loss])
            local_loss = local_loss[0]
            if not self.replicas.commit(self.step):
                self.optimizer.zero_grad(set_to_none=True)
                self.data.position = position
                return None
        if self.on_grads is not None:
            self.on_grads(self)
        grad_norm = clip_grad_norm_(self.params, self.cfg.optim.grad_clip, self.pp_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        # One small all-gather gives the loss, every rank's memory and every rank's
        # preemption notice (flag, grace left): all ranks see a notice at the same step.
        mem = memory_mb(self.device)
        flag, left = self._notice_row()
        row = torch.tensor(
            [float(local_loss) if self.reports_loss else 0.0, float(self.reports_loss), mem,
             flag, left],
            dtype=torch.float64, device=self.device,
        )
        rows = torch.empty(self.world * _ROW, dtype=torch.float64, device=self.device)
        _all_gather(rows, row)
        rows = rows.view(self.world, _ROW).cpu()
        loss = float(rows[:, 0].sum() / rows[:, 1].sum())
        noticed = [r for r in range(self.world) if rows[r, 3] > 0]
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "data_position": position,
                "mem_per_rank_mb": [round(float(v), 1) for v in rows[:, 2]],
                "_notice_ranks": noticed,
                "_notice_left_s": float(rows[noticed, 4].min()) if noticed else None}

    def evaluate(self) -> float | None:
        """Mean loss on the first ``data.eval_samples`` held-out samples (every rank calls
        it; None under pipeline parallelism, where it is not computed)."""
        if self.schedule is not None:
            return None
        with self.dev.autocast(torch.bfloat16 if self.autocast else None):
            return eval_loss(self.model, self.data.corpus, n=self.cfg.data.eval_samples,
                             micro_batch=self.plan.micro_batch, dp=self.layout.dp,
                             dp_rank=self.pmesh.dp_rank, reports=self.reports_loss,
                             device=self.device)

    # ---- the loop ------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.cfg
        result = TrainResult(layout=self.layout.describe(), world_size=self.world,
                             rank=self.rank)
        metrics = MetricsWriter(cfg.train.metrics_path, enabled=self.rank == 0,
                                log_every=cfg.train.log_every)
        tb = self._start_tensorboard()
        watchdog = Watchdog(cfg.train.watchdog_timeout_s, rank=self.rank).start()
        self.watcher = NoticeWatcher(cfg.preemption, rank=self.rank).start()
        try:
            self._open_checkpoints()
            result.restored_step = self.restored_step
            watchdog.beat(self.step)
            tokens = cfg.data.global_batch_size * cfg.data.seq_len
            if self.rank == 0:
                rnd = "" if self.rdzv_round is None else f", rendezvous round {self.rdzv_round}"
                self.log.info("layout %s on %d ranks, %d steps, %d micro-batches per rank; "
                              "restart %d%s", self.layout.describe(), self.world,
                              cfg.train.steps, self.plan.local_microbatches, self.restarts, rnd)
            end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
            self.watcher.phase = "training"
            first: dict[str, Any] = {"startup_s": _process_age_s(), "restore_s": self.restore_s,
                                     "restore_started_at": self.restore_started_at}
            if self.restore_tier_bytes is not None:
                first["restore_tier_bytes"] = self.restore_tier_bytes
            while self.step < end:
                t0 = time.perf_counter()
                rec = self.train_step()
                if rec is None:  # abandoned by the replica groups: redo it
                    watchdog.beat(self.step)
                    continue
                self.dev.synchronize()
                step_time = time.perf_counter() - t0
                noticed, left = rec.pop("_notice_ranks"), rec.pop("_notice_left_s")
                preempt = bool(noticed) and self.step < end
                stall, ok, saved = (0.0, True, False) if preempt else self._maybe_save()
                self._poll_save()
                result.checkpoint_failures += 0 if ok else 1
                self.log.extra["step"] = self.step
                watchdog.beat(self.step)
                self.watcher.step_done(self.step, time.perf_counter() - t0)
                tps = tokens / step_time
                rec.update(
                    step=self.step, tokens_per_s=tps, step_time_s=step_time,
                    ckpt_stall_s=stall, mem_max_mb=max(rec["mem_per_rank_mb"]),
                    mfu=(tps * self.flops_per_token / (self.world * self.peak)
                         if self.peak else None),
                    world_size=self.world, layout=self.layout.describe(),
                    restored_step=self.restored_step, time=time.time(), ckpt_saved=saved,
                    ckpt_age_s=(None if self._last_commit_unix is None
                                else max(0.0, time.time() - self._last_commit_unix)),
                    restarts=self.restarts,
                )
                if self.rdzv_round is not None:
                    rec["rdzv_round"] = self.rdzv_round
                if self.replicas is not None:
                    rec.update(self.replicas.record())
                    every = cfg.replica.digest_every
                    if every and self.step % every == 0:
                        rec["state_crc"] = self._state_digests()
                every = cfg.data.eval_every
                if every and (self.step % every == 0 or self.step == end):
                    rec["eval_loss"] = self.evaluate()
                    if self.rank == 0 and rec["eval_loss"] is not None:
                        self.log.info("eval loss %.4f (%d held-out samples)", rec["eval_loss"],
                                      cfg.data.eval_samples)
                rec.update(first)
                first = {}
                if noticed:
                    rec["preempt_notice_ranks"] = noticed
                metrics.write(rec, cfg.train.steps)
                if tb is not None:
                    tb.write(rec)
                result.losses.append(rec["loss"])
                if noticed and not preempt:
                    self.log.warning("preemption notice on ranks %s at the last step: the "
                                     "run finishes normally", noticed)
                if preempt:
                    self.log.warning("preemption notice on ranks %s: stopping after step %d "
                                     "(%.1f s of grace left)", noticed, self.step, left)
                    result.preempted, result.notice_ranks = True, noticed
                    if self.replicas is not None and not self.replicas.alone:
                        self.log.warning("this replica group leaves; the other groups hold "
                                         "the state and train on (no emergency save)")
                        break
                    self.emergency_checkpoint(left, result)
                    watchdog.beat(self.step)
                    break
            self.watcher.phase = "done"
            if self.ckpt_mgr is not None:
                committed = True
                try:
                    self.ckpt_mgr.wait()
                except Exception:
                    self.log.exception("the last checkpoint did not commit")
                    committed = False
                self._poll_save()
                # Failures of earlier async saves surface (and are counted by the manager)
                # when the next save waits for them.
                result.checkpoint_failures += (getattr(self.ckpt_mgr, "failed_saves", 0)
                                               + (0 if committed else 1))
                if self.step >= cfg.train.steps and not result.preempted:
                    self._drop_local_tier()
        except Exception as e:
            # A dead peer, a timed-out collective, a failed restore: this rank exits non-zero
            # and the agent re-forms the group; say so once, with rank and step.
            self.log.error("fault detected: %s: %s; exiting so the agent restarts the group",
                           type(e).__name__, e)
            raise
        finally:
            watchdog.stop()
            self.watcher.stop(restore_signals=not result.preempted)
            metrics.close()
            if tb is not None:
                tb.close()
        result.final_step = self.step
        return result

    def close(self) -> None:
        if self.replicas is not None:
            self.replicas.close()
            self.replicas = None
        if self._peer_server is not None:
            self._peer_server.close()
            self._peer_server = None
        if self.prometheus is not None:
            self.prometheus.close()
            self.prometheus = None
        if self._owns_pg and dist.is_initialized():
            dist.destroy_process_group()


def run_training(cfg: Config) -> TrainResult:
    """Train per ``cfg`` on this process's rank (inits and tears down the process group if
    none exists)."""
    preexisting = dist.is_initialized()
    try:
        trainer = Trainer(cfg)
    except BaseException:
        if dist.is_initialized() and not preexisting:
            dist.destroy_process_group()
        raise
    try:
        return trainer.run()
    finally:
        trainer.close()


def _parse(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(
        prog="relight train",
        description="Train the Relight transformer. Extra --section.key=value override config.",
        epilog="exit status: 0 done; 1 an error (a fault: the agent restarts the group); "
        f"{CONFIG_EXIT_CODE} bad config or layout; {NO_LOADABLE_CHECKPOINT_EXIT_CODE} every "
        "committed checkpoint is damaged (relight run does not restart these two); "
        f"{WATCHDOG_EXIT_CODE} the watchdog saw no step complete in "
        f"train.watchdog_timeout_s; {PREEMPTED_EXIT_CODE} stopped on a preemption notice "
        "(docs/troubleshooting.md)",
    )
    parser.add_argument("--config", help="TOML config file (defaults if omitted)")
    args, overrides = parser.parse_known_args(argv)
    return load_config(args.config, overrides)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the process exit status (`runtime.exit_codes`: 2 bad config
    or layout, 65 no committed checkpoint loads, 76 stopped on a preemption notice; the
    watchdog exits with 75 on a hang)."""
    logging.basicConfig(
        level=os.environ.get("RELIGHT_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = _parse(sys.argv[1:] if argv is None else argv)
        result = run_training(cfg)
    except (ConfigError, LayoutError) as e:
        log.error("%s: %s", type(e).__name__, e)
        return CONFIG_EXIT_CODE
    except Exception as e:
        from ckpt.errors import NoLoadableCheckpointError  # lazily, like the engine itself

        if not isinstance(e, NoLoadableCheckpointError):
            raise
        log.error("%s: %s", type(e).__name__, e)
        return NO_LOADABLE_CHECKPOINT_EXIT_CODE
    if result.checkpoint_failures:
        log.warning("run finished with %d failed checkpoint saves", result.checkpoint_failures)
    if result.preempted:
        log.warning("[rank %d step %d] preempted (%s); exiting with status %d", result.rank,
                    result.final_step, result.emergency_note, PREEMPTED_EXIT_CODE)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
