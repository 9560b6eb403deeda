"""Shared fixtures: the real servers the tests run against.

Both servers bind to 127.0.0.1 on free ports, keep their data in pytest's temp
dirs, and are torn down even when a test fails. Tests that need S3 are marked
`s3`; they are never skipped silently: if the server cannot start, they error.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from relight.chaos.s3_server import S3Server
from relight.elastic.etcd_server import EtcdCluster, EtcdServer


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` are skipped, saying why, where torch sees no GPU."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False here")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _running(server: EtcdServer) -> Iterator[EtcdServer]:
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd for the session; tests isolate themselves by key prefix."""
    yield from _running(EtcdServer(tmp_path_factory.mktemp("etcd") / "data"))


@pytest.fixture
def etcd_restartable(tmp_path) -> Iterator[EtcdServer]:
    """A private etcd a test may kill and restart (`.kill()`, `.start()`, `.restart()`)."""
    yield from _running(EtcdServer(tmp_path / "etcd-data"))


@pytest.fixture
def etcd_cluster(tmp_path) -> Iterator[EtcdCluster]:
    """Three real etcd members on loopback, as users run etcd; a test may kill, pause
    (SIGSTOP) and restart members (`.kill(i)`, `.pause(i)`, `.start_member(i)`)."""
    cluster = EtcdCluster(tmp_path / "etcd-cluster", size=3)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One real S3 server for the session, with a bucket ready: SeaweedFS, or moto's
    server when RELIGHT_MOTO_SERVER names its executable (tests/storage/moto_server.py)."""
    server: Any
    if os.environ.get("RELIGHT_MOTO_SERVER"):
        from tests.storage.moto_server import MotoServer

        server = MotoServer(os.environ["RELIGHT_MOTO_SERVER"], tmp_path_factory.mktemp("moto"))
    else:
        server = S3Server(tmp_path_factory.mktemp("s3") / "data")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The S3 server with its credentials and endpoint in this process's environment
    (child processes started by the test inherit them)."""
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    return s3_server


@pytest.fixture
def s3_url(s3_env: S3Server, request: pytest.FixtureRequest) -> str:
    """A fresh `s3://bucket/prefix` per test, so tests never see each other's objects."""
    safe = "".join(c if c.isalnum() else "-" for c in request.node.name)[:80]
    return s3_env.url(f"tests/{safe}-{os.getpid()}-{id(request)}")
