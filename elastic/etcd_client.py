"""The one door to etcd v3: a small synchronous client over etcd's JSON gateway.

Why the gateway (through `etcd3gw`'s transport) and not a gRPC client: see
docs/etcd-client.md. In short, it recovers at once when etcd restarts, has no
protobuf/gRPC version coupling, and runs no background threads of its own inside
the torchrun agent. This module adds what `etcd3gw` lacks: user/password auth with
re-authentication, TLS settings that environment CA bundles cannot override,
compare-and-swap transactions on `mod_revision`, a lease keepalive thread, bounded
waits for changes, retries within a deadline, and typed errors that say which
endpoint and which key.

Everything stored through this client is bytes; callers that store structure use
JSON. Nothing read from etcd is ever unpickled or evaluated.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import requests
from etcd3gw import exceptions as gw_exc
from etcd3gw.client import Etcd3Client

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
    "LeaseKeeper",
    "OpDelete",
    "OpPut",
    "TxnResult",
]


class EtcdError(RuntimeError):
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
class TxnResult:
    succeeded: bool
    revision: int


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


class EtcdClient:
    """A small synchronous etcd v3 client. Thread-safe: calls may come from any thread.

    Every call retries connection failures (and moves to the next endpoint) until
    `settings.timeout` has passed, then raises EtcdUnavailableError naming the
    endpoints. A request that was sent but not answered may have been applied: every
    write here is either idempotent (put, delete, revoke) or a compare-and-swap whose
    caller re-reads on failure.
    """

    def __init__(self, settings: EtcdSettings) -> None:
        self.settings = settings
        self._urls = settings.urls()
        self._index = 0
        self._lock = threading.Lock()
        self._token: str | None = None
        self._local = threading.local()

    # -- transport ------------------------------------------------------------

    def _session(self) -> requests.Session:
        # One session per thread: requests.Session is not documented thread-safe,
        # and the keepalive thread must never queue behind a long call.
        session = getattr(self._local, "session", None)
        if session is None:
            session = requests.Session()
            # Without this, REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE in the environment
            # silently replace `verify` (a long-standing requests behaviour), and
            # HTTP(S)_PROXY would route etcd traffic through a proxy.
            session.trust_env = False
            if self.settings.tls:
                session.verify = self.settings.ca_file or True
            if self.settings.cert_file and self.settings.key_file:
                session.cert = (self.settings.cert_file, self.settings.key_file)
            self._local.session = session
        return session

    def _gateway(self, url: str) -> Etcd3Client:
        host, _, port = url.split("://", 1)[1].rpartition(":")
        return Etcd3Client(
            host=host,
            port=int(port),
            protocol=url.split("://", 1)[0],
            timeout=self.settings.timeout,
            api_path="/v3/",
            session=self._session(),
        )

    @property
    def endpoint(self) -> str:
        """The endpoint currently in use (for messages)."""
        return self._urls[self._index % len(self._urls)]

    def _authenticate(self, gw: Etcd3Client) -> None:
        assert self.settings.username is not None
        try:
            resp = gw.post(
                gw.get_url("/auth/authenticate"),
                json={"name": self.settings.username, "password": self.settings.password},
            )
        except gw_exc.Etcd3Exception as exc:
            if isinstance(exc, gw_exc.ConnectionFailedError | gw_exc.ConnectionTimeoutError):
                raise
            if "commonname" in (exc.detail_text or "").lower():
                raise EtcdAuthError(_CN_HINT.format(endpoint=self.endpoint)) from None
            raise EtcdAuthError(
                f"etcd at {self.endpoint} refused user {self.settings.username!r}: "
                f"{(exc.detail_text or '').strip()[:200]}; check the etcd username/password"
            ) from None
        with self._lock:
            self._token = resp["token"]

    def call(self, path: str, body: dict[str, Any], *, what: str) -> dict[str, Any]:
        """POST `body` to `/v3/{path}`, with retries, auth and typed errors.

        `what` names the operation and key for error messages.
        """
        deadline = time.monotonic() + self.settings.timeout
        delay = 0.05
        reauthed = False
        last: Exception | None = None
        while True:
            gw = self._gateway(self.endpoint)
            try:
                if self.settings.username and self._token is None:
                    self._authenticate(gw)
                headers = {"Authorization": self._token} if self._token else None
                return gw.post(gw.get_url(path), json=body, headers=headers)
            except (gw_exc.ConnectionFailedError, gw_exc.ConnectionTimeoutError) as exc:
                last = exc
                with self._lock:
                    self._index += 1
            except gw_exc.Etcd3Exception as exc:
                text = (exc.detail_text or "").lower()
                if self.settings.username and not reauthed and any(
                    m in text for m in _REAUTH_MARKERS
                ):
                    reauthed = True
                    with self._lock:
                        self._token = None
                    continue
                if "commonname" in text:
                    raise EtcdAuthError(_CN_HINT.format(endpoint=self.endpoint)) from None
                if "permission denied" in text or "authentication failed" in text or (
                    any(m in text for m in _REAUTH_MARKERS)
                ):
                    raise EtcdAuthError(
                        f"etcd at {self.endpoint} denied {what}: {text.strip()[:200]}; "
                        "check the etcd user and its role's key permissions"
                    ) from None
                if "lease not found" in text:
                    raise EtcdLeaseLostError(
                        f"{what}: lease not found at {self.endpoint}"
                    ) from None
                if "no leader" in text or "timed out" in text or "unavailable" in text:
                    last = exc
                else:
                    raise EtcdError(
                        f"etcd at {self.endpoint} rejected {what}: {text.strip()[:300]}"
                    ) from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise EtcdUnavailableError(
                    f"etcd unreachable for {what}: no answer from {', '.join(self._urls)} "
                    f"within {self.settings.timeout:.1f}s (last error: {_short(last)}); "
                    "check that etcd is running and the endpoint (--rdzv-endpoint) is right"
                ) from None
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

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (sorted by key) and the store revision read at."""
        resp = self.call(
            "kv/range",
            {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
             "sort_order": "ASCEND", "sort_target": "KEY"},
            what=f"range {prefix}*",
        )
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
        success: Sequence[OpPut | OpDelete] = (),
        failure: Sequence[OpPut | OpDelete] = (),
    ) -> TxnResult:
        body = {
            "compare": [c.to_json() for c in compare],
            "success": [o.to_json() for o in success],
            "failure": [o.to_json() for o in failure],
        }
        keys = ",".join(c.key for c in compare)
        resp = self.call("kv/txn", body, what=f"txn on {keys}")
        # proto3 JSON leaves false booleans out.
        return TxnResult(bool(resp.get("succeeded", False)), int(resp["header"]["revision"]))

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

    def wait_for_change(self, prefix: str, after_revision: int, timeout: float) -> bool:
        """Block until a key under `prefix` changes after `after_revision`, or `timeout`.

        Returns True when something changed (or may have: a broken watch returns
        early so the caller re-reads), False on timeout. Never blocks past `timeout`.
        """
        if timeout <= 0:
            return False
        url = self.endpoint + "/v3/watch"
        body = {"create_request": {
            "key": _b64(prefix), "range_end": _b64(_prefix_end(prefix)),
            "start_revision": str(after_revision + 1),
        }}
        headers = {"Authorization": self._token} if self._token else None
        deadline = time.monotonic() + timeout
        try:
            with self._session().post(
                url, json=body, headers=headers, stream=True,
                timeout=(min(timeout, self.settings.timeout), timeout),
            ) as resp:
                if resp.status_code != 200:
                    time.sleep(min(0.2, timeout))
                    return True
                for line in resp.iter_lines(chunk_size=None):
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("events") or result.get("canceled") or result.get(
                        "compact_revision"
                    ):
                        return True
                    if time.monotonic() >= deadline:
                        return False
        except requests.exceptions.ReadTimeout:
            return False
        except (requests.exceptions.RequestException, ValueError) as exc:
            # ConnectionError, and ChunkedEncodingError when etcd dies mid-stream.
            if "Read timed out" in str(exc):
                return False
            logger.debug("watch on %s broke (%s); caller re-reads", prefix, _short(exc))
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            return True
        return True

    def close(self) -> None:
        session = getattr(self._local, "session", None)
        if session is not None:
            session.close()
            self._local.session = None


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    text = getattr(exc, "detail_text", None) or str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {str(text)[:160]}"


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
        while not self._stop.wait(interval):
            try:
                self.client.lease_keepalive(self.lease_id)
                if self.unreachable_since is not None:
                    logger.info("lease %x refreshed again after %.1fs without etcd",
                                self.lease_id, time.monotonic() - self.unreachable_since)
                self.unreachable_since = None
            except EtcdLeaseLostError as exc:
                self._fail(exc)
                return
            except Exception as exc:  # noqa: BLE001 - etcd decides when the lease is gone
                if self.unreachable_since is None:
                    self.unreachable_since = time.monotonic()
                    logger.warning("lease %x keepalive failed (%s); retrying every %.1fs",
                                   self.lease_id, _short(exc), interval)

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
