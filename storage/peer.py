"""The peer tier's transport: a small HTTP object server over a node's replica directory,
and the client calls that push a replica to it and fetch one back.

Each node's local rank 0 runs a `PeerServer` in a daemon thread (plain HTTP on the
node's address, port chosen by the OS). `TieredStore`'s copy thread pushes every data
object it copies locally to k other nodes' servers (`push`); a rank whose node lost its
local copy asks the other nodes' servers (`fetch`). A replica is the object's bytes plus
its persistent URL, key and whole-object crc32c; the server checks the crc32c on receipt,
the client checks it again on fetch, so a damaged replica is never served.

A server keeps replicas of the two newest steps it has received (it cannot see commits
of the nodes that push to it); older steps are deleted when a newer one arrives.
"""

from __future__ import annotations

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

import google_crc32c

from storage.url import check_key

logger = logging.getLogger(__name__)

__all__ = ["PeerServer", "Replica", "fetch", "push"]

TIMEOUT_S = 10.0
KEEP_STEPS = 2
_META = ".meta"


class Replica(dict):
    """What `fetch` returns: `data` (bytes), `url`, `key`, `crc32c`."""


def _step_dirs(root: str) -> list[str]:
    try:
        return sorted(d for d in os.listdir(root) if d.startswith("step-"))
    except FileNotFoundError:
        return []


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, fmt: str, *args: Any) -> None:  # the default prints every request
        logger.debug("peer server %s: " + fmt, self.server.root, *args)

    def _key(self) -> str | None:
        try:
            return check_key(unquote(self.path.lstrip("/")), self.server.root)
        except ValueError:
            self.send_error(400, "bad key")
            return None

    def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
        key = self._key()
        if key is None:
            return
        n = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(n)
        crc = int(self.headers.get("X-Relight-Crc32c", "-1"))
        if len(data) != n or google_crc32c.value(data) != crc:
            self.send_error(422, "crc32c mismatch")
            return
        self.server.store(key, data, {"url": self.headers.get("X-Relight-Url", ""),
                                      "key": key, "size": n, "crc32c": crc})
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

    def __init__(self, addr: tuple[str, int], root: str, also_serve: tuple[str, ...]) -> None:
        super().__init__(addr, _Handler)
        self.root = root
        self.also_serve = also_serve
        self.lock = threading.Lock()

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
            steps = _step_dirs(self.root)
            for old in steps[:-KEEP_STEPS]:
                for d in (os.path.join(self.root, old), os.path.join(self.root, _META, old)):
                    shutil.rmtree(d, ignore_errors=True)


class PeerServer:
    """Receives and serves replicas under `root` on `host`:<a free port>, in a daemon
    thread; also serves the objects under `also_serve` (the node's own local tier, laid
    out the same way), so a rank can read what another node's ranks wrote."""

    def __init__(self, root: str, host: str = "0.0.0.0", also_serve: tuple[str, ...] = ()
                 ) -> None:
        os.makedirs(root, exist_ok=True)
        self.root = root
        self._server = _Server((host, 0), root, tuple(also_serve))
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="relight-peer-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        """`ip:port` other nodes reach this server at."""
        try:
            ip = socket.gethostbyname(socket.gethostname())
        except OSError:
            ip = "127.0.0.1"
        return f"{ip}:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _conn(addr: str) -> http.client.HTTPConnection:
    host, _, port = addr.rpartition(":")
    return http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)


def push(addr: str, key: str, url: str, data: bytes, crc: int) -> None:
    """Store a replica of `key` on the server at `addr`; raises OSError on failure."""
    conn = _conn(addr)
    try:
        conn.request("PUT", "/" + quote(key), body=data, headers={
            "X-Relight-Crc32c": str(crc), "X-Relight-Url": url,
            "Content-Length": str(len(data))})
        resp = conn.getresponse()
        resp.read()
        if resp.status != 204:
            raise ConnectionError(f"peer {addr} refused the replica of {key}: {resp.status}")
    finally:
        conn.close()


def fetch(addr: str, key: str) -> Replica | None:
    """The replica of `key` held by the server at `addr` if it is there and its bytes
    match the crc32c recorded with it; None otherwise (or if the peer is unreachable)."""
    conn = _conn(addr)
    try:
        conn.request("GET", "/" + quote(key))
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            return None
        meta = json.loads(resp.getheader("X-Relight-Meta") or "{}")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        conn.close()
    if meta.get("key") != key or google_crc32c.value(data) != meta.get("crc32c"):
        return None
    return Replica(data=data, url=meta.get("url"), key=key, crc32c=meta["crc32c"])
