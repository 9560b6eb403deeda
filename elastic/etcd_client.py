"""The one door to etcd v3: a small synchronous client over etcd's JSON gateway.

Why the gateway and not a gRPC client: see docs/design/etcd-client.md. In short, it
recovers at once when etcd restarts, has no protobuf/gRPC version coupling, and runs no
background threads of its own inside the torchrun agent. Calls go over plain HTTP/1.1
(`elastic.etcd_http`: kept-alive connections for unary calls, one per watch). This module
adds user/password auth with
re-authentication, TLS settings that environment CA bundles cannot override,
compare-and-swap transactions on `mod_revision`, a lease keepalive thread, bounded
waits for changes, retries within a deadline, and typed errors that say which
endpoint and which key.

Everything stored through this client is bytes; callers that store structure use
JSON. Nothing read from etcd is ever unpickled or evaluated.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from relight.elastic.etcd_http import GatewayConnections, GatewayError, GatewayUnreachable, TlsFiles
from relight.errors import RelightError

logger = logging.getLogger(__name__)

__all__ = [
    "Compare",
    "EtcdAuthError",
    "EtcdClient",
    "EtcdError",
    "EtcdLeaseLostError",
    "EtcdSettings",
    "EtcdUnavailableError",
    "KeyValue",
    "MIN_ETCD_VERSION",
    "LeaseKeeper",
    "OpDelete",
    "OpPut",
    "OpRange",
    "TxnResult",
    "etcd_version_advice",
]


class EtcdError(RelightError, RuntimeError):
    """An etcd request failed for a reason that retrying will not fix."""


class EtcdUnavailableError(EtcdError, ConnectionError):
    """No configured etcd endpoint answered within the deadline."""


class EtcdAuthError(EtcdError, PermissionError):
    """Authentication failed or the user lacks permission on a key."""


class EtcdLeaseLostError(EtcdError):
    """The lease expired or was revoked: whatever it held is gone."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdSettings:
    """How to reach etcd. Secrets never appear in `repr`."""

    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    """`host:port` or `http(s)://host:port`; tried in order, the next on failure."""
    prefix: str = "/relight"
    """Root of every key Relight writes; a job lives under `{prefix}/{job_id}/`."""
    timeout: float = 5.0
    """Seconds one call may spend, retries included, before EtcdUnavailableError."""
    attempt_timeout: float = 2.0
    """Seconds one HTTP attempt against one endpoint may take before the next endpoint is
    tried. A member that accepts connections and never answers (frozen, or cut off from
    its peers) costs at most this once; each full pass over the endpoints doubles it, so
    a slow single etcd still gets long attempts, never past what is left of `timeout`."""
    username: str | None = None
    """etcd user (with `password`) when etcd has auth enabled."""
    password: str | None = field(default=None, repr=False)
    """Password of `username`."""
    ca_file: str | None = None
    """CA bundle that signed the server certificate; setting it turns TLS on."""
    cert_file: str | None = None
    """Client certificate, when etcd runs with --client-cert-auth."""
    key_file: str | None = field(default=None, repr=False)
    """Private key of `cert_file`."""

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(self.endpoints.split(",")))
        if not self.endpoints:
            raise ValueError("EtcdSettings.endpoints is empty: give at least one host:port")
        if self.timeout <= 0:
            raise ValueError(f"EtcdSettings.timeout must be > 0, got {self.timeout}")
        if self.attempt_timeout <= 0:
            raise ValueError(
                f"EtcdSettings.attempt_timeout must be > 0, got {self.attempt_timeout}")
        if (self.username is None) != (self.password is None):
            raise ValueError("EtcdSettings: give both username and password, or neither")
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("EtcdSettings: give both cert_file and key_file, or neither")
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(
                f"EtcdSettings.prefix must start with '/' and not end with one, "
                f"got {self.prefix!r}"
            )

    @property
    def tls(self) -> bool:
        return self.ca_file is not None or self.cert_file is not None or any(
            e.startswith("https://") for e in self.endpoints
        )

    def urls(self) -> list[str]:
        """Every endpoint as a base URL."""
        scheme = "https" if self.tls else "http"
        return [e.rstrip("/") if "://" in e else f"{scheme}://{e}" for e in self.endpoints]


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def json(self) -> Any:
        """The value parsed as JSON (the only structured format Relight stores)."""
        return json.loads(self.value)


@dataclass(frozen=True, slots=True)
class Compare:
    """One txn condition. `Compare(key, "mod", "==", 0)` means "the key is absent"."""

    key: str
    target: Literal["mod", "create", "version", "value", "lease"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes | str

    def to_json(self) -> dict[str, Any]:
        result = {"==": "EQUAL", "!=": "NOT_EQUAL", "<": "LESS", ">": "GREATER"}[self.op]
        field_name, target = {
            "mod": ("mod_revision", "MOD"),
            "create": ("create_revision", "CREATE"),
            "version": ("version", "VERSION"),
            "value": ("value", "VALUE"),
            "lease": ("lease", "LEASE"),
        }[self.target]
        value: Any = self.value
        if self.target == "value":
            value = _b64(value if isinstance(value, bytes) else str(value).encode())
        else:
            value = str(int(value))  # int64 travels as a JSON string
        return {"key": _b64(self.key), "result": result, "target": target, field_name: value}


@dataclass(frozen=True, slots=True)
class OpPut:
    key: str
    value: bytes | str
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        value = self.value.encode() if isinstance(self.value, str) else self.value
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


@dataclass(frozen=True, slots=True)
class OpDelete:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        body = {"key": _b64(self.key)}
        if self.prefix:
            body["range_end"] = _b64(_prefix_end(self.key))
        return {"request_delete_range": body}


@dataclass(frozen=True, slots=True)
class OpRange:
    """Every key under `prefix`, read inside a transaction: at the transaction's revision,
    after the operations before it in the same branch."""

    prefix: str

    def to_json(self) -> dict[str, Any]:
        return {"request_range": {"key": _b64(self.prefix),
                                  "range_end": _b64(_prefix_end(self.prefix)),
                                  "sort_order": "ASCEND", "sort_target": "KEY"}}


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: tuple[tuple[KeyValue, ...], ...] = ()
    """The keys each `OpRange` of the branch that ran read, in order."""


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _prefix_end(prefix: str) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    raw = bytearray(prefix.encode())
    while raw:
        if raw[-1] < 0xFF:
            raw[-1] += 1
            return bytes(raw)
        raw.pop()
    return b"\0"  # etcd: from key to the end of the keyspace


def _kv(item: dict[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(item.get("key")).decode(),
        value=_unb64(item.get("value")),
        create_revision=int(item.get("create_revision", 0)),
        mod_revision=int(item.get("mod_revision", 0)),
        version=int(item.get("version", 0)),
        lease=int(item.get("lease", 0)),
    )


# Gateway error texts that mean "get a new token and retry": simple tokens live in
# the server's memory, so every restart of etcd invalidates them.
_CN_HINT = (
    "etcd at {endpoint} refuses client certificates that carry a Common Name on its "
    "JSON gateway while auth is on; use a client certificate without a CN (identity "
    "then comes from username/password), or turn etcd auth off and rely on mTLS"
)
_REAUTH_MARKERS = ("invalid auth token", "user name is empty", "auth token is expired")


class _Endpoints:
    """The endpoint rotation, shared by every client made from one (`EtcdClient.sibling`):
    once one of them found a member dead or hung, the others start at the next one
    instead of paying the same attempt timeout again."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._index = 0
        self._lock = threading.Lock()

    def current(self) -> str:
        return self.urls[self._index % len(self.urls)]

    def failed(self, url: str) -> None:
        """Move past `url`, unless another thread already did."""
        with self._lock:
            if self.urls[self._index % len(self.urls)] == url:
                self._index += 1


class _Auth:
    """The simple-auth token, shared like the endpoints (one login for all siblings)."""

    def __init__(self) -> None:
        self.token: str | None = None
        self.lock = threading.Lock()


class EtcdClient:
    """A small synchronous etcd v3 client. Thread-safe: calls may come from any thread.

    Every call retries connection failures until `settings.timeout` has passed, then
    raises EtcdUnavailableError naming the endpoints. A failed attempt moves to the next
    endpoint at once (a refused connection, a member without a leader, or an attempt
    that ran past `settings.attempt_timeout`: a frozen member); only after every
    endpoint failed in a pass does the client back off. A request that was sent but not
    answered may have been applied: every write here is either idempotent (put, delete,
    revoke) or a compare-and-swap whose caller re-reads on failure.
    """

    def __init__(self, settings: EtcdSettings, *, _endpoints: _Endpoints | None = None,
                 _auth: _Auth | None = None) -> None:
        self.settings = settings
        self._urls = settings.urls()
        self._endpoints = _endpoints or _Endpoints(self._urls)
        self._auth = _auth or _Auth()
        self._http = GatewayConnections(
            TlsFiles(settings.ca_file, settings.cert_file, settings.key_file)
            if settings.tls else None)

    def sibling(self, *, timeout: float, attempt_timeout: float | None = None) -> EtcdClient:
        """A client with other deadlines that shares this one's endpoint rotation and
        auth token (the rendezvous's monitor and keepalive clients)."""
        settings = dataclasses.replace(
            self.settings, timeout=timeout,
            attempt_timeout=min(attempt_timeout or self.settings.attempt_timeout, timeout))
        return EtcdClient(settings, _endpoints=self._endpoints, _auth=self._auth)

    # -- transport ------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The endpoint currently in use (for messages)."""
        return self._endpoints.current()

    @property
    def _token(self) -> str | None:
        return self._auth.token

    @_token.setter
    def _token(self, value: str | None) -> None:
        with self._auth.lock:
            self._auth.token = value

    def _authenticate(self, endpoint: str, timeout: float) -> None:
        assert self.settings.username is not None
        try:
            resp = self._http.post(
                endpoint, "/v3/auth/authenticate",
                {"name": self.settings.username, "password": self.settings.password},
                timeout=timeout)
        except GatewayError as exc:
            if "commonname" in exc.text.lower():
                raise EtcdAuthError(_CN_HINT.format(endpoint=endpoint)) from None
            raise EtcdAuthError(
                f"etcd at {endpoint} refused user {self.settings.username!r}: "
                f"{exc.text.strip()[:200]}; check the etcd username/password"
            ) from None
        with self._auth.lock:
            self._auth.token = resp["token"]

    def call(self, path: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        """POST `body` to `/v3/{path}`, with failover, retries, auth and typed errors.

        `what` names the operation and key for error messages.
        """
        deadline = time.monotonic() + self.settings.timeout
        attempt = self.settings.attempt_timeout
        delay = 0.05
        failed_in_pass = 0
        reauthed = False
        last: Exception | None = None
        while True:
            url = self.endpoint
            per_try = max(0.05, min(attempt, deadline - time.monotonic()))
            try:
                if self.settings.username and self._token is None:
                    self._authenticate(url, per_try)
                headers = {"Authorization": self._token} if self._token else None
                resp = self._http.post(url, "/v3/" + path, body, timeout=per_try,
                                       headers=headers)
                _check_version_once(self, url)
                return resp
            except GatewayUnreachable as exc:
                last = exc
            except GatewayError as exc:
                text = exc.text.lower()
                if self.settings.username and not reauthed and any(
                    m in text for m in _REAUTH_MARKERS
                ):
                    reauthed = True
                    with self._auth.lock:
                        self._auth.token = None
                    continue
                if "commonname" in text:
                    raise EtcdAuthError(_CN_HINT.format(endpoint=url)) from None
                if "permission denied" in text or "authentication failed" in text or (
                    any(m in text for m in _REAUTH_MARKERS)
                ):
                    raise EtcdAuthError(
                        f"etcd at {url} denied {what}: {text.strip()[:200]}; "
                        "check the etcd user and its role's key permissions"
                    ) from None
                if "lease not found" in text:
                    raise EtcdLeaseLostError(f"{what}: lease not found at {url}") from None
                if "no leader" in text or "timed out" in text or "unavailable" in text:
                    # A member cut off from its peers (or mid-election) answers this way;
                    # another member may have a leader now.
                    last = exc
                else:
                    raise EtcdError(
                        f"etcd at {url} rejected {what}: {text.strip()[:300]}"
                    ) from None
            self._endpoints.failed(url)
            failed_in_pass += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdUnavailableError(
                    f"etcd unreachable for {what}: no answer from {', '.join(self._urls)} "
                    f"within {self.settings.timeout:.1f}s (last error: {_short(last)}); "
                    "check that etcd is running and the endpoint (--rdzv-endpoint) is right"
                ) from None
            if failed_in_pass >= len(self._urls):
                # Every endpoint failed once: back off, and give the next pass longer
                # attempts (a loaded single etcd may just be slow).
                failed_in_pass = 0
                attempt *= 2
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1.0)

    # -- key/value ------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        resp = self.call("kv/range", {"key": _b64(key)}, what=f"get {key}")
        kvs = resp.get("kvs") or []
        return _kv(kvs[0]) if kvs else None

    def read(self, key: str) -> tuple[KeyValue | None, int]:
        """`get` plus the store revision it was read at (to wait for later changes)."""
        resp = self.call("kv/range", {"key": _b64(key)}, what=f"get {key}")
        kvs = resp.get("kvs") or []
        return (_kv(kvs[0]) if kvs else None), int(resp["header"]["revision"])

    def get_prefix(self, prefix: str, *, keys_only: bool = False) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (sorted by key) and the store revision read at;
        `keys_only`: without their values (empty), for a caller that needs only names."""
        body = {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
                "sort_order": "ASCEND", "sort_target": "KEY"}
        if keys_only:
            body["keys_only"] = True
        resp = self.call("kv/range", body, what=f"range {prefix}*")
        return [_kv(i) for i in resp.get("kvs") or []], int(resp["header"]["revision"])

    def revision(self) -> int:
        """The current store revision."""
        resp = self.call("kv/range", {"key": _b64("\0"), "count_only": True}, what="revision")
        return int(resp["header"]["revision"])

    def put(self, key: str, value: bytes | str, *, lease: int = 0) -> int:
        """Write `key`; returns the new store revision."""
        resp = self.call("kv/put", OpPut(key, value, lease).to_json()["request_put"],
                         what=f"put {key}")
        return int(resp["header"]["revision"])

    def delete(self, key: str) -> int:
        resp = self.call("kv/deleterange", {"key": _b64(key)}, what=f"delete {key}")
        return int(resp.get("deleted", 0))

    def delete_prefix(self, prefix: str) -> int:
        resp = self.call(
            "kv/deleterange",
            {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))},
            what=f"delete {prefix}*",
        )
        return int(resp.get("deleted", 0))

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[OpPut | OpDelete | OpRange] = (),
        failure: Sequence[OpPut | OpDelete | OpRange] = (),
    ) -> TxnResult:
        body = {
            "compare": [c.to_json() for c in compare],
            "success": [o.to_json() for o in success],
            "failure": [o.to_json() for o in failure],
        }
        keys = ",".join(c.key for c in compare)
        resp = self.call("kv/txn", body, what=f"txn on {keys}")
        ranges = tuple(tuple(_kv(i) for i in r["response_range"].get("kvs") or [])
                       for r in resp.get("responses") or [] if "response_range" in r)
        # proto3 JSON leaves false booleans out.
        return TxnResult(bool(resp.get("succeeded", False)), int(resp["header"]["revision"]),
                         ranges)

    def cas(self, key: str, mod_revision: int, value: bytes | str, *, lease: int = 0) -> bool:
        """Write `key` only if its mod_revision is still `mod_revision` (0: absent)."""
        cond = [Compare(key, "mod", "==", mod_revision)]
        return self.txn(cond, [OpPut(key, value, lease)]).succeeded

    # -- leases ---------------------------------------------------------------

    def lease_grant(self, ttl: int) -> int:
        resp = self.call("lease/grant", {"TTL": str(int(ttl))}, what=f"lease grant ttl={ttl}")
        return int(resp["ID"])

    def lease_keepalive(self, lease_id: int) -> int:
        """Refresh the lease; returns its new TTL. Raises EtcdLeaseLostError if it is gone."""
        resp = self.call("lease/keepalive", {"ID": str(lease_id)}, what=f"keepalive {lease_id:x}")
        ttl = int((resp.get("result") or {}).get("TTL", 0))
        if ttl <= 0:
            raise EtcdLeaseLostError(
                f"lease {lease_id:x} expired or was revoked at {self.endpoint}: "
                "the keys it held are gone"
            )
        return ttl

    def lease_revoke(self, lease_id: int) -> None:
        """Revoke the lease and delete its keys; a lease already gone is not an error."""
        try:
            self.call("lease/revoke", {"ID": str(lease_id)}, what=f"revoke {lease_id:x}")
        except EtcdLeaseLostError:
            pass

    # -- waiting --------------------------------------------------------------

    def wait_for_change(self, prefix: str, after_revision: int | None, timeout: float,
                        until: Callable[[KeyValue | None], bool] | None = None, *,
                        then: Callable[[], int | None] | None = None,
                        idle_s: float | None = None) -> bool:
        """Block until a key under `prefix` changes after `after_revision`, or `timeout`.

        Returns True when something changed (or may have: a broken watch returns
        early so the caller re-reads), False on timeout. Never blocks past `timeout`.
        `until`: only changes it accepts count (`kv` is None for a delete), on one
        watch stream.

        `after_revision` None: from now, and `then()` (a read, say) runs once the watch
        is in place; changes at or before the revision it returns are skipped, and
        None from it ends the wait at once (True: what it read is the change). A read
        followed by a watch from its revision gets a change made between the two only
        at etcd's next catch-up round of watches that start in the past (every 100 ms).
        `idle_s`: the wait also ends (False) once no change came for that long, so that
        a caller with work to do in a lull keeps one stream while changes flow.
        """
        return self._watch(prefix, True, after_revision, timeout,
                           until or (lambda _kv: True), then, idle_s)[0] != "timeout"

    def wait_for_event(self, key: str, after_revision: int, timeout: float,
                       until: Callable[[KeyValue | None], bool]) -> tuple[bool, KeyValue | None]:
        """Follow the changes of the one `key` after `after_revision` on one watch
        stream until `until(kv)` holds for one (`kv` is None for a delete), or
        `timeout`. Returns `(True, kv)` for that change; `(False, None)` on timeout
        or when the stream broke (the caller re-reads). Changes `until` rejects cost
        no request: a waiter that only cares about some changes of a busy key stays
        on one stream instead of re-reading and re-watching after each."""
        outcome, kv = self._watch(key, False, after_revision, timeout, until)
        return outcome == "event", kv

    def _watch(self, key: str, prefix: bool, after_revision: int | None, timeout: float,
               until: Callable[[KeyValue | None], bool],
               then: Callable[[], int | None] | None = None, idle_s: float | None = None,
               ) -> tuple[Literal["event", "broken", "timeout"], KeyValue | None]:
        """The watch loop: `("event", kv)` for the first event `until` accepts,
        `("broken", None)` when the stream ended early, `("timeout", None)` (also after
        `idle_s` without a message). From now when `after_revision` is None, `then` run
        once the watch is created (its errors are the caller's) and the changes up to
        the revision it returns skipped (`("event", None)` at once when it returns
        None)."""
        if timeout <= 0:
            return "timeout", None
        url = self.endpoint
        create: dict[str, Any] = {"key": _b64(key)}
        if after_revision is not None:
            create["start_revision"] = str(after_revision + 1)
        seen = 0
        if prefix:
            create["range_end"] = _b64(_prefix_end(key))
        headers = {"Authorization": self._token} if self._token else None
        deadline = time.monotonic() + timeout
        try:
            for msg in self._http.stream(url, "/v3/watch", {"create_request": create},
                                         connect_timeout=min(timeout, self.settings.timeout),
                                         deadline=deadline, headers=headers, idle_s=idle_s):
                result = msg.get("result", {})
                if result.get("canceled") or result.get("compact_revision"):
                    return "broken", None
                if result.get("created") and then is not None and after_revision is None:
                    read_at = then()
                    if read_at is None:
                        return "event", None
                    seen = read_at
                for event in result.get("events") or []:
                    if seen and int(event["kv"].get("mod_revision", 0)) <= seen:
                        continue  # in what `then` read
                    kv = None if event.get("type") == "DELETE" else _kv(event["kv"])
                    if until(kv):
                        return "event", kv
        except TimeoutError:
            return "timeout", None
        except (GatewayUnreachable, GatewayError, ValueError) as exc:
            # Refused, reset, an error status, or etcd dying mid-stream.
            logger.debug("watch on %s broke (%s); caller re-reads", key, _short(exc))
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            return "broken", None
        return "broken", None

    def close(self) -> None:
        """Close this thread's connections."""
        self._http.close()


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    text = getattr(exc, "text", None) or str(exc) or type(exc).__name__
    # Long enough for a TLS failure's reason in full.
    return f"{type(exc).__name__}: {str(text)[:600]}"


MIN_ETCD_VERSION = (3, 5, 13)
"""The oldest etcd Relight recommends for real clusters (see `etcd_version_advice`)."""

_LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})
_versions_lock = threading.Lock()
_versions_checked: set[str] = set()
_versions_told: set[str] = set()


def etcd_version_advice(version: str) -> str | None:
    """Why etcd `version` (e.g. "3.5.1") is unsafe for Relight's leases, or None if it
    is not known to be. Pure; `EtcdClient` logs it once per endpoint and process."""
    try:
        parts = tuple(int(p) for p in version.split("-", 1)[0].split(".")[:3])
    except ValueError:
        return None
    if len(parts) < 3 or parts >= MIN_ETCD_VERSION or parts >= (3, 6, 0):
        return None
    reasons = []
    if (3, 5, 0) <= parts <= (3, 5, 2):
        reasons.append("3.5.0-3.5.2 can lose data consistency after a crash "
                       "(etcd-io/etcd#13766, fixed in 3.5.3)")
    reasons.append("a leader that stalls and resumes can revoke leases the new leader kept "
                   "alive, restarting healthy nodes (etcd-io/etcd#15247, fixed in 3.5.13)")
    minimum = ".".join(map(str, MIN_ETCD_VERSION))
    return (f"etcd {version} is older than {minimum}: " + "; ".join(reasons)
            + f". Use etcd >= {minimum} (or 3.6) for a real cluster; the embedded "
            "single-member etcd of `relight run` is for local runs only")


def _check_version_once(client: EtcdClient, url: str) -> None:
    """Read `/version` of `url` once per process and warn if it is an affected release.
    Best effort: a failure here never fails the call that triggered it."""
    with _versions_lock:
        if url in _versions_checked:
            return
        _versions_checked.add(url)
    try:
        version = str(client._http.get(url, "/version", timeout=client.settings.attempt_timeout)
                      .get("etcdserver", ""))
    except (GatewayUnreachable, GatewayError) as exc:
        logger.debug("could not read the version of etcd at %s: %s", url, exc)
        return
    advice = etcd_version_advice(version)
    with _versions_lock:
        if advice and version in _versions_told:
            return
        _versions_told.add(version)
    if advice:
        # On loopback it is a local run (the embedded etcd, a test cluster): say it once
        # quietly. Anywhere else it is a cluster users depend on: warn.
        host = url.split("://", 1)[1].rsplit(":", 1)[0]
        level = logging.INFO if host in _LOOPBACK else logging.WARNING
        logger.log(level, "etcd at %s: %s", url, advice)


class LeaseKeeper:
    """Keeps one lease alive from a daemon thread, refreshing every `ttl/3` seconds.

    Only etcd can say a lease is gone: while etcd is unreachable the keeper keeps
    trying (and logs), because a restarted etcd renews every lease it still holds.
    When etcd answers that the lease expired or was revoked, `lost` is set, `error`
    holds the reason, `on_lost` is called once, and the thread stops. It never dies
    silently; `unreachable_since` tells how long etcd has been silent.
    """

    def __init__(
        self,
        client: EtcdClient,
        lease_id: int,
        ttl: float,
        on_lost: Callable[[BaseException], None] | None = None,
        name: str = "relight-lease",
    ) -> None:
        self.client = client
        self.lease_id = lease_id
        self.ttl = ttl
        self.on_lost = on_lost
        self.lost = threading.Event()
        self.error: BaseException | None = None
        self.unreachable_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def _run(self) -> None:
        interval = max(self.ttl / 3.0, 0.2)
        wait = interval
        while not self._stop.wait(wait):
            try:
                self.client.lease_keepalive(self.lease_id)
                if self.unreachable_since is not None:
                    logger.info("lease %x refreshed again after %.1fs without etcd",
                                self.lease_id, time.monotonic() - self.unreachable_since)
                self.unreachable_since = None
                wait = interval
            except EtcdLeaseLostError as exc:
                self._fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - etcd decides when the lease is gone
                # The TTL is running: try again almost at once (the client has moved on
                # to the next endpoint), backing off only while nothing answers at all.
                wait = 0.05 if self.unreachable_since is None else min(wait * 2, interval)
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    logger.warning("lease %x keepalive failed (%s); retrying on the next "
                                   "endpoint", self.lease_id, _short(exc))

    def _fail(self, exc: BaseException) -> None:
        self.error = exc
        self.lost.set()
        logger.error("lease %x lost: %s", self.lease_id, _short(exc))
        if self.on_lost is not None:
            try:
                self.on_lost(exc)
            except Exception:  # noqa: BLE001 - a callback failure must not hide the loss
                logger.exception("on_lost callback of lease %x failed", self.lease_id)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.client.settings.timeout + 1)
