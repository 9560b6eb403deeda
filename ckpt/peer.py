"""The peer tier's transport: a small HTTP object server over a node's replica directory,
and the client calls that push a replica to it and fetch one back.

Each node's local rank 0 runs a `PeerServer` in a daemon thread (plain HTTP on the
node's address, port chosen by the OS). The local tier's copy thread (`ckpt.local_tier`)
pushes every data object it copies locally to k other nodes' servers (`push`); a rank
whose node lost its local copy asks the other nodes' servers (`fetch`, in the order of
`ckpt.tiered.RESTORE_ORDER`). Replicas sit under the same step prefixes as in the
checkpoint root (`ckpt.root_layout.step_dir`). A replica is the object's bytes plus
its persistent URL, key and whole-object crc32c; the server checks the crc32c on receipt,
the client checks it again on fetch, so a damaged replica is never served.

A server keeps replicas of the two newest steps it has received (it cannot see commits
of the nodes that push to it); older steps are deleted when a newer one arrives. With a
`budget_bytes`, the replicas it holds never exceed it: a push that would is first made
room for by dropping older steps, and refused (HTTP 507, before its body is read) if it
still does not fit; the pushing node counts that as a failed replica and its ranks then
restore those shards from the persistent store.

Access: a server made with a `token` (the trainer always passes one: a random secret its
rank 0 draws at start and shares over the job's process group) answers only requests
that carry it (`X-Relight-Token`, compared in constant time); anything else gets 403
before a body is read. So another process on the network can neither plant replicas
(which a restore would then reject as damaged, falling back a checkpoint) nor read the
job's state. The token travels in clear HTTP like the data itself: it keeps out other
tenants of the network, not someone who can read the job's own traffic.
"""

from __future__ import annotations

import hmac
import http.client
import json
import logging
import os
import shutil
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import quote, unquote

from relight.ckpt.root_layout import step_of_dir
from relight.storage.checksum import crc32c
from relight.storage.url import check_key

logger = logging.getLogger(__name__)

__all__ = ["PeerServer", "Replica", "advertised_ip", "fetch", "push"]

TIMEOUT_S = 10.0
TOKEN_HEADER = "X-Relight-Token"
KEEP_STEPS = 2
_META = ".meta"


class Replica(dict):
    """What `fetch` returns: `data` (bytes), `url`, `key`, `crc32c`."""


def _step_of(name: str) -> int:
    """The step of a step prefix; -1 for anything else."""
    step = step_of_dir(name)
    return -1 if step is None else step


def _step_dirs(root: str) -> list[str]:
    """The step prefixes under `root`, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted((d for d in names if step_of_dir(d) is not None), key=_step_of)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, fmt: str, *args: Any) -> None:  # the default prints every request
        logger.debug("peer server %s: " + fmt, self.server.root, *args)

    def _allowed(self) -> bool:
        want = self.server.token
        if want is None or hmac.compare_digest(
                self.headers.get(TOKEN_HEADER, "").encode(), want.encode()):
            return True
        self.close_connection = True  # the body stays unread
        self.send_error(403, "missing or wrong peer token")
        return False

    def _key(self) -> str | None:
        if not self._allowed():
            return None
        try:
            return check_key(unquote(self.path.lstrip("/")), self.server.root)
        except ValueError:
            self.send_error(400, "bad key")
            return None

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        key = self._key()
        if key is None:
            return
        try:
            n = int(self.headers.get("Content-Length", ""))
        except ValueError:
            n = -1
        if n < 0:
            self.send_error(411, "Content-Length required")
            return
        if not self.server.reserve(key, n):
            self.close_connection = True  # the body stays unread
            self.send_error(507, "replica budget exceeded")
            return
        try:
            data = self.rfile.read(n)
            crc = int(self.headers.get("X-Relight-Crc32c", "-1"))
            if len(data) != n or crc32c(data) != crc:
                self.send_error(422, "crc32c mismatch")
                return
            self.server.store(key, data, {"url": self.headers.get("X-Relight-Url", ""),
                                          "key": key, "size": n, "crc32c": crc})
        finally:
            self.server.release(key)
        self.send_response(204)
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        key = self._key()
        if key is None:
            return
        for root in (self.server.root, *self.server.also_serve):
            try:
                with open(os.path.join(root, _META, key + ".json"), "rb") as f:
                    meta = json.loads(f.read())
                with open(os.path.join(root, key), "rb") as f:
                    data = f.read()
                break
            except (OSError, ValueError):
                continue
        else:
            self.send_error(404, "no replica")
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Relight-Meta", json.dumps(meta))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, addr: tuple[str, int], root: str, also_serve: tuple[str, ...],
                 budget_bytes: int | None, token: str | None) -> None:
        super().__init__(addr, _Handler)
        self.token = token
        self.root = root
        self.also_serve = also_serve
        self.budget = budget_bytes
        self.lock = threading.Lock()
        self.held = self._scan()
        """Key -> bytes of every replica held or being received (reserved)."""
        self.refused = 0

    def _scan(self) -> dict[str, int]:
        held = {}
        for step in _step_dirs(self.root):
            for dirpath, _, files in os.walk(os.path.join(self.root, step)):
                for name in files:
                    path = os.path.join(dirpath, name)
                    held[os.path.relpath(path, self.root)] = os.path.getsize(path)
        return held

    def _drop_step(self, step: str) -> None:
        for d in (os.path.join(self.root, step), os.path.join(self.root, _META, step)):
            shutil.rmtree(d, ignore_errors=True)
        self.held = {k: n for k, n in self.held.items() if not k.startswith(step + "/")}

    def reserve(self, key: str, n: int) -> bool:
        """Make room for `n` bytes under `key` within the budget (dropping steps older
        than the key's); False if they do not fit."""
        with self.lock:
            if self.budget is None:
                return True
            def excess() -> int:  # bytes over budget once `key` holds `n` bytes
                return sum(self.held.values()) - self.held.get(key, 0) + n - self.budget

            step = _step_of(key.split("/", 1)[0])
            older = [d for d in _step_dirs(self.root) if _step_of(d) < step]
            droppable = sum(b for k, b in self.held.items() if k.split("/", 1)[0] in older)
            if 0 < excess() <= droppable:  # drop only what lets this one in, oldest first
                for old in older:
                    self._drop_step(old)
                    if excess() <= 0:
                        break
            if excess() > 0:
                self.refused += 1
                logger.warning("peer server %s: replica of %s (%d bytes) refused: %d of the "
                               "%d-byte budget held", self.root, key, n,
                               sum(self.held.values()), self.budget)
                return False
            self.held[key] = n
            return True

    def release(self, key: str) -> None:
        """After a receive: forget a reservation that was not stored."""
        with self.lock:
            if not os.path.exists(os.path.join(self.root, key)):
                self.held.pop(key, None)

    def store(self, key: str, data: bytes, meta: dict[str, Any]) -> None:
        for path, blob in ((os.path.join(self.root, key), data),
                           (os.path.join(self.root, _META, key + ".json"),
                            json.dumps(meta).encode())):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{threading.get_ident()}"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        with self.lock:
            self.held[key] = len(data)
            for old in _step_dirs(self.root)[:-KEEP_STEPS]:
                self._drop_step(old)


class PeerServer:
    """Receives and serves replicas under `root` on `host`:<a free port>, in a daemon
    thread; also serves the objects under `also_serve` (the node's own local tier, laid
    out the same way), so a rank can read what another node's ranks wrote. With a `token`,
    only requests carrying it are answered."""

    def __init__(self, root: str, host: str = "0.0.0.0", also_serve: tuple[str, ...] = (),
                 budget_bytes: int | None = None, token: str | None = None,
                 toward: str | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise ValueError(f"replica budget must be >= 0 bytes, got {budget_bytes}")
        if token is not None and not token:
            raise ValueError("peer token must be a non-empty string (or None: no check)")
        os.makedirs(root, exist_ok=True)
        self.root = root
        self._host, self._toward = host, toward
        self._server = _Server((host, 0), root, tuple(also_serve), budget_bytes, token)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="relight-peer-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """`ip:port` other nodes reach this server at: the bound host when one was given;
        else the host name's address, unless that is a loopback address and `toward` (a
        host other nodes share, e.g. the job's master) is not: then the address of the
        interface that routes to `toward`."""
        return f"{advertised_ip(self._host, self._toward)}:{self._server.server_address[1]}"

    @property
    def held_bytes(self) -> int:
        """Bytes of the replicas held now."""
        with self._server.lock:
            return sum(self._server.held.values())

    @property
    def refused(self) -> int:
        """Pushes refused for the budget so far."""
        return self._server.refused

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip == "::1"


def advertised_ip(bound: str, toward: str | None = None) -> str:
    """The address a server bound to `bound` is reached at (see `PeerServer.address`)."""
    if bound not in ("0.0.0.0", "", "::"):
        return bound
    try:
        ip = socket.gethostbyname(socket.gethostname())
    except OSError:
        ip = "127.0.0.1"
    if not _is_loopback(ip) or not toward:
        return ip
    try:
        target = socket.gethostbyname(toward)
        if _is_loopback(target):
            return ip
        # A UDP "connect" sends nothing; it only asks the kernel for the route's source.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return ip


def _conn(addr: str) -> http.client.HTTPConnection:
    host, _, port = addr.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)


def _auth(token: str | None) -> dict[str, str]:
    return {TOKEN_HEADER: token} if token else {}


def push(addr: str, key: str, url: str, data: bytes, crc: int, token: str | None = None
         ) -> None:
    """Store a replica of `key` on the server at `addr`; raises OSError on failure."""
    conn = _conn(addr)
    try:
        conn.request("PUT", "/" + quote(key), body=data, headers={
            "X-Relight-Crc32c": str(crc), "X-Relight-Url": url,
            "Content-Length": str(len(data)), **_auth(token)})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 204:
            raise ConnectionError(f"peer {addr} refused the replica of {key}: {resp.status}")
    finally:
        conn.close()


def fetch(addr: str, key: str, token: str | None = None) -> Replica | None:
    """The replica of `key` held by the server at `addr` if it is there and its bytes
    match the crc32c recorded with it; None otherwise (or if the peer is unreachable or
    refuses the token)."""
    conn = _conn(addr)
    try:
        conn.request("GET", "/" + quote(key), headers=_auth(token))
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return None
        meta = json.loads(resp.getheader("X-Relight-Meta") or "{}")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    if meta.get("key") != key or crc32c(data) != meta.get("crc32c"):
        return None
    return Replica(data=data, url=meta.get("url"), key=key, crc32c=meta["crc32c"])
