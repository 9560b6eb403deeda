"""An etcd v3 rendezvous backend for torchrun (`--rdzv-backend=relight-etcd`).

Registered through the `torchrun.handlers` entry point group (`torchrun_handler`).
The protocol, the key layout and the timing rules are documented in
docs/elastic.md; in one paragraph:

Every job lives under `{prefix}/{run_id}/`. Each agent holds an etcd lease with
keepalive and a node key bound to it, so a dead agent disappears after one TTL. One
JSON `state` key describes the current round: `open` (collecting members) or
`complete` (participants in rank order). Every change to it is a compare-and-swap
transaction on the key's `mod_revision`; no etcd lock is used. The round's rank 0
starts a brand-new TCPStore for every round and publishes its address under
`rounds/{n}/store`, so workers of a new round never read an address an earlier
round wrote (torchrun's c10d backend reuses one store across restarts). Every wait
is bounded: by the join timeout, by the lease TTL of whoever is awaited, or by the
etcd timeout.
"""

# ruff: noqa: E402 - `torchrun_handler` must be defined before torch is imported (see it)
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def torchrun_handler() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """Entry point of group `torchrun.handlers`: returns the handler creator.

    Defined before this module imports torch on purpose: torch registers out-of-tree
    handlers while its rendezvous package is first imported, which can happen in the
    middle of importing this very module; the partially imported module must already
    have this function, and the creator it returns looks `create_handler` up only
    when torchrun calls it.
    """

    def create(params: RendezvousParameters) -> RendezvousHandler:
        return create_handler(params)

    return create


import atexit
import dataclasses
import json
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

from torch.distributed import DistError, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from relight.elastic.etcd_client import (
    EtcdAuthError,
    EtcdClient,
    EtcdError,
    EtcdLeaseLostError,
    EtcdSettings,
    EtcdUnavailableError,
    KeyValue,
    LeaseKeeper,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND_NAME",
    "EtcdRendezvousHandler",
    "RDZV_ROUND_ENV",
    "RendezvousSettings",
    "RoundState",
    "add_listener",
    "assign_ranks",
    "create_handler",
    "parse_node_counts",
    "record_event",
    "release_leases",
    "remove_listener",
    "torchrun_handler",
]

BACKEND_NAME = "relight-etcd"
PASSWORD_ENV = "RELIGHT_ETCD_PASSWORD"
EVENTS_ENV = "RELIGHT_EVENTS_FILE"
"""If set, each rendezvous appends JSON lines (`rdzv_start`, `rdzv_done`) with wall-clock
times to this file: how recovery time splits into detection and re-rendezvous."""
RDZV_ROUND_ENV = "RELIGHT_RDZV_ROUND"
"""Set in the agent's environment to the round just joined, so the workers it starts
next inherit it (torchrun's workers get the agent's environment plus their own)."""

Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def add_listener(fn: Listener) -> None:
    """Call `fn(kind, fields)` for every event of the handlers in this process: the ones
    `record_event` writes, and `nodes_waiting` (each fresh `num_nodes_waiting()` count,
    never written to the file). A node agent's metrics subscribe here."""
    _listeners.append(fn)


def remove_listener(fn: Listener) -> None:
    if fn in _listeners:
        _listeners.remove(fn)


def _notify(kind: str, fields: dict[str, Any]) -> None:
    for fn in list(_listeners):
        try:
            fn(kind, fields)
        except Exception as exc:  # noqa: BLE001 - an observer never breaks the rendezvous
            logger.warning("rendezvous listener %r failed on %s: %s", fn, kind, exc)


def record_event(kind: str, **fields: Any) -> None:
    """Tell the listeners, and append one JSON line to $RELIGHT_EVENTS_FILE (no-op when
    unset; never raises)."""
    _notify(kind, fields)
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    line = json.dumps({"ev": kind, "t": time.time(), "pid": os.getpid(), **fields})
    try:
        # One write() of one line with O_APPEND: lines from processes do not interleave.
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        logger.warning("could not append to %s=%s: %s", EVENTS_ENV, path, exc)


@dataclass(frozen=True, kw_only=True, slots=True)
class RendezvousSettings:
    """Timing and identity of one node's rendezvous; from `--rdzv-conf key=value,...`."""

    run_id: str
    """The job id (`--rdzv-id`); keys live under `{prefix}/{run_id}/`."""
    min_nodes: int
    """Smallest group that may start (`--nnodes=MIN:MAX`)."""
    max_nodes: int
    """Largest group; nodes beyond it wait as spares."""
    etcd: EtcdSettings
    """How to reach etcd (`--rdzv-endpoint`, conf keys `prefix`, `username`, `ca_file`...)."""
    join_timeout: float = 900.0
    """Conf `join_timeout` (or torchrun's `timeout`): longest one next_rendezvous() may take."""
    last_call_timeout: float = 5.0
    """Conf `last_call_timeout`: once the first round has min nodes, wait this long for more."""
    rejoin_timeout: float = 30.0
    """Conf `rejoin_timeout`: how long a new round waits for members of the previous round
    whose leases are still alive (a dead node stops being awaited when its lease expires)."""
    lease_ttl: float = 10.0
    """Conf `lease_ttl`: seconds after which a silent node is out (keepalive every ttl/3)."""
    etcd_timeout: float = 30.0
    """Conf `etcd_timeout`: how long etcd may stay unreachable before joining fails."""
    store_timeout: float = 300.0
    """Conf `store_timeout`: timeout of the per-round TCPStore operations."""
    poll_interval: float = 1.0
    """Conf `poll_interval`: how stale num_nodes_waiting() may be (one etcd read per interval)."""
    local_addr: str | None = None
    """Address others use to reach this node's TCPStore (torchrun `--local-addr`)."""
    node_counts: tuple[int, ...] | None = None
    """Conf `node_counts` (`2+4+8`): the numbers of nodes the job's layout can train on
    (`relight run` reads them from the training config). A round of another size trains
    on the largest of them it holds, and the nodes left over wait as hot spares until a
    loss, or enough newcomers, make a larger one. None: any number."""

    def __post_init__(self) -> None:
        if not self.run_id or "/" in self.run_id:
            raise ValueError(f"rendezvous id {self.run_id!r} must be non-empty without '/'")
        if not 1 <= self.min_nodes <= self.max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got "
                             f"{self.min_nodes}:{self.max_nodes}")
        for name in ("join_timeout", "last_call_timeout", "rejoin_timeout", "lease_ttl",
                     "etcd_timeout", "store_timeout", "poll_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"rendezvous setting {name} must be > 0")
        if self.lease_ttl < 1:
            raise ValueError("rendezvous setting lease_ttl must be >= 1 s (etcd's granularity)")
        if self.node_counts is not None and (
                not self.node_counts or min(self.node_counts) < 1):
            raise ValueError(f"rendezvous setting node_counts needs counts >= 1, got "
                             f"{self.node_counts}")

    def fit(self, nodes: int) -> int:
        """How many of `nodes` present nodes train: the largest usable count up to
        `nodes` (and `max_nodes`); 0 when none is."""
        nodes = min(nodes, self.max_nodes)
        if self.node_counts is None:
            return nodes
        return max((c for c in self.node_counts if c <= nodes), default=0)

    @property
    def namespace(self) -> str:
        return f"{self.etcd.prefix}/{self.run_id}/"

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> RendezvousSettings:
        conf = params.config
        known = {"timeout", "join_timeout", "last_call_timeout", "rejoin_timeout", "lease_ttl",
                 "etcd_timeout", "attempt_timeout", "store_timeout", "poll_interval", "prefix",
                 "username", "ca_file", "cert_file", "key_file", "node_counts"}
        unknown = sorted(set(conf) - known)
        if "password" in unknown:
            raise ValueError(
                f"do not pass the etcd password in --rdzv-conf (torchrun logs it); "
                f"set the {PASSWORD_ENV} environment variable instead"
            )
        if unknown:
            logger.warning("relight-etcd ignores unknown --rdzv-conf keys %s", unknown)

        def num(key: str, default: float) -> float:
            value = conf.get(key)
            return default if value is None else float(value)

        username = conf.get("username")
        password = os.environ.get(PASSWORD_ENV) if username else None
        if username and password is None:
            raise ValueError(f"--rdzv-conf username={username} needs the password in "
                             f"the {PASSWORD_ENV} environment variable")
        endpoints = tuple(e.strip() for e in (params.endpoint or "127.0.0.1:2379").split(",")
                          if e.strip())
        etcd_timeout = num("etcd_timeout", 30.0)
        lease_ttl = num("lease_ttl", 10.0)
        # A member that cannot answer within a third of the lease TTL is failing by the
        # rendezvous's own measure of liveness: try the next one.
        attempt_timeout = num("attempt_timeout", min(2.0, max(0.2, lease_ttl / 3)))
        return cls(
            run_id=params.run_id,
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            etcd=EtcdSettings(
                endpoints=endpoints,
                prefix=str(conf.get("prefix", "/relight")),
                timeout=etcd_timeout,
                attempt_timeout=attempt_timeout,
                username=username,
                password=password,
                ca_file=conf.get("ca_file"),
                cert_file=conf.get("cert_file"),
                key_file=conf.get("key_file"),
            ),
            join_timeout=num("join_timeout", num("timeout", 900.0)),
            last_call_timeout=num("last_call_timeout", 5.0),
            rejoin_timeout=num("rejoin_timeout", 30.0),
            lease_ttl=lease_ttl,
            etcd_timeout=etcd_timeout,
            store_timeout=num("store_timeout", 300.0),
            poll_interval=num("poll_interval", 1.0),
            local_addr=params.local_addr,
            node_counts=parse_node_counts(conf.get("node_counts")),
        )


NODE_COUNTS_SEP = "+"
"""Separates the counts of conf `node_counts` (`,` separates torchrun's conf keys)."""


def parse_node_counts(value: object) -> tuple[int, ...] | None:
    """Conf `node_counts` (`"2+4"`, or an int) as sorted counts; None when unset."""
    if value is None or value == "":
        return None
    try:
        counts = sorted({int(v) for v in str(value).split(NODE_COUNTS_SEP)})
    except ValueError:
        raise ValueError(f"--rdzv-conf node_counts={value!r}: expected node counts joined "
                         f"by {NODE_COUNTS_SEP!r}, e.g. 2{NODE_COUNTS_SEP}4") from None
    return tuple(counts)


@dataclass(slots=True)
class RoundState:
    """The JSON document at `{namespace}state`. Plain data: parsed, never unpickled."""

    round: int = 0
    phase: str = "open"
    """`open`: collecting `members`; `complete`: `participants` hold the ranks."""
    members: list[str] = field(default_factory=list)
    """Open round: node ids in join order."""
    participants: list[str] = field(default_factory=list)
    """Complete round: node ids in rank order (rank = index)."""
    previous: list[str] = field(default_factory=list)
    """Open round: the participants of the last complete round, awaited while alive."""
    closed: bool = False

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, where: str) -> RoundState:
        try:
            doc = json.loads(raw)
            state = cls(
                round=int(doc["round"]),
                phase=str(doc["phase"]),
                members=[str(m) for m in doc.get("members", [])],
                participants=[str(p) for p in doc.get("participants", [])],
                previous=[str(p) for p in doc.get("previous", [])],
                closed=bool(doc.get("closed", False)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousStateError(
                f"rendezvous state at {where} is not valid JSON state ({exc}); delete the key "
                "or use a new --rdzv-id"
            ) from None
        if state.phase not in ("open", "complete"):
            raise RendezvousStateError(f"rendezvous state at {where} has phase {state.phase!r}")
        return state


def assign_ranks(members: Sequence[str], previous: Sequence[str]) -> list[str]:
    """Rank order of a new round: members of the previous round keep their relative
    order (so an unchanged group gets unchanged ranks), then newcomers in join order."""
    kept = [p for p in previous if p in members]
    return kept + [m for m in members if m not in kept]


_live: weakref.WeakSet[EtcdRendezvousHandler] = weakref.WeakSet()


def release_leases(reason: str) -> int:
    """Revoke the lease of every handler in this process that holds one, so that peers
    see this node leave at once instead of one TTL later. The rendezvous stays open (a
    node that leaves is not the job ending). Returns how many leases were revoked.

    `relight run` calls it when its agent is stopped by a signal; it also runs at
    interpreter exit, which covers plain torchrun (whose agent skips `shutdown()` on a
    signal, so as not to close the rendezvous)."""
    released = 0
    for handler in list(_live):
        # Only in the process that granted the lease (a forked child inherits the set).
        if handler._lease_pid == os.getpid():
            released += handler.leave(reason)
    return released


atexit.register(release_leases, "process exit")


class _Retry(Enum):
    """`_step`'s answer after a CAS on the state key, won or lost: read the state again
    at once."""

    RETRY = "retry"


_RETRY = _Retry.RETRY


@dataclass(frozen=True, slots=True)
class _Spare:
    """`_step`'s answer when the group is full, or trains on as many nodes as its layout
    can use: wait (at most `wait` seconds per watch) without a join deadline."""

    wait: float
    why: str = ""
    """What the spare's one log line says (empty: the group is full)."""


class _Unregistered(Exception):
    """This node's own key is missing from the node list just read."""


class _Alive:
    """The live node ids, read from etcd on first use within one pass of the join loop:
    a member waiting in an open round, or one whose round completed, decides without
    the node list (N node keys per read, read by N agents). Reading it raises
    `_Unregistered` when this node's own key is gone."""

    def __init__(self, handler: EtcdRendezvousHandler) -> None:
        self._handler = handler
        self._ids: set[str] | None = None

    def fetch(self) -> set[str]:
        if self._ids is None:
            self._ids = self._handler._alive(self._handler._client)
            if self._handler.node_id not in self._ids:
                raise _Unregistered
        return self._ids

    def __contains__(self, node: object) -> bool:
        return node in self.fetch()


class _StoreMissing(Exception):
    def __init__(self, round_: int, message: str) -> None:
        super().__init__(message)
        self.round = round_


def _now() -> float:
    return time.monotonic()


class EtcdRendezvousHandler(RendezvousHandler):
    """torchrun's rendezvous on etcd v3.

    Call order (by torchrun's agent): `next_rendezvous()` at start and at every
    worker-group restart; `num_nodes_waiting()` on every monitor tick while healthy;
    `shutdown()` at the end (which also closes the rendezvous, as torch's own
    dynamic rendezvous does); `set_closed()`/`is_closed()` at any time.
    """

    def __init__(self, settings: RendezvousSettings, node_id: str | None = None) -> None:
        self.settings = settings
        self.node_id = node_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        ns = settings.namespace
        self._state_key = ns + "state"
        self._nodes = ns + "nodes/"
        self._rounds = ns + "rounds/"
        self._client = EtcdClient(settings.etcd)
        # Separate, shorter deadlines for the calls made from the agent's monitor loop
        # and from the keepalive thread: neither may block for the full etcd timeout.
        # They share the endpoint rotation, so a member found frozen by one is skipped
        # by all.
        fast = min(settings.etcd.timeout, max(1.0, settings.poll_interval))
        self._fast = self._client.sibling(timeout=fast)
        keep = max(0.5, settings.lease_ttl / 3)
        self._keep_client = self._client.sibling(
            timeout=keep, attempt_timeout=min(settings.etcd.attempt_timeout, keep / 2))
        self._lease: int | None = None
        self._lease_pid = -1
        self._keeper: LeaseKeeper | None = None
        self._round = -1
        self._participants: list[str] = []
        self._store: TCPStore | None = None
        self._lock = threading.Lock()
        self._waiting_cache: tuple[float, int] = (-1e9, 0)
        self._min_seen: dict[int, float] = {}
        self._seat_wait: dict[int, float] = {}
        """Per open round: when this node first waited for a seat reserved for a live
        member of the previous round."""
        self._lost_logged = -1
        self._fold_wait: dict[int, float] = {}
        """Per first round: when this node, registered but not a member, began to wait
        for the round's leader to fold it in."""
        self._fold_grace = max(0.5, settings.lease_ttl / 3)
        """How long a newcomer waits to be folded in before it joins by itself."""
        self._registered: list[str] = []
        """Live node ids in the order they first registered (from the last `_alive`)."""
        self._waiting_outage: float | None = None
        """When num_nodes_waiting() first failed to reach etcd in the current outage."""
        """The round whose lost participants were already logged (one line per fault)."""

    def _log(self, msg: str, *args: Any, level: int = logging.INFO) -> None:
        logger.log(level, "[%s node=%s round=%d] " + msg, self.settings.run_id, self.node_id,
                   self._round, *args)

    # -- RendezvousHandler ----------------------------------------------------

    def get_backend(self) -> str:
        return BACKEND_NAME

    def get_run_id(self) -> str:
        return self.settings.run_id

    @property
    def use_agent_store(self) -> bool:
        # Workers connect to the agent's per-round TCPStore: fresh every round.
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        s = self.settings
        start = _now()
        deadline = start + s.join_timeout
        unreachable_since: float | None = None
        if self._round >= 0:
            waiting = self._waiting_cache[1]
            reason = "membership" if waiting > 0 else "fault"
            if waiting > 0:
                self._log("membership change detected (%d node(s) waiting): leaving the round",
                          waiting, level=logging.WARNING)
            else:
                self._log("fault detected: the local worker group failed or was stopped; "
                          "leaving the round", level=logging.WARNING)
        else:
            reason = "start"
        record_event("rdzv_start", run_id=s.run_id, node=self.node_id, after_round=self._round,
                     reason=reason)
        while True:
            try:
                info = self._try_rendezvous(deadline)
                os.environ[RDZV_ROUND_ENV] = str(self._round)
                record_event("rdzv_done", run_id=s.run_id, node=self.node_id, round=self._round,
                             rank=info.rank, world=info.world_size, reason=reason)
                self._log("joined as rank %d of %d in %.2fs (store %s:%d)", info.rank,
                          info.world_size, _now() - start, info.bootstrap_store_info.master_addr,
                          info.bootstrap_store_info.master_port)
                return info
            except EtcdUnavailableError as exc:
                # Keep trying across an etcd restart, within the etcd timeout.
                unreachable_since = unreachable_since or _now()
                if _now() - unreachable_since >= s.etcd_timeout or _now() >= deadline:
                    raise RendezvousConnectionError(
                        f"rendezvous for job {s.run_id!r}: {exc}") from None
                self._log("etcd unreachable (%s); retrying", exc, level=logging.WARNING)
                time.sleep(0.5)
            except EtcdLeaseLostError as exc:
                # Expired before the keeper noticed (this node was stopped longer than
                # its TTL, or etcd lost it): register again with a new lease; the others
                # have re-formed without the old one.
                if _now() >= deadline:
                    raise RendezvousTimeoutError(
                        f"rendezvous for job {s.run_id!r}: {exc}") from None
                self._log("lease lost (%s); registering again", exc, level=logging.WARNING)
                self._drop_lease()
            except EtcdAuthError as exc:
                raise RendezvousConnectionError(
                    f"rendezvous for job {s.run_id!r}: {exc}") from None
            except EtcdError as exc:
                raise RendezvousStateError(f"rendezvous for job {s.run_id!r}: {exc}") from None

    def is_closed(self) -> bool:
        try:
            state, _ = self._read(self._client)
        except EtcdError as exc:
            raise RendezvousConnectionError(
                f"rendezvous for job {self.settings.run_id!r}: {exc}") from None
        return state is not None and state.closed

    def set_closed(self) -> None:
        while True:
            try:
                state, kv = self._read(self._client)
                new = state or RoundState()
                if new.closed:
                    return
                new.closed = True
                if self._client.cas(self._state_key, kv.mod_revision if kv else 0,
                                    new.to_json()):
                    self._log("rendezvous closed")
                    return
            except EtcdError as exc:
                raise RendezvousConnectionError(
                    f"closing rendezvous of job {self.settings.run_id!r}: {exc}") from None

    def num_nodes_waiting(self) -> int:
        """Nodes that want a new round. Besides late joiners, a participant of the
        current round whose lease expired counts as one: the survivors must re-form
        without it even if their collectives have not failed yet."""
        with self._lock:
            at, cached = self._waiting_cache
            if _now() - at < self.settings.poll_interval:
                return cached
            try:
                count = self._count_waiting()
                if self._waiting_outage is not None:
                    self._log("num_nodes_waiting: etcd answers again after %.1fs",
                              _now() - self._waiting_outage)
                    self._waiting_outage = None
            except EtcdError as exc:
                # A running job must not die because etcd restarts: report nothing new,
                # and say so once per outage (the agent polls every monitor tick).
                if self._waiting_outage is None:
                    self._waiting_outage = _now()
                    self._log("num_nodes_waiting: etcd error (%s); assuming 0 until etcd "
                              "answers", exc, level=logging.WARNING)
                count = 0
            self._waiting_cache = (_now(), count)
        _notify("nodes_waiting", {"run_id": self.settings.run_id, "node": self.node_id,
                                  "round": self._round, "waiting": count})
        return count

    def shutdown(self) -> bool:
        ok = True
        try:
            self.set_closed()
        except RendezvousConnectionError as exc:
            self._log("shutdown could not close the rendezvous: %s", exc, level=logging.WARNING)
            ok = False
        self._release()
        return ok

    def leave(self, reason: str) -> bool:
        """Revoke this node's lease without closing the rendezvous: its node key (and
        the round's store key if it is rank 0) go at once, so peers re-form without it
        now rather than one TTL later. True if a lease was revoked."""
        with self._lock:
            if self._lease is None:
                return False
            self._log("leaving (%s): revoking lease %x", reason, self._lease,
                      level=logging.WARNING)
            # The keepalive client's short deadline: leaving must not hang on a dead etcd.
            return self._release(self._keep_client)

    # -- internals ------------------------------------------------------------

    def _release(self, client: EtcdClient | None = None) -> bool:
        revoked = False
        if self._keeper is not None:
            self._keeper.stop()
            self._keeper = None
        if self._lease is not None:
            try:
                (client or self._client).lease_revoke(self._lease)
                revoked = True
            except EtcdError as exc:
                self._log("could not revoke lease %x (%s); it expires in %.0fs", self._lease,
                          exc, self.settings.lease_ttl, level=logging.WARNING)
            self._lease = None
        self._store = None
        _live.discard(self)
        return revoked

    def _read(self, client: EtcdClient) -> tuple[RoundState | None, KeyValue | None]:
        state, kv, _ = self._read_at(client)
        return state, kv

    def _read_at(self, client: EtcdClient) -> tuple[RoundState | None, KeyValue | None, int]:
        kv, revision = client.read(self._state_key)
        if kv is None:
            return None, None, revision
        return RoundState.from_json(kv.value, self._state_key), kv, revision

    def _alive(self, client: EtcdClient) -> set[str]:
        """Ids of the registered nodes (names only: a node list of N keys is read often)."""
        kvs, _ = client.get_prefix(self._nodes, keys_only=True)
        ids = [kv.key[len(self._nodes):] for kv in sorted(kvs, key=lambda kv: kv.create_revision)]
        self._registered = ids
        return set(ids)

    def _count_waiting(self) -> int:
        state, _ = self._read(self._fast)
        if state is None or state.closed or self._round < 0:
            return 0
        if state.round > self._round:
            # A newer round exists: open (someone wants to re-form) or complete without us.
            return max(1, len(state.members)) if state.phase == "open" else 1
        alive = self._alive(self._fast)
        dead = [p for p in self._participants if p not in alive]
        if dead and self._lost_logged != self._round:
            self._lost_logged = self._round
            self._log("fault detected: participants %s lost their leases", dead,
                      level=logging.WARNING)
        return len(dead)

    def _drop_lease(self) -> None:
        """Forget a lease etcd no longer has (nothing to revoke)."""
        if self._keeper is not None:
            self._keeper.stop()
        self._keeper, self._lease = None, None

    def _ensure_lease(self) -> None:
        if self._keeper is not None and self._keeper.lost.is_set():
            self._log("lease lost (%s); registering again", self._keeper.error,
                      level=logging.WARNING)
            self._drop_lease()
        if self._lease is None:
            ttl = max(1, round(self.settings.lease_ttl))
            self._lease = self._client.lease_grant(ttl)
            self._keeper = LeaseKeeper(self._keep_client, self._lease, ttl,
                                       name=f"relight-lease-{self.settings.run_id}").start()
            self._lease_pid = os.getpid()
            _live.add(self)
        addr = self._local_addr()
        self._client.put(self._nodes + self.node_id,
                         json.dumps({"addr": addr, "host": socket.gethostname(),
                                     "pid": os.getpid()}), lease=self._lease)

    def _local_addr(self) -> str:
        if self.settings.local_addr:
            return self.settings.local_addr
        # On a loopback-only setup (the embedded etcd, tests) stay on loopback.
        hosts = {u.split("://", 1)[1].rsplit(":", 1)[0] for u in self.settings.etcd.urls()}
        if hosts <= {"127.0.0.1", "localhost", "::1", "[::1]"}:
            return "127.0.0.1"
        return socket.getfqdn()

    def _cas_state(self, kv: KeyValue | None, new: RoundState) -> bool:
        return self._client.cas(self._state_key, kv.mod_revision if kv else 0, new.to_json())

    def _try_rendezvous(self, deadline: float) -> RendezvousInfo:
        s = self.settings
        self._ensure_lease()
        prev_round = self._round
        spare_since: float | None = None
        known: tuple[RoundState | None, KeyValue | None, int] | None = None
        """The state a watch delivered: this pass decides on it without reading again."""
        while True:
            if _now() >= deadline and spare_since is None:
                raise RendezvousTimeoutError(
                    f"rendezvous for job {s.run_id!r} on etcd {self._client.endpoint} did not "
                    f"complete within {s.join_timeout:.0f}s (min_nodes={s.min_nodes}, "
                    f"max_nodes={s.max_nodes}); check that enough nodes are starting, or raise "
                    "--rdzv-conf join_timeout")
            if self._keeper is not None and self._keeper.lost.is_set():
                self._ensure_lease()
            if known is not None:
                state, kv, revision = known
                known = None
            else:
                state, kv, revision = self._read_at(self._client)
            if state is not None and state.closed:
                if spare_since is not None:
                    raise RendezvousGracefulExitError(
                        f"job {s.run_id!r} finished while node {self.node_id} waited as a "
                        "spare")
                raise RendezvousClosedError(
                    f"rendezvous for job {s.run_id!r} is closed (the job finished or was "
                    f"stopped); start a new job with another --rdzv-id, or delete "
                    f"{s.namespace} in etcd to reuse this one")
            alive = _Alive(self)
            try:
                step = self._step(state, kv, prev_round, alive)
            except _Unregistered:
                self._reregister()
                continue
            except _StoreMissing as exc:
                # Rank 0 died before publishing the round's store: re-form without it.
                self._log("%s; opening a new round", exc, level=logging.WARNING)
                prev_round = exc.round
                continue
            if isinstance(step, RendezvousInfo):
                return step
            if step is _RETRY:
                continue
            if isinstance(step, _Spare):
                # A hot spare waits as long as the job lives, woken by any change under
                # the job's keys (a lost member's key expiring, a new round, the close).
                if spare_since is None:
                    spare_since = _now()
                    if step.why:
                        self._log("%s: waiting as a hot spare", step.why)
                    else:
                        self._log("the group is full (%d nodes): waiting as a spare",
                                  s.max_nodes)
                wait = step.wait
            else:
                if spare_since is not None:
                    # No longer a spare: joining gets a join timeout of its own.
                    spare_since, deadline = None, _now() + s.join_timeout
                wait = min(max(0.0, deadline - _now()), step)
            if not isinstance(step, _Spare) and self._waits_on_state(state):
                assert state is not None
                known = self._await_state(state, revision, min(wait, max(0.5, s.lease_ttl / 3)))
            else:
                self._client.wait_for_change(s.namespace, revision, wait)

    def _reregister(self) -> None:
        """This node's key is gone while it rendezvouses: its lease expired or was
        revoked before the keeper noticed, or the key was deleted. Registering again at
        once keeps the loop from dropping this node from the open round and adding it
        back on every pass until the next keepalive."""
        self._log("this node's key is gone (lease %x); registering again", self._lease or 0,
                  level=logging.WARNING)
        if self._lease is not None:
            try:
                self._client.lease_keepalive(self._lease)
            except EtcdLeaseLostError:
                self._drop_lease()
        self._ensure_lease()

    def _step(self, state: RoundState | None, kv: KeyValue | None, prev_round: int,
              alive: _Alive) -> RendezvousInfo | _Retry | float | _Spare:
        """One decision on the current state: a RendezvousInfo when this node's round is
        complete, `_RETRY` after a CAS (won or lost), seconds to wait for a change, or
        `_Spare` when the group is full and this node waits for a place."""
        s, me = self.settings, self.node_id
        spare = _Spare(max(s.lease_ttl, s.poll_interval))
        if state is None:
            # Whoever creates the first round leads it (folds in the others): no node
            # list is read here, where all N agents of a cold start arrive at once.
            self._cas_state(None, self._joined(RoundState(round=0, phase="open"), [me]))
            return _RETRY
        if state.phase == "complete":
            if me in state.participants and state.round > prev_round:
                return self._finish(state)
            dead = any(p not in alive for p in state.participants)
            if me in state.participants or dead:
                return self._reopen(state, kv)
            if len(state.participants) < s.max_nodes:
                # Re-form only when the nodes waiting make a larger group the layout can
                # use: otherwise every round would stop the job to leave them out again.
                waiting = len(alive.fetch() - set(state.participants))
                grown = s.fit(len(state.participants) + waiting)
                if grown > len(state.participants):
                    return self._reopen(state, kv)
                return _Spare(spare.wait, why=self._unfit_note(len(state.participants),
                                                               waiting))
            return spare
        # Open round.
        now = _now()
        if not state.previous and state.members[:1] != [me]:
            # The first round is led by its first member, which folds in every node that
            # registers and drops members without a lease: everyone else waits on the
            # state key without reading the node list (N keys, read by N agents, was
            # the O(N^2) of a cold start). A newcomer joins by itself only if it was
            # not folded in within `_fold_grace` (a dead or stalled leader).
            if me in state.members:
                if len(state.members) < s.min_nodes:
                    return s.lease_ttl
                since = self._min_seen.setdefault(state.round, now)
                if now - since < s.last_call_timeout and len(state.members) < s.max_nodes:
                    return max(0.05, min(since + s.last_call_timeout - now, s.lease_ttl))
            elif len(state.members) < s.max_nodes:
                waited = now - self._fold_wait.setdefault(state.round, now)
                if waited < self._fold_grace:
                    return max(0.05, self._fold_grace - waited)
        members = [m for m in state.members if m in alive]
        if members != state.members:
            gone = [m for m in state.members if m not in alive]
            self._log("dropping members without a lease from round %d: %s", state.round, gone)
            self._cas_state(kv, dataclasses.replace(state, members=members))
            return _RETRY
        if not state.previous and members[:1] == [me]:
            newcomers = self._fold(state, members, s.max_nodes - len(members))
            if newcomers:
                self._cas_state(kv, self._joined(state, [*members, *newcomers]))
                return _RETRY
        if me not in members:
            seats = s.max_nodes - len(members)
            if seats <= 0:
                return spare
            # Live members of the last round keep their places: a newcomer takes a seat
            # they still need only once they had `rejoin_timeout` to come back.
            reserved = [p for p in state.previous if p in alive and p not in members]
            if me not in state.previous and seats <= len(reserved):
                waited = _now() - self._seat_wait.setdefault(state.round, _now())
                if waited < s.rejoin_timeout:
                    return _Spare(max(0.05, min(s.rejoin_timeout - waited, spare.wait)))
            self._cas_state(kv, self._joined(
                state, [*members, me, *self._fold(state, members, seats - 1)]))
            return _RETRY
        if len(members) < s.min_nodes or s.fit(len(members)) == 0:
            return s.lease_ttl  # any join or lease expiry wakes us earlier
        since = self._min_seen.setdefault(state.round, now)
        awaited = [p for p in state.previous if p in alive and p not in members]
        if len(members) >= s.max_nodes:
            ready = True
        elif state.previous:
            # A re-formed group: go as soon as every live member of the last round is
            # back; a dead one stops being awaited when its lease expires.
            ready = not awaited or now - since >= s.rejoin_timeout
        else:
            ready = now - since >= s.last_call_timeout
        if not ready:
            limit = s.rejoin_timeout if state.previous else s.last_call_timeout
            return max(0.05, min(since + limit - now, s.lease_ttl))
        complete = self._completed(state, members)
        if self._cas_state(kv, complete):
            self._log("round %d complete: %s", state.round, complete.participants)
            if len(complete.participants) < len(members):
                self._log("%s", self._unfit_note(len(complete.participants),
                                                 len(members) - len(complete.participants)),
                          level=logging.WARNING)
        return _RETRY

    def _reopen(self, state: RoundState, kv: KeyValue | None) -> _Retry:
        """Open the round after the complete `state`, with this node its first member."""
        self._cas_state(kv, RoundState(round=state.round + 1, phase="open",
                                       members=[self.node_id], previous=state.participants))
        return _RETRY

    def _completed(self, state: RoundState, members: list[str]) -> RoundState:
        """The open round `state` completed by `members`: as many of them as the layout
        can use (`RendezvousSettings.fit`), members of the previous round first; the
        others are left out and wait as hot spares."""
        ranked = assign_ranks(members, state.previous)
        return RoundState(round=state.round, phase="complete",
                          participants=ranked[:self.settings.fit(len(members))])

    def _unfit_note(self, training: int, waiting: int) -> str:
        """The one line that says why nodes wait although the group is not full."""
        s = self.settings
        return (f"{training} node(s) train and {waiting} wait as hot spares: the layout "
                f"trains on {NODE_COUNTS_SEP.join(map(str, s.node_counts or ()))} nodes "
                f"(of {s.min_nodes}:{s.max_nodes}), not on {training + waiting}")

    def _joined(self, state: RoundState, members: list[str]) -> RoundState:
        """The open round `state` with `members`; complete at once when they fill the
        group. A full round has nothing left to wait for, and writing it complete in the
        join itself saves every member a wakeup, a read and a CAS that all but one
        would lose (N-1 conflicts per round)."""
        if len(members) < self.settings.max_nodes or self.settings.fit(len(members)) == 0:
            return dataclasses.replace(state, members=members)
        return self._completed(state, members)

    def _fold(self, state: RoundState, members: list[str], seats: int) -> list[str]:
        """Registered nodes the first round's leader (or a newcomer joining by itself)
        adds to it: everyone registered so far that is not in yet (their node key says
        they are rendezvousing), in registration order, up to `seats`. Each join is a CAS
        on the one state key, and each CAS won makes every other joiner's CAS fail and
        re-read: N agents each CASing themselves in made O(N^2) requests. Re-formed
        rounds (`previous` set) keep joining one by one: their seat rules (returning
        members first) stay each node's own decision."""
        if state.previous or seats <= 0:
            return []
        taken = {*members, self.node_id}
        return [n for n in self._registered if n not in taken][:seats]

    def _waits_on_state(self, state: RoundState | None) -> bool:
        """Whether a waiting node follows only the state key: in the first open round,
        anyone but its leader (members waiting for the round to complete, newcomers
        waiting to be folded in). Node keys coming and going do not change what they
        do next (the leader folds newcomers and drops members without a lease), and
        waking every waiting member on every newcomer's registration was the other
        O(N^2) of a cold start. Its own key vanishing (a lease revoked from outside)
        is then seen when the wait ends: the caller bounds it by the keepalive period,
        when the keeper would notice the lost lease anyway. The leader, spares and
        re-forming rounds watch the whole job (registrations, lease expiries)."""
        return (state is not None and state.phase == "open" and not state.previous
                and state.members[:1] != [self.node_id])

    def _await_state(self, state: RoundState, revision: int, wait: float,
                     ) -> tuple[RoundState | None, KeyValue | None, int] | None:
        """A member of the open first round waits on one watch stream for a change that
        concerns it: the round completing or re-opening, this node dropped, the close,
        or the round reaching min nodes (which starts the last call). Other joins are
        skipped on the stream: with N joiners each member would otherwise read and
        watch again after every join. Returns the state that ended the wait (the next
        decision needs no read), or None (timeout, broken stream: read again)."""
        s, me = self.settings, self.node_id
        below_min = len(state.members) < s.min_nodes

        def concerns_me(kv: KeyValue | None) -> bool:
            if kv is None:
                return True
            try:
                new = RoundState.from_json(kv.value, self._state_key)
            except RendezvousStateError:
                return True
            return (new.closed or new.round != state.round or new.phase != "open"
                    or (me in new.members) != (me in state.members)
                    or new.members[:1] != state.members[:1]
                    or (below_min and len(new.members) >= s.min_nodes))

        changed, kv = self._client.wait_for_event(self._state_key, revision, wait, concerns_me)
        if not changed:
            return None
        if kv is None:
            return None, None, revision
        return RoundState.from_json(kv.value, self._state_key), kv, kv.mod_revision

    def _finish(self, state: RoundState) -> RendezvousInfo:
        s = self.settings
        rank = state.participants.index(self.node_id)
        store_key = f"{self._rounds}{state.round}/store"
        timeout = timedelta(seconds=s.store_timeout)
        if rank == 0:
            addr = self._local_addr()
            store = TCPStore(addr, 0, is_master=True, wait_for_workers=False, timeout=timeout)
            self._client.put(store_key, json.dumps({"addr": addr, "port": store.port}),
                             lease=self._lease or 0)
            self._cleanup_rounds(state.round)
        else:
            addr, port = self._await_store(store_key, state)
            try:
                store = TCPStore(addr, port, is_master=False, timeout=timeout)
            except DistError as exc:
                # Rank 0 published its store and died before we reached it.
                raise _StoreMissing(state.round, f"rank 0 ({state.participants[0]}) of round "
                                    f"{state.round} is unreachable at {addr}:{port}: "
                                    f"{exc}") from exc
        self._store = store  # keep the server (rank 0) alive for the round
        self._round = state.round
        self._participants = list(state.participants)
        self._waiting_cache = (-1e9, 0)
        self._min_seen = {r: t for r, t in self._min_seen.items() if r > state.round}
        return RendezvousInfo(store, rank, len(state.participants),
                              RendezvousStoreInfo(addr, store.port if rank == 0 else port))

    def _await_store(self, store_key: str, state: RoundState) -> tuple[str, int]:
        s = self.settings
        deadline = _now() + min(s.join_timeout, max(s.lease_ttl * 3, 30.0))
        leader = state.participants[0]
        while _now() < deadline:
            kv, revision = self._client.read(store_key)
            if kv is None:
                # The put arrives on the stream with its value: no read after it.
                _, kv = self._client.wait_for_event(store_key, revision, 1.0,
                                                    lambda kv: kv is not None)
            if kv is not None:
                doc = kv.json()
                return str(doc["addr"]), int(doc["port"])
            # One key, not the whole node list: N waiters each reading N node keys
            # was O(N^2) bytes at every round's end.
            if self._client.get(self._nodes + leader) is None:
                break
        raise _StoreMissing(state.round, f"rank 0 ({leader}) of round {state.round} never "
                            f"published its store at {store_key}")

    def _cleanup_rounds(self, current: int) -> None:
        try:
            kvs, _ = self._client.get_prefix(self._rounds)
            stale = {kv.key.split("/")[-2] for kv in kvs
                     if kv.key.split("/")[-2].isdigit() and int(kv.key.split("/")[-2]) < current}
            for r in stale:
                self._client.delete_prefix(f"{self._rounds}{r}/")
        except EtcdError as exc:  # cleanup is best effort; the next round retries it
            self._log("could not delete stale rounds: %s", exc, level=logging.WARNING)


def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """The creator torchrun calls with its RendezvousParameters."""
    return EtcdRendezvousHandler(RendezvousSettings.from_parameters(params))


