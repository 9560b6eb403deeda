"""The training loop serves Prometheus metrics from rank 0 when a port is configured."""

from __future__ import annotations

import socket
import urllib.request
from pathlib import Path

from relight.runtime.config import load_config
from relight.runtime.train import Trainer

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_trainer_serves_metrics_on_loopback_and_stops() -> None:
    port = _free_port()
    cfg = load_config(str(CONFIG), [f"--train.prometheus_port={port}", "--train.steps=1",
                                    "--model.n_layers=1", "--train.watchdog_timeout_s=0",
                                    "--train.prometheus_host=127.0.0.2"])
    trainer = Trainer(cfg)
    try:
        assert trainer.prometheus is not None
        # train.prometheus_host is the bound address (127.0.0.2 is loopback too on Linux)
        assert trainer.prometheus._server.server_address[0] == "127.0.0.2"
        body = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read()
        assert "relight_world_size 1.0" in body.decode()
        with socket.socket() as sock:  # bound to that address only
            assert sock.connect_ex(("127.0.0.1", port)) != 0
    finally:
        trainer.close()
    with socket.socket() as sock:  # the endpoint is gone once the trainer is closed
        assert sock.connect_ex(("127.0.0.2", port)) != 0
