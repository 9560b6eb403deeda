"""The cluster of one launch: the nodes (one agent each, in a process session of its
own), what the fault injectors may do to them (`faults.ClusterControl`), follow-up timers,
and the teardown that leaves nothing behind; the run's etcd (one server, or a cluster
seen as one) and torchrun's standalone c10d store.

Every process tree the cluster starts is tracked while it runs (`Cluster.track_all`), so
a dead agent cannot orphan a worker: `Cluster.teardown` SIGKILLs each pid it ever saw
and returns the ones that survived.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from relight.chaos.ckpt_probe import CheckpointProbe
from relight.chaos.commands import agent_command
from relight.chaos.faults import FaultInjectionError, find_workers, kill_tree, process_tree
from relight.chaos.scenario import Scenario
from relight.ckpt.local_tier import TIER_NODE_ENV, local_tier_dir
from relight.elastic.etcd_server import EtcdCluster, EtcdServer, free_port
from relight.errors import RelightError
from relight.runtime.replicas import GROUP_ENV
from relight.storage import Store
from relight.storage.testing import corrupt_object, write_plan_file

logger = logging.getLogger(__name__)

__all__ = ["ChaosRunError", "Cluster", "EtcdMembers", "Node", "etcd_for", "job_tmpdir",
           "keep_etcd_logs", "keep_warm_logs", "node_name", "start_c10d_store"]


class ChaosRunError(RelightError, RuntimeError):
    """The harness itself could not run the scenario (servers, launcher)."""


@dataclass
class Node:
    """One simulated node: its agent's process, its log, when it started, and whether a
    fault removed it (a removed node's exit status does not count)."""

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
        self.nodes: dict[int, Node] = {}
        self.seen: dict[int, psutil.Process] = {}
        self._timers: list[tuple[float, str, Callable[[], None]]] = []
        self._memory_to_drop: list[tuple[Node, list[int]]] = []
        self.actions: list[dict[str, Any]] = []
        c = scenario.cluster
        self.nnodes = f"{c.min_nodes}:{c.max_nodes}"
        # c10d: the first agent hosts the rendezvous store on this port, or the harness.
        self.endpoint = (etcd.endpoint if c.rendezvous == "relight-etcd"
                         else f"127.0.0.1:{free_port()}")
        self.c10d_store: subprocess.Popen | None = None
        if c.rendezvous == "c10d" and c.c10d_store == "standalone":
            self.c10d_store = start_c10d_store(self.endpoint, run_dir / "c10d-store.log")

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
            job_id, nnodes = f"{self.job_id}-{node_name(index)}", "1"
            train_argv = [*train_argv, f"--replica.job={self.job_id}",
                          f"--replica.etcd={self.endpoint}", "--replica.host=127.0.0.1",
                          f"--replica.min_groups={c.nodes}"]
            env = {**env, GROUP_ENV: node_name(index)}
        argv = agent_command(self.scenario, self.endpoint, job_id, nnodes, train_argv,
                             node_dir)
        if c.node_memory == "per_node":
            env = {**env, TIER_NODE_ENV: node_name(index)}
        with open(log_path, "ab") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.workdir, start_new_session=True)
        self.nodes[index] = Node(index, proc, log_path, time.time())
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
        return local_tier_dir(str(base), self.store.url, node_name(node)) if base else None

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

    def _signal_agent(self, n: Node, sig: int) -> list[int]:
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


def start_c10d_store(endpoint: str, log_path: Path) -> subprocess.Popen:
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


def node_name(index: int) -> str:
    return f"node-{index}"


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def job_tmpdir(scenario: Scenario, env: dict[str, str]) -> Path | None:
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


def keep_warm_logs(run_dir: Path) -> None:
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


# -- etcd -----------------------------------------------------------------------------------

def etcd_for(scenario: Scenario, out: Path, data_root: Path) -> EtcdServer | EtcdMembers:
    """The run's etcd: its data under `data_root`, its log(s) under `out/etcd`."""
    (out / "etcd").mkdir(parents=True, exist_ok=True)
    if scenario.cluster.etcd_members == 1:
        return EtcdServer(data_root / "data", log_path=out / "etcd" / "etcd.log")
    return EtcdMembers(EtcdCluster(data_root, size=scenario.cluster.etcd_members))


def keep_etcd_logs(data_root: Path, out: Path) -> None:
    """A cluster's members log beside their data: copy the logs out before the data goes."""
    for log in data_root.glob("*.etcd.log"):
        shutil.copyfile(log, out / "etcd" / log.name)


class EtcdMembers:
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
