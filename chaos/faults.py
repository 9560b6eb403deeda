"""Fault kinds and the injectors that cause them through the real mechanism.

Every fault is something that happens to real fleets, done the way it happens: SIGKILL to
a worker pid found in the agent's process tree, SIGKILL to a whole node's tree, SIGSTOP
(a hang), etcd killed and restarted on its data dir, the newest committed checkpoint's
chunk damaged in the store, storage errors and latency through `storage.testing.FaultyStore`
(handed to the training processes by a fault-plan file named in their environment, see
`storage.testing`). Nothing here reaches into a training process's memory.

The injector never sleeps: follow-ups (SIGCONT, a replacement node, etcd coming back, a
storage fault ending) are scheduled on the cluster, whose loop runs them when due, so one
slow fault never delays the next one or the deadline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import psutil

from relight.chaos.proc_clock import start_time
from relight.elastic.warm import worker_of
from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINT_ATTACKS",
    "NODE_LOSSES",
    "PHASES",
    "RESTARTING",
    "SAVE_PHASES",
    "ClusterControl",
    "FaultEvent",
    "FaultInjectionError",
    "FaultKind",
    "Injector",
    "Phase",
    "WorkerProc",
    "draw_mtbf_schedule",
    "find_workers",
    "process_tree",
]


class FaultKind(StrEnum):
    KILL_WORKER = "kill_worker"
    """SIGKILL one worker process."""
    KILL_NODE = "kill_node"
    """SIGKILL a node's agent and all its workers (optionally replaced later)."""
    STOP_WORKER = "stop_worker"
    """SIGSTOP one worker (a hang); SIGCONT after `resume_after_s` if given."""
    KILL_DURING_PERSIST = "kill_during_persist"
    """SIGKILL a worker while a checkpoint is being persisted (uncommitted in the store)."""
    KILL_COORDINATOR_BEFORE_COMMIT = "kill_coordinator_before_commit"
    """SIGKILL rank 0 after the per-rank indexes are written and before the commit marker."""
    STORAGE_TRANSIENT = "storage_transient"
    """A fraction of storage operations fail for `duration_s` (FaultyStore)."""
    STORAGE_LATENCY = "storage_latency"
    """Every storage operation is delayed by `latency_s` for `duration_s` (FaultyStore)."""
    CORRUPT_CHECKPOINT = "corrupt_checkpoint"
    """Flip a bit in one chunk of the newest committed checkpoint."""
    TRUNCATE_CHECKPOINT = "truncate_checkpoint"
    """Cut one chunk of the newest committed checkpoint to half its size."""
    ETCD_RESTART = "etcd_restart"
    """SIGKILL etcd, keep it down `down_s`, start it again on the same data dir."""
    SCALE_DOWN = "scale_down"
    """Remove a node for good (SIGTERM to its agent, as a drained machine)."""
    SCALE_UP = "scale_up"
    """Start one more node (up to max_nodes)."""
    PREEMPT = "preempt"
    """A preemption: SIGTERM to the node's agent, SIGKILL 5 s later (the grace period),
    replaced after `replace_after_s` if given."""


class Phase(StrEnum):
    """A phase a fault can be triggered in (`during = ...`)."""

    PERSIST = "persist"
    """A checkpoint's per-rank indexes are being written (it is not committed yet)."""
    BEFORE_COMMIT = "before_commit"
    """The indexes are written and the coordinator has not written the manifest yet."""
    RESTORE = "restore"
    """A restarted group is up and has not logged a step yet."""
    TRAINING = "training"
    """Any time the run is training (past `after_step`)."""


PHASES = frozenset(Phase)
"""Phases a fault can be triggered in (`during = ...`)."""

SAVE_PHASES = frozenset({Phase.PERSIST, Phase.BEFORE_COMMIT})
"""Phases inside a save: the harness holds the save in them (`FaultSpec.window_s`)."""

NODE_LOSSES = frozenset({FaultKind.KILL_NODE, FaultKind.SCALE_DOWN, FaultKind.PREEMPT})
"""Faults that take a whole node away."""

CHECKPOINT_ATTACKS = frozenset(
    {
        FaultKind.KILL_DURING_PERSIST,
        FaultKind.KILL_COORDINATOR_BEFORE_COMMIT,
        FaultKind.CORRUPT_CHECKPOINT,
        FaultKind.TRUNCATE_CHECKPOINT,
        FaultKind.STORAGE_TRANSIENT,
        FaultKind.STORAGE_LATENCY,
    }
)
"""Faults that may legitimately cost one more checkpoint interval of work: they destroy,
prevent or delay a checkpoint, so the resume falls back one further (a slowed save still
in flight when a kill lands is lost with it: preemptible-fleet seed 9 lost 12 steps at
interval 10 that way)."""

RESTARTING = frozenset(
    {
        FaultKind.CORRUPT_CHECKPOINT,  # only with kill_after: measured when it restarts
        FaultKind.TRUNCATE_CHECKPOINT,
        FaultKind.KILL_WORKER,
        FaultKind.KILL_NODE,
        FaultKind.STOP_WORKER,
        FaultKind.KILL_DURING_PERSIST,
        FaultKind.KILL_COORDINATOR_BEFORE_COMMIT,
        FaultKind.SCALE_DOWN,
        FaultKind.SCALE_UP,
        FaultKind.PREEMPT,
    }
)
"""Faults after which the worker group must restart (recovery times are measured)."""

PREEMPT_GRACE_S = 5.0


class FaultInjectionError(RelightError, RuntimeError):
    """A fault could not be injected (no live victim, no committed checkpoint yet...)."""


@dataclass
class FaultEvent:
    """One injected fault and what was measured about it afterwards."""

    index: int
    kind: FaultKind
    trigger: str
    """How it fired: `step>=8`, `t>=12.0s`, `during=persist`, `mtbf`."""
    time: float
    """Unix time of the injection."""
    step: int
    """Highest step logged when it was injected (-1: none yet)."""
    node: int | None = None
    pids: list[int] = field(default_factory=list)
    detail: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    error: str = ""
    detected_at: float | None = None
    """First time a surviving worker of the old group was gone (the agents noticed)."""
    rendezvous_at: float | None = None
    """First time the new worker group's processes were all up (rendezvous completed)."""
    first_step_at: float | None = None
    """Time of the first step logged after the fault by a restarted group."""

    def to_dict(self) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - self.time, 3)

        return {
            "index": self.index,
            "kind": self.kind.value,
            "trigger": self.trigger,
            "time": self.time,
            "step": self.step,
            "node": self.node,
            "pids": self.pids,
            "detail": self.detail,
            "ok": self.ok,
            "error": self.error,
            "detect_s": rel(self.detected_at),
            "rendezvous_s": rel(self.rendezvous_at),
            "first_step_s": rel(self.first_step_at),
        }


@dataclass(frozen=True, slots=True)
class WorkerProc:
    pid: int
    rank: int
    local_rank: int
    restart_count: int
    started_at: float
    """Unix time the worker process started, at most one clock tick early
    (`proc_clock.start_time`; never psutil's, which reads up to a second early)."""


def process_tree(pid: int) -> list[psutil.Process]:
    """`pid` and all its descendants that are alive now (empty if `pid` is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def find_workers(agent_pid: int) -> list[WorkerProc]:
    """The torchrun workers under an agent: descendants with `LOCAL_RANK` in their
    environment whose parent has none (a worker's own children inherit it)."""
    out = []
    for proc in process_tree(agent_pid)[1:]:
        try:
            env = proc.environ()
            if "LOCAL_RANK" not in env or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            parent = proc.parent()
            if parent is not None and "LOCAL_RANK" in parent.environ():
                continue
            cmdline = proc.cmdline()
            if not cmdline:
                # Exiting: its memory is gone, so its command line reads empty before it
                # is a zombie (a warm client whose worker ended would count as a worker).
                continue
            target = proc
            forked = worker_of(cmdline, proc.pid)
            if forked is not None:
                # A warm start: the agent's child is a client that forwards signals
                # (not SIGSTOP); the worker is the process the fork server made for it.
                target = psutil.Process(forked)
            elif "relight.elastic.warm" in cmdline:
                continue  # a warm client whose worker is not forked yet
            out.append(
                WorkerProc(
                    pid=target.pid,
                    rank=int(env.get("RANK", "-1")),
                    local_rank=int(env["LOCAL_RANK"]),
                    restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    started_at=start_time(target.pid),
                )
            )
        except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError, ValueError):
            continue
    return sorted(out, key=lambda w: w.local_rank)


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every descendant; returns the pids killed. The tree is frozen
    first (SIGSTOP from the root down, again until no new process shows up), so nothing
    in it can start a process while it dies: a supervisor that saw its workers killed
    before itself would start new ones, orphaned once it is killed in turn."""
    seen: dict[int, psutil.Process] = {}
    while new := [p for p in process_tree(pid) if p.pid not in seen]:
        for proc in new:
            seen[proc.pid] = proc
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.suspend()
    hit = []
    for proc in seen.values():
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
            hit.append(proc.pid)
    return hit


class ClusterControl(Protocol):
    """What the injectors need from the cluster of a launch (`cluster.Cluster`)."""

    def live_nodes(self) -> list[int]: ...

    def min_nodes(self) -> int: ...

    def agent_pid(self, node: int) -> int | None: ...

    def remove_node(self, node: int, sig: int) -> list[int]: ...

    def add_node(self) -> int: ...

    def schedule(self, delay_s: float, action: Callable[[], None], label: str) -> None: ...

    def etcd_kill(self) -> int | None: ...

    def etcd_start(self) -> None: ...

    def set_storage_fault(self, plan: dict[str, Any] | None) -> None: ...

    def newest_committed_chunk(self) -> tuple[int, str]: ...

    def corrupt(self, key: str, mode: str) -> None: ...

    def checkpoint_phase(self) -> dict[str, Any]: ...


class Injector:
    """Causes one `FaultSpec` on a `ClusterControl`; victims are drawn from `rng`."""

    def __init__(self, cluster: ClusterControl, rng: random.Random) -> None:
        self.cluster = cluster
        self.rng = rng

    def inject(self, spec: Any, index: int, trigger: str, step: int) -> FaultEvent:
        event = FaultEvent(index=index, kind=spec.kind, trigger=trigger, time=time.time(),
                           step=step)
        try:
            getattr(self, f"_{spec.kind.value}")(spec, event)
        except FaultInjectionError as exc:
            event.ok = False
            event.error = str(exc)
            logger.warning("fault #%d %s not injected: %s", index, spec.kind.value, exc)
        except Exception as exc:  # noqa: BLE001 - a failed injection must not end the run
            event.ok = False
            event.error = f"{type(exc).__name__}: {exc}"
            logger.exception("fault #%d %s failed to inject", index, spec.kind.value)
        else:
            logger.info(
                "fault #%d %s injected at step %d (%s): node=%s pids=%s %s",
                index, spec.kind.value, step, trigger, event.node, event.pids, event.detail,
            )
        return event

    # victims ---------------------------------------------------------------------------

    def _node(self, spec: Any) -> int:
        live = self.cluster.live_nodes()
        if not live:
            raise FaultInjectionError("no live node to attack")
        if spec.node is not None:
            if spec.node not in live:
                raise FaultInjectionError(f"node {spec.node} is not alive (live: {live})")
            return spec.node
        return self.rng.choice(live)

    def _worker(self, spec: Any, want_rank: int | None = None) -> tuple[int, WorkerProc]:
        live = self.cluster.live_nodes()
        nodes = [spec.node] if spec.node is not None else list(live)
        self.rng.shuffle(nodes)
        for node in nodes:
            pid = self.cluster.agent_pid(node)
            workers = find_workers(pid) if pid else []
            if want_rank is not None:
                workers = [w for w in workers if w.rank == want_rank]
            elif spec.local_rank is not None:
                workers = [w for w in workers if w.local_rank == spec.local_rank]
            if workers:
                return node, self.rng.choice(workers)
        what = f"rank {want_rank}" if want_rank is not None else "worker"
        raise FaultInjectionError(f"no live {what} on nodes {nodes}")

    # one method per FaultKind ------------------------------------------------------------

    def _kill_worker(self, spec: Any, event: FaultEvent) -> None:
        node, w = self._worker(spec)
        os.kill(w.pid, signal.SIGKILL)
        event.node, event.pids = node, [w.pid]
        event.detail.update(rank=w.rank, local_rank=w.local_rank)

    def _kill_during_persist(self, spec: Any, event: FaultEvent) -> None:
        event.detail.update(self.cluster.checkpoint_phase())
        self._kill_worker(spec, event)

    def _kill_coordinator_before_commit(self, spec: Any, event: FaultEvent) -> None:
        event.detail.update(self.cluster.checkpoint_phase())
        node, w = self._worker(spec, want_rank=0)
        os.kill(w.pid, signal.SIGKILL)
        event.node, event.pids = node, [w.pid]
        event.detail.update(rank=0, local_rank=w.local_rank)

    def _stop_worker(self, spec: Any, event: FaultEvent) -> None:
        node, w = self._worker(spec)
        os.kill(w.pid, signal.SIGSTOP)
        event.node, event.pids = node, [w.pid]
        event.detail.update(rank=w.rank, local_rank=w.local_rank)
        if spec.resume_after_s is not None:
            def cont(pid: int = w.pid) -> None:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass  # the agent already replaced the hung worker

            self.cluster.schedule(spec.resume_after_s, cont, f"SIGCONT {w.pid}")

    def _check_min(self, permanent: bool) -> None:
        live = self.cluster.live_nodes()
        if permanent and len(live) - 1 < self.cluster.min_nodes():
            raise FaultInjectionError(
                f"removing a node for good would leave {len(live) - 1} < min_nodes "
                f"{self.cluster.min_nodes()}: the job could not go on")

    def _kill_node(self, spec: Any, event: FaultEvent) -> None:
        self._check_min(spec.replace_after_s is None)
        node = self._node(spec)
        event.node = node
        event.pids = self.cluster.remove_node(node, signal.SIGKILL)
        self._maybe_replace(spec, event)

    def _scale_down(self, spec: Any, event: FaultEvent) -> None:
        self._check_min(True)
        node = self._node(spec)
        event.node = node
        event.pids = self.cluster.remove_node(node, signal.SIGTERM)

    def _preempt(self, spec: Any, event: FaultEvent) -> None:
        self._check_min(spec.replace_after_s is None)
        node = self._node(spec)
        event.node = node
        event.pids = self.cluster.remove_node(node, signal.SIGTERM)
        pids = list(event.pids)

        def hard_kill() -> None:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

        self.cluster.schedule(PREEMPT_GRACE_S, hard_kill, f"preempt grace end node {node}")
        self._maybe_replace(spec, event)

    def _maybe_replace(self, spec: Any, event: FaultEvent) -> None:
        if spec.replace_after_s is not None:
            event.detail["replaced_after_s"] = spec.replace_after_s
            def replace() -> None:
                event.detail["replacement"] = self.cluster.add_node()

            self.cluster.schedule(spec.replace_after_s, replace,
                                  f"replacement for node {event.node}")

    def _scale_up(self, spec: Any, event: FaultEvent) -> None:
        node = self.cluster.add_node()
        event.node = node
        pid = self.cluster.agent_pid(node)
        event.pids = [pid] if pid else []

    def _etcd_restart(self, spec: Any, event: FaultEvent) -> None:
        pid = self.cluster.etcd_kill()
        event.pids = [pid] if pid else []
        event.detail["down_s"] = spec.down_s
        self.cluster.schedule(spec.down_s, self.cluster.etcd_start, "etcd start")

    def _storage_plan(self, spec: Any, event: FaultEvent, plan: dict[str, Any]) -> None:
        if spec.ops:
            plan["ops"] = list(spec.ops)
        if spec.key_contains:
            plan["key_contains"] = spec.key_contains
        plan["seed"] = self.rng.randrange(2**31)
        self.cluster.set_storage_fault(plan)
        event.detail.update(plan, duration_s=spec.duration_s)
        self.cluster.schedule(
            spec.duration_s, lambda: self.cluster.set_storage_fault(None), "storage fault end"
        )

    def _storage_transient(self, spec: Any, event: FaultEvent) -> None:
        self._storage_plan(
            spec, event, {"fail_fraction": spec.fail_fraction, "fail_times": spec.fail_times}
        )

    def _storage_latency(self, spec: Any, event: FaultEvent) -> None:
        self._storage_plan(spec, event, {"latency_s": spec.latency_s})

    def _damage(self, event: FaultEvent, mode: str) -> None:
        try:
            step, key = self.cluster.newest_committed_chunk()
        except LookupError as exc:
            raise FaultInjectionError(str(exc)) from exc
        self.cluster.corrupt(key, mode)
        event.detail.update(checkpoint_step=step, key=key, mode=mode)

    def _corrupt_checkpoint(self, spec: Any, event: FaultEvent) -> None:
        self._damage(event, "flip")
        self._kill_after(spec, event)

    def _truncate_checkpoint(self, spec: Any, event: FaultEvent) -> None:
        self._damage(event, "truncate")
        self._kill_after(spec, event)

    def _kill_after(self, spec: Any, event: FaultEvent) -> None:
        if not getattr(spec, "kill_after", False):
            return
        node, w = self._worker(spec)
        os.kill(w.pid, signal.SIGKILL)
        event.node, event.pids = node, [w.pid]
        event.detail.update(killed_rank=w.rank)


def draw_mtbf_schedule(
    kinds: Sequence[FaultKind], count: int, mean_s: float, start_s: float, seed: int
) -> list[tuple[float, FaultKind]]:
    """`count` (time, kind) pairs: exponential gaps of mean `mean_s` after `start_s`,
    kinds cycling through a seeded shuffle of `kinds` so each appears when count allows.
    Pure: the same arguments give the same schedule."""
    rng = random.Random(f"mtbf:{seed}")
    out: list[tuple[float, FaultKind]] = []
    t = start_s
    order: list[FaultKind] = []
    for _ in range(count):
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        t += rng.expovariate(1.0 / mean_s)
        out.append((round(t, 3), order.pop()))
    return out
