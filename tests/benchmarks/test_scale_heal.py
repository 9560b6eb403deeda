"""The heal-at-scale benchmark at a tiny size against a real 3-member etcd: every phase
completes with the dead group out and the joiner in, and the counters it reads from etcd
move (not a timing test)."""

from __future__ import annotations

import pytest

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
    # The lost group's survivors and the joiner's quorum settled, every member in.
    assert row["lost"]["settle_s"] is not None and row["lost"]["errors"] == []
    assert row["joined"]["settle_s"] is not None and row["joined"]["errors"] == []
    assert row["lost"]["requests_per_group"] > 0 and row["joined"]["bytes_per_group"] > 0
    # Some of the machine was busy in each change, and no more than all of it (a share
    # above 1 would mean the CPU and the window were read over different spans).
    for change in ("lost", "joined"):
        assert 0 < row[change]["cores_busy"] <= 1.05, row[change]


def test_the_lighthouse_model_counts_heartbeats_and_quorum_requests() -> None:
    m = lighthouse_model(1024, 1.0)
    assert m["requests_per_group_step"] == pytest.approx(11.0)  # 10 heartbeats + 1 quorum
    assert m["server_requests_per_s"] == pytest.approx(11 * 1024)
    assert lighthouse_model(1024, 2.0)["requests_per_group_step"] == pytest.approx(21.0)
