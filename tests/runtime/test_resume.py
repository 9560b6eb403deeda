"""Checkpoint integration through ``ckpt.CheckpointManager``: exact resume in the same layout,
and resume resharded into another layout."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

DENSE = "configs/tiny.toml"
MOE = "configs/tiny_moe.toml"
RUN = ["--train.steps=10", "--checkpoint.every=5"]


def assert_states_equal(got: dict, want: dict) -> None:
    tensors = [k for k, v in want.items() if isinstance(v, torch.Tensor)]
    assert any(k.startswith("optim/") for k in tensors), "optimizer state missing"
    assert got.keys() == want.keys()
    for name in tensors:
        assert torch.equal(got[name], want[name]), f"{name} differs after resume"
    assert got["train"]["step"] == want["train"]["step"] == 10


def merged_state(results: list[dict]) -> dict:
    out: dict = {}
    for r in results:
        out.update(r["state"])
    return out


@pytest.fixture(scope="module")
def straight(rank_pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """10 uninterrupted steps under fsdp4 (checkpointing every 5, like the resumed run).
    Its losses equal the single-process ones within 1e-4 (test_parity), so they serve as the
    uninterrupted reference of the resharded resumes too."""
    url = tmp_path_factory.mktemp("straight")
    results = rank_pool.run("tests.runtime.cases:train", 4, overrides=RUN + [
        f"--checkpoint.url={url}"], dump=True)
    return {"state": merged_state(results), "losses": results[0]["losses"]}


@pytest.fixture(scope="module")
def saved_at_5(rank_pool: RankPool, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint root holding only step 5, written under fsdp4."""
    url = tmp_path_factory.mktemp("at5") / "ckpt"
    r = rank_pool.run("tests.runtime.cases:train", 4,
                      overrides=RUN + [f"--checkpoint.url={url}", "--train.stop_at=5"])
    assert r[0]["final_step"] == 5 and r[0]["restored_step"] is None
    return url


def test_resume_same_layout_is_bitwise_exact(rank_pool: RankPool, straight: dict,
                                             saved_at_5: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved_at_5, root)
    results = rank_pool.run("tests.runtime.cases:train", 4,
                            overrides=RUN + [f"--checkpoint.url={root}"], dump=True)
    assert results[0]["restored_step"] == 5
    assert results[0]["final_step"] == 10
    state = merged_state(results)
    assert_states_equal(state, straight["state"])


@pytest.mark.parametrize("pipelined", [False, True], ids=["staged-in-call", "pipelined"])
def test_checkpoint_persisted_while_training_goes_on_restores_exactly(
        rank_pool: RankPool, straight: dict, tmp_path: Path, pipelined: bool) -> None:
    """Step 5 is saved asynchronously while steps 6-8 update the same tensors: the checkpoint
    must hold step 5's values (the runtime hands the engine live tensors). Pipelined, the
    copy itself overlaps step 6 and only the optimizer step waits for it."""
    root = tmp_path / "ckpt"
    rank_pool.run("tests.runtime.cases:train", 4, overrides=RUN + [
        f"--checkpoint.url={root}", "--train.stop_at=8",
        f"--checkpoint.pipelined_staging={str(pipelined).lower()}"])
    results = rank_pool.run("tests.runtime.cases:train", 4, overrides=RUN + [
        f"--checkpoint.url={root}", "--checkpoint.restore_step=5"], dump=True)
    assert results[0]["restored_step"] == 5
    assert_states_equal(merged_state(results), straight["state"])


@pytest.mark.parametrize(("overrides", "world"), [
    pytest.param(["--parallel.tp=2"], 4, id="fsdp4-to-dp2xtp2"),
    pytest.param(["--parallel.pp=2"], 4, id="fsdp4-to-pp2xdp2"),
    # long: tensor parallelism is resharded into in fsdp4-to-dp2xtp2 too
    pytest.param(["--parallel.tp=2", "--parallel.dp_shard=1"], 2, id="fsdp4-to-tp2",
                 marks=pytest.mark.long),
])
def test_resume_resharded(rank_pool: RankPool, straight: dict, saved_at_5: Path,
                          tmp_path: Path, overrides: list[str], world: int) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(saved_at_5, root)
    results = rank_pool.run("tests.runtime.cases:train", world,
                            overrides=RUN + overrides + [f"--checkpoint.url={root}"])
    assert results[0]["restored_step"] == 5
    got, want = results[0]["losses"], straight["losses"][5:]
    assert len(got) == 5
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert abs(g - w) <= 1e-4 * w, f"step {6 + i}: {g} vs uninterrupted {w}"


@pytest.mark.long  # 30 s; CI resumes resharded dense layouts, and trains EP ones (test_parity)
def test_resume_changes_expert_parallelism(rank_pool: RankPool, tmp_path: Path) -> None:
    """MoE saved under fsdp4 x ep4 resumes under dp2 x ep2 (2 ranks) and under one process."""
    ref = rank_pool.run("tests.runtime.cases:train", 1, config=MOE, overrides=RUN)[0]["losses"]
    root = tmp_path / "ckpt"
    rank_pool.run("tests.runtime.cases:train", 4, config=MOE, overrides=RUN + [
        f"--checkpoint.url={root}", "--train.stop_at=5", "--parallel.ep=4"])
    for world, extra in ((2, ["--parallel.ep=2"]), (1, [])):
        copy = tmp_path / f"copy{world}"
        shutil.copytree(root, copy)
        r = rank_pool.run("tests.runtime.cases:train", world, config=MOE,
                          overrides=RUN + extra + [f"--checkpoint.url={copy}"])[0]
        assert r["restored_step"] == 5
        for i, (g, w) in enumerate(zip(r["losses"], ref[5:], strict=True)):
            assert abs(g - w) <= 1e-4 * w, f"world {world} step {6 + i}: {g} vs {w}"
