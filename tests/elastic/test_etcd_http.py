"""The unary HTTP transport to etcd's gateway (`elastic.etcd_http`) against a scripted
local HTTP server: etcd's "unavailable" statuses are failover signals, other errors
carry etcd's body, and a kept-alive connection the server dropped while idle costs the
caller nothing. (Against a real etcd it runs in every test of tests/elastic.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relight.elastic.etcd_http import GatewayConnections, GatewayError, GatewayUnreachable


class _Scripted(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as etcd's gateway
    answers: list[tuple[int, bytes]] = []
    bodies: list[dict] = []
    stream: tuple[list[bytes], float] | None = None
    """Lines to send as a chunked stream, then how long to hold it open at most."""
    release = threading.Event()
    """Set at teardown: a held stream ends."""

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers["Content-Length"])
        type(self).bodies.append(json.loads(self.rfile.read(length)))
        if type(self).stream is not None:
            lines, hold = type(self).stream
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for line in lines:  # etcd sends each message as one chunk, a line each
                self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                self.wfile.flush()
            type(self).release.wait(hold)
            self.wfile.write(b"0\r\n\r\n")
            self.close_connection = True
            return
        status, body = type(self).answers.pop(0)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[ThreadingHTTPServer, str]]:
    _Scripted.answers, _Scripted.bodies, _Scripted.stream = [], [], None
    _Scripted.release = threading.Event()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05},
                     daemon=True).start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    _Scripted.release.set()
    srv.shutdown()
    srv.server_close()


def test_a_call_posts_json_and_returns_the_answer(server) -> None:
    _, url = server
    _Scripted.answers = [(200, b'{"header": {"revision": "7"}}')]
    http = GatewayConnections(None)
    assert http.post(url, "/v3/kv/range", {"key": "YQ=="}, timeout=5.0) == {
        "header": {"revision": "7"}}
    assert _Scripted.bodies == [{"key": "YQ=="}]


@pytest.mark.parametrize(("status", "timed_out"), [(503, False), (504, True), (408, True)])
def test_etcds_unavailable_statuses_mean_try_another_member(server, status, timed_out) -> None:
    _, url = server
    body = b'{"error":"etcdserver: leader changed","code":14}'
    _Scripted.answers = [(status, body)]
    with pytest.raises(GatewayUnreachable, match="leader changed") as err:
        GatewayConnections(None).post(url, "/v3/kv/put", {}, timeout=5.0)
    assert err.value.timed_out is timed_out


def test_other_errors_carry_etcds_body(server) -> None:
    _, url = server
    _Scripted.answers = [(404, b'{"error":"etcdserver: requested lease not found"}')]
    with pytest.raises(GatewayError) as err:
        GatewayConnections(None).post(url, "/v3/lease/keepalive", {}, timeout=5.0)
    assert err.value.status == 404 and "lease not found" in err.value.text


def test_a_connection_dropped_while_idle_is_replaced_at_once(server) -> None:
    srv, url = server
    _Scripted.answers = [(200, b"{}"), (200, b'{"n": 2}')]
    http = GatewayConnections(None)
    assert http.post(url, "/v3/kv/range", {}, timeout=5.0) == {}
    # The server side of the kept-alive connection goes away (an etcd restart, an idle
    # timeout): the next call must not fail for it.
    conn = http._local.conns[url]
    conn.sock.shutdown(socket.SHUT_RDWR)
    assert http.post(url, "/v3/kv/range", {}, timeout=5.0) == {"n": 2}


def test_no_listener_is_unreachable_not_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GatewayUnreachable) as err:
        GatewayConnections(None).post(f"http://127.0.0.1:{port}", "/v3/kv/range", {},
                                      timeout=5.0)
    assert not err.value.timed_out


def test_no_answer_within_the_timeout_is_a_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts (the kernel's backlog) and never answers: frozen
    try:
        with pytest.raises(GatewayUnreachable) as err:
            GatewayConnections(None).post(
                f"http://127.0.0.1:{listener.getsockname()[1]}", "/v3/kv/range", {},
                timeout=0.3)
        assert err.value.timed_out
    finally:
        listener.close()


def test_a_watch_yields_each_streamed_message_until_its_deadline(server) -> None:
    _, url = server
    _Scripted.stream = ([b'{"result": {"created": true}}\n',
                         b'{"result": {"events": [{"kv": {}}]}}\n'], 60.0)
    got = []
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        for msg in GatewayConnections(None).stream(
                url, "/v3/watch", {"create_request": {}}, connect_timeout=5.0,
                deadline=time.monotonic() + 1.0):
            got.append(msg)
    assert got == [{"result": {"created": True}}, {"result": {"events": [{"kv": {}}]}}]
    # Ended by its 1 s deadline, not by the server, which holds the stream for 60 s (the
    # bound is generous for a loaded machine).
    assert time.monotonic() - t0 < 30.0


def test_a_watch_the_server_ends_is_broken_not_a_timeout(server) -> None:
    _, url = server
    _Scripted.stream = ([b'{"result": {"created": true}}\n'], 0.0)
    with pytest.raises(GatewayUnreachable, match="ended"):
        for _ in GatewayConnections(None).stream(
                url, "/v3/watch", {}, connect_timeout=5.0, deadline=time.monotonic() + 30):
            pass
