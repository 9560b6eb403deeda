"""The chaos runner: real etcd + real storage + N `relight run` nodes on loopback, faults
injected on a timeline, a global deadline, teardown no matter what, then the reference
run, the verifier and the report.

Order of `run_scenario`:

1. start etcd (`EtcdServer`) and, for `storage.kind = "s3"`, SeaweedFS (`S3Server`);
2. the uninterrupted reference run (same command, same initial world size, no faults),
   unless a cached one for the same training setup is given;
3. the chaos run: start the nodes (one elastic agent each, all on the same etcd), then one
   loop until every agent has exited or the deadline passed: tail the metrics, poll the
   checkpoint store for commits, watch the worker processes, fire due faults and
   follow-ups;
4. always: SIGKILL every process tree the run started (agents, workers, their children),
   stop the servers, and check that nothing survived;
5. gather the evidence (committed checkpoints verified, final states compared), verify,
   write the report.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from relight.chaos.ckpt_probe import (
    CheckpointProbe,
    compare_final_states,
    read_writer_commits,
)
from relight.chaos.faults import (
    RESTARTING,
    SAVE_PHASES,
    FaultEvent,
    FaultInjectionError,
    FaultKind,
    Injector,
    Phase,
    draw_mtbf_schedule,
    find_workers,
    kill_tree,
    process_tree,
)
from relight.chaos.fingerprint import files_digest, local_imports
from relight.chaos.logs import StepRecord, parse_metrics
from relight.chaos.node_logs import closed_rendezvous, last_errors
from relight.chaos.proc_clock import started_after
from relight.chaos.report import build_report, write_junit, write_report
from relight.chaos.scenario import FaultSpec, Scenario
from relight.chaos.verifier import (
    CheckpointEvent,
    FaultMark,
    RunEvidence,
    Tolerances,
    WeightsComparison,
    WriterCommit,
    verify,
)
from relight.ckpt.local_tier import TIER_NODE_ENV, local_tier_dir
from relight.elastic.etcd_server import EtcdCluster, EtcdServer, free_port
from relight.errors import RelightError
from relight.runtime.replicas import GROUP_ENV
from relight.storage import StorageError, Store, open_store
from relight.storage.testing import FAULT_PLAN_ENV, corrupt_object, write_plan_file

logger = logging.getLogger(__name__)

__all__ = ["ChaosRunError", "RunOutcome", "TrainingFileError", "run_scenario"]

POLL_S = 0.2
DAMAGE = (FaultKind.CORRUPT_CHECKPOINT, FaultKind.TRUNCATE_CHECKPOINT)
CKPT_POLL_S = 0.5


class ChaosRunError(RelightError, RuntimeError):
    """The harness itself could not run the scenario (servers, launcher)."""


class TrainingFileError(RelightError, FileNotFoundError):
    """A file the scenario's [training] names (its script, its config) is not there."""


@dataclass
class RunOutcome:
    """What one launch of the job produced."""

    records: list[StepRecord]
    finished: bool
    detail: str
    started_at: float
    ended_at: float
    faults: list[FaultEvent] = field(default_factory=list)
    checkpoint_events: list[CheckpointEvent] = field(default_factory=list)
    store_url: str = ""
    leaked: list[int] = field(default_factory=list)
    worker_starts: dict[int, int] = field(default_factory=dict)
    """Worker processes seen started on each node over the launch."""
    writer_commits: list[WriterCommit] = field(default_factory=list)
    """The commits the checkpoint writers logged (read from the nodes' logs at the end)."""


# -- the command every node runs ------------------------------------------------------------

def resolve_path(path: str, scenario: Scenario) -> str:
    """A file the scenario names (`training.command`'s script, `training.config`): an
    absolute path as it is, a relative one against the scenario file's folder (a
    scenario built in code, with no file: the current directory). One rule, so a
    scenario means the same files from whatever directory it is run; a path that is not
    there is an error naming where it was looked for, never a file of the same name
    found elsewhere."""
    candidate = (scenario.base_dir / path).resolve()
    if not candidate.exists():
        where = (f"the scenario file's folder {scenario.base_dir}" if scenario.source
                 else f"the current directory {scenario.base_dir} (no scenario file)")
        raise TrainingFileError(f"training file {path!r} not found: {candidate} does not "
                                f"exist (relative paths in a scenario are resolved against "
                                f"{where})")
    return str(candidate)


def check_training_files(scenario: Scenario) -> None:
    """Raise `TrainingFileError` now, before any server starts, if the script or the
    config the scenario names is not where the one rule says."""
    tr = scenario.training
    if tr.config:
        resolve_path(tr.config, scenario)
    if tr.command and tr.command[0].endswith(".py"):
        resolve_path(tr.command[0], scenario)


def threads_per_rank(scenario: Scenario) -> int:
    """Intra-op threads for each training process: the simulated nodes all run on this
    machine, so its cores are shared by every rank the cluster can hold at once.
    torchrun sets one thread only for agents of several workers; a node of one worker
    would take every core, and four such nodes on two cores ran their steps 10x slower
    (torch's thread pools spinning against each other) than with one thread each."""
    c = scenario.cluster
    ranks = max(c.nodes, c.max_nodes) * c.ranks_per_node
    return max(1, (os.cpu_count() or 1) // ranks)


def training_command(scenario: Scenario, ckpt_url: str, metrics: Path) -> tuple[list[str],
                                                                                dict[str, str]]:
    """argv and extra environment of the training processes."""
    tr = scenario.training
    values = {
        "python": sys.executable,
        "ckpt_url": ckpt_url,
        "metrics": str(metrics),
        "target_step": str(scenario.target_step),
        "interval": str(scenario.checkpoint.interval),
        "config": resolve_path(tr.config, scenario) if tr.config else "",
        "scenario_dir": str(scenario.base_dir),
    }
    env = {
        "RELIGHT_CKPT_URL": ckpt_url,
        "RELIGHT_METRICS_PATH": str(metrics),
        "RELIGHT_TARGET_STEP": values["target_step"],
        "RELIGHT_CKPT_INTERVAL": values["interval"],
        **({} if "OMP_NUM_THREADS" in os.environ
           else {"OMP_NUM_THREADS": str(threads_per_rank(scenario))}),
        # runtime.train gets it as an argument; for a user's script it is a hint only
        # (what it keeps is its own retention policy).
        **({"RELIGHT_CKPT_KEEP_LAST": str(scenario.checkpoint.keep_last)}
           if scenario.checkpoint.keep_last else {}),
        **tr.env,
    }
    overrides = [f"--{k}={_toml_value(v)}" for k, v in tr.overrides.items()]
    if tr.command:
        argv = [a.format(**values) for a in tr.command]
        if argv and argv[0].endswith(".py"):
            argv = [sys.executable, resolve_path(argv[0], scenario), *argv[1:]]
        return argv + overrides, env
    argv = [
        sys.executable, "-m", "relight.runtime.train", "--config", values["config"],
        f"--train.steps={scenario.target_step}",
        f"--checkpoint.url={ckpt_url}",
        f"--checkpoint.every={scenario.checkpoint.interval}",
        f"--train.metrics_path={metrics}",
    ]
    if scenario.checkpoint.keep_last:
        argv.append(f"--checkpoint.keep_last={scenario.checkpoint.keep_last}")
    return argv + overrides, env


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def agent_command(scenario: Scenario, endpoint: str, job_id: str, nnodes: str,
                  train_argv: list[str], node_dir: Path) -> list[str]:
    """One node's agent: `relight run` (the launcher's `main(argv)` in a fresh python) or
    plain torchrun, on the harness's etcd (`relight-etcd`) or torchrun's `c10d`."""
    c = scenario.cluster
    if c.launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run"]
    else:
        head = [sys.executable, "-c",
                "import sys; from relight.cli import main; sys.exit(main(['run', *sys.argv[1:]]))",
                f"--run-dir={node_dir}"]
    conf = f"join_timeout={c.rdzv_timeout_s:g},last_call_timeout={c.last_call_s:g}"
    if c.rendezvous == "relight-etcd":
        conf += "".join(f",{k}={v:g}" for k, v in (("lease_ttl", c.lease_ttl_s),
                                                   ("rejoin_timeout", c.rejoin_timeout_s)) if v)
    elif c.c10d_store == "standalone":
        conf += ",is_host=false"
    return [
        *head,
        f"--rdzv-backend={c.rendezvous}",
        f"--nnodes={nnodes}",
        f"--nproc-per-node={c.ranks_per_node}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={job_id}",
        f"--rdzv-conf={conf}",
        f"--max-restarts={c.max_restarts}",
        f"--monitor-interval={c.monitor_interval_s:g}",
        *(["--no-python"] if c.launcher == "torchrun" else ["--"]),
        *train_argv,
    ]


# -- the cluster ----------------------------------------------------------------------------

@dataclass
class _Node:
    index: int
    proc: subprocess.Popen
    log_path: Path
    started_at: float
    removed: bool = False


class Cluster:
    """The nodes of one launch, and what the injectors may do to them (`ClusterControl`)."""

    def __init__(self, scenario: Scenario, run_dir: Path, etcd: Any, store: Store,
                 job_id: str, train_argv: list[str], env: dict[str, str],
                 fault_plan: Path | None, workdir: Path | None = None) -> None:
        self.scenario = scenario
        self.run_dir = run_dir
        self.workdir = workdir or Path.cwd()
        """The training processes' working directory: the one the harness was started in
        (a user's repository), so a script's relative paths mean what they mean there."""
        self.etcd = etcd
        self.store = store
        self.probe = CheckpointProbe(store)
        self.job_id = job_id
        self.train_argv = train_argv
        self.env = env
        self.fault_plan = fault_plan
        self.storage_fault: dict[str, Any] | None = None
        self.armed: dict[str, Any] | None = None
        self.nodes: dict[int, _Node] = {}
        self.seen: dict[int, psutil.Process] = {}
        self._timers: list[tuple[float, str, Callable[[], None]]] = []
        self._memory_to_drop: list[tuple[_Node, list[int]]] = []
        self.actions: list[dict[str, Any]] = []
        c = scenario.cluster
        self.nnodes = f"{c.min_nodes}:{c.max_nodes}"
        # c10d: the first agent hosts the rendezvous store on this port, or the harness.
        self.endpoint = (etcd.endpoint if c.rendezvous == "relight-etcd"
                         else f"127.0.0.1:{free_port()}")
        self.c10d_store: subprocess.Popen | None = None
        if c.rendezvous == "c10d" and c.c10d_store == "standalone":
            self.c10d_store = _start_c10d_store(self.endpoint, run_dir / "c10d-store.log")

    # nodes -------------------------------------------------------------------------------

    def start_node(self) -> int:
        index = len(self.nodes)
        log_dir = self.run_dir / "nodes"
        log_dir.mkdir(parents=True, exist_ok=True)
        log_path = log_dir / f"node-{index}.log"
        node_dir = log_dir / f"node-{index}"
        c = self.scenario.cluster
        job_id, nnodes, train_argv, env = self.job_id, self.nnodes, self.train_argv, self.env
        if c.replica_groups:
            # A replica group: a job of its own under `relight run` (one node, its own
            # rendezvous id, which is also its group id), training with the others
            # through the quorum in the same etcd. The first quorum waits for every
            # group the scenario starts with (then any number trains on).
            job_id, nnodes = f"{self.job_id}-{_node_name(index)}", "1"
            train_argv = [*train_argv, f"--replica.job={self.job_id}",
                          f"--replica.etcd={self.endpoint}", "--replica.host=127.0.0.1",
                          f"--replica.min_groups={c.nodes}"]
            env = {**env, GROUP_ENV: _node_name(index)}
        argv = agent_command(self.scenario, self.endpoint, job_id, nnodes, train_argv,
                             node_dir)
        if c.node_memory == "per_node":
            env = {**env, TIER_NODE_ENV: _node_name(index)}
        with open(log_path, "ab") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.workdir, start_new_session=True)
        self.nodes[index] = _Node(index, proc, log_path, time.time())
        self._track(proc.pid)
        logger.info("node %d started: agent pid %d (log %s)", index, proc.pid, log_path)
        return index

    def live_nodes(self) -> list[int]:
        return [i for i, n in self.nodes.items() if not n.removed and n.proc.poll() is None]

    def min_nodes(self) -> int:
        return self.scenario.cluster.min_nodes

    def agent_pid(self, node: int) -> int | None:
        n = self.nodes.get(node)
        return n.proc.pid if n and n.proc.poll() is None else None

    def remove_node(self, node: int, sig: int) -> list[int]:
        n = self.nodes[node]
        n.removed = True
        self._track_tree(n.proc.pid)
        pids = kill_tree(n.proc.pid) if sig == signal.SIGKILL else self._signal_agent(
            n, sig)
        if self.scenario.cluster.node_memory == "per_node":
            self._memory_to_drop.append((n, pids))
        return pids

    def node_tier_dir(self, node: int) -> str | None:
        """The node's local checkpoint tier (None when the training overrides set none)."""
        base = self.scenario.training.overrides.get("checkpoint.local_tier_dir")
        return local_tier_dir(str(base), self.store.url, _node_name(node)) if base else None

    def _drop_lost_memory(self) -> None:
        """A removed node's machine is gone, and its memory with it: once its processes
        have exited, delete its tier (its own copies and the replicas it held)."""
        for item in list(self._memory_to_drop):
            n, pids = item
            if n.proc.poll() is None or any(_running(p) for p in pids):
                continue
            self._memory_to_drop.remove(item)
            path = self.node_tier_dir(n.index)
            if path is None:
                continue
            existed = os.path.isdir(path)
            shutil.rmtree(path, ignore_errors=True)
            logger.info("node %d's memory lost with it: deleted its tier %s", n.index, path)
            self.actions.append({"time": time.time(), "action": f"node {n.index} memory lost",
                                 "ok": True, "path": path, "existed": existed})

    def _signal_agent(self, n: _Node, sig: int) -> list[int]:
        # A drained or preempted machine: its agent gets the signal and shuts its workers
        # down itself (the grace-period SIGKILL is scheduled by the injector).
        pids = [p.pid for p in process_tree(n.proc.pid)]
        try:
            os.kill(n.proc.pid, sig)
        except ProcessLookupError:
            pass
        return pids

    def add_node(self) -> int:
        live = self.live_nodes()
        if len(live) >= self.scenario.cluster.max_nodes:
            raise FaultInjectionError(
                f"cannot add a node: {len(live)} live = max_nodes "
                f"{self.scenario.cluster.max_nodes}")
        return self.start_node()

    def workers(self) -> dict[int, list[Any]]:
        out = {}
        for i in self.live_nodes():
            pid = self.agent_pid(i)
            if pid:
                out[i] = find_workers(pid)
        return out

    # timers ------------------------------------------------------------------------------

    def schedule(self, delay_s: float, action: Callable[[], None], label: str) -> None:
        self._timers.append((time.monotonic() + delay_s, label, action))

    def pending_follow_ups(self) -> bool:
        """Whether a follow-up is still due (a replacement node, etcd coming back): a run
        whose every node is gone goes on while one is."""
        return bool(self._timers)

    def run_due(self) -> None:
        self._drop_lost_memory()
        now = time.monotonic()
        due = [t for t in self._timers if t[0] <= now]
        self._timers = [t for t in self._timers if t[0] > now]
        for _, label, action in due:
            logger.info("follow-up: %s", label)
            try:
                action()
                self.actions.append({"time": time.time(), "action": label, "ok": True})
            except Exception as exc:  # noqa: BLE001 - one failed follow-up must not stop the run
                logger.warning("follow-up %s failed: %s", label, exc)
                self.actions.append({"time": time.time(), "action": label, "ok": False,
                                     "error": str(exc)})

    # etcd, storage -----------------------------------------------------------------------

    def etcd_kill(self) -> int | None:
        pid = self.etcd.pid
        self.etcd.kill()
        return pid

    def etcd_start(self) -> None:
        self.etcd.start()

    def set_storage_fault(self, plan: dict[str, Any] | None) -> None:
        if self.fault_plan is None:
            raise FaultInjectionError("storage faults need the fault-plan file (chaos run only)")
        write_plan_file(self.fault_plan, plan)
        self.storage_fault = plan
        self.armed = None

    def arm(self, plan: dict[str, Any] | None) -> None:
        """Widen a checkpoint phase for a waiting fault (never over a storage fault)."""
        if self.fault_plan is None or self.storage_fault is not None or plan == self.armed:
            return
        write_plan_file(self.fault_plan, plan)
        self.armed = plan

    def newest_committed_chunk(self) -> tuple[int, str]:
        return self.probe.newest_committed_chunk()

    def corrupt(self, key: str, mode: str) -> None:
        corrupt_object(self.store, key, mode=mode, seed=7)

    def checkpoint_phase(self) -> dict[str, Any]:
        return self.probe.phase(self.world_size())

    def world_size(self) -> int:
        """Ranks that write a checkpoint: every live node's, or with replica groups one
        group's (the quorum's first group saves for all)."""
        c = self.scenario.cluster
        return c.ranks_per_node * (1 if c.replica_groups else len(self.live_nodes()))

    # process bookkeeping -----------------------------------------------------------------

    def _track(self, pid: int) -> None:
        try:
            self.seen.setdefault(pid, psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass

    def _track_tree(self, pid: int) -> None:
        for p in process_tree(pid):
            self.seen.setdefault(p.pid, p)

    def track_all(self) -> None:
        for n in self.nodes.values():
            if n.proc.poll() is None:
                self._track_tree(n.proc.pid)

    def all_exited(self) -> bool:
        return all(n.proc.poll() is not None for n in self.nodes.values())

    def exit_codes(self) -> dict[int, int | None]:
        return {i: n.proc.poll() for i, n in self.nodes.items()}

    def teardown(self) -> list[int]:
        """SIGKILL every process this cluster ever started; returns pids that survived."""
        self.track_all()
        for n in self.nodes.values():
            if n.proc.poll() is None:
                kill_tree(n.proc.pid)
        for p in list(self.seen.values()):
            try:
                if p.is_running():  # same pid *and* create time: never someone else's process
                    p.send_signal(signal.SIGCONT)
                    p.kill()
            except psutil.NoSuchProcess:
                pass
        for n in self.nodes.values():
            try:
                n.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        gone, alive = psutil.wait_procs(list(self.seen.values()), timeout=10)
        leaked = [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        if self.c10d_store is not None:
            self.c10d_store.kill()
            self.c10d_store.wait(timeout=30)
        if leaked:
            logger.error("processes survived teardown: %s", leaked)
        return leaked


def _start_c10d_store(endpoint: str, log_path: Path) -> subprocess.Popen:
    """torchrun's c10d rendezvous store (a multi-tenant TCPStore) in a process of its own,
    serving `endpoint` until killed; returns once it accepts connections."""
    host, port = endpoint.rsplit(":", 1)
    code = ("import sys, time, datetime, torch.distributed as d; "
            "s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=True, "
            "wait_for_workers=False, multi_tenant=True, "
            "timeout=datetime.timedelta(seconds=60)); print('ready', flush=True); "
            "time.sleep(1e9)")
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-c", code, host, port],
                                stdout=subprocess.PIPE, stderr=log, start_new_session=True)
    assert proc.stdout is not None
    # Waits for the store's own start (importing torch, then bind): a line, or its exit.
    if proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise ChaosRunError(f"the c10d store on {endpoint} did not start (log {log_path})")
    return proc


def _node_name(index: int) -> str:
    return f"node-{index}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# -- one launch -----------------------------------------------------------------------------

@dataclass
class _Pending:
    index: int
    spec: FaultSpec
    trigger: str
    at_time_s: float | None = None


class _Recovery:
    """Measures one restarting fault: detected (a pre-fault worker of the survivors gone,
    or a new worker up), re-rendezvous (every live node runs only post-fault workers),
    first step (first metrics line seen after that)."""

    def __init__(self, event: FaultEvent, before: dict[int, list[Any]]) -> None:
        self.event = event
        self.before = {w.pid for ws in before.values() for w in ws} - set(event.pids)
        self.group: set[int] = set()
        self.restarts = 0

    def update(self, workers: dict[int, list[Any]], ranks_per_node: int, now: float,
               new_record_at: float | None) -> bool:
        e = self.event
        current = {w.pid for ws in workers.values() for w in ws}
        # Start times exact to a clock tick (`proc_clock`): a group restarted within
        # milliseconds of the fault still counts as started after it.
        fresh = [w for ws in workers.values() for w in ws if started_after(w.started_at, e.time)]
        if e.detected_at is None and ((self.before - current) or fresh):
            e.detected_at = now
        complete = bool(workers) and all(
            len(ws) == ranks_per_node and all(started_after(w.started_at, e.time) for w in ws)
            for ws in workers.values())
        if e.detected_at is not None and complete and current != self.group:
            # A group that fails again before its first step (a stale peer address, a
            # rendezvous race) is replaced: recovery counts from the group that trains.
            if self.group:
                self.restarts += 1
                e.detail["extra_restarts"] = self.restarts
            self.group = current
            e.rendezvous_at = now
        if e.rendezvous_at is not None and new_record_at is not None and (
            new_record_at >= e.rendezvous_at
        ):
            e.first_step_at = new_record_at
            return True
        return False


class _QuorumRecovery:
    """Measures one fault when replica groups are on, where survivors do not restart.

    - `first_step_at` (the report's recovery): when the fault hit a member of the
      quorum, the survivors' first step in a quorum formed after it;
    - `detail["pause_s"]`: the survivors' longest stall the fault caused: the gap
      between their last step before a new quorum and their first step in it (at the
      loss, and again when the hit or replacement group heals in);
    - `detail["rejoin_s"]`: fault -> the first step of the group that comes back: the
      hit group (restarted by its agent), the replacement (`detail["replacement"]`,
      set when it starts) or the spare a scale-up added.
    """

    def __init__(self, event: FaultEvent, records: list[StepRecord]) -> None:
        self.event = event
        self.records = records
        """The launch's records so far (the watch's own list: it grows)."""
        self.victim = _node_name(event.node) if event.node is not None else None
        self.quorum = records[-1].quorum if records else None
        in_quorum = {r.replica_group for r in records if r.quorum == self.quorum}
        self.member = self.victim in in_quorum and event.kind is not FaultKind.SCALE_UP
        if not self.member:
            event.detail["quorum_member"] = False
        self.join_quorum: int | None = None
        self.rejoins = event.kind in (FaultKind.SCALE_UP, FaultKind.KILL_WORKER,
                                      FaultKind.STOP_WORKER, FaultKind.KILL_DURING_PERSIST,
                                      FaultKind.KILL_COORDINATOR_BEFORE_COMMIT) or bool(
            event.detail.get("replaced_after_s") is not None)

    def _joiner(self) -> str | None:
        e = self.event
        if e.kind in (FaultKind.KILL_NODE, FaultKind.PREEMPT, FaultKind.SCALE_DOWN):
            new = e.detail.get("replacement")
            return _node_name(new) if new is not None else None
        return self.victim

    def _pause(self, rec: StepRecord) -> float | None:
        """Gap before survivor record `rec` (the first of its group in a new quorum)."""
        mine = [r for r in self.records if r.replica_group == rec.replica_group
                and r.time is not None and r.time < rec.time]
        return round(rec.time - mine[-1].time, 3) if mine else None

    def update(self, new_records: list[StepRecord]) -> bool:
        e = self.event
        joiner = self._joiner()
        for rec in new_records:
            if rec.time is None or rec.time < e.time:
                continue
            if rec.replica_group in (self.victim, joiner):
                # A record of the quorum the fault met is a step the victim finished
                # before the kill landed (logged late on a loaded machine): a group that
                # comes back enters a quorum formed after the fault.
                if (self.rejoins and rec.replica_group == joiner and rec.quorum != self.quorum
                        and "rejoin_s" not in e.detail):
                    e.detail.update(rejoin_s=round(rec.time - e.time, 3),
                                    rejoined_group=rec.replica_group,
                                    healed_bytes=rec.healed_bytes)
                    self.join_quorum = rec.quorum
                continue
            if rec.quorum == self.quorum:
                continue
            if self.member and e.first_step_at is None:
                e.detected_at = e.rendezvous_at = e.first_step_at = rec.time
                e.detail["pause_s"] = self._pause(rec)
        if self.join_quorum is not None and "join_pause_s" not in e.detail:
            # The survivors' first step in the quorum the joiner entered (its log line may
            # come before or after the joiner's).
            first = next((r for r in self.records if r.quorum == self.join_quorum
                          and r.replica_group not in (self.victim, joiner)), None)
            if first is not None:
                e.detail["join_pause_s"] = self._pause(first)
        lost_done = not self.member or e.first_step_at is not None
        join_done = not self.rejoins or "join_pause_s" in e.detail
        return lost_done and join_done


def came_after_finish(codes: dict[int, int | None], workers_seen: dict[int, set[int]],
                      log_of: Callable[[int], str]) -> set[int]:
    """Nodes that came after the job had finished: another node exited 0, and this one
    started no worker and left because the job's rendezvous was closed (a replacement
    whose agent started late, on a loaded machine, after the survivors reached the
    target). Such a node did nothing wrong and nothing of the job's; its exit status 1
    is no evidence against the run."""
    if not any(c == 0 for c in codes.values()):
        return set()
    return {i for i, c in codes.items()
            if c != 0 and not workers_seen.get(i) and closed_rendezvous(log_of(i))}


def _metrics_tail(path: Path, offset: int) -> tuple[list[str], int]:
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    return data[: end + 1].decode(errors="replace").splitlines(), offset + end + 1


def launch(scenario: Scenario, run_dir: Path, etcd: Any, store_url: str, job_id: str,
           base_env: dict[str, str], faults: bool, deadline_s: float, seed: int,
           cluster_type: type[Cluster] | None = None) -> RunOutcome:
    """Run the job once (with or without faults); always tears the nodes down.
    `cluster_type`: what starts the nodes (`Cluster`, the default: `relight run`
    agents; tests pass stand-ins)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics = run_dir / "metrics.jsonl"
    train_argv, train_env = training_command(scenario, store_url, metrics)
    env = {**os.environ, **base_env, **train_env}
    env.pop(FAULT_PLAN_ENV, None)
    fault_plan = None
    if faults:
        fault_plan = run_dir / "fault-plan.json"
        write_plan_file(fault_plan, None)
        env[FAULT_PLAN_ENV] = f"@{fault_plan}"  # storage.open_store follows this file
    (run_dir / "command.json").write_text(json.dumps({"train_argv": train_argv,
                                                      "env": train_env}, indent=1))
    job_tmp = _job_tmpdir(scenario, env)
    cluster = (cluster_type or Cluster)(scenario, run_dir, etcd, open_store(store_url), job_id,
                                        train_argv, env, fault_plan)
    loop = _Watch(scenario, cluster, Injector(cluster, random.Random(f"victims:{seed}")),
                  metrics, run_dir / "metrics.observed.jsonl")
    if faults:
        loop.schedule_faults(seed)
    started = time.time()
    try:
        for _ in range(scenario.cluster.nodes):
            cluster.start_node()
        finished, detail = loop.run(time.monotonic() + deadline_s, deadline_s)
    finally:
        leaked = cluster.teardown()
        if fault_plan is not None:
            write_plan_file(fault_plan, None)
        loop.close()
        _keep_warm_logs(run_dir)
        if job_tmp is not None:
            shutil.rmtree(job_tmp, ignore_errors=True)
    ended = time.time()
    (run_dir / "actions.json").write_text(json.dumps(cluster.actions, indent=1))
    events = sorted(loop.events, key=lambda e: e.index)
    logs = [n.log_path for _, n in sorted(cluster.nodes.items())]
    if not finished:
        detail = _with_last_errors(detail, loop.records, logs)
    return RunOutcome(records=loop.records, finished=finished and not leaked, detail=detail,
                      started_at=started, ended_at=ended, faults=events,
                      checkpoint_events=loop.ckpt_events, store_url=store_url, leaked=leaked,
                      worker_starts={n: len(p) for n, p in sorted(loop.worker_pids.items())},
                      writer_commits=read_writer_commits(logs, cluster.store.url))


def _job_tmpdir(scenario: Scenario, env: dict[str, str]) -> Path | None:
    """A temporary directory for one launch's processes (`TMPDIR` in their environment),
    deleted after its teardown: each agent makes its warm-start socket's directory there,
    and a SIGKILLed agent or worker cleans nothing up. None when the scenario's
    `training.env` names a TMPDIR of its own (the user's to keep)."""
    if "TMPDIR" in scenario.training.env:
        return None
    # Short, under the system's temp directory: an AF_UNIX socket path must stay
    # under ~100 bytes, which a run directory deep in a CI workspace may not.
    path = Path(tempfile.mkdtemp(prefix="relight-chaos-"))
    env["TMPDIR"] = str(path)
    return path


def _keep_warm_logs(run_dir: Path) -> None:
    """Each node's `warm.log` is a link into the launch's temporary directory: replace it
    with a copy of what it points to before that directory is deleted."""
    for link in run_dir.glob("nodes/*/warm.log"):
        if not link.is_symlink():
            continue
        try:
            text = link.read_bytes()
        except OSError:
            text = None
        link.unlink()
        if text is not None:
            link.write_bytes(text)


def _with_last_errors(detail: str, records: list[StepRecord], logs: list[Path]) -> str:
    """`detail` of a run that did not finish, with the last errors its node logs show:
    a script that failed before its first step left nothing in the metrics, and the
    reason is only there."""
    errors = last_errors(logs)
    if not errors:
        return detail
    what = ("the training script failed before its first step" if not records
            else "last error in the node logs")
    return f"{detail}; {what}: {'; '.join(errors)}"


class _Watch:
    """The loop of one launch: tail the metrics, poll commits, watch workers, fire faults.
    Step-triggered faults fire as soon as their step's line is read, not a poll later."""

    def __init__(self, scenario: Scenario, cluster: Cluster, injector: Injector,
                 metrics: Path, observed: Path) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.injector = injector
        self.metrics = metrics
        self.observed = open(observed, "a")  # noqa: SIM115 - closed in close()
        self.pending: list[_Pending] = []
        self.records: list[StepRecord] = []
        self.events: list[FaultEvent] = []
        self.recoveries: list[_Recovery | _QuorumRecovery] = []
        self.worker_pids: dict[int, set[int]] = {}
        """Every worker process seen on each node: its process starts."""
        self.ckpt_events: list[CheckpointEvent] = []
        self.committed: set[tuple[int, str | None]] = set()
        self.offset = self.line_no = 0
        self.high = -1
        self.recovered_at = -1
        """The highest step logged when the last recovery ended (-1: none has)."""
        self.first_step_time: float | None = None
        self.next_ckpt_poll = 0.0
        self.last_listing = time.time()
        """When the newest listing of the checkpoint root that succeeded began (at first,
        the watch's start: before any node started, so before any commit)."""

    def close(self) -> None:
        self.observed.close()

    def schedule_faults(self, seed: int) -> None:
        for i, spec in enumerate(self.scenario.faults):
            trig = (f"step>={spec.at_step}" if spec.at_step is not None else
                    f"t>={spec.at_time_s}s" if spec.at_time_s is not None else
                    f"during={spec.during}")
            self.pending.append(_Pending(i, spec, trig))
        m = self.scenario.mtbf
        for t, kind in draw_mtbf_schedule(m.kinds, m.count, m.mean_s, m.start_s, seed):
            spec = _mtbf_spec(kind, m, self.scenario.checkpoint.interval)
            self.pending.append(_Pending(len(self.pending), spec, f"mtbf t>={t}s", t))

    def run(self, deadline: float, deadline_s: float) -> tuple[bool, str]:
        while True:
            now = time.time()
            seen = len(self.records)
            new_at = self._read_metrics(now)
            self._poll_commits()
            workers = self.cluster.workers()
            for node, ws in workers.items():
                known = self.worker_pids.setdefault(node, set())
                for w in ws:
                    if w.pid not in known:
                        # Each start in the log: what check 8 counts, one line each.
                        known.add(w.pid)
                        logger.info("node %d: worker process %d (rank %d, local rank %d, "
                                    "agent restart %d)", node, w.pid, w.rank, w.local_rank,
                                    w.restart_count)
            self.cluster.track_all()
            for rc in list(self.recoveries):
                done = (rc.update(self.records[seen:]) if isinstance(rc, _QuorumRecovery)
                        else rc.update(workers, self.scenario.cluster.ranks_per_node, now,
                                       new_at))
                if done:
                    self.recoveries.remove(rc)
                    if not self.recoveries:
                        self.recovered_at = self.high
            self.cluster.run_due()
            self._fire(now)
            if self.cluster.all_exited() and not self.cluster.pending_follow_ups():
                finished, detail = self._ending()
                break
            window = self.scenario.run_for_s
            if (window and self.first_step_time is not None
                    and time.time() - self.first_step_time >= window):
                detail = f"stopped {window:g} s after the first step (run_for_s)"
                finished = False
                break
            if time.monotonic() > deadline:
                detail = (f"deadline of {deadline_s:.0f} s passed at step {self.high}; live "
                          f"agents {self.cluster.live_nodes()}")
                logger.error("%s", detail)
                finished = False
                break
            time.sleep(POLL_S)
        # One last look: the final commit may land as the agents exit.
        self._poll_commits(force=True)
        self._read_metrics(time.time())
        for p in self.pending:
            self.events.append(FaultEvent(index=p.index, kind=p.spec.kind, trigger=p.trigger,
                                          time=time.time(), step=self.high, ok=False,
                                          error="never fired: the run ended first"))
        return finished, detail

    def _ending(self) -> tuple[bool, str]:
        """Whether the job ended by itself (every agent the run kept exited 0), and the
        exit codes that say so. Nodes the faults removed do not count, nor does a node
        that came after the job had finished (below)."""
        codes = self.cluster.exit_codes()
        kept = {i: c for i, c in codes.items() if not self.cluster.nodes[i].removed}
        late = came_after_finish(kept, self.worker_pids, self._node_log)
        counted = {i: c for i, c in kept.items() if i not in late}
        detail = f"agents exited {counted}"
        if len(kept) != len(codes):
            detail += f" (removed nodes: {sorted(set(codes) - set(kept))})"
        if late:
            detail += (f" (nodes {sorted(late)} not counted: they came after the job had "
                       "finished, started no worker and found its rendezvous closed)")
        return bool(counted) and all(c == 0 for c in counted.values()), detail

    def _node_log(self, node: int) -> str:
        try:
            return self.cluster.nodes[node].log_path.read_text(errors="replace")
        except OSError:
            return ""

    def _read_metrics(self, now: float) -> float | None:
        """New metrics lines -> records; fires step-triggered faults line by line. Returns
        the time of the first new record (or None)."""
        lines, self.offset = _metrics_tail(self.metrics, self.offset)
        new_at = None
        for line in lines:
            self.line_no += 1
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict):
                continue
            obj.setdefault("seen", now)
            self.observed.write(json.dumps(obj) + "\n")
            parsed = parse_metrics([json.dumps(obj)]).records
            if not parsed:
                continue
            rec = replace(parsed[0], line=self.line_no)
            self.records.append(rec)
            self.high = max(self.high, rec.step)
            new_at = rec.time if new_at is None else new_at
            if self.first_step_time is None:
                self.first_step_time = now
            self._fire(now, steps_only=True)
        self.observed.flush()
        return new_at

    def _poll_commits(self, force: bool = False) -> None:
        """New commits in the store, each dated by the end of the listing that first
        showed it (a time it was committed by, never one before the commit) and bounded
        below by the start of the listing before (it was not committed when that one
        began)."""
        if not force and time.monotonic() < self.next_ckpt_poll:
            return
        self.next_ckpt_poll = time.monotonic() + CKPT_POLL_S
        began = time.time()
        try:
            seen = self.cluster.probe.commits()
        except StorageError as exc:
            logger.debug("commit poll: %s", exc)
            return  # a listing that failed shows nothing, not the absence of commits
        listed = time.time()
        for step, _ in sorted(seen - self.committed, key=lambda c: c[0]):
            self.ckpt_events.append(CheckpointEvent(step, listed, "commit",
                                                    since=self.last_listing))
        self.committed |= seen
        self.last_listing = began

    def _due(self, p: _Pending, now: float, phase: dict[str, Any] | None) -> bool:
        spec = p.spec
        if p.at_time_s is not None and (
            self.first_step_time is None or now - self.first_step_time < p.at_time_s
        ):
            return False
        if spec.at_step is not None:
            if self.high < spec.at_step:
                return False
            return not spec.after_recovery or (
                not self.recoveries
                and self.high >= self.recovered_at + spec.steps_after_recovery)
        if spec.at_time_s is not None:
            return self.first_step_time is not None and (
                now - self.first_step_time >= spec.at_time_s)
        if spec.during is None or self.high < max(spec.after_step, 1):
            return False
        if spec.kind in DAMAGE and len({step for step, _ in self.committed}) < 2:
            # Damage the newest checkpoint only once an older one exists to fall back to:
            # with one checkpoint, damaging it leaves no good state to resume from, and
            # the runtime refuses to start over silently (preemptible-fleet seed 9 looped
            # on CheckpointNotFoundError).
            return False
        c = self.scenario.cluster
        if spec.kind is FaultKind.SCALE_UP and len(self.cluster.live_nodes()) >= c.max_nodes:
            return False  # the fleet is full: grow it once a node is gone
        if spec.kind is FaultKind.SCALE_DOWN and len(self.cluster.live_nodes()) <= c.min_nodes:
            return False  # shrinking now would stop the job: wait for a node to come back
        if spec.during in SAVE_PHASES:
            return phase is not None and phase["phase"] == spec.during
        if spec.during is Phase.RESTORE:
            # A restarted group is up and has not logged a step yet.
            return any(rc.event.rendezvous_at is not None and rc.event.first_step_at is None
                       for rc in self.recoveries)
        return True

    def _fire(self, now: float, steps_only: bool = False) -> None:
        waiting_phase = [p for p in self.pending if p.spec.during in SAVE_PHASES
                         and self.high >= max(p.spec.after_step, 1)]
        phase = None
        if waiting_phase and not steps_only:
            phase = self.cluster.checkpoint_phase()
        for p in list(self.pending):
            if steps_only and p.spec.at_step is None:
                continue
            if not self._due(p, now, phase):
                continue
            self.pending.remove(p)
            self._inject(p)
            phase = None
        if not steps_only:
            # Hold the next save in the phase the first waiting fault aims at.
            waiting = [p for p in self.pending if p.spec.during in SAVE_PHASES
                       and self.high >= max(p.spec.after_step, 1)]
            self.cluster.arm(_window_plan(waiting[0].spec) if waiting else None)

    def _inject(self, p: _Pending) -> None:
        spec = p.spec
        before = self.cluster.workers()
        ev = self.injector.inject(spec, p.index, p.trigger, self.high)
        if not ev.ok and spec.during is not None and ev.error.startswith("no live"):
            # Aimed at a phase, it met a group still restarting (its victim not up yet):
            # wait for the phase to come round again rather than give up.
            self.pending.append(p)
            return
        self.events.append(ev)
        damage = spec.kind in DAMAGE
        if ev.ok and damage:
            self.ckpt_events.append(CheckpointEvent(ev.detail["checkpoint_step"], ev.time,
                                                    "damage"))
        if ev.ok and spec.kind in RESTARTING and (not damage or spec.kill_after):
            self.recoveries.append(_QuorumRecovery(ev, self.records)
                                   if self.scenario.cluster.replica_groups
                                   else _Recovery(ev, before))


def _reference_scenario(scenario: Scenario) -> Scenario:
    """The reference: the same world size as the chaos run starts with, on one agent (the
    layout depends on the world size only, and one agent needs no multi-node rendezvous
    to be trusted), no faults. Replica groups keep their groups."""
    c = scenario.cluster
    if c.replica_groups:
        # The same groups, no faults: steps in a full quorum are then bitwise comparable.
        return replace(scenario, faults=(), mtbf=replace(scenario.mtbf, count=0))
    one = replace(c, nodes=1, ranks_per_node=c.world_size, min_nodes=1, max_nodes=1)
    return replace(scenario, cluster=one, faults=(), mtbf=replace(scenario.mtbf, count=0))


def _window_plan(spec: FaultSpec) -> dict[str, Any] | None:
    """Storage latency that holds a save in the phase a waiting fault aims at."""
    if not spec.window_s:
        return None
    key = "/index/" if spec.during is Phase.PERSIST else "manifest.json"
    return {"latency_s": spec.window_s, "ops": ["put"], "key_contains": key}


def _mtbf_spec(kind: FaultKind, m: Any, interval: int) -> FaultSpec:
    """A drawn fault: its time gates it; the kinds aimed at a save wait for the next one,
    damage waits until there is a committed checkpoint to damage, and a scale up (down)
    waits until the fleet is below max_nodes (above min_nodes) — see `_Watch._due`."""
    if kind in DAMAGE:
        return FaultSpec(kind=kind, during=Phase.TRAINING, after_step=interval + 2)
    if kind is FaultKind.KILL_DURING_PERSIST:
        return FaultSpec(kind=kind, during=Phase.PERSIST)
    if kind is FaultKind.KILL_COORDINATOR_BEFORE_COMMIT:
        return FaultSpec(kind=kind, during=Phase.BEFORE_COMMIT)
    if kind in (FaultKind.KILL_NODE, FaultKind.PREEMPT):
        return FaultSpec(kind=kind, during=Phase.TRAINING, replace_after_s=m.replace_after_s)
    if kind is FaultKind.STOP_WORKER:
        return FaultSpec(kind=kind, during=Phase.TRAINING, resume_after_s=m.resume_after_s)
    return FaultSpec(kind=kind, during=Phase.TRAINING)


# -- the whole scenario ---------------------------------------------------------------------

def reference_key(scenario: Scenario, workdir: Path | None = None) -> str:
    """Runs with equal keys produce the same reference (the seed only moves the faults):
    the training setup, and the content of the files it runs (`training_files`), so an
    edited script never meets the reference of its previous version."""
    files = training_files(scenario, workdir or Path.cwd())
    ident = {"training": scenario.to_dict()["training"], "target": scenario.target_step,
             "interval": scenario.checkpoint.interval, "world": scenario.cluster.world_size,
             "ranks_per_node": scenario.cluster.ranks_per_node,
             "nodes": scenario.cluster.nodes, "storage": scenario.storage.kind,
             "files": files_digest(files, scenario.base_dir)}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def training_files(scenario: Scenario, workdir: Path) -> list[Path]:
    """The files the training command runs: its Python script and the modules the script
    imports from its own folder (`fingerprint.local_imports`), runtime.train's config,
    and any other argument of the command that names a file (relative to `workdir`, as
    the script would open it). Installed packages, Relight included, are not covered."""
    tr = scenario.training
    files: list[Path] = []
    if tr.config:
        with contextlib.suppress(TrainingFileError):
            files.append(Path(resolve_path(tr.config, scenario)))
    args = list(tr.command)
    if args and args[0].endswith(".py"):
        with contextlib.suppress(TrainingFileError):
            files.extend(local_imports(Path(resolve_path(args[0], scenario))))
        args = args[1:]
    for arg in args:
        path = workdir / arg
        if "{" not in arg and path.is_file():
            files.append(path.resolve())
    return files


@dataclass
class ScenarioResult:
    passed: bool
    out_dir: Path
    report: dict[str, Any]


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """While the harness runs, SIGTERM (`timeout`, a CI job cancelled, a benchmark
    stopped) raises SystemExit(128 + 15) in the main thread, so every `finally` below
    runs: the nodes' teardown, etcd and the S3 server stopped. By default Python dies at
    once, and the agents and workers, each node in a session of its own, outlive it. A
    second SIGTERM during that teardown is ignored rather than cutting it short. Only in
    the main thread (where Python runs signal handlers); elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_IGN)
        logger.warning("the chaos harness got %s: tearing down what it started",
                       signal.Signals(signum).name)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_scenario(scenario: Scenario, out_dir: str | Path, *, seed: int | None = None,
                 junit: str | Path | None = None,
                 reference_cache: str | Path | None = None,
                 keep_etcd_data: bool = False) -> ScenarioResult:
    """Run `scenario` end to end and write the report under `out_dir`. A SIGTERM while it
    runs tears down every process it started, then raises SystemExit(143).
    `keep_etcd_data`: keep etcd's data directory under `out_dir/etcd` (tens of MB of
    preallocated write-ahead log; by default it lives in a temporary directory, deleted
    at the end, and only etcd's log is kept)."""
    with _sigterm_unwinds():
        return _run_scenario(scenario, out_dir, seed=seed, junit=junit,
                             reference_cache=reference_cache, keep_etcd_data=keep_etcd_data)


def _etcd_for(scenario: Scenario, out: Path, data_root: Path) -> EtcdServer | _EtcdMembers:
    """The run's etcd: its data under `data_root`, its log(s) under `out/etcd`."""
    (out / "etcd").mkdir(parents=True, exist_ok=True)
    if scenario.cluster.etcd_members == 1:
        return EtcdServer(data_root / "data", log_path=out / "etcd" / "etcd.log")
    return _EtcdMembers(EtcdCluster(data_root, size=scenario.cluster.etcd_members))


def _keep_etcd_logs(data_root: Path, out: Path) -> None:
    """A cluster's members log beside their data: copy the logs out before the data goes."""
    for log in data_root.glob("*.etcd.log"):
        shutil.copyfile(log, out / "etcd" / log.name)


def _run_scenario(scenario: Scenario, out_dir: str | Path, *, seed: int | None,
                  junit: str | Path | None, reference_cache: str | Path | None,
                  keep_etcd_data: bool) -> ScenarioResult:
    if seed is not None:
        scenario = scenario.with_seed(seed)
    check_training_files(scenario)
    out = Path(out_dir).resolve()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / "scenario.json").write_text(json.dumps(scenario.to_dict(), indent=1))
    notes: list[str] = []
    data_root = (out / "etcd" if keep_etcd_data
                 else Path(tempfile.mkdtemp(prefix="relight-chaos-etcd-")))
    etcd = _etcd_for(scenario, out, data_root)
    s3 = None
    try:
        etcd.start()
        base_env: dict[str, str] = {}
        if scenario.storage.kind == "s3":
            from relight.chaos.s3_server import S3Server

            s3 = S3Server(out / "s3" / "data").start()
            base_env.update(s3.env())
            os.environ.update(s3.env())  # this process reads the store too

        def url(kind: str) -> str:
            if s3 is not None:
                return s3.url(f"{out.name}-{kind}")
            return str(out / f"ckpt-{kind}")

        ref_outcome: RunOutcome | None = None
        ref_records: list[StepRecord] | None = None
        ref_url = None
        cache = (Path(reference_cache) / reference_key(scenario) if reference_cache
                 else None)
        if scenario.verify.reference:
            if cache is not None and (cache / "reference.json").is_file():
                cached = json.loads((cache / "reference.json").read_text())
                ref_records = parse_metrics(cached["metrics"]).records
                ref_url = str(cache / "ckpt") if (cache / "ckpt").is_dir() else None
                notes.append(f"reference run reused from {cache}")
            else:
                ref_deadline = scenario.reference_deadline_s or scenario.deadline_s
                logger.info("reference run (no faults) ...")
                ref_outcome = launch(_reference_scenario(scenario), out / "reference", etcd,
                                     url("reference"),
                                     f"ref-{out.name}", base_env, faults=False,
                                     deadline_s=ref_deadline, seed=scenario.seed)
                ref_records = ref_outcome.records
                ref_url = url("reference")
                if not ref_outcome.finished:
                    notes.append(f"the reference run did not finish: {ref_outcome.detail}")
                elif cache is not None:
                    cache.mkdir(parents=True, exist_ok=True)
                    _copy_store(open_store(ref_url), open_store(str(cache / "ckpt")))
                    lines = (out / "reference" / "metrics.observed.jsonl").read_text()
                    (cache / "reference.json").write_text(json.dumps(
                        {"metrics": lines.splitlines()}))
        if ref_outcome is not None and not ref_outcome.finished:
            # Faults on a run that fails without them prove nothing, and cost the whole
            # chaos deadline: the report says why the reference failed instead.
            logger.error("the reference run failed: %s; not starting the chaos run",
                         ref_outcome.detail)
            outcome = _not_run(scenario, url("chaos"),
                               f"not run: the reference run (no faults) failed: "
                               f"{ref_outcome.detail}")
            ref_url = None
        else:
            logger.info("chaos run (seed %d) ...", scenario.seed)
            outcome = launch(scenario, out / "chaos", etcd, url("chaos"), f"chaos-{out.name}",
                             base_env, faults=True, deadline_s=scenario.deadline_s,
                             seed=scenario.seed)
        if outcome.leaked:
            notes.append(f"processes leaked past teardown: {outcome.leaked}")
        # Bring etcd back if a fault left it down, for nothing else needs it now; evidence.
        chaos_probe = CheckpointProbe(open_store(outcome.store_url))
        verified = chaos_probe.verify_all()
        weights = _compare(scenario, chaos_probe, ref_url)
        evidence = RunEvidence(
            records=outcome.records, target_step=scenario.target_step,
            interval=scenario.checkpoint.interval, finished=outcome.finished,
            finish_detail=outcome.detail, reference=ref_records,
            checkpoint_events=outcome.checkpoint_events, verified=verified,
            faults=[FaultMark(e.index, e.kind, e.time, e.ok,
                              required=not e.trigger.startswith("mtbf"), error=e.error,
                              node=e.node)
                    for e in outcome.faults],
            weights=weights, compare_weights=scenario.verify.compare_weights,
            tolerances=Tolerances(loss_rtol=scenario.verify.loss_rtol,
                                  weights_rtol=scenario.verify.weights_rtol,
                                  weights_atol=scenario.verify.weights_atol),
            max_restore_persistent_bytes=scenario.verify.max_restore_persistent_bytes,
            replica_groups=scenario.cluster.replica_groups,
            ranks_per_node=scenario.cluster.ranks_per_node,
            worker_starts=outcome.worker_starts,
            writer_commits=outcome.writer_commits,
        )
        results = verify(evidence)
        report = build_report(
            scenario=scenario.to_dict(), seed=scenario.seed, results=results,
            faults=[e.to_dict() for e in outcome.faults], records=outcome.records,
            reference=ref_records, started_at=outcome.started_at, ended_at=outcome.ended_at,
            reference_wall_s=(ref_outcome.ended_at - ref_outcome.started_at
                              if ref_outcome else None),
            notes=notes,
            replica_groups=scenario.cluster.nodes if scenario.cluster.replica_groups else None,
        )
        write_report(out, report)
        if junit:
            write_junit(junit, report)
        return ScenarioResult(report["passed"], out, report)
    finally:
        if s3 is not None:
            s3.stop()
        etcd.stop()
        if not keep_etcd_data:
            _keep_etcd_logs(data_root, out)
            shutil.rmtree(data_root, ignore_errors=True)


def _not_run(scenario: Scenario, store_url: str, why: str) -> RunOutcome:
    """The outcome of a chaos run that was not started: no step, every fault unfired."""
    now = time.time()
    faults = [FaultEvent(index=i, kind=spec.kind, trigger="-", time=now, step=-1, ok=False,
                         error="never fired: the chaos run was not started")
              for i, spec in enumerate(scenario.faults)]
    return RunOutcome(records=[], finished=False, detail=why, started_at=now, ended_at=now,
                      faults=faults, store_url=store_url)


class _EtcdMembers:
    """An etcd cluster seen as the one etcd the runner and the injectors use: the
    endpoint is every member's, and `etcd_restart` kills the leader (the member whose
    loss costs most) and starts that member again."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self._down: int | None = None

    @property
    def endpoint(self) -> str:
        return ",".join(self.cluster.endpoints)

    @property
    def pid(self) -> int | None:
        return self.cluster.members[self.cluster.leader()].pid

    def start(self) -> None:
        if self._down is None:
            self.cluster.start()
        else:
            self.cluster.start_member(self._down)
            self._down = None

    def kill(self) -> None:
        self._down = self.cluster.leader()
        self.cluster.kill(self._down)

    def stop(self) -> None:
        self.cluster.stop()


def _copy_store(src: Store, dst: Store) -> int:
    """Copy every object of `src` to `dst` (the reference checkpoints into a local cache,
    from whichever store the reference run wrote them to). Returns the objects copied."""
    keys = src.list()
    for key in keys:
        dst.put(key, src.get(key))
    return len(keys)


def _compare(scenario: Scenario, chaos_probe: CheckpointProbe, ref_url: str | None
             ) -> WeightsComparison | None:
    if not scenario.verify.compare_weights:
        return None
    if ref_url is None:
        return WeightsComparison(compared=False, error="no reference checkpoint to compare")
    target = scenario.target_step
    try:
        ref_state = CheckpointProbe(open_store(ref_url)).read_state(target)
        chaos_state = chaos_probe.read_state(target)
    except Exception as exc:  # noqa: BLE001 - reported as a broken invariant, not a crash
        logger.exception("final states could not be read")
        return WeightsComparison(compared=False, error=f"{type(exc).__name__}: {exc}")
    return compare_final_states(chaos_state, ref_state, rtol=scenario.verify.weights_rtol,
                                atol=scenario.verify.weights_atol, chaos_step=target,
                                ref_step=target)
