"""The cross-group benchmark runs its three arms on four real gloo processes and checks
its own results: both reductions exact on every rank, both heals the source's bytes."""

from __future__ import annotations

import pytest

from relight.benchmarks.cross_group import run, table


@pytest.mark.multirank
@pytest.mark.timeout(300)  # four process starts (torch imports) and a few small messages
def test_cross_group_benchmark_arms_are_exact() -> None:
    res = run(mb=0.5, tensors=3, reps=2, timeout_s=60)
    assert res["correct"] is True
    assert res["bytes_per_rank"] == 3 * res["shape"][0] * res["shape"][1] * 4 // 2
    for arm in ("matched_reduce", "mixed_reduce", "matched_heal", "mixed_heal", "floor"):
        assert len(res["all_s"][arm]) == 2 and res["median_s"][arm] > 0
    assert "| cross-group reduction |" in table(res)
