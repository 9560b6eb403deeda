"""The torchft arm of the goodput benchmark: torchft's own Manager and lighthouse on the
job the Relight arms train, under the same failure schedule.

    python benchmarks/torchft_arm.py --groups 4 --duration 120 --schedule schedule.json \
        --out DIR [--steps N] [--seed S]
    python benchmarks/torchft_arm.py --groups 4 --duration 120 --mtbf 15 --out DIR

Runs with the interpreter of torchft's own environment (`scripts/torchft-env.sh`) and
``PYTHONPATH`` at the repository root: torchft is never a dependency of Relight, and this
file imports Relight's model and data (`runtime.model`, `runtime.data`, which need only
torch and numpy) so that the job is the same. Nothing of Relight's runtime is used.

What it starts:

- a torchft lighthouse (the wheel's ``torchft_lighthouse`` console script) on a loopback
  port, ``--min_replicas 1``, torchft's default join and heartbeat timeouts;
- ``--groups`` replica groups, each one process (one rank, gloo, CPU) with a TCPStore of
  its own, a `torchft.Manager` (async quorum, the default) over a `torchft.ProcessGroupGloo`,
  and `PGTransport` as the checkpoint transport, as torchft's ``train_ddp.py`` does. The
  gradients cross groups in one flat `Manager.allreduce` (SUM) per step;
- the global batch stays fixed whatever the number of live groups: each step's
  participants (`Manager.num_participants`) take contiguous shares of it
  (`runtime.data.BatchPlan`) by their `Manager.participating_rank`, each group's loss
  weighted by its share; a group that is healing contributes zeros, as torchft has it.

The groups first build their model and Manager, then wait for all to be ready, so the
window does not measure imports. The measured window is ``--duration`` seconds from the
first committed step. At each fault of the schedule (seconds after the first committed
step) one live group, drawn by ``--seed``, is SIGKILLed; ``replace_after_s`` later a new
group (a new process, a new replica id) starts and heals from the live peers through
torchft's checkpoint transport and the `Manager`'s ``load_state_dict`` callback.

Outputs in ``--out``: ``metrics.jsonl`` (one record per committed step per group:
group, step, time, step_time_s, quorum_s, participants, loss), ``heals.jsonl`` (per heal the
bytes received and the receive time), ``summary.json`` (also printed), and one log per
process under ``logs/``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

try:
    from relight.errors import RelightError
except ModuleNotFoundError as exc:  # run by torchft's own interpreter
    raise SystemExit(f"torchft arm: {exc}: this interpreter's environment has no relight; "
                     "run scripts/torchft-env.sh (it installs relight there, without "
                     "dependencies)") from None
from relight.benchmarks.goodput_metrics import (  # noqa: E402
    fleet_goodput,
    heal_times,
    job_arguments,
    kept_steps,
    outage_pause,
    pauses,
    read_records,
    steps_in_window,
    window_start,
)

FAULT_KINDS = ("kill_group", "kill_lighthouse")
PAUSE_WINDOW_S = 30.0


class ScheduleError(RelightError, ValueError):
    """The failure schedule is not a list of faults this arm knows."""


@dataclass(frozen=True, slots=True)
class Fault:
    time_s: float
    """Seconds after the first committed step."""
    kind: str = "kill_group"
    """``kill_group`` (SIGKILL one live group's process) or ``kill_lighthouse``."""
    replace_after_s: float | None = 10.0
    """Start the replacement (a new group, or the lighthouse again) this long after the
    fault; None: never."""


def parse_schedule(raw: Any) -> list[Fault]:
    """A schedule from its JSON form, a list of ``{"time_s", "kind", "replace_after_s"}``."""
    if not isinstance(raw, list):
        raise ScheduleError(f"a schedule is a JSON list of faults, got {type(raw).__name__}")
    out = []
    for i, f in enumerate(raw):
        if not isinstance(f, dict) or "time_s" not in f:
            raise ScheduleError(f"fault {i} must be an object with time_s: {f!r}")
        unknown = set(f) - {"time_s", "kind", "replace_after_s"}
        if unknown:
            raise ScheduleError(f"fault {i} has unknown keys {sorted(unknown)}")
        kind = f.get("kind", "kill_group")
        if kind not in FAULT_KINDS:
            raise ScheduleError(f"fault {i}: kind {kind!r} is not one of {FAULT_KINDS}")
        try:
            t = float(f["time_s"])
            r = f.get("replace_after_s", 10.0)
            r = None if r is None else float(r)
        except (TypeError, ValueError):
            raise ScheduleError(f"fault {i}: time_s and replace_after_s must be numbers: "
                                f"{f!r}") from None
        if t < 0 or (r is not None and r < 0):
            raise ScheduleError(f"fault {i}: times must be >= 0: {f!r}")
        out.append(Fault(t, kind, r))
    return sorted(out, key=lambda f: f.time_s)


def mtbf_schedule(mtbf_s: float, duration_s: float, seed: int, replace_after_s: float,
                  quiet_tail_s: float = 20.0) -> list[Fault]:
    """Group kills at exponential gaps of mean ``mtbf_s`` (seeded), none in the last
    ``quiet_tail_s`` of the window, where a fault's cost would fall outside it."""
    if mtbf_s <= 0:
        raise ScheduleError(f"mtbf must be > 0, got {mtbf_s}")
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t >= duration_s - quiet_tail_s:
            return out
        out.append(Fault(round(t, 3), "kill_group", replace_after_s))


# --------------------------------------------------------------------------------------
# One replica group (``--worker``): torch and torchft are imported only here.


def _tensor_bytes(obj: Any) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _append(path: Path, record: dict[str, Any]) -> None:
    """One O_APPEND write per record, so processes can share the file."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def worker(args: argparse.Namespace) -> int:
    import logging
    from datetime import timedelta

    import torch
    import torch.nn.functional as F
    from torch.distributed import ReduceOp, TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    from relight.runtime.config import load_config
    from relight.runtime.data import BatchPlan, build_corpus
    from relight.runtime.model import build_model

    events = Path(args.out) / "events.jsonl"
    _append(events, {"group": args.group, "event": "imported", "time": time.time()})
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)
    gid = args.group
    out = Path(args.out)
    heals = out / "heals.jsonl"

    class TimedPGTransport(PGTransport):
        """torchft's PGTransport, timing each checkpoint it receives (a heal)."""

        def recv_checkpoint(self, src_rank: int, metadata: str, step: int,
                            timeout: timedelta) -> Any:
            t0 = time.perf_counter()
            sd = super().recv_checkpoint(src_rank, metadata, step, timeout)
            _append(heals, {"group": gid, "time": time.time(), "step": step,
                            "src_replica_rank": src_rank,
                            "recv_s": round(time.perf_counter() - t0, 4),
                            "bytes": _tensor_bytes(sd)})
            return sd

    # The job of `benchmarks.goodput`'s Relight arms (`goodput_metrics.JOBS`).
    cfg = load_config(ROOT / "configs" / "tiny.toml", job_arguments(args.job))
    model = build_model(cfg.model, cfg.train.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.optim.lr)
    corpus = build_corpus(cfg.data, model_vocab=cfg.model.vocab_size)
    gb, mb = cfg.data.global_batch_size, cfg.data.micro_batch_size

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=args.pg_timeout))
    transport = TimedPGTransport(pg, timeout=timedelta(seconds=args.timeout),
                                 device=torch.device("cpu"))
    manager = Manager(
        pg=pg, load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=timedelta(seconds=args.timeout), rank=0, world_size=1,
        store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
        replica_id=f"relight_bench_{gid}", hostname="127.0.0.1",
        checkpoint_transport=transport, quorum_retries=args.quorum_retries)
    metrics = out / "metrics.jsonl"
    _append(events, {"group": gid, "event": "manager", "time": time.time()})
    if args.go:
        (out / "ready" / str(gid)).touch()
        go = Path(args.go)
        while not go.exists():
            time.sleep(0.05)
    try:
        while manager.current_step() < args.steps:
            t0 = time.perf_counter()
            manager.start_quorum()
            opt.zero_grad(set_to_none=True)
            n = manager.num_participants()  # waits for the quorum (and a heal's transfer)
            rank = manager.participating_rank()
            quorum_s = time.perf_counter() - t0
            local_loss = torch.zeros(1)
            if rank is not None and manager.is_participating():
                plan = BatchPlan(global_batch=gb, micro_batch=mb, dp=1, dp_rank=0,
                                 replicas=n, replica_rank=rank)
                for start in plan.microbatch_starts(manager.current_step() * gb):
                    s = corpus.samples(start, mb)
                    logits = model(s[:, :-1])
                    loss = F.cross_entropy(logits.flatten(0, 1).float(),
                                           s[:, 1:].flatten()) / plan.units
                    loss.backward()
                    local_loss += loss.detach()
            flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p))
                              .flatten() for p in params] + [local_loss])
            manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            offset = 0
            for p in params:
                k = p.numel()
                p.grad = flat[offset:offset + k].view_as(p).clone()
                offset += k
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            if not manager.should_commit():
                continue
            opt.step()
            _append(metrics, {"group": gid, "step": manager.current_step(),
                              "time": time.time(),
                              "step_time_s": round(time.perf_counter() - t0, 5),
                              "quorum_s": round(quorum_s, 5), "participants": n,
                              "loss": float(flat[-1])})
    finally:
        manager.shutdown(wait=False)
    return 0


# --------------------------------------------------------------------------------------
# The orchestrator: lighthouse, groups, faults, summary. No torch here.


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the arm dies, even by SIGKILL (a caller's
    timeout), where no ``finally`` runs. Each child has a session of its own, so nothing
    else would reach it (Linux; elsewhere the ``finally`` is all there is)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _raise_on_term(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the lighthouse exited {proc.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"the lighthouse did not listen on 127.0.0.1:{port} "
                       f"within {timeout_s} s")


@dataclass
class Fleet:
    """Every process the arm started, so that all are killed at the end."""

    out: Path
    args: argparse.Namespace
    lighthouse_port: int = 0
    lighthouse: subprocess.Popen | None = None
    groups: dict[int, subprocess.Popen] = field(default_factory=dict)
    started: dict[int, float] = field(default_factory=dict)
    dead: list[subprocess.Popen] = field(default_factory=list)

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen:
        logs = self.out / "logs"
        logs.mkdir(exist_ok=True)
        fh = open(logs / log, "ab")
        try:
            return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent,
                                    env={**os.environ, "PYTHONPATH": str(ROOT)})
        finally:
            fh.close()

    def start_lighthouse(self) -> None:
        exe = shutil.which("torchft_lighthouse", path=str(Path(sys.executable).parent)) \
            or shutil.which("torchft_lighthouse")
        if exe is None:
            raise RuntimeError("no torchft_lighthouse next to this interpreter: run this "
                               "arm with the python of scripts/torchft-env.sh's venv")
        self.lighthouse_port = self.lighthouse_port or _free_port()
        self.lighthouse = self._spawn(
            [exe, "--min_replicas", "1", "--bind", f"127.0.0.1:{self.lighthouse_port}"],
            "lighthouse.log")
        _wait_port(self.lighthouse_port, self.lighthouse, 60.0)

    def start_group(self, gid: int, go: Path | None) -> None:
        a = self.args
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--group", str(gid),
               "--out", str(self.out), "--lighthouse", f"http://127.0.0.1:{self.lighthouse_port}",
               "--steps", str(a.steps), "--job", a.job, "--timeout", str(a.timeout),
               "--pg-timeout", str(a.pg_timeout), "--quorum-retries", str(a.quorum_retries)]
        if go is not None:
            cmd += ["--go", str(go)]
        if a.verbose:
            cmd.append("--verbose")
        self.started[gid] = time.time()
        self.groups[gid] = self._spawn(cmd, f"group{gid}.log")

    def kill(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
        self.dead.append(proc)

    def live_groups(self) -> list[int]:
        return sorted(g for g, p in self.groups.items() if p.poll() is None)

    def stop_all(self) -> None:
        procs = list(self.groups.values()) + ([self.lighthouse] if self.lighthouse else [])
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass


def _first_commit(path: Path) -> float | None:
    recs = read_records(path)
    return min((r["time"] for r in recs), default=None)


def run(args: argparse.Namespace, schedule: list[Fault]) -> dict[str, Any]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "heals.jsonl", "events.jsonl", "summary.json"):
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / "ready", ignore_errors=True)
    (out / "ready").mkdir()
    go = out / "go"
    go.unlink(missing_ok=True)
    metrics = out / "metrics.jsonl"
    rng = random.Random(args.seed)
    fleet = Fleet(out, args)
    fired: list[dict[str, Any]] = []
    load_before = os.getloadavg()
    try:
        fleet.start_lighthouse()
        for g in range(args.groups):
            fleet.start_group(g, go)
        deadline = time.monotonic() + args.start_timeout
        while len(list((out / "ready").iterdir())) < args.groups:
            dead = [g for g, p in fleet.groups.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"group(s) {dead} exited before training; see "
                                   f"{out / 'logs'}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the groups were not ready within {args.start_timeout} s")
            time.sleep(0.1)
        go.touch()
        while (first := _first_commit(metrics)) is None:
            if time.monotonic() > deadline + args.start_timeout:
                raise TimeoutError("no step committed: see the logs under "
                                   f"{out / 'logs'}")
            time.sleep(0.05)
        # (due unix time, action, detail): faults and their replacements
        pending: list[tuple[float, str, Any]] = [(first + f.time_s, f.kind, f) for f in schedule]
        next_gid = args.groups
        end = first + args.duration
        while True:
            now = time.time()
            if now >= end:
                break
            pending.sort(key=lambda x: x[0])
            while pending and pending[0][0] <= now:
                due, action, f = pending.pop(0)
                if action == "kill_group":
                    live = fleet.live_groups()
                    if not live:
                        fired.append({"kind": action, "time": now, "skipped": "no live group"})
                        continue
                    victim = rng.choice(live)
                    fleet.kill(fleet.groups[victim])
                    rec = {"kind": action, "time": time.time(), "time_s": f.time_s,
                           "victim": victim, "survivors": [g for g in live if g != victim]}
                    if f.replace_after_s is not None:
                        rec["replacement"] = next_gid
                        pending.append((rec["time"] + f.replace_after_s, "start_group",
                                        next_gid))
                        next_gid += 1
                    fired.append(rec)
                elif action == "kill_lighthouse":
                    if fleet.lighthouse is not None:
                        fleet.kill(fleet.lighthouse)
                    fired.append({"kind": action, "time": time.time(), "time_s": f.time_s,
                                  "survivors": fleet.live_groups()})
                    if f.replace_after_s is not None:
                        pending.append((time.time() + f.replace_after_s, "start_lighthouse",
                                        None))
                elif action == "start_group":
                    fleet.start_group(f, None)
                elif action == "start_lighthouse":
                    fleet.start_lighthouse()
            time.sleep(0.02)
    finally:
        fleet.stop_all()
    load_after = os.getloadavg()
    return summarize(read_records(metrics), read_records(out / "heals.jsonl"),
                     read_records(out / "events.jsonl"), fired, fleet.started, args, first,
                     load_before, load_after)


def summarize(records: list[dict[str, Any]], heals: list[dict[str, Any]],
              events: list[dict[str, Any]], fired: list[dict[str, Any]], started: dict[int, float],
              args: argparse.Namespace, first: float, load_before: tuple[float, ...],
              load_after: tuple[float, ...]) -> dict[str, Any]:
    start = window_start(records)
    end = (start if start is not None else first) + args.duration
    in_window = [r for r in records if r["time"] <= end]
    steps = kept_steps(in_window)
    kills = [f for f in fired if f["kind"] == "kill_group" and "victim" in f]
    replaced = {f["replacement"]: f for f in kills if "replacement" in f}
    # survivors of a fault: its live groups but the victim, less any later victim
    # killed inside the pause window (its gap would be the later fault's)
    survivors = [[g for g in f["survivors"]] for f in kills]
    pause = pauses(in_window, [f["time"] for f in kills], survivors, PAUSE_WINDOW_S)
    # The lighthouse lost: every live group's pause.
    outages = [f for f in fired if f["kind"] == "kill_lighthouse"]
    coordinator = [outage_pause(in_window, f["time"], f["survivors"], end) for f in outages]
    heal = heal_times(in_window, {g: started[g] for g in replaced if g in started})
    step_times = [r["step_time_s"] for r in steps]
    replacements = []
    for g in replaced:
        t0 = started.get(g)
        if t0 is None:
            continue
        ev = {e["event"]: round(e["time"] - t0, 3) for e in events if e["group"] == g}
        got = [h for h in heals if h["group"] == g]
        replacements.append({
            "group": g, "victim": replaced[g]["victim"],
            "imported_s": ev.get("imported"), "manager_s": ev.get("manager"),
            "first_step_s": None if heal.get(g) is None else round(heal[g], 3),
            "recv_s": got[0]["recv_s"] if got else None,
            "recv_bytes": got[0]["bytes"] if got else None,
            "healed_at_step": got[0]["step"] if got else None,
            "killed_before_first_step": (heal.get(g) is None
                                         and any(f.get("victim") == g for f in kills))})
    return {
        "arm": "torchft",
        "groups": args.groups,
        "duration_s": args.duration,
        "seed": args.seed,
        "fleet_goodput": (round(fleet_goodput(in_window, start, args.duration,
                                              args.groups), 4)
                          if start is not None else 0.0),
        "committed_steps": len(steps),
        "steps_in_window": steps_in_window(in_window, start, args.duration),
        "last_step": steps[-1]["step"] if steps else None,
        "median_step_s": round(statistics.median(step_times), 4) if step_times else None,
        "faults_fired": len([f for f in fired if "skipped" not in f]),
        "faults": [{k: v for k, v in f.items() if k != "survivors"} for f in fired],
        "pauses_s": [None if p is None else round(p, 3) for p in pause],
        "coordinator_pauses_s": [None if p is None else round(p, 3) for p in coordinator],
        "rejoins_s": [None if v is None else round(v, 3) for v in heal.values()],
        "heal_times_s": {str(g): (None if v is None else round(v, 3))
                         for g, v in heal.items()},
        "replacements": replacements,
        "heals": heals,
        "participants_seen": sorted({r["participants"] for r in steps}),
        "final_loss": steps[-1]["loss"] if steps else None,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        "torch": _version("torch"),
        "torchft": _version("torchft"),
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds measured from the first committed step")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--schedule", help="JSON list of faults: time_s, kind, replace_after_s")
    src.add_argument("--mtbf", type=float, help="draw group kills at this mean gap instead")
    p.add_argument("--replace-after", type=float, default=10.0,
                   help="with --mtbf: replacement delay")
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job", choices=("small", "large"), default="small",
                   help="the job trained (benchmarks.goodput_metrics.JOBS)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="torchft Manager timeout (collectives, commit vote, heal), seconds")
    p.add_argument("--pg-timeout", type=float, default=5.0,
                   help="ProcessGroupGloo timeout, seconds (train_ddp.py's)")
    p.add_argument("--quorum-retries", type=int, default=0,
                   help="torchft Manager quorum_retries: lighthouse quorum calls retried "
                        "before a group gives up (torchft's default 0)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--verbose", action="store_true", help="torchft's INFO logs in logs/")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--group", type=int, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--go", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.groups < 1:
        p.error("--groups must be >= 1")
    if args.duration <= 0:
        p.error("--duration must be > 0")
    try:
        if args.schedule:
            schedule = parse_schedule(json.loads(Path(args.schedule).read_text()))
        elif args.mtbf:
            schedule = mtbf_schedule(args.mtbf, args.duration, args.seed, args.replace_after)
        else:
            schedule = []
    except (OSError, ValueError) as e:
        p.error(f"--schedule: {e}")
    signal.signal(signal.SIGTERM, _raise_on_term)  # so that the fleet is stopped
    summary = run(args, schedule)
    summary["schedule"] = [vars_(f) for f in schedule]
    text = json.dumps(summary, indent=1)
    (Path(args.out) / "summary.json").write_text(text)
    print(text)
    return 0


def vars_(f: Fault) -> dict[str, Any]:
    return {"time_s": f.time_s, "kind": f.kind, "replace_after_s": f.replace_after_s}


if __name__ == "__main__":
    sys.exit(main())
