"""Fixtures for the elastic tests: TLS certificates and an etcd with TLS + auth."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from relight.elastic.etcd_server import EtcdServer, EtcdTLS, etcd_binary


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def tls_certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.crt", "-days", "2", "-subj", "/CN=relight-test-ca", cwd=d)
    (d / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        # clientAuth too: etcd's gateway dials its own gRPC port with this certificate.
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    # The client certificate carries no Common Name: with auth on, etcd's JSON gateway
    # refuses any client certificate that has one (see docs/design/etcd-client.md).
    for name, subject in (("server", "/CN=relight-server"), ("client", "/O=relight-client")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                 f"{name}.csr", "-subj", subject, cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile",
                 f"{name}.ext", cwd=d)
    return Certs(str(d / "ca.crt"), str(d / "server.crt"), str(d / "server.key"),
                 str(d / "client.crt"), str(d / "client.key"))


def etcdctl(server: EtcdServer, certs: Certs | None, *args: str, user: str | None = None) -> str:
    cmd = [etcd_binary("etcdctl"), f"--endpoints={server.url}", "--dial-timeout=5s"]
    if certs is not None:
        cmd += [f"--cacert={certs.ca}", f"--cert={certs.client_cert}", f"--key={certs.client_key}"]
    if user:
        cmd.append(f"--user={user}")
    return subprocess.run(cmd + list(args), check=True, capture_output=True, text=True,
                          timeout=30).stdout


@pytest.fixture(scope="session")
def etcd_secure(tmp_path_factory: pytest.TempPathFactory, tls_certs: Certs) -> Iterator[EtcdServer]:
    """etcd with TLS, client certificates required, and auth on: user `alice`
    (password `alice-pw`) may read and write only keys under `/relight-secure/`."""
    tls = EtcdTLS(tls_certs.ca, tls_certs.server_cert, tls_certs.server_key,
                  client_cert_auth=True)
    server = EtcdServer(tmp_path_factory.mktemp("etcd-secure") / "data", tls=tls)
    server.start()
    try:
        etcdctl(server, tls_certs, "user", "add", "root:root-pw", "--interactive=false")
        etcdctl(server, tls_certs, "user", "add", "alice:alice-pw", "--interactive=false")
        etcdctl(server, tls_certs, "role", "add", "relight")
        etcdctl(server, tls_certs, "role", "grant-permission", "relight", "--prefix=true",
                "readwrite", "/relight-secure/")
        etcdctl(server, tls_certs, "user", "grant-role", "alice", "relight")
        etcdctl(server, tls_certs, "auth", "enable")
        yield server
    finally:
        server.stop()
