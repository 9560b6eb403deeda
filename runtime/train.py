"""The training loop:
``python -m relight.runtime.train --config configs/tiny.toml [--key=value ...]``.

Runs as a single process or under torchrun (one process per rank). `Trainer` composes
the parts of a run: the model, optimizer and data it builds itself; checkpoints through
its `runtime.checkpointing.RunCheckpoints` (where they live, when they are written, the
restore at start, the emergency save); replica groups through
`runtime.replicas.ReplicaTraining` (the quorum, the cross-group reduction, the heal);
metrics through `runtime.metrics.MetricsWriter`. Order of a run:

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
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from relight.exit_codes import (
    CONFIG_EXIT_CODE,
    NO_LOADABLE_CHECKPOINT_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    WATCHDOG_EXIT_CODE,
)
from relight.rank_log import RankStepLogger
from relight.runtime import state as st
from relight.runtime.checkpointing import RunCheckpoints, all_gather
from relight.runtime.config import Config, ConfigError, MixedPrecision, load_config
from relight.runtime.data import BatchPlan, DataLoader, Deal, MicroBatch, build_corpus
from relight.runtime.device import Device, bound_mesh_timeouts, init_process_group, resolve_device
from relight.runtime.evaluate import eval_loss
from relight.runtime.mesh import Layout, LayoutError, ParallelMesh, build_mesh, plan_layout
from relight.runtime.metrics import MetricsWriter, flops_per_token, memory_mb, peak_flops
from relight.runtime.model import Transformer
from relight.runtime.models import create_model, model_vocab_size
from relight.runtime.observability import (
    PrometheusConfig,
    PrometheusExporter,
    TensorBoardWriter,
    rdzv_round_from_env,
    restarts_from_env,
    start_prometheus,
)
from relight.runtime.optim import LRSchedule, build_optimizer, clip_grad_norm_, grad_norm
from relight.runtime.parallel.pp import build_pipeline
from relight.runtime.preemption import NoticeWatcher
from relight.runtime.watchdog import Watchdog

__all__ = ["PREEMPTED_EXIT_CODE", "TrainResult", "Trainer", "main", "run_training"]

log = logging.getLogger(__name__)


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


def _bytes_of(t: torch.Tensor) -> Any:
    """A tensor's bytes as a host array (for a checksum)."""
    return t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()


def _deal(cfg: Config, layout: Layout) -> Deal:
    """How the data ranks split the batch when their number does not divide it: whole
    micro-batches under pipelining (its schedules need equal chunks) and where the model
    adds a load-balance loss per micro-batch (exact only on the same micro-batches);
    otherwise by samples, which leaves the largest share the least work."""
    if layout.pp > 1:
        return Deal.PIPELINE
    if cfg.model.num_experts > 0 and cfg.model.aux_loss_coef > 0:
        return Deal.MICRO_BATCHES
    return Deal.SAMPLES


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
        self.log = RankStepLogger(log, self.rank, 0)
        self.layout = plan_layout(self.world, cfg)
        self.pmesh: ParallelMesh = build_mesh(self.layout, self.device.type)
        bound_mesh_timeouts(self.pmesh.meshes.values(), cfg.train.collective_timeout_s)
        # The registered model (built on the meta device, sharded, then materialised) or
        # the user's factory model (runtime.models).
        self.model: Transformer = create_model(cfg, self.pmesh, self.device)
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.param_names = [n for n, _ in named]
        """Each parameter's name: its identity across replica groups of any layout."""
        self.optimizer = build_optimizer(self.params, cfg.optim)
        self.lr = LRSchedule(cfg.optim.lr, cfg.optim.warmup_steps, cfg.train.steps,
                             cfg.optim.min_lr_ratio)
        self.plan = BatchPlan(
            global_batch=cfg.data.global_batch_size, micro_batch=cfg.data.micro_batch_size,
            dp=self.layout.dp, dp_rank=self.pmesh.dp_rank, deal=_deal(cfg, self.layout),
        )
        corpus = build_corpus(cfg.data, model_vocab=model_vocab_size(self.model, cfg),
                              model=cfg.model.factory or cfg.model.name)
        self.data = DataLoader(corpus, self.plan)
        self.step = 0
        self.replicas: Any = None
        """`runtime.replicas.ReplicaTraining` when replica groups are on (`replica.job`)."""
        if cfg.replica.enabled:
            from relight.runtime.replicas import ReplicaTraining

            self.replicas = ReplicaTraining(cfg.replica, self.plan, state=self.state_dict,
                                            load=self.load_state_dict,
                                            restore=lambda: self.checkpoints.restore())
        self._schedules: dict[tuple[int, float], Any] = {}
        self.schedule = self._pipeline(self.plan) if self.layout.pp > 1 else None
        self.pp_group = self.pmesh["pp"].get_group() if self.layout.pp > 1 else None
        # The rank that reports the loss for its data shard: last stage, first tp rank.
        self.reports_loss = (self.pmesh.pp_rank == self.layout.pp - 1
                             and self.pmesh.coord("tp") == 0)
        self.fsdp = isinstance(self.model, FSDPModule)
        self.autocast = (cfg.train.mixed_precision == MixedPrecision.BF16 and not self.fsdp)
        self.flops_per_token = flops_per_token(cfg.model, cfg.data.seq_len)
        self.peak = peak_flops(self.device, cfg.train.peak_tflops)
        self.on_grads: Callable[[Trainer], None] | None = None
        """Called after backward, before clipping, each step (tests inspect gradients)."""
        self.watcher: NoticeWatcher | None = None
        self.restarts = restarts_from_env()
        self.rdzv_round = rdzv_round_from_env()
        self.prometheus = self._start_prometheus()
        self.checkpoints = RunCheckpoints(
            cfg, rank=self.rank, world=self.world, device=self.device, layout=self.layout,
            log=self.log, optimizer=self.optimizer, state=self.state_dict,
            load=self.load_state_dict, step=lambda: self.step, prometheus=self.prometheus,
            rdzv_round=self.rdzv_round)
        """Where checkpoints live, when they are written, what is reported about them."""

    @property
    def ckpt_mgr(self) -> Any:
        """The run's `ckpt.CheckpointManager` (None without `checkpoint.url`)."""
        return self.checkpoints.manager

    @property
    def restored_step(self) -> int | None:
        return self.checkpoints.restored_step

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

    # ---- one step ------------------------------------------------------------------------

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _forward_backward(self, micro: list[tuple[torch.Tensor, torch.Tensor, MicroBatch]],
                          ) -> torch.Tensor:
        """Returns this rank's share of the step's mean loss, weighted like its gradients
        (`MicroBatch.divisor`): the mean over the ranks that compute it is the global
        batch's mean loss (0 on ranks that do not compute it)."""
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
        for i, (x, y, mb) in enumerate(micro):
            if self.fsdp:
                self.model.set_requires_gradient_sync(i == n - 1)
            self.model.set_aux_scale(0.0 if mb.divisor is None else 1.0 / mb.divisor)
            with self.dev.autocast(torch.bfloat16 if self.autocast else None):
                logits = self.model(x.to(self.device))
            loss = self._loss(logits, y.to(self.device))
            if mb.divisor is None:
                # Padding: its forward and backward keep FSDP's collectives paired with
                # the ranks that run more micro-batches; the gradients it adds are zeros.
                (loss * 0.0).backward()
                continue
            (loss / mb.divisor).backward()
            total += loss.detach().float() / mb.divisor
        return total

    def _group_loss(self, local_loss: torch.Tensor) -> torch.Tensor:
        """The group's mean loss over its reporting ranks, on every rank of the group: in
        a quorum of different layouts, ranks of different groups do not pair up, so the
        loss crosses groups as one value per group."""
        row = torch.tensor([float(local_loss) if self.reports_loss else 0.0,
                            float(self.reports_loss)], dtype=torch.float64,
                           device=self.device)
        rows = torch.empty(self.world * 2, dtype=torch.float64, device=self.device)
        all_gather(rows, row)
        rows = rows.view(self.world, 2).cpu()
        return torch.tensor([float(rows[:, 0].sum() / rows[:, 1].sum())],
                            dtype=local_loss.dtype, device=local_loss.device)

    def _state_digests(self) -> list[int]:
        """Every rank's crc32c of its parameter shards, in rank order (replica groups of
        the same layout hold equal lists after every committed step)."""
        from relight.storage.checksum import crc32c

        crc = 0
        for p in self.params:
            local = p.detach()
            local = local.to_local() if hasattr(local, "to_local") else local
            crc = crc32c(_bytes_of(local), crc)
        return self._every_rank(crc)

    def _params_digests(self) -> list[int]:
        """A digest of the whole parameters that does not depend on the layout: per
        parameter, the crc32c of its name seeded with the crc32c of its gathered whole
        tensor; summed over the parameters (order-free), and over the distinct values of
        the ranks (one per pipeline stage: the ranks of a stage hold the same whole
        parameters). Groups of different layouts compare by it. It gathers every
        parameter (a collective over each parameter's mesh)."""
        from relight.storage.checksum import crc32c

        total = 0
        for name, p in zip(self.param_names, self.params, strict=True):
            whole = p.detach()
            whole = whole.full_tensor() if hasattr(whole, "full_tensor") else whole
            total += crc32c(name.encode(), crc32c(_bytes_of(whole)))
        # Sums of 32-bit values over up to 2**20 parameters stay exact in float64.
        return [sum(set(self._every_rank(total)))]

    def _every_rank(self, value: int) -> list[int]:
        """`value` of every rank of this group, in rank order."""
        mine = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        every = torch.empty(self.world, dtype=torch.float64, device=self.device)
        all_gather(every, mine)
        return [int(v) for v in every.cpu().tolist()]

    def _pipeline(self, plan: BatchPlan) -> Any:
        """The pipeline schedule of `plan`'s micro-batches on this rank, built at its first
        use and kept: in replica groups the count follows the quorum's size, and a count
        seen before comes back with the groups that rejoin. Its micro-batches are whole
        ones (`Deal.PIPELINE`), all of one weight, which sets the load-balance loss's
        scale too."""
        micro = plan.micro_batches(0)
        divisor = micro[0].divisor
        assert divisor is not None, "pipelined plans deal whole micro-batches, no padding"
        key = (len(micro), divisor)
        if key not in self._schedules:
            self._schedules[key] = build_pipeline(
                self.model, self.pmesh["pp"], device=self.device, n_microbatches=len(micro),
                loss_fn=lambda out, tgt: self._loss(out, tgt) / divisor,
                schedule=self.cfg.parallel.pp_schedule,
            )
        self.model.set_aux_scale(1.0 / divisor)
        return self._schedules[key]

    def _replica_plan(self) -> None:
        """The step's quorum (a heal may set the state first) and this group's share of
        the global batch in it."""
        plan = self.replicas.begin_step()
        if plan != self.plan:
            self.plan = self.data.plan = plan
            if self.schedule is not None:
                self.schedule = self._pipeline(plan)

    def _warm_up(self) -> None:
        """One forward and backward on the next batch, thrown away, before a healing group
        asks to be taken in: a process's first step pays for lazy set-up (allocator,
        autograd, FSDP's lazy init, kernels' first calls), and the groups already training
        would wait that long for this one in its first cross-group reduction. Nothing
        stays: the data position is put back, the gradients dropped, the heal overwrites
        parameters and optimizer state, and every step reseeds the RNG."""
        t0 = time.perf_counter()
        position = self.data.position
        self._forward_backward(self.data.next_step())
        self.data.position = position
        self.optimizer.zero_grad(set_to_none=True)
        self.log.info("warm-up step before healing: %.2fs", time.perf_counter() - t0)

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
        norm = None
        if self.replicas is not None:
            # The loss rides in the gradients' cross-group sum, weighted like them: every
            # group then logs the job's global mean loss, not its own share's.
            local_loss = local_loss.detach().float().reshape(1).clone()
            if self.replicas.layouts_differ:
                local_loss = self._group_loss(local_loss)
            self.replicas.reduce(self.params, self.plan.share, names=self.param_names,
                                 extra=[local_loss])
            local_loss = local_loss[0]
            if self.replicas.layouts_differ:
                # Groups of different layouts sum the squares in different orders: the
                # clip must use one norm everywhere, or the replicas drift apart.
                norm = self.replicas.agree(grad_norm(self.params, self.pp_group))
            if not self.replicas.commit(self.step):
                self.optimizer.zero_grad(set_to_none=True)
                self.data.position = position
                return None
        if self.on_grads is not None:
            self.on_grads(self)
        norm = clip_grad_norm_(self.params, self.cfg.optim.grad_clip, self.pp_group,
                               total=norm)
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
        all_gather(rows, row)
        rows = rows.view(self.world, _ROW).cpu()
        loss = float(rows[:, 0].sum() / rows[:, 1].sum())
        noticed = [r for r in range(self.world) if rows[r, 3] > 0]
        return {"loss": loss, "lr": lr, "grad_norm": norm, "data_position": position,
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
            ck = self.checkpoints
            ck.open(healing=self.replicas is not None and self.replicas.healing)
            result.restored_step = ck.restored_step
            watchdog.beat(self.step)
            tokens = cfg.data.global_batch_size * cfg.data.seq_len
            if self.rank == 0:
                rnd = "" if self.rdzv_round is None else f", rendezvous round {self.rdzv_round}"
                self.log.info("layout %s on %d ranks, %d steps, %s; restart %d%s",
                              self.layout.describe(), self.world, cfg.train.steps,
                              self.plan.describe(), self.restarts, rnd)
            end = min(cfg.train.steps, cfg.train.stop_at or cfg.train.steps)
            self.watcher.phase = "training"
            first: dict[str, Any] = {"startup_s": _process_age_s(), "restore_s": ck.restore_s,
                                     "restore_started_at": ck.restore_started_at}
            if ck.restore_tier_bytes is not None:
                first["restore_tier_bytes"] = ck.restore_tier_bytes
            if self.replicas is not None and self.replicas.healing:
                self._warm_up()
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
                saves = self.replicas is None or self.replicas.saves_checkpoints
                sole = self.replicas is not None and self.replicas.sole_copy()
                stall, ok, saved = ((0.0, True, False) if preempt
                                    else ck.maybe_save(saves=saves, due=sole))
                ck.poll_save()
                result.checkpoint_failures += 0 if ok else 1
                self.log.step = self.step
                watchdog.beat(self.step)
                self.watcher.step_done(self.step, time.perf_counter() - t0)
                tps = tokens / step_time
                rec.update(
                    step=self.step, tokens_per_s=tps, step_time_s=step_time,
                    ckpt_stall_s=stall, mem_max_mb=max(rec["mem_per_rank_mb"]),
                    mfu=(tps * self.flops_per_token / (self.world * self.peak)
                         if self.peak else None),
                    world_size=self.world, layout=self.layout.describe(),
                    restored_step=ck.restored_step, time=time.time(), ckpt_saved=saved,
                    ckpt_age_s=ck.commit_age_s,
                    restarts=self.restarts,
                )
                if self.rdzv_round is not None:
                    rec["rdzv_round"] = self.rdzv_round
                if self.replicas is not None:
                    rec.update(self.replicas.record())
                    every = cfg.replica.digest_every
                    if every and self.step % every == 0:
                        rec["state_crc"] = self._state_digests()
                        if self.replicas.layouts_differ:
                            rec["params_crc"] = self._params_digests()
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
                    ck.emergency_checkpoint(left, result, self.watcher)
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
                ck.poll_save()
                # Failures of earlier async saves surface (and are counted by the manager)
                # when the next save waits for them.
                result.checkpoint_failures += (getattr(self.ckpt_mgr, "failed_saves", 0)
                                               + (0 if committed else 1))
                if self.step >= cfg.train.steps and not result.preempted:
                    ck.drop_local_tier()
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
        self.checkpoints.close()
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
    """CLI entry point; returns the process exit status (`relight.exit_codes`: 2 bad config
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
        from relight.ckpt import NoLoadableCheckpointError  # lazily, like the engine itself

        if not isinstance(e, NoLoadableCheckpointError):
            raise
        log.error("%s: %s", type(e).__name__, e)
        return NO_LOADABLE_CHECKPOINT_EXIT_CODE
    if result.checkpoint_failures:
        log.warning("run finished with %d failed checkpoint saves", result.checkpoint_failures)
    if result.preempted:
        RankStepLogger(log, result.rank, result.final_step).warning(
            "preempted (%s); exiting with status %d", result.emergency_note, PREEMPTED_EXIT_CODE)
        return PREEMPTED_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
