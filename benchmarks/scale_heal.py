"""Heal in place at fleet scale: N simulated replica groups against a real 3-member etcd.

    relight bench scale_heal --groups 4 16 64 256 1024 --json OUT.json

Each simulated group is Relight's own `QuorumClient` (the code a group's first rank
runs) with its own etcd client, lease keeper and membership watch, and a listening socket
for its store (the protocol probes stores to tell a dead group from a slow one). No
training runs: in a standing quorum a step costs etcd nothing (its outcome rides the
cross-group reduction), so what scales with the number of groups is what runs beside
the steps and what a membership change costs. Per size, one round:

1. formation (set-up, not a target): every group joins ready, the first proposes the
   quorum of all, the others read it in waves, and all enter it;
2. happy path: `--quiet-s` seconds of standing quorum (leases kept alive, watches open);
   etcd requests and bytes per group per step at `--step-s` steps, and the etcd
   members' CPU per step, from the servers' own counters (`/metrics`:
   `grpc_server_started_total`, `etcd_network_client_grpc_{received,sent}_bytes_total`;
   `/proc/<pid>/stat` for CPU), and the worker processes' CPU per step (what a change's
   window holds of the standing load);
3. a lost group: the last group's process dies (its store stops listening; its lease
   lives on, as after a kill); every survivor's reduction fails, it votes the failure and
   agrees again: settle time from the failure to the last survivor entering the new
   quorum; requests and bytes of that change per group;
4. a joiner: a new group registers asking to heal; the members' watches see it, and at
   their next step boundary they agree and enter the quorum that takes it in: settle time
   from its registration to the last member entering (the step boundary's own wait, up
   to one step, is not in it: the flag rides the next reduction).

The clients run as threads of `--procs` worker processes (8; groups dealt round-robin),
on the same cores as the three etcd members:
on a machine of 2 cores the settle times at large N include the simulator's own CPU
(reported as `clients_cpu_s`, the worker processes' CPU over the change), and
`cores_busy` says how much of the machine the change kept busy: (etcd's CPU + the
clients' CPU) / (cores x the change's window). Near 1, the settle time is what the
machine's cores can do, not a wait in the protocol. The server-side counts do not
depend on it. Per change, `phases` says when the first,
median and last group of each role in the new quorum (its host, its other deciders, its
followers) voted or saw the change, took the new quorum, and entered it (seconds from
the change): where a settle time goes.

Beside it, torchft's lighthouse protocol computed from its code: a heartbeat every 100 ms
per group and one quorum request per group per step to one lighthouse process, whose
response lists every participant.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import selectors
import socket
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HealScaleConfig", "lighthouse_model", "run_heal_scale"]


@dataclass(frozen=True, slots=True)
class HealScaleConfig:
    groups: tuple[int, ...] = (4, 16, 64, 256, 1024)
    quiet_s: float = 20.0
    """Length of the happy-path window per size."""
    step_s: float = 1.0
    """The step time the per-step figures are given at."""
    lease_ttl_s: float = 10.0
    timeout_s: float = 300.0
    """Bound on each phase of a round (a phase not done by then is reported as such)."""
    procs: int = 8
    """Worker processes the groups are spread over (at most one per group)."""


_WAVE = 16
"""Groups of one worker process that read the first quorum at once during the formation."""

_LIGHTHOUSE_HEARTBEAT_S = 0.1
"""torchft's default heartbeat interval (per replica group, to the lighthouse)."""
_LIGHTHOUSE_MEMBER_BYTES = 110
"""Estimated bytes of one `QuorumMember` on the wire (replica id, manager address, store
address, step, world size, protobuf framing): the lighthouse's quorum response repeats
one per participant. An estimate from the message's fields, not a measurement."""


def lighthouse_model(n: int, step_s: float) -> dict[str, float]:
    """torchft's lighthouse load at `n` groups and `step_s` steps, from its protocol:
    requests and response bytes per group per step, and the lighthouse's request rate
    (one process behind one lock)."""
    per_group = step_s / _LIGHTHOUSE_HEARTBEAT_S + 1
    return {"requests_per_group_step": per_group,
            "bytes_per_group_step": n * _LIGHTHOUSE_MEMBER_BYTES,
            "server_requests_per_s": n * per_group / step_s}


# -- the etcd members' own counters ------------------------------------------------------

_COUNTERS = ("grpc_server_started_total", "etcd_network_client_grpc_received_bytes_total",
             "etcd_network_client_grpc_sent_bytes_total")


def _scrape(endpoints: list[str]) -> dict[str, float]:
    """Requests handled and client bytes in and out, summed over the members."""
    out = dict.fromkeys(("requests", "bytes_in", "bytes_out"), 0.0)
    for ep in endpoints:
        with urllib.request.urlopen(f"http://{ep}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        for line in text.splitlines():
            if line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            base = name.split("{", 1)[0]
            if base == _COUNTERS[0]:  # unary calls and streams (a watch, a keepalive)
                out["requests"] += float(value)
            elif base == _COUNTERS[1]:
                out["bytes_in"] += float(value)
            elif base == _COUNTERS[2]:
                out["bytes_out"] += float(value)
    return out


def _cores_busy(change: dict[str, float]) -> float:
    """The share of the machine's cores that etcd and the clients kept busy over a
    change's window (`_Probe.delta`)."""
    return (change["cpu_s"] + change["clients_cpu_s"]) / ((os.cpu_count() or 1)
                                                           * change["wall_s"])


def _cpu_s(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


class _Probe:
    """Server counters, the etcd members' CPU (`pids`) and the worker processes' CPU
    (`clients`) between two points."""

    def __init__(self, endpoints: list[str], pids: list[int], clients: list[int]) -> None:
        self.endpoints, self.pids, self.clients = endpoints, pids, clients
        self.t0, self.c0 = time.monotonic(), _scrape(endpoints)
        self.cpu0, self.clients_cpu0 = _cpu_s(pids), _cpu_s(clients)

    def delta(self) -> dict[str, float]:
        c1, cpu1, clients_cpu1 = _scrape(self.endpoints), _cpu_s(self.pids), _cpu_s(self.clients)
        out = {k: c1[k] - self.c0[k] for k in c1}
        out["cpu_s"] = cpu1 - self.cpu0
        out["clients_cpu_s"] = clients_cpu1 - self.clients_cpu0
        out["wall_s"] = time.monotonic() - self.t0
        return out


# -- simulated groups --------------------------------------------------------------------

class _Acceptor:
    """Takes and closes every connection to the groups' stores (one thread for all), as a
    live group's store does: the protocol probes stores to tell dead groups from slow ones."""

    def __init__(self) -> None:
        self.selector = selectors.DefaultSelector()
        self._stop = False
        threading.Thread(target=self._run, daemon=True, name="scale-heal-acceptor").start()

    def add(self, listener: socket.socket) -> None:
        listener.setblocking(False)
        self.selector.register(listener, selectors.EVENT_READ)

    def remove(self, listener: socket.socket) -> None:
        try:
            self.selector.unregister(listener)
        except (KeyError, ValueError):
            pass

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self.selector.select(timeout=0.2):
                try:
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    conn.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._stop = True


class _Group:
    def __init__(self, endpoints: list[str], job: str, name: str, ttl: float,
                 acceptor: _Acceptor) -> None:
        from relight.elastic.etcd_client import EtcdClient, EtcdSettings
        from relight.elastic.quorum import QuorumClient

        self.acceptor = acceptor
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        acceptor.add(self.listener)
        self.name = name
        self.client = QuorumClient(
            EtcdClient(EtcdSettings(endpoints=tuple(endpoints), prefix="/scale-heal",
                                    timeout=60.0)),
            job, name, lease_ttl=ttl, timeout=300.0, failover_grace_s=1.0)

    @property
    def store(self) -> tuple[str, int]:
        return self.listener.getsockname()

    def die(self) -> None:
        """The process is gone: nothing listens on its store; its lease lives on."""
        self.acceptor.remove(self.listener)
        self.listener.close()
        self.client.detach()

    def close(self) -> None:
        self.client.leave()
        self.acceptor.remove(self.listener)
        self.listener.close()


def _parallel(fns: list[Any], timeout: float) -> tuple[list[float], list[str]]:
    """Run each fn in a thread at once; the monotonic time each finished, and errors."""
    done: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()

    def run(fn: Any) -> None:
        try:
            fn()
            with lock:
                done.append(time.monotonic())
        except Exception as exc:  # noqa: BLE001 - reported in the row
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    end = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, end - time.monotonic()))
    return done, errors


class _Marks:
    """When one group passed each point of a change (monotonic clock: one clock for every
    process of the machine), its role in the new quorum, and its etcd requests."""

    def __init__(self, g: _Group) -> None:
        self.g = g
        self.out: dict[str, Any] = {}
        self.requests0 = g.client.requests

    def __call__(self, point: str) -> None:
        self.out[point] = time.monotonic()

    def done(self, quorum: Any) -> dict[str, Any]:
        deciders = quorum.deciders(self.g.client.deciders)
        self.out["role"] = ("host" if quorum.host == self.g.name
                            else "decider" if self.g.name in deciders else "follower")
        self.out["requests"] = self.g.client.requests - self.requests0
        return self.out


def _phases(marks: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    """Per point of a change, seconds from `t0` to the first and the last group past it
    (deciders and followers apart), and the host's own times: where a settle time goes."""
    out: dict[str, Any] = {}
    points = [p for p in ("voted", "saw", "agreed", "entered") if any(p in m for m in marks)]
    for role in ("host", "decider", "follower"):
        mine = [m for m in marks if m["role"] == role]
        if not mine:
            continue
        for p in points:
            ts = sorted(m[p] - t0 for m in mine if p in m)
            out[f"{role}_{p}"] = [round(ts[0], 3), round(ts[len(ts) // 2], 3),
                                  round(ts[-1], 3)]
        out[f"{role}_requests_max"] = max(m["requests"] for m in mine)
    return out


def _enter(g: _Group, quorum: Any) -> None:
    entry = g.client.confirm(quorum, 120.0)
    if not entry.complete:
        raise RuntimeError(f"{g.name} could not enter quorum {quorum.id}: {entry}")


class _Worker:
    """One worker process's groups (threads), driven by the parent over a pipe. Groups of
    a size are spread over `procs` processes, as groups on separate hosts do not share
    one interpreter lock: in one process, ~2,000 threads of a thousand groups left a
    lease keeper waiting for the lock longer than its lease."""

    def __init__(self) -> None:
        self.groups: dict[str, _Group] = {}
        self.acceptor = _Acceptor()
        self.quorums: dict[str, Any] = {}

    def build(self, endpoints: list[str], job: str, names: list[str], ttl: float,
              ready: bool) -> float:
        t0 = time.monotonic()
        for name in names:
            g = self.groups[name] = _Group(endpoints, job, name, ttl, self.acceptor)
            g.client.join(g.store, ready=ready, heal=not ready)
        return t0

    def agree_first(self, name: str, n: int) -> Any:
        q, _ = self.groups[name].client.agree(min_groups=n)
        self.quorums[name] = q
        return q

    def read_first(self, timeout: float) -> list[str]:
        errors: list[str] = []
        rest = [g for g in self.groups.values() if g.name not in self.quorums]
        for k in range(0, len(rest), _WAVE):
            _, errs = _parallel([lambda g=g: self.quorums.__setitem__(g.name, g.client.agree()[0])
                                 for g in rest[k:k + _WAVE]], timeout)
            errors += errs
        return errors

    def enter(self, quorum: Any, timeout: float) -> tuple[list[float], list[str]]:
        done, errors = _parallel([lambda g=g: _enter(g, quorum) for g in self.groups.values()],
                                 timeout)
        for g in self.groups.values():
            g.client.watch_membership()
        return done, errors

    def die(self, name: str) -> None:
        self.groups.pop(name).die()

    def fail_over(self, q0: Any, dead: str, grace_s: float, timeout: float
                  ) -> tuple[list[float], list[str], list[dict[str, Any]]]:
        marks: list[dict[str, Any]] = []

        def run(g: _Group) -> None:
            mark = _Marks(g)
            g.client.vote(q0, 0, False)
            mark("voted")
            q, _ = g.client.agree(failed=(q0, 0), grace_s=grace_s)
            mark("agreed")
            if dead in q.members:
                raise RuntimeError(f"{g.name}: the dead group is still in quorum {q.id}")
            self.quorums[g.name] = q
            _enter(g, q)
            mark("entered")
            marks.append(mark.done(q))

        done, errors = _parallel([lambda g=g: run(g) for g in self.groups.values()], timeout)
        for g in self.groups.values():
            g.client.watch_membership()
        return done, errors, marks

    def take_in(self, joiner: str, timeout: float
                ) -> tuple[list[float], list[str], list[dict[str, Any]]]:
        marks: list[dict[str, Any]] = []

        def run(g: _Group) -> None:
            mark = _Marks(g)
            if g.name != joiner:
                # The member's watch says the keys changed; at its next step boundary
                # (not waited for here) it agrees again.
                if not g.client.membership_changed.wait(timeout):
                    raise RuntimeError(f"{g.name}'s watch never saw the joiner")
            mark("saw")
            q, _ = g.client.agree()
            while joiner not in q.members:
                g.client.client.wait_for_change(g.client.root, q.revision, 5.0)
                q, _ = g.client.agree()
            mark("agreed")
            _enter(g, q)
            mark("entered")
            marks.append(mark.done(q))

        done, errors = _parallel([lambda g=g: run(g) for g in self.groups.values()], timeout)
        return done, errors, marks

    def close(self) -> None:
        for g in self.groups.values():
            try:
                g.close()
            except Exception:  # noqa: BLE001 - a dead group's lease just expires
                pass
        self.groups.clear()
        self.quorums.clear()


def _serve(conn: Any) -> None:
    """A worker process: runs the parent's calls on its `_Worker`, one at a time."""
    logging.getLogger("relight.elastic").setLevel(logging.ERROR)
    worker = _Worker()
    while True:
        name, args = conn.recv()
        if name == "exit":
            worker.close()
            worker.acceptor.close()
            return
        try:
            conn.send(("ok", getattr(worker, name)(*args)))
        except Exception as exc:  # noqa: BLE001 - reported in the row
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:300]))


class _Pool:
    """Worker processes (spawned: the parent holds threads), reused across sizes."""

    def __init__(self, procs: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        for _ in range(procs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        self.pids = [p.pid for p in self.procs]

    def call(self, which: list[int], name: str, *args: Any, timeout: float) -> list[Any]:
        """`name(*args)` on each worker in `which`, at once; their results, in order."""
        for i in which:
            self.conns[i].send((name, args))
        out = []
        for i in which:
            if not self.conns[i].poll(timeout + 60):
                raise RuntimeError(f"worker {i} did not answer {name} within {timeout + 60:.0f} s")
            status, value = self.conns[i].recv()
            if status != "ok":
                raise RuntimeError(f"worker {i} {name}: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                conn.send(("exit", ()))
            except OSError:
                pass
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def _one_size(pool: _Pool, endpoints: list[str], pids: list[int], n: int,
              cfg: HealScaleConfig) -> dict[str, Any]:
    job = f"heal-{n}-{uuid.uuid4().hex[:6]}"
    names = [f"g{i:05d}" for i in range(n)]
    used = list(range(min(len(pool.conns), n)))
    shares = {w: names[w::len(used)] for w in used}
    owner = {name: w for w, share in shares.items() for name in share}
    row: dict[str, Any] = {"groups": n, "procs": len(used)}
    timeout = cfg.timeout_s
    try:
        # 1. formation (set-up, not a target): every group joins ready, the first
        # proposes the quorum of all, the others read it (in waves of `_WAVE` per
        # process: a job's start does this once, each group on its own host), and all
        # enter it together.
        for w in used:
            pool.call([w], "build", endpoints, job, shares[w], cfg.lease_ttl_s, True,
                      timeout=timeout)
        t0 = time.monotonic()
        (first,) = pool.call([owner[names[0]]], "agree_first", names[0], n, timeout=timeout)
        errors = [e for errs in pool.call(used, "read_first", timeout, timeout=timeout)
                  for e in errs]
        if errors:
            row["errors"] = errors[:3]
            return row
        entered = pool.call(used, "enter", first, timeout, timeout=timeout)
        done = [t for d, _ in entered for t in d]
        errors = [e for _, errs in entered for e in errs]
        row["formation_s"] = max(done) - t0 if len(done) == n else None
        if errors or len(done) < n:
            row["errors"] = errors[:3]
            return row
        # 2. happy path
        probe = _Probe(endpoints, pids, pool.pids)
        time.sleep(cfg.quiet_s)
        quiet = probe.delta()
        steps = quiet["wall_s"] / cfg.step_s
        row["quiet"] = {
            "requests_per_group_step": quiet["requests"] / n / steps,
            "bytes_per_group_step": (quiet["bytes_in"] + quiet["bytes_out"]) / n / steps,
            "etcd_cpu_per_step_s": quiet["cpu_s"] / steps,
            "clients_cpu_per_step_s": quiet["clients_cpu_s"] / steps,
            "server_requests_per_s": quiet["requests"] / quiet["wall_s"],
            "window_s": quiet["wall_s"]}
        # 3. a lost group
        dead = names[-1]
        pool.call([owner[dead]], "die", dead, timeout=timeout)
        probe = _Probe(endpoints, pids, pool.pids)
        t0 = time.monotonic()
        failed = pool.call(used, "fail_over", first, dead, 1.0 + 2 * cfg.step_s, timeout,
                           timeout=timeout)
        lost = probe.delta()
        done = [t for d, _, _ in failed for t in d]
        errors = [e for _, errs, _ in failed for e in errs]
        row["lost"] = {"settle_s": max(done) - t0 if len(done) == n - 1 else None,
                       "requests_per_group": lost["requests"] / (n - 1),
                       "bytes_per_group": (lost["bytes_in"] + lost["bytes_out"]) / (n - 1),
                       "etcd_cpu_s": lost["cpu_s"],
                       "clients_cpu_s": lost["clients_cpu_s"],
                       "cores_busy": _cores_busy(lost),
                       "phases": _phases([m for _, _, ms in failed for m in ms], t0),
                       "errors": errors[:3]}
        if errors or len(done) < n - 1:
            return row
        # 4. a joiner
        joiner = f"j{n:05d}"
        probe = _Probe(endpoints, pids, pool.pids)
        (t0,) = pool.call([used[0]], "build", endpoints, job, [joiner], cfg.lease_ttl_s,
                          False, timeout=timeout)
        taken = pool.call(used, "take_in", joiner, timeout, timeout=timeout)
        joined = probe.delta()
        done = [t for d, _, _ in taken for t in d]
        errors = [e for _, errs, _ in taken for e in errs]
        row["joined"] = {"settle_s": max(done) - t0 if len(done) == n else None,
                         "requests_per_group": joined["requests"] / n,
                         "bytes_per_group": (joined["bytes_in"] + joined["bytes_out"]) / n,
                         "etcd_cpu_s": joined["cpu_s"],
                         "clients_cpu_s": joined["clients_cpu_s"],
                         "cores_busy": _cores_busy(joined),
                         "phases": _phases([m for _, _, ms in taken for m in ms], t0),
                         "errors": errors[:3]}
        return row
    except RuntimeError as exc:
        row.setdefault("errors", [str(exc)[:300]])
        return row
    finally:
        pool.call(used, "close", timeout=timeout)


def run_heal_scale(cfg: HealScaleConfig, log: Any = print) -> list[dict[str, Any]]:
    from relight.elastic.etcd_server import EtcdCluster

    rows = []
    pool = _Pool(cfg.procs)
    try:
        with tempfile.TemporaryDirectory(prefix="scale-heal-") as tmp:
            cluster = EtcdCluster(Path(tmp)).start()
            try:
                pids = [m.pid for m in cluster.members if m.pid is not None]
                for n in cfg.groups:
                    row = _one_size(pool, cluster.endpoints, pids, n, cfg)
                    row["lighthouse"] = lighthouse_model(n, cfg.step_s)
                    row["lease_ttl_s"] = cfg.lease_ttl_s
                    log(json.dumps(row))
                    rows.append(row)
                    if row.get("errors") or (row.get("lost") or {}).get("errors"):
                        break
            finally:
                cluster.stop()
    finally:
        pool.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="relight bench scale_heal", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = HealScaleConfig()
    p.add_argument("--groups", type=int, nargs="+", default=list(defaults.groups))
    p.add_argument("--quiet-s", type=float, default=defaults.quiet_s)
    p.add_argument("--step-s", type=float, default=defaults.step_s)
    p.add_argument("--lease-ttl-s", type=float, default=defaults.lease_ttl_s,
                   help="each group's lease TTL (ReplicaSettings.lease_ttl); keepalives "
                   "run every TTL / 3")
    p.add_argument("--procs", type=int, default=defaults.procs,
                   help="worker processes the simulated groups are spread over")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    rows = run_heal_scale(HealScaleConfig(groups=tuple(a.groups), quiet_s=a.quiet_s,
                                          step_s=a.step_s, lease_ttl_s=a.lease_ttl_s,
                                          procs=a.procs))
    if a.json is not None:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
