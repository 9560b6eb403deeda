"""Every layout matches the single-process reference from the same init: the loss of each of
5 steps within 1e-4 relative, and the step-0 gradients of every parameter (a stronger check:
Adam hides a wrong gradient scale from the loss for many steps)."""

from __future__ import annotations

import pytest
import torch

from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

DENSE = "configs/tiny.toml"
MOE = "configs/tiny_moe.toml"
STEPS = ["--train.steps=5"]

LAYOUTS = [
    # id, config, overrides, world
    ("dp4", DENSE, ["--parallel.dp_replicate=4", "--parallel.dp_shard=1"], 4),
    ("fsdp4", DENSE, [], 4),
    ("hsdp2x2", DENSE, ["--parallel.dp_replicate=2"], 4),
    ("tp2", DENSE, ["--parallel.tp=2"], 2),
    ("tp2-sp", DENSE, ["--parallel.tp=2", "--parallel.sequence_parallel=true"], 2),
    ("pp2-gpipe", DENSE, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"], 2),
    ("pp2-1f1b", DENSE, ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"], 2),
    ("dp2xtp2", DENSE, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1",
                        "--parallel.tp=2"], 4),
    ("fsdp2-ac", DENSE, ["--train.activation_checkpointing=true"], 2),
    ("fsdp2xtp2xpp2", DENSE, ["--parallel.tp=2", "--parallel.pp=2"], 8),
    ("pp2xtp2-sp-ac", DENSE, ["--parallel.pp=2", "--parallel.tp=2",
                              "--parallel.sequence_parallel=true",
                              "--train.activation_checkpointing=true"], 4),
    ("moe-ep2", MOE, ["--parallel.ep=2"], 2),
    ("moe-dp2xep2", MOE, ["--parallel.dp_replicate=2", "--parallel.dp_shard=1",
                          "--parallel.ep=2"], 2),
    ("moe-fsdp4xep2", MOE, ["--parallel.ep=2"], 4),
    ("moe-hsdp2x2xep2", MOE, ["--parallel.dp_replicate=2", "--parallel.ep=2"], 4),
    ("moe-tp2", MOE, ["--parallel.tp=2"], 2),
    ("moe-pp2xep2", MOE, ["--parallel.pp=2", "--parallel.ep=2"], 4),
    # A dp that does not divide the batch's 4 micro-batches: uneven, weighted shares (by
    # samples; by whole micro-batches under pipelining and with a load-balance loss).
    ("fsdp3-uneven", DENSE, [], 3),
    ("fsdp3xtp2-uneven", DENSE, ["--parallel.tp=2"], 6),
    ("pp2xfsdp3-gpipe-uneven", DENSE, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"], 6),
    ("pp2xfsdp3-1f1b-uneven", DENSE, ["--parallel.pp=2", "--data.micro_batch_size=2"], 6),
    ("moe-fsdp3-uneven", MOE, [], 3),
]

_refs: dict[str, dict] = {}


def reference(pool: RankPool, config: str) -> dict:
    if config not in _refs:
        _refs[config] = pool.run("tests.runtime.cases:train", 1, config=config,
                                 overrides=STEPS, grads=True)[0]
    return _refs[config]


def assert_losses_close(got: list[float], want: list[float], rel: float = 1e-4) -> None:
    assert len(got) == len(want), (got, want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= rel * abs(w), f"step {i + 1}: loss {g} vs reference {w}"


def merged_grads(results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in results:
        out.update(r["grads"])
    return out


LONG = {"fsdp2xtp2xpp2", "dp4", "tp2", "moe-ep2", "dp2xtp2", "moe-pp2xep2",
        "fsdp3xtp2-uneven", "pp2xfsdp3-gpipe-uneven", "pp2xfsdp3-1f1b-uneven"}
"""In the long tier: eight ranks (the only case that grows the pool to eight workers),
three one-dimensional cases whose parallelism CI runs inside a two-dimensional one (dp4
in hsdp2x2, tp2 in tp2-sp, moe-ep2 in moe-dp2xep2 and moe-fsdp4xep2), and two
combinations whose dimensions CI runs in others (dp2xtp2: replication in hsdp2x2, TP
in tp2-sp, and a resharded resume checks FSDP x TP against an unbroken run,
tests/runtime/test_resume.py; moe-pp2xep2: pp2xtp2-sp-ac and the EP cases), and the
six-rank uneven cases (CI runs uneven shares in fsdp3-uneven and moe-fsdp3-uneven, and
resumes over 2, 3, 4 and 3 ranks in tests/runtime/test_resize.py)."""


@pytest.mark.parametrize(("config", "overrides", "world"),
                         [pytest.param(c, o, w, id=i,
                                       marks=[pytest.mark.long] if i in LONG else [])
                          for i, c, o, w in LAYOUTS])
def test_layout_matches_single_process(rank_pool: RankPool, config: str,
                                       overrides: list[str], world: int) -> None:
    ref = reference(rank_pool, config)
    results = rank_pool.run("tests.runtime.cases:train", world, config=config,
                            overrides=STEPS + overrides, grads=True)
    # Every rank reports the same global loss.
    for r in results:
        assert r["losses"] == results[0]["losses"]
    assert_losses_close(results[0]["losses"], ref["losses"])
    grads = merged_grads(results)
    assert grads.keys() == ref["grads"].keys()
    for name, want in ref["grads"].items():
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6, msg=name)


def test_reference_learns(rank_pool: RankPool) -> None:
    """The reference itself moves: parity of constant losses would prove nothing."""
    losses = reference(rank_pool, DENSE)["losses"]
    assert losses[-1] < losses[0] - 0.1


def test_bf16_mixed_precision_tracks_fp32(rank_pool: RankPool) -> None:
    ref = reference(rank_pool, DENSE)
    results = rank_pool.run("tests.runtime.cases:train", 2, config=DENSE,
                            overrides=STEPS + ["--train.mixed_precision=bf16"])
    assert_losses_close(results[0]["losses"], ref["losses"], rel=2e-2)
