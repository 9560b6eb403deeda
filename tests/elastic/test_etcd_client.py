"""The etcd client wrapper against a real etcd: KV, CAS txns, leases, waits, errors,
restart, TLS and auth."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from relight.elastic.etcd_client import (
    Compare,
    EtcdAuthError,
    EtcdClient,
    EtcdSettings,
    EtcdUnavailableError,
    LeaseKeeper,
    OpDelete,
    OpPut,
)
from relight.elastic.etcd_server import free_port

pytestmark = [pytest.mark.etcd, pytest.mark.timeout(60)]


@pytest.fixture
def client(etcd_server) -> EtcdClient:
    return EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,), timeout=3))


@pytest.fixture
def ns() -> str:
    return f"/test-client/{uuid.uuid4().hex}/"


def test_put_get_delete_and_prefix(client: EtcdClient, ns: str) -> None:
    assert client.get(ns + "missing") is None
    rev = client.put(ns + "a", b"1")
    client.put(ns + "b", '{"x": 2}')
    client.put(ns[:-1] + "-sibling", b"not mine")
    kv = client.get(ns + "a")
    assert kv is not None and kv.value == b"1" and kv.mod_revision == rev
    kvs, at = client.get_prefix(ns)
    assert [k.key for k in kvs] == [ns + "a", ns + "b"] and at >= rev
    assert kvs[1].json() == {"x": 2}
    assert client.delete(ns + "a") == 1
    assert client.delete_prefix(ns) == 1
    assert client.get_prefix(ns)[0] == []


def test_cas_on_mod_revision(client: EtcdClient, ns: str) -> None:
    key = ns + "state"
    assert client.cas(key, 0, b"v1")  # create only if absent
    assert not client.cas(key, 0, b"again")
    kv = client.get(key)
    assert kv is not None
    assert client.cas(key, kv.mod_revision, b"v2")
    assert not client.cas(key, kv.mod_revision, b"v3")  # stale revision loses
    assert client.get(key).value == b"v2"
    res = client.txn(
        [Compare(key, "value", "==", b"v2")],
        [OpPut(ns + "other", b"x"), OpDelete(key)],
        [OpPut(ns + "failed", b"x")],
    )
    assert res.succeeded and client.get(key) is None and client.get(ns + "other") is not None


def test_a_range_inside_a_transaction_sees_the_branchs_writes(client: EtcdClient,
                                                               ns: str) -> None:
    from relight.elastic.etcd_client import OpRange

    client.put(ns + "a", b"1")
    res = client.txn([Compare(ns + "a", "value", "==", b"1")],
                     [OpPut(ns + "b", b"2"), OpDelete(ns + "a"), OpRange(ns)],
                     [OpRange(ns)])
    assert res.succeeded and len(res.ranges) == 1
    assert [(kv.key, kv.value) for kv in res.ranges[0]] == [(ns + "b", b"2")]
    assert res.ranges[0][0].mod_revision == res.revision
    # The failure branch's range runs instead when the compare fails.
    res = client.txn([Compare(ns + "a", "value", "==", b"1")], [OpRange(ns + "none/")],
                     [OpRange(ns)])
    assert not res.succeeded and [kv.key for kv in res.ranges[0]] == [ns + "b"]


def test_concurrent_cas_exactly_one_wins(client: EtcdClient, ns: str) -> None:
    key = ns + "counter"
    client.put(key, b"0")
    wins: list[int] = []

    def bump(i: int) -> None:
        c = EtcdClient(client.settings)
        while True:
            kv = c.get(key)
            if c.cas(key, kv.mod_revision, str(int(kv.value) + 1)):
                wins.append(i)
                return

    threads = [threading.Thread(target=bump, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(wins) == list(range(8))
    assert client.get(key).value == b"8"


def test_lease_keepalive_keeps_and_expiry_removes(client: EtcdClient, ns: str) -> None:
    kept = client.lease_grant(1)
    dropped = client.lease_grant(1)
    client.put(ns + "kept", b"x", lease=kept)
    client.put(ns + "dropped", b"x", lease=dropped)
    keeper = LeaseKeeper(client, kept, ttl=1).start()
    try:
        deadline = time.monotonic() + 10
        while client.get(ns + "dropped") is not None:
            assert time.monotonic() < deadline, "an unrefreshed 1 s lease never expired"
            time.sleep(0.2)
        time.sleep(1.5)
        assert client.get(ns + "kept") is not None and not keeper.lost.is_set()
    finally:
        keeper.stop()
    client.lease_revoke(kept)
    assert client.get(ns + "kept") is None
    client.lease_revoke(kept)  # already gone: not an error


def test_keeper_reports_revoked_lease(client: EtcdClient) -> None:
    lease = client.lease_grant(3)
    seen: list[BaseException] = []
    keeper = LeaseKeeper(client, lease, ttl=0.6, on_lost=seen.append).start()
    client.lease_revoke(lease)
    assert keeper.lost.wait(5), "a revoked lease went unnoticed"
    keeper.stop()
    assert len(seen) == 1 and "expired or was revoked" in str(seen[0])


def test_wait_for_change_wakes_and_times_out(client: EtcdClient, ns: str) -> None:
    rev = client.put(ns + "x", b"0")
    t0 = time.monotonic()
    assert client.wait_for_change(ns, rev, timeout=0.5) is False
    assert 0.4 < time.monotonic() - t0 < 2.0
    timer = threading.Timer(0.3, lambda: client.put(ns + "y", b"1"))
    timer.start()
    t0 = time.monotonic()
    assert client.wait_for_change(ns, rev, timeout=10) is True
    assert time.monotonic() - t0 < 3.0
    timer.join()
    # A change already past `after_revision` returns at once.
    assert client.wait_for_change(ns, rev, timeout=10) is True


def test_unreachable_raises_typed_error_after_timeout() -> None:
    port = free_port()
    c = EtcdClient(EtcdSettings(endpoints=(f"127.0.0.1:{port}",), timeout=0.8))
    t0 = time.monotonic()
    with pytest.raises(EtcdUnavailableError, match=f"127.0.0.1:{port}"):
        c.get("/x")
    assert 0.7 < time.monotonic() - t0 < 3.0


def test_second_endpoint_used_when_first_is_down(etcd_server, ns: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    c = EtcdClient(EtcdSettings(endpoints=(dead, etcd_server.endpoint), timeout=3))
    c.put(ns + "k", b"v")
    assert c.get(ns + "k").value == b"v"


@contextlib.contextmanager
def _hung_endpoint() -> Iterator[str]:
    """A loopback port that accepts connections (the kernel completes the handshake into
    the backlog) and never answers: what a SIGSTOPped etcd member looks like."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"127.0.0.1:{sock.getsockname()[1]}"


def test_hung_first_endpoint_costs_one_attempt_then_is_skipped(etcd_server, ns: str) -> None:
    with _hung_endpoint() as hung:
        c = EtcdClient(EtcdSettings(endpoints=(hung, etcd_server.endpoint), timeout=30,
                                    attempt_timeout=1.0))
        t0 = time.monotonic()
        c.put(ns + "k", b"v")
        first = time.monotonic() - t0
        # One attempt timeout on the hung endpoint, not the whole 30 s deadline.
        assert first < 1.0 + 5.0, first
        assert c.endpoint == f"http://{etcd_server.endpoint}"
        # A sibling (another deadline, same rotation) starts at the live endpoint.
        fast = c.sibling(timeout=0.5)
        assert fast.get(ns + "k").value == b"v"


def test_keeper_survives_a_hung_first_endpoint(etcd_server) -> None:
    with _hung_endpoint() as hung:
        settings = EtcdSettings(endpoints=(hung, etcd_server.endpoint), timeout=1.0,
                                attempt_timeout=0.5)
        c = EtcdClient(settings)
        lease = EtcdClient(EtcdSettings(endpoints=(etcd_server.endpoint,))).lease_grant(3)
        keeper = LeaseKeeper(c, lease, 3).start()
        try:
            # Three TTLs: each keepalive must reach the live endpoint in time.
            time.sleep(9)
            assert not keeper.lost.is_set(), keeper.error
        finally:
            keeper.stop()


def test_version_advice() -> None:
    from relight.elastic.etcd_client import etcd_version_advice

    assert "13766" in etcd_version_advice("3.5.1")
    assert "15247" in etcd_version_advice("3.5.12")
    assert "13766" not in etcd_version_advice("3.5.12")
    assert "15247" in etcd_version_advice("3.4.20")
    for fine in ("3.5.13", "3.5.21", "3.6.0", "3.6.5", "garbage", "3"):
        assert etcd_version_advice(fine) is None, fine


def test_survives_etcd_restart(etcd_restartable) -> None:
    c = EtcdClient(EtcdSettings(endpoints=(etcd_restartable.endpoint,), timeout=10))
    c.put("/r/k", b"before")
    etcd_restartable.kill()
    timer = threading.Timer(1.0, etcd_restartable.start)
    timer.start()
    try:
        t0 = time.monotonic()
        assert c.get("/r/k").value == b"before"  # retried across the restart
        assert time.monotonic() - t0 >= 0.9
    finally:
        timer.join(30)


def test_tls_and_auth(etcd_secure, tls_certs) -> None:
    settings = EtcdSettings(
        endpoints=(etcd_secure.endpoint,), timeout=5, username="alice", password="alice-pw",
        ca_file=tls_certs.ca, cert_file=tls_certs.client_cert, key_file=tls_certs.client_key,
    )
    assert "alice-pw" not in repr(settings)
    c = EtcdClient(settings)
    c.put("/relight-secure/k", b"v")
    assert c.get("/relight-secure/k").value == b"v"
    with pytest.raises(EtcdAuthError, match="denied"):
        c.put("/elsewhere/k", b"v")
    wrong = EtcdClient(EtcdSettings(
        endpoints=(etcd_secure.endpoint,), timeout=5, username="alice", password="nope",
        ca_file=tls_certs.ca, cert_file=tls_certs.client_cert, key_file=tls_certs.client_key,
    ))
    with pytest.raises(EtcdAuthError, match="alice"):
        wrong.get("/relight-secure/k")
    no_client_cert = EtcdClient(EtcdSettings(
        endpoints=(etcd_secure.endpoint,), timeout=1, username="alice", password="alice-pw",
        ca_file=tls_certs.ca,
    ))
    with pytest.raises(EtcdUnavailableError):
        no_client_cert.get("/relight-secure/k")


def test_tls_ignores_ambient_ca_bundle(etcd_secure, tls_certs, monkeypatch, tmp_path) -> None:
    # An ambient CA bundle or proxy (requests would honour both) must not change how
    # or where the client connects.
    bogus = tmp_path / "bundle.pem"
    bogus.write_text("")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bogus))
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    c = EtcdClient(EtcdSettings(
        endpoints=(etcd_secure.endpoint,), timeout=5, username="alice", password="alice-pw",
        ca_file=tls_certs.ca, cert_file=tls_certs.client_cert, key_file=tls_certs.client_key,
    ))
    c.put("/relight-secure/env", b"ok")
    assert c.get("/relight-secure/env").value == b"ok"


def test_reauthenticates_after_etcd_restart(tmp_path, tls_certs) -> None:
    from relight.elastic.etcd_server import EtcdServer, EtcdTLS
    from tests.elastic.conftest import etcdctl

    server = EtcdServer(tmp_path / "d", tls=EtcdTLS(tls_certs.ca, tls_certs.server_cert,
                                                    tls_certs.server_key, True)).start()
    try:
        etcdctl(server, tls_certs, "user", "add", "root:root-pw", "--interactive=false")
        etcdctl(server, tls_certs, "auth", "enable")
        c = EtcdClient(EtcdSettings(
            endpoints=(server.endpoint,), timeout=10, username="root", password="root-pw",
            ca_file=tls_certs.ca, cert_file=tls_certs.client_cert,
            key_file=tls_certs.client_key,
        ))
        c.put("/k", b"1")
        server.restart()
        c.put("/k", b"2")
        assert c.get("/k").value == b"2"
        c._token = "stale.token"  # what a token from before a restart looks like to etcd
        c.put("/k", b"3")
        assert c.get("/k").value == b"3" and c._token != "stale.token"
    finally:
        server.stop()


def test_server_start_moves_off_a_port_taken_after_it_was_picked(tmp_path) -> None:
    """`free_port` races every other process's connections (a full CI run lost one):
    a first start with ports it picked itself picks new ones; explicit ports do not
    move and the error names the cause."""
    import socket

    from relight.elastic.etcd_server import EtcdServer, EtcdServerError

    server = EtcdServer(tmp_path / "picked")
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", server.client_port))
    squatter.listen()
    try:
        taken = server.client_port
        server.start()
        try:
            assert server.client_port != taken
            c = EtcdClient(EtcdSettings(endpoints=(server.endpoint,), timeout=3))
            c.put("/moved", b"1")
            assert c.get("/moved").value == b"1"
        finally:
            server.stop()

        pinned = EtcdServer(tmp_path / "pinned", client_port=taken)
        with pytest.raises(EtcdServerError, match="address already in use"):
            pinned.start()
        assert pinned.client_port == taken and not pinned.running()
    finally:
        squatter.close()


def test_ports_picked_together_are_distinct() -> None:
    from relight.elastic.etcd_server import free_ports

    ports = free_ports(32)
    assert len(set(ports)) == 32


def test_cluster_start_moves_every_member_off_a_taken_port(tmp_path) -> None:
    """A 3-member cluster whose last member's peer port was taken after it was picked
    (a full CI run lost a cluster that way) starts on new ports, all members together:
    the peer URLs are part of the cluster's identity."""
    import socket

    from relight.elastic.etcd_server import EtcdCluster

    cluster = EtcdCluster(tmp_path / "cluster", size=3)
    taken = cluster.members[2].peer_port
    before = cluster.endpoints
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", taken))
    squatter.listen()
    try:
        cluster.start()
        try:
            assert taken not in [p for m in cluster.members for p in (m.client_port,
                                                                      m.peer_port)]
            assert cluster.endpoints != before
            assert all(m.running() for m in cluster.members)
            c = EtcdClient(EtcdSettings(endpoints=tuple(cluster.endpoints), timeout=5))
            c.put("/moved", b"1")
            assert c.get("/moved").value == b"1"
            assert cluster.leader() in range(3)
        finally:
            cluster.stop()
    finally:
        squatter.close()


def test_wait_for_event_follows_one_stream_to_the_change_it_wants(client: EtcdClient,
                                                                  ns: str) -> None:
    key = ns + "state"
    rev = client.put(key, "0")
    other = EtcdClient(client.settings)

    def writer() -> None:
        for i in range(1, 6):
            time.sleep(0.05)
            other.put(key, str(i))

    t = threading.Thread(target=writer)
    calls: list[str] = []
    real_call = client.call
    client.call = lambda path, *a, **k: calls.append(path) or real_call(path, *a, **k)
    t.start()
    changed, kv = client.wait_for_event(key, rev, 10.0, lambda kv: kv is not None
                                        and kv.value == b"4")
    t.join()
    assert changed and kv is not None and kv.value == b"4"
    assert calls == []  # the rejected changes cost no read: one stream, no requests
    # From a revision after the last write nothing comes: a timeout, not a change.
    t0 = time.monotonic()
    assert client.wait_for_event(key, client.revision(), 0.5, lambda kv: True) == (False, None)
    assert time.monotonic() - t0 < 3
    # A delete is reported as None.
    rev = client.revision()
    threading.Timer(0.05, client.delete, args=(key,)).start()
    assert client.wait_for_event(key, rev, 10.0, lambda kv: kv is None) == (True, None)
