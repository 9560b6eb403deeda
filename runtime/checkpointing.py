"""The trainer's checkpoint component: where checkpoints live, when they are written, and
what is reported about them.

`RunCheckpoints` opens the checkpoint root (the persistent store, fronted by the node-local
tier and its peers when configured), restores the newest committed step at start,
starts a save when one is due (`checkpoint.every`, and the last step), reports each
save once it finished (log line, commit age, Prometheus, the timings the preemption
decision uses), writes the emergency checkpoint on a preemption notice, and frees the
node's tier when the run is complete. The trainer hands it its state through callables:
it never reaches into the model or the optimizer itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from relight.runtime import state as st
from relight.runtime.config import Config, config_to_dict
from relight.runtime.mesh import Layout
from relight.runtime.observability import PrometheusExporter
from relight.runtime.preemption import NoticeWatcher, decide, estimate_save_s

__all__ = ["RunCheckpoints", "all_gather"]


def all_gather(out: torch.Tensor, inp: torch.Tensor) -> None:
    """Every rank's `inp` into `out` on every rank (default group)."""
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp)


class RunCheckpoints:
    """Checkpoints of one run on this rank (see the module docstring).

    Call order: `open()` once (it may restore), then per step `maybe_save()` and
    `poll_save()`, `emergency_checkpoint()` on a notice, `wait()` at the end and
    `drop_local_tier()` when the run is complete.
    """

    def __init__(self, cfg: Config, *, rank: int, world: int, device: torch.device,
                 layout: Layout, log: Any, optimizer: torch.optim.Optimizer,
                 state: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None],
                 step: Callable[[], int], prometheus: PrometheusExporter | None,
                 rdzv_round: int | None) -> None:
        """`state()` builds the state dict to save or restore into, `load(sd)` applies a
        restored one, `step()` is the trainer's current step."""
        self.cfg = cfg
        self.rank, self.world, self.device, self.layout = rank, world, device, layout
        self.log = log
        self.prometheus = prometheus
        self.rdzv_round = rdzv_round
        self._optimizer = optimizer
        self._state, self._load, self._step = state, load, step
        self.manager: Any = None
        """`ckpt.CheckpointManager` once opened (None without `checkpoint.url`)."""
        self.restored_step: int | None = None
        self.restore_s: float | None = None
        """Seconds the checkpoint restore took at start (None: nothing restored)."""
        self.restore_started_at: float | None = None
        """Unix time the restore began (a checkpoint damaged after it may have been read
        intact); in the first metrics record after a restore."""
        self.restore_tier_bytes: dict[str, int] | None = None
        """Data bytes each checkpoint tier served to the restore, summed over the ranks
        (None without a local tier); in the first metrics record after a restore."""
        self.restore_io: dict[str, Any] | None = None
        """Bytes the restore read from the persistent store (all of them: data, manifests,
        markers) and, with a local tier, what each tier served."""
        self.root: Any = None
        """`ckpt.CheckpointRoot` once opened: the store stack, the tiers when configured
        (None without `checkpoint.url`)."""
        self._pending: tuple[Any, float] | None = None
        """(handle, unix time the save began) of the save not yet seen finished."""
        self.last_commit_unix: float | None = None
        self._save_timings: list[tuple[int, float]] = []
        """(bytes written, seconds to commit) of this run's saves on this rank."""

    def close(self) -> None:
        """Stop this node's replica server, if this rank runs it."""
        if self.root is not None:
            self.root.close()

    @property
    def commit_age_s(self) -> float | None:
        """Seconds since the newest commit this run knows of (None: none yet)."""
        if self.last_commit_unix is None:
            return None
        return max(0.0, time.time() - self.last_commit_unix)

    def open(self, *, healing: bool = False) -> None:
        """Open the checkpoint root and restore the newest committed step that loads
        (unless `checkpoint.resume` is off, or `healing`: a replica group that receives
        its state from a live group reads nothing from storage)."""
        c = self.cfg.checkpoint
        if not c.url:
            return
        from relight import (
            ckpt,  # the checkpoint engine; imported lazily so the runtime works without it
        )

        self.root = ckpt.open_checkpoint_root(c.url, self._tier_options())
        self.manager = ckpt.CheckpointManager(
            self.root.store, keep_last=c.keep_last, config=config_to_dict(self.cfg),
            layout=self.layout.as_dict(), busy=c.busy,
            options=ckpt.SaveOptions(pipelined_staging=c.pipelined_staging),
            # The runtime keeps training through failed saves (a storage outage must not
            # stop the job; the chaos invariant): it logs each one, counts it in the
            # metrics, and the next committed save recovers. A user's script gets the
            # default policy instead, which stops after three failures in a row.
            on_failures=ckpt.SaveFailurePolicy(max_consecutive=None),
        )
        if c.pipelined_staging:  # the snapshot copy may still read the state: guard updates
            ckpt.guard_optimizer(self._optimizer)
        if not c.resume:
            return
        if healing:
            self.log.info("replica groups are training: this group's state comes from a "
                          "live group's memory, nothing is read from %s", c.url)
            return
        self.restore()

    def restore(self) -> None:
        """Restore the newest committed step that loads (nothing when there is none: the
        state stays at step 0). `open()` calls it; so does a replica group that was to
        heal when every group holding the state is gone."""
        c = self.cfg.checkpoint
        if self.manager is None or not c.resume:
            return
        if self.manager.latest_step() is None:
            self.log.info("no committed checkpoint under %s; starting from scratch", c.url)
            return
        sd = self._state()
        read0 = self.manager.store.stats.snapshot()["bytes_read"]
        t0 = time.perf_counter()
        self.restore_started_at = time.time()
        # step=None: the newest committed step that loads cleanly (older ones if damaged).
        restored = self.manager.restore(sd, step=c.restore_step or None)
        self._load(sd)
        if self._step() != restored:
            raise st.StateError(
                f"checkpoint step {restored} under {c.url} holds train/step={self._step()}"
            )
        self.restored_step = restored
        self.restore_s = time.perf_counter() - t0
        self.log.extra["step"] = self._step()
        rnd = "" if self.rdzv_round is None else f", rendezvous round {self.rdzv_round}"
        self.log.info("restore from step %d at layout %s (saved at layout %s) from %s in "
                      "%.2f s%s", restored, self.layout.describe(), sd[st.TRAIN].get("layout"),
                      c.url, self.restore_s, rnd)
        tiers = self.tier_stats()
        self.restore_io = {"persistent_bytes_read":
                           self.manager.store.stats.snapshot()["bytes_read"] - read0,
                           "tiers": tiers}
        if tiers is not None:
            self.log.info("restore served %s bytes per tier (local tier misses: %s)",
                          tiers["served"], tiers["misses"] or "none")
            # Every rank's figures, summed: what the metrics (and the chaos verifier) see.
            assert self.root is not None
            self.restore_tier_bytes = self.root.served_by_every_rank(
                timeout_s=self.cfg.train.collective_timeout_s)
        if self.rank == 0:
            self._note_restored_commit(restored)

    def _tier_options(self) -> Any:
        """The node-local tier and its peers (`ckpt.TierOptions`), when
        ``checkpoint.local_tier_dir`` is set."""
        from relight import ckpt

        c = self.cfg.checkpoint
        if not c.local_tier_dir:
            return None
        return ckpt.TierOptions(
            local_dir=c.local_tier_dir, budget_bytes=c.local_tier_budget_mb * (1 << 20),
            node=c.local_tier_node, peer_replicas=c.peer_replicas, peer_host=c.peer_host,
            peer_toward=os.environ.get("MASTER_ADDR"))

    def drop_local_tier(self) -> None:
        """The run is complete: free the node memory its local tier holds (after every
        rank has flushed its copies, so none lands after the delete)."""
        if self.root is not None and self.root.drop_local_tier(
                timeout_s=self.cfg.train.collective_timeout_s):
            self.log.info("run complete: dropped the local tier %s", self.root.tiered.local_dir)

    def tier_stats(self) -> dict[str, Any] | None:
        """What each checkpoint tier served (None without a local tier)."""
        stats = None if self.root is None else self.root.tier_stats
        return None if stats is None else stats.snapshot()

    def _note_restored_commit(self, step: int) -> None:
        """The restored checkpoint is the newest commit until this run commits one."""
        from relight.ckpt import list_records

        try:
            rec = list_records(self.manager.store).get(step)
        except Exception:  # noqa: BLE001 - only the commit-age metric depends on it
            self.log.warning("could not read the commit record of step %d", step)
            return
        if rec is not None and rec.created > 0:
            self.last_commit_unix = rec.created
            if self.prometheus is not None:
                self.prometheus.set_last_commit(step, rec.created)

    def maybe_save(self, *, saves: bool = True, due: bool = False) -> tuple[float, bool, bool]:
        """Start this step's checkpoint when one is due: (stall seconds, ok, whether due).
        `saves` False: another replica group writes the job's checkpoints. `due`: this
        step is due whatever `checkpoint.every` says (replica groups: the state's last
        copy in memory)."""
        c = self.cfg.checkpoint
        step = self._step()
        last = step in (self.cfg.train.steps, self.cfg.train.stop_at)
        if self.manager is None or (step % c.every and not last and not due):
            return 0.0, True, False
        if not saves:
            return 0.0, True, False  # the replicas hold the same state: one group writes it
        t0, began = time.perf_counter(), time.time()
        try:
            handle = self.manager.save(step, self._state(), async_save=c.async_save,
                                        busy="wait" if last else None)
        except Exception:  # a failed save must not stop training; older checkpoints remain
            self.log.exception("checkpoint save of step %d failed; training continues and "
                               "older checkpoints are untouched", step)
            self.poll_save()
            return time.perf_counter() - t0, False, True
        self.poll_save()  # the manager waited for the previous save: report it first
        if handle is None:  # skipped by the manager's busy="skip" policy: nothing started
            return time.perf_counter() - t0, True, False
        self._pending = (handle, began)
        return time.perf_counter() - t0, True, True

    def poll_save(self) -> None:
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
        self.last_commit_unix = committed
        if h.total_s > 0:
            self._save_timings.append((int(h.bytes_written), float(h.total_s)))
        if self.prometheus is not None:
            self.prometheus.record_commit(h.step, int(h.bytes_written), float(h.total_s),
                                          committed_unix=committed)
        if self.rank == 0:
            self.log.info("checkpoint step %s committed: %.1f MiB from this rank, %.2f s from "
                          "start to commit (training stalled %.3f s)", h.step,
                          h.bytes_written / 2**20, h.total_s, h.stall_s)

    @staticmethod
    def _local_state_bytes( sd: dict[str, Any]) -> int:
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

    @staticmethod
    def _fallback_note(mgr: Any, step: int) -> str:
        latest = mgr.latest_step()
        if latest is None:
            return (f"no committed checkpoint exists: the resume starts from scratch "
                    f"({step} steps lost)")
        return (f"the resume will use the newest committed checkpoint, step {latest} "
                f"({step - latest} steps lost)")

    def emergency_checkpoint(self, remaining_s: float, result: Any,
                             watcher: NoticeWatcher | None) -> None:
        """Every rank, at the same step boundary after the ranks agreed on a notice: let the
        async save in flight commit, agree whether a synchronous save of this step fits in
        the grace left, and write it (a collective save; it commits before returning)."""
        pcfg = self.cfg.preemption
        if watcher is not None:
            watcher.phase = "emergency"
        deadline = time.monotonic() + remaining_s
        mgr = self.manager
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
        self.poll_save()
        step = self._step()
        sd = self._state()
        nbytes = self._local_state_bytes(sd)
        est = estimate_save_s(nbytes, self._save_timings, pcfg.assumed_write_mb_s)
        # The go / no-go must be the same on every rank: decide from gathered values.
        mine = torch.tensor([est, deadline - time.monotonic()], dtype=torch.float64,
                            device=self.device)
        both = torch.empty(self.world * 2, dtype=torch.float64, device=self.device)
        all_gather(both, mine)
        both = both.view(self.world, 2).cpu()
        decision = decide(both[:, 0].tolist(), both[:, 1].tolist(),
                          safety_factor=pcfg.safety_factor, margin_s=pcfg.save_margin_s)
        if not decision.save:
            result.emergency_note = (f"{decision.reason}: skipping the emergency save; "
                                     + self._fallback_note(mgr, step))
            self.log.warning("preemption: %s", result.emergency_note)
            return
        self.log.info("preemption: emergency save of step %d starts (%.1f MiB on this rank; "
                      "%s)", step, nbytes / 2**20, decision.reason)
        t0 = time.perf_counter()
        try:
            mgr.save(step, sd, async_save=False, busy="wait")
            mgr.wait()
        except Exception as e:
            result.emergency_note = (f"emergency save failed ({type(e).__name__}: {e}); "
                                     + self._fallback_note(mgr, step))
            self.log.exception("preemption: %s", result.emergency_note)
            return
        result.emergency_save_s = time.perf_counter() - t0
        result.emergency_step = step
        result.emergency_note = (f"committed step {step}: {nbytes / 2**20:.1f} MiB on "
                                 f"this rank in {result.emergency_save_s:.2f} s "
                                 f"(estimated {est:.2f} s)")
        self.log.info("preemption: emergency checkpoint %s", result.emergency_note)
