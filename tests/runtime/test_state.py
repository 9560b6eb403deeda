"""The state dict names and global shapes are the same under every layout."""

from __future__ import annotations

import pytest

from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

DENSE = "configs/tiny.toml"
MOE = "configs/tiny_moe.toml"


def union(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        for k, v in r.items():
            if k == "train":
                continue  # the one JSON leaf; its "layout" field differs by design
            assert out.setdefault(k, v) == v, f"ranks disagree on {k}: {out[k]} vs {v}"
    return out


@pytest.fixture(scope="module")
def single(rank_pool: RankPool) -> dict[str, dict]:
    return {c: union(rank_pool.run("tests.runtime.cases:state_shapes", 1, config=c))
            for c in (DENSE, MOE)}


@pytest.mark.parametrize(("config", "overrides", "world"), [
    pytest.param(DENSE, [], 4, id="fsdp4"),
    pytest.param(DENSE, ["--parallel.tp=2"], 4, id="dp2xtp2"),
    pytest.param(DENSE, ["--parallel.pp=2"], 4, id="pp2xdp2"),
    pytest.param(MOE, ["--parallel.ep=4"], 4, id="moe-fsdp4xep4"),
])
def test_names_and_global_shapes_do_not_depend_on_layout(
        rank_pool: RankPool, single: dict, config: str, overrides: list[str],
        world: int) -> None:
    got = union(rank_pool.run("tests.runtime.cases:state_shapes", world, config=config,
                              overrides=overrides))
    assert got == single[config]


def test_key_scheme(single: dict) -> None:
    dense, moe = single[DENSE], single[MOE]
    assert dense["model/layers.3.attention.wq.weight"] == (64, 64)
    assert dense["optim/layers.3.attention.wq.weight/exp_avg"] == (64, 64)
    assert dense["optim/layers.3.attention.wq.weight/step"] == ()
    assert moe["model/layers.1.feed_forward.experts.w1"] == (4, 64, 64)
    assert not any("rank" in k or "_fsdp" in k or "_orig_mod" in k for k in dense)
