"""The heal-at-scale benchmark at a tiny size against a real 3-member etcd: every phase
completes with the dead group out and the joiner in, and the counters it reads from etcd
move (not a timing test)."""

from __future__ import annotations

import pytest

from relight.benchmarks import scale_heal
from relight.benchmarks.scale_heal import HealScaleConfig, lighthouse_model, run_heal_scale

pytestmark = [pytest.mark.etcd]


def test_a_small_fleet_loses_a_group_and_takes_a_joiner_in() -> None:
    lines: list[str] = []
    # Keepalives every lease_ttl / 3 = 2 s: a 5 s window holds two per group.
    rows = run_heal_scale(HealScaleConfig(groups=(5,), quiet_s=5.0, lease_ttl_s=6.0),
                          log=lines.append)
    assert len(rows) == 1 and len(lines) == 1
    row = rows[0]
    assert "errors" not in row, row
    assert row["formation_s"] is not None
    # A standing quorum: leases kept alive, watches open; etcd served some requests.
    assert row["quiet"]["requests_per_group_step"] > 0
    assert row["quiet"]["bytes_per_group_step"] > 0
    assert row["quiet"]["clients_cpu_per_step_s"] >= 0
    # The lost group's survivors and the joiner's quorum settled, every member in.
    assert row["lost"]["settle_s"] is not None and row["lost"]["errors"] == []
    assert row["joined"]["settle_s"] is not None and row["joined"]["errors"] == []
    assert row["lost"]["requests_per_group"] > 0 and row["joined"]["bytes_per_group"] > 0
    # CPU is read in clock ticks: over a change of a few tens of ms the share can round
    # either way, so only its presence is checked here (the formula below).
    assert row["lost"]["cores_busy"] >= 0 and row["joined"]["cores_busy"] >= 0


def test_the_lighthouse_model_counts_heartbeats_and_quorum_requests() -> None:
    m = lighthouse_model(1024, 1.0)
    assert m["requests_per_group_step"] == pytest.approx(11.0)  # 10 heartbeats + 1 quorum
    assert m["server_requests_per_s"] == pytest.approx(11 * 1024)
    assert lighthouse_model(1024, 2.0)["requests_per_group_step"] == pytest.approx(21.0)


def test_cores_busy_is_the_cpu_of_a_change_over_the_machines_cores(monkeypatch) -> None:
    monkeypatch.setattr(scale_heal.os, "cpu_count", lambda: 2)
    # etcd 1.5 CPU-s and the clients 1.5 over 2 s on 2 cores: three quarters busy.
    assert scale_heal._cores_busy({"cpu_s": 1.5, "clients_cpu_s": 1.5, "wall_s": 2.0}
                                  ) == pytest.approx(0.75)
    assert scale_heal._cores_busy({"cpu_s": 2.0, "clients_cpu_s": 0.0, "wall_s": 1.0}
                                  ) == pytest.approx(1.0)
