"""runtime.observability: the Prometheus endpoint, scraped over HTTP on loopback."""

from __future__ import annotations

import math
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from relight.runtime.observability import PrometheusConfig, PrometheusExporter, start_prometheus


def _scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                            + "}" if s.labels else "")
            out[key] = s.value
    return out


def test_scrape_over_http() -> None:
    exp = PrometheusExporter()
    port = exp.serve(0)
    try:
        assert exp._server.server_address[0] == "127.0.0.1"  # loopback unless told otherwise
        m = _scrape(port)
        assert math.isnan(m["relight_last_committed_step"])
        assert math.isnan(m["relight_last_commit_age_seconds"])
        assert m["relight_checkpoint_saves_total"] == 0

        exp.set_world_size(8)
        exp.set_rendezvous_round(3)
        exp.set_restarts(2)
        exp.record_commit(100, 1000, 1.5, committed_unix=time.time() - 30)
        exp.record_commit(200, 2500, 0.2)
        exp.record_save_failure()
        m = _scrape(port)
        assert m["relight_last_committed_step"] == 200
        assert 0 <= m["relight_last_commit_age_seconds"] < 5
        assert m["relight_checkpoint_bytes_written_total"] == 3500
        assert m["relight_checkpoint_saves_total"] == 2
        assert m["relight_checkpoint_save_failures_total"] == 1
        assert m["relight_checkpoint_save_seconds_count"] == 2
        assert m["relight_checkpoint_save_seconds_sum"] == pytest.approx(1.7)
        assert m["relight_checkpoint_save_seconds_bucket{le=0.25}"] == 1
        assert m["relight_checkpoint_save_seconds_bucket{le=2.5}"] == 2
        assert m["relight_world_size"] == 8
        assert m["relight_rendezvous_round"] == 3
        assert m["relight_restarts"] == 2
    finally:
        exp.close()


def test_two_exporters_in_one_process_are_independent() -> None:
    a, b = PrometheusExporter(), PrometheusExporter()
    pa, pb = a.serve(0), b.serve(0)
    try:
        a.set_world_size(4)
        b.set_world_size(2)
        assert _scrape(pa)["relight_world_size"] == 4
        assert _scrape(pb)["relight_world_size"] == 2
    finally:
        a.close()
        b.close()


def test_start_only_on_rank0_with_a_port() -> None:
    assert start_prometheus(PrometheusConfig(port=None), rank=0) is None
    assert start_prometheus(PrometheusConfig(port=0), rank=0) is None
    exp = PrometheusExporter()
    port = exp.serve(0)
    exp.close()  # a port that was just free
    assert start_prometheus(PrometheusConfig(port=port), rank=1) is None
    on0 = start_prometheus(PrometheusConfig(port=port), rank=0)
    assert on0 is not None
    try:
        assert on0.port == port and "relight_world_size" in _scrape(port)
    finally:
        on0.close()
    with pytest.raises(ValueError, match="prometheus_port"):
        PrometheusConfig(port=70000)
