"""`ckpt.peer`: the replica server and its client, in one process over loopback."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest

from relight.ckpt.peer import PeerServer, fetch, push


@pytest.fixture()
def server(tmp_path: Path) -> Iterator[tuple[PeerServer, str]]:
    s = PeerServer(str(tmp_path / "replicas"), host="127.0.0.1")
    try:
        yield s, f"127.0.0.1:{s.address.rsplit(':', 1)[1]}"
    finally:
        s.close()


def _key(step: int) -> str:
    return f"step-{step:012d}/data/a1/t0/c/0"


def test_replica_round_trip_and_damage_refused(server: tuple[PeerServer, str]) -> None:
    srv, addr = server
    data = b"shard bytes" * 100
    push(addr, _key(1), "file:///ckpt/" + _key(1), data, google_crc32c.value(data))
    got = fetch(addr, _key(1))
    assert got is not None and got["data"] == data and got["url"] == "file:///ckpt/" + _key(1)
    with pytest.raises(ConnectionError, match="422"):
        push(addr, _key(2), "u", data, google_crc32c.value(data) ^ 1)  # damaged in flight
    assert fetch(addr, _key(2)) is None
    stored = Path(srv.root) / _key(1)
    stored.write_bytes(b"X" + data[1:])  # damaged at rest: never served
    assert fetch(addr, _key(1)) is None


def test_keys_leaving_the_root_are_refused(server: tuple[PeerServer, str]) -> None:
    _, addr = server
    host, port = addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("PUT", "/../escape", body=b"x", headers={"X-Relight-Crc32c": "0"})
    assert conn.getresponse().status == 400
    conn.close()


def test_server_keeps_the_two_newest_steps(server: tuple[PeerServer, str]) -> None:
    srv, addr = server
    for step in (1, 2, 3):
        push(addr, _key(step), "u", b"d", google_crc32c.value(b"d"))
    assert fetch(addr, _key(1)) is None
    assert fetch(addr, _key(2)) is not None and fetch(addr, _key(3)) is not None


def test_replicas_stay_within_the_budget(tmp_path: Path) -> None:
    """Older steps make room for a newer one; a push that does not fit is refused before
    its body is read and leaves what is held intact; the budget survives a restart."""
    root = str(tmp_path / "replicas")
    srv = PeerServer(root, host="127.0.0.1", budget_bytes=250)
    addr = f"127.0.0.1:{srv.address.rsplit(':', 1)[1]}"

    def put(step: int, name: str, n: int) -> None:
        data = bytes([step]) * n
        push(addr, f"step-{step:012d}/data/a1/{name}", "u", data, google_crc32c.value(data))

    try:
        put(1, "t0", 100)
        put(1, "t1", 100)
        assert srv.held_bytes == 200
        put(2, "t0", 100)  # over budget: step 1 goes first, although two steps are kept
        assert srv.held_bytes == 100 and fetch(addr, "step-000000000001/data/a1/t0") is None
        put(2, "t1", 100)
        with pytest.raises(OSError):  # 507, or the connection closed on the unread body
            put(2, "t2", 100)
        assert srv.refused == 1 and srv.held_bytes == 200
        assert fetch(addr, "step-000000000002/data/a1/t1")["data"] == bytes([2]) * 100
        with pytest.raises(OSError):
            put(3, "big", 300)  # larger than the whole budget: nothing dropped for it
        assert srv.held_bytes == 200
    finally:
        srv.close()
    again = PeerServer(root, host="127.0.0.1", budget_bytes=250)
    try:
        assert again.held_bytes == 200  # what is on disk counts after a restart
    finally:
        again.close()


def test_a_server_with_a_token_answers_only_requests_carrying_it(tmp_path: Path) -> None:
    """Another process on the network can neither plant nor read replicas."""
    srv = PeerServer(str(tmp_path / "replicas"), host="127.0.0.1", token="s3cret")
    addr = f"127.0.0.1:{srv.address.rsplit(':', 1)[1]}"
    data = b"shard bytes" * 100
    crc = google_crc32c.value(data)
    try:
        for wrong in (None, "guess"):
            with pytest.raises(ConnectionError, match="403"):
                push(addr, _key(1), "u", data, crc, wrong)
        assert srv.held_bytes == 0 and not (Path(srv.root) / _key(1)).exists()
        push(addr, _key(1), "u", data, crc, "s3cret")
        assert fetch(addr, _key(1), "guess") is None and fetch(addr, _key(1)) is None
        got = fetch(addr, _key(1), "s3cret")
        assert got is not None and got["data"] == data
    finally:
        srv.close()
    with pytest.raises(ValueError, match="token"):
        PeerServer(str(tmp_path / "other"), host="127.0.0.1", token="")


def test_advertised_address() -> None:
    """A bound host is advertised as is; all interfaces: the host name's address, or the
    route's source toward a non-loopback master when the name resolves to loopback."""
    from relight.ckpt.peer import advertised_ip

    assert advertised_ip("10.1.2.3") == "10.1.2.3"
    ip = advertised_ip("0.0.0.0")
    assert ip  # whatever the host name resolves to here
    assert advertised_ip("0.0.0.0", "127.0.0.1") == ip  # a loopback master changes nothing
    toward = advertised_ip("0.0.0.0", "192.0.2.1")  # TEST-NET-1: routed, never reached
    if not ip.startswith("127."):
        assert toward == ip
    else:  # the interface of the default route, if there is one
        assert toward == ip or not toward.startswith("127.")
