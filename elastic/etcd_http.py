"""HTTP/1.1 to etcd's JSON gateway: unary calls on one kept-alive connection per thread
and endpoint, watch streams each on a connection of their own; JSON in and out.

Why not `requests` (and `etcd3gw` on top of it) for these: a unary call through them
cost the client 1.1-1.2 ms of CPU on this 2-core machine, against 0.22 ms for the same
POST over `http.client` (docs/design/etcd-client.md). The replica groups' commit vote
makes several such calls per training step, and a rendezvous of a thousand agents makes
thousands at once, on cores the training and etcd itself need. A watch is a POST whose
answer is a stream of JSON lines; it gets a connection of its own, closed when the
caller stops reading (the gateway has no way to cancel a watch on a live connection).

Errors are two kinds, which `EtcdClient.call` maps to failover and typed errors:
`GatewayUnreachable` (no answer: refused, reset, closed, TLS failure, past the
attempt's timeout, or etcd's "unavailable" statuses, 503/408/504, as when a member has
no leader; `timed_out` tells the timeouts apart) and `GatewayError` (etcd answered with
another HTTP error; `text` is its body, which names the cause).
"""

from __future__ import annotations

import http.client
import json
import ssl
import threading
import time
from collections.abc import Iterator
from typing import Any

from relight.errors import RelightError

__all__ = ["GatewayConnections", "GatewayError", "GatewayUnreachable", "TlsFiles"]


_UNAVAILABLE = {503: False, 408: True, 504: True}
"""HTTP statuses that mean "no answer from this member now" (gRPC UNAVAILABLE and
DEADLINE_EXCEEDED through the gateway), and whether each is a timeout."""


class GatewayUnreachable(ConnectionError):
    """No answer from the endpoint (connection refused, reset or closed, TLS failure, or
    no reply within the attempt's timeout)."""

    def __init__(self, message: str, *, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class GatewayError(RelightError, RuntimeError):
    """etcd answered the call with an HTTP error status; `text` is the body it sent."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text[:300]}")
        self.status = status
        self.text = text


class TlsFiles:
    """The TLS material of a client: CA bundle (None: the system's), and an optional
    client certificate and key. Builds one `ssl.SSLContext`, shared by every
    connection (it is thread-safe once built)."""

    def __init__(self, ca_file: str | None, cert_file: str | None,
                 key_file: str | None) -> None:
        self.context = ssl.create_default_context(cafile=ca_file)
        if cert_file and key_file:
            self.context.load_cert_chain(cert_file, key_file)


class GatewayConnections:
    """Per-thread, per-endpoint kept-alive connections, and `post` over them."""

    def __init__(self, tls: TlsFiles | None) -> None:
        self._tls = tls
        self._local = threading.local()

    def _new_conn(self, url: str, timeout: float) -> http.client.HTTPConnection:
        scheme, _, hostport = url.partition("://")
        host, _, port = hostport.rpartition(":")
        host = host.strip("[]")
        if scheme == "https":
            return http.client.HTTPSConnection(
                host, int(port), timeout=timeout,
                context=self._tls.context if self._tls else ssl.create_default_context())
        return http.client.HTTPConnection(host, int(port), timeout=timeout)

    def _conn(self, url: str, timeout: float) -> http.client.HTTPConnection:
        conns: dict[str, http.client.HTTPConnection] | None = getattr(self._local, "conns", None)
        if conns is None:
            conns = self._local.conns = {}
        conn = conns.get(url)
        if conn is None:
            conn = conns[url] = self._new_conn(url, timeout)
        elif conn.sock is not None:
            conn.sock.settimeout(timeout)
        conn.timeout = timeout
        return conn

    def _drop(self, url: str) -> None:
        conns = getattr(self._local, "conns", None) or {}
        conn = conns.pop(url, None)
        if conn is not None:
            conn.close()

    def post(self, url: str, path: str, body: dict[str, Any], *, timeout: float,
             headers: dict[str, str] | None = None) -> dict[str, Any]:
        """POST `body` as JSON to `url + path`; the decoded JSON answer. A kept-alive
        connection the server closed while idle is replaced once, at once (the request
        never reached etcd); any other failure raises."""
        data = json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        for fresh in (False, True):
            conn = self._conn(url, timeout)
            reused = conn.sock is not None
            try:
                conn.request("POST", path, body=data, headers=hdrs)
                resp = conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException) as exc:
                # Refused, reset, unreachable, timed out, TLS failures (ssl.SSLError is
                # an OSError).
                self._drop(url)
                idle_drop = isinstance(exc, http.client.RemoteDisconnected | BrokenPipeError
                                       | ConnectionResetError)
                if idle_drop and reused and not fresh:
                    continue  # the server closed an idle kept-alive connection
                raise _unreachable(url, exc, timeout) from exc
            if resp.will_close:
                self._drop(url)
            return _decode(resp.status, raw, url)
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, url: str, path: str, *, timeout: float) -> dict[str, Any]:
        """GET `url + path` on a connection of its own (rare calls: `/version`); the
        decoded JSON object. Raises as `post` does."""
        conn = self._new_conn(url, timeout)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            status, raw = resp.status, resp.read()
        except (OSError, http.client.HTTPException) as exc:
            raise _unreachable(url, exc, timeout) from exc
        finally:
            conn.close()
        return _decode(status, raw, url)

    def stream(self, url: str, path: str, body: dict[str, Any], *, connect_timeout: float,
               deadline: float, headers: dict[str, str] | None = None,
               idle_s: float | None = None) -> Iterator[dict[str, Any]]:
        """POST `body` and yield each JSON object of the streamed answer (one a line)
        until `deadline` (a `time.monotonic()` value), or until no line came for
        `idle_s`: then `TimeoutError`. A stream the server ends raises
        `GatewayUnreachable`; an HTTP error status `GatewayError`. The connection is
        closed when the caller stops (after a timeout it cannot be read on)."""
        conn = self._new_conn(url, connect_timeout)
        try:
            try:
                conn.request("POST", path, body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json", **(headers or {})})
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as exc:
                if isinstance(exc, TimeoutError):
                    raise
                raise _unreachable(url, exc, connect_timeout) from exc
            if resp.status != 200:
                _decode(resp.status, resp.read(), url)
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"watch on {url}: deadline reached")
                assert conn.sock is not None
                conn.sock.settimeout(remaining if idle_s is None else min(remaining, idle_s))
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException) as exc:
                    if isinstance(exc, TimeoutError):
                        raise
                    raise GatewayUnreachable(f"{url}: stream broke: {type(exc).__name__}",
                                             timed_out=False) from exc
                if not line:
                    raise GatewayUnreachable(f"{url}: the stream ended", timed_out=False)
                if line.strip():
                    msg = json.loads(line)
                    if isinstance(msg, dict):
                        yield msg
        finally:
            conn.close()

    def close(self) -> None:
        """Close this thread's connections."""
        for url in list(getattr(self._local, "conns", None) or {}):
            self._drop(url)


def _decode(status: int, raw: bytes, url: str) -> dict[str, Any]:
    """The JSON object of a 200 answer; the typed error of any other."""
    text = raw.decode("utf-8", "replace")
    if status in _UNAVAILABLE:
        # A member without a leader, mid-election ("leader changed"), or timed out
        # inside etcd: another member, or a later attempt, may answer.
        raise GatewayUnreachable(f"{url}: HTTP {status}: {text.strip()[:300]}",
                                 timed_out=_UNAVAILABLE[status])
    if status != 200:
        raise GatewayError(status, text)
    try:
        out = json.loads(text) if text else {}
    except ValueError as exc:
        raise GatewayError(status, f"not JSON: {text[:200]}") from exc
    if not isinstance(out, dict):
        raise GatewayError(status, f"not a JSON object: {text[:200]}")
    return out


def _unreachable(url: str, exc: BaseException, timeout: float) -> GatewayUnreachable:
    if isinstance(exc, TimeoutError):
        return GatewayUnreachable(f"no answer from {url} within {timeout:.2f}s",
                                  timed_out=True)
    return GatewayUnreachable(f"{url}: {type(exc).__name__}: {exc}", timed_out=False)
