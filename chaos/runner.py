"""The chaos runner: real etcd + real storage + N `relight run` nodes on loopback, faults
injected on a timeline, a global deadline, teardown no matter what, then the reference
run, the verifier and the report.

Order of `run_scenario`:

1. start etcd (`cluster.etcd_for`) and, for `storage.kind = "s3"`, SeaweedFS (`S3Server`);
2. the uninterrupted reference run (`reference.reference_scenario`: same command, same
   initial world size, no faults), unless a cached one for the same training setup is
   given (`reference.reference_key`);
3. the chaos run (`launch`): start the nodes (`cluster.Cluster`: one elastic agent each,
   all on the same etcd, running `commands.agent_command`), then one loop (`_Watch`) until
   every agent has exited or the deadline passed: tail the metrics and poll the
   checkpoint store for commits (`measure`), watch the worker processes, fire due faults
   and follow-ups (`schedule`);
4. always: SIGKILL every process tree the run started (agents, workers, their children),
   stop the servers, and check that nothing survived;
5. gather the evidence (committed checkpoints verified, final states compared), verify,
   write the report.

The modules, one job each: `commands` (what the nodes run), `cluster` (the processes and
servers of a launch), `schedule` (when each fault is due, and injecting it), `measure`
(metrics, commits, recoveries as the run goes), `reference` (the fault-free run and its
cache), `node_logs` (what the nodes' logs say), and this one, which runs them in order.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relight.chaos.ckpt_probe import (
    CheckpointProbe,
    compare_final_states,
    read_writer_commits,
)
from relight.chaos.cluster import (
    ChaosRunError,
    Cluster,
    etcd_for,
    job_tmpdir,
    keep_etcd_logs,
    keep_warm_logs,
)
from relight.chaos.commands import TrainingFileError, check_training_files, training_command
from relight.chaos.faults import FaultEvent, Injector
from relight.chaos.logs import StepRecord
from relight.chaos.measure import CommitPoll, MetricsTail, Recoveries
from relight.chaos.node_logs import came_after_finish, with_last_errors
from relight.chaos.reference import load_cached, reference_key, reference_scenario, save_cached
from relight.chaos.report import build_report, write_junit, write_report
from relight.chaos.scenario import Scenario
from relight.chaos.schedule import FaultSchedule, planned_faults
from relight.chaos.verifier import (
    CheckpointEvent,
    FaultMark,
    RunEvidence,
    Tolerances,
    WeightsComparison,
    WriterCommit,
    verify,
)
from relight.storage import open_store
from relight.storage.testing import FAULT_PLAN_ENV, write_plan_file

logger = logging.getLogger(__name__)

__all__ = ["ChaosRunError", "RunOutcome", "ScenarioResult", "TrainingFileError", "launch",
           "run_scenario"]

POLL_S = 0.2


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


# -- one launch -----------------------------------------------------------------------------

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
    job_tmp = job_tmpdir(scenario, env)
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
        keep_warm_logs(run_dir)
        if job_tmp is not None:
            shutil.rmtree(job_tmp, ignore_errors=True)
    ended = time.time()
    (run_dir / "actions.json").write_text(json.dumps(cluster.actions, indent=1))
    events = sorted(loop.events, key=lambda e: e.index)
    logs = [n.log_path for _, n in sorted(cluster.nodes.items())]
    if not finished:
        detail = with_last_errors(detail, loop.records, logs)
    return RunOutcome(records=loop.records, finished=finished and not leaked, detail=detail,
                      started_at=started, ended_at=ended, faults=events,
                      checkpoint_events=loop.ckpt_events, store_url=store_url, leaked=leaked,
                      worker_starts={n: len(p) for n, p in sorted(loop.worker_pids.items())},
                      writer_commits=read_writer_commits(logs, cluster.store.url))


class _Watch:
    """The loop of one launch: tail the metrics, poll commits, watch workers, fire faults.
    Step-triggered faults fire as soon as their step's line is read, not a poll later."""

    def __init__(self, scenario: Scenario, cluster: Cluster, injector: Injector,
                 metrics: Path, observed: Path) -> None:
        self.scenario = scenario
        self.cluster = cluster
        self.metrics = MetricsTail(metrics, observed)
        self.commits = CommitPoll(cluster.probe)
        c = scenario.cluster
        self.recoveries = Recoveries(c.replica_groups, c.ranks_per_node)
        self.schedule = FaultSchedule(scenario, cluster, injector, self.metrics, self.commits,
                                      self.recoveries)
        self.worker_pids: dict[int, set[int]] = {}
        """Every worker process seen on each node: its process starts."""

    @property
    def records(self) -> list[StepRecord]:
        return self.metrics.records

    @property
    def events(self) -> list[FaultEvent]:
        return self.schedule.events

    @property
    def ckpt_events(self) -> list[CheckpointEvent]:
        return self.commits.events

    def close(self) -> None:
        self.metrics.close()

    def schedule_faults(self, seed: int) -> None:
        self.schedule.pending.extend(planned_faults(self.scenario, seed))

    def run(self, deadline: float, deadline_s: float) -> tuple[bool, str]:
        while True:
            now = time.time()
            seen = len(self.records)
            new_at = self._read_metrics(now)
            self.commits.poll()
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
            self.recoveries.update(workers, now, new_at, self.records[seen:], self.metrics.high)
            self.cluster.run_due()
            self.schedule.fire(now)
            if self.cluster.all_exited() and not self.cluster.pending_follow_ups():
                finished, detail = self._ending()
                break
            window = self.scenario.run_for_s
            first_step_time = self.metrics.first_step_time
            if (window and first_step_time is not None
                    and time.time() - first_step_time >= window):
                detail = f"stopped {window:g} s after the first step (run_for_s)"
                finished = False
                break
            if time.monotonic() > deadline:
                detail = (f"deadline of {deadline_s:.0f} s passed at step "
                          f"{self.metrics.high}; live agents {self.cluster.live_nodes()}")
                logger.error("%s", detail)
                finished = False
                break
            time.sleep(POLL_S)
        # One last look: the final commit may land as the agents exit.
        self.commits.poll(force=True)
        self._read_metrics(time.time())
        self.schedule.never_fired()
        return finished, detail

    def _read_metrics(self, now: float) -> float | None:
        """New metrics lines -> records; fires step-triggered faults line by line. Returns
        the time of the first new record (or None)."""
        return self.metrics.read(now, lambda: self.schedule.fire(now, steps_only=True))

    def _ending(self) -> tuple[bool, str]:
        """Whether the job ended by itself (every agent the run kept exited 0), and the
        exit codes that say so. Nodes the faults removed do not count, nor does a node
        that came after the job had finished (`node_logs.came_after_finish`)."""
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


# -- the whole scenario ---------------------------------------------------------------------

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
    etcd = etcd_for(scenario, out, data_root)
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
            cached = load_cached(cache) if cache is not None else None
            if cached is not None:
                ref_records, ref_url = cached
                notes.append(f"reference run reused from {cache}")
            else:
                ref_deadline = scenario.reference_deadline_s or scenario.deadline_s
                logger.info("reference run (no faults) ...")
                ref_outcome = launch(reference_scenario(scenario), out / "reference", etcd,
                                     url("reference"),
                                     f"ref-{out.name}", base_env, faults=False,
                                     deadline_s=ref_deadline, seed=scenario.seed)
                ref_records = ref_outcome.records
                ref_url = url("reference")
                if not ref_outcome.finished:
                    notes.append(f"the reference run did not finish: {ref_outcome.detail}")
                elif cache is not None:
                    save_cached(cache, ref_url, out / "reference" / "metrics.observed.jsonl")
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
            keep_etcd_logs(data_root, out)
            shutil.rmtree(data_root, ignore_errors=True)


def _not_run(scenario: Scenario, store_url: str, why: str) -> RunOutcome:
    """The outcome of a chaos run that was not started: no step, every fault unfired."""
    now = time.time()
    faults = [FaultEvent(index=i, kind=spec.kind, trigger="-", time=now, step=-1, ok=False,
                         error="never fired: the chaos run was not started")
              for i, spec in enumerate(scenario.faults)]
    return RunOutcome(records=[], finished=False, detail=why, started_at=now, ended_at=now,
                      faults=faults, store_url=store_url)


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
