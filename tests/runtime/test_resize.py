"""Resume on any cluster size: the main job's config (16 samples in micro-batches of 8)
trained on 2 ranks, resumed on 3, 4 and 3 again. Three data ranks take uneven shares
(6, 5 and 5 samples), weighted so the update is the one any other size makes: every
sample of the run is computed exactly once across the resumes, and the loss continues
the uninterrupted two-rank run within the resharded-resume tolerance."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.runtime.pool import RankPool

pytestmark = pytest.mark.multirank

MAIN_JOB = "configs/text.toml"
STEPS = 12
SEGMENTS = [(2, 3), (3, 6), (4, 9), (3, 12)]
"""(ranks, last step) of each resumed run: the main job's 2 ranks, then 3, 4 and 3."""
LOSS_RTOL = 1e-4
"""The resharded-resume tolerance of tests/runtime/test_resume.py: reduction order only."""


@pytest.fixture(scope="module")
def main_job_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The main job's corpus (pydoc topics as bytes), as scripts/run.sh prepares it."""
    from relight.runtime.prepare import prepare, write_pydoc_topics

    root = tmp_path_factory.mktemp("pydoc")
    write_pydoc_topics(root / "topics.jsonl")
    prepare([str(root / "topics.jsonl")], tokenizer="byte", out=root / "ds", workers=1)
    return root / "ds"


def _overrides(data: Path, ckpt: Path) -> list[str]:
    return [f"--data.source=tokens:{data}", f"--train.steps={STEPS}",
            "--checkpoint.every=3", f"--checkpoint.url={ckpt}", "--data.eval_every=0"]


@pytest.fixture(scope="module")
def reference(rank_pool: RankPool, main_job_data: Path,
              tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The main job uninterrupted on its 2 ranks."""
    ckpt = tmp_path_factory.mktemp("ref") / "ckpt"
    r = rank_pool.run("tests.runtime.cases:train_recording_samples", 2, config=MAIN_JOB,
                      overrides=_overrides(main_job_data, ckpt), dump=True)
    state: dict = {}
    for rank in r:
        state.update(rank["state"])
    return {"losses": r[0]["losses"], "state": state}


def test_resume_over_2_3_4_3_ranks_keeps_the_batch_and_the_loss(
        rank_pool: RankPool, main_job_data: Path, reference: dict, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    losses: list[float] = []
    samples: list[tuple[int, int, int]] = []
    previous = None
    for world, stop in SEGMENTS:
        runs = rank_pool.run("tests.runtime.cases:train_recording_samples", world,
                             config=MAIN_JOB, dump=stop == STEPS,
                             overrides=_overrides(main_job_data, ckpt)
                             + [f"--train.stop_at={stop}"])
        assert runs[0]["restored_step"] == previous, (world, runs[0]["restored_step"])
        assert runs[0]["final_step"] == stop and runs[0]["dp"] == world
        if world == 3:
            assert "uneven shares of 6/5 samples over dp=3" in runs[0]["plan"]
        losses += runs[0]["losses"]
        samples += [s for r in runs for s in r["samples"]]
        previous = stop

    # Every sample of the 12 steps once, each step's 16 in that step.
    per_step: dict[int, list[int]] = {}
    for step, first, count in samples:
        per_step.setdefault(step, []).extend(range(first, first + count))
    assert sorted(per_step) == list(range(STEPS))
    for step, got in per_step.items():
        assert sorted(got) == list(range(16 * step, 16 * step + 16)), step

    want = reference["losses"]
    assert len(losses) == len(want) == STEPS
    for i, (g, w) in enumerate(zip(losses, want, strict=True)):
        assert abs(g - w) <= LOSS_RTOL * w, f"step {i + 1}: {g} vs uninterrupted {w}"

    # The final weights match too: the uneven steps made the same updates.
    state: dict = {}
    for r in runs:
        state.update(r["state"])
    params = [k for k in reference["state"] if k.startswith("model/")]
    assert params
    for name in params:
        torch.testing.assert_close(state[name], reference["state"][name], rtol=1e-3,
                                   atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert state["train"]["data_position"] == reference["state"]["train"]["data_position"]


def test_uneven_shares_make_the_same_update_as_one_process(
        rank_pool: RankPool, main_job_data: Path, tmp_path: Path) -> None:
    """One step's gradients on 3 data ranks (6/5/5 samples) against one process holding
    the whole batch: the weighting is exact up to reduction order."""
    base = [f"--data.source=tokens:{main_job_data}", "--train.steps=1",
            "--data.eval_every=0"]
    one = rank_pool.run("tests.runtime.cases:train", 1, config=MAIN_JOB, overrides=base,
                        grads=True)[0]["grads"]
    three = rank_pool.run("tests.runtime.cases:train", 3, config=MAIN_JOB, overrides=base,
                          grads=True)[0]["grads"]
    assert one.keys() == three.keys()
    for name, g in one.items():
        torch.testing.assert_close(three[name], g, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_a_copy_of_the_checkpoint_resumes_on_any_size(
        rank_pool: RankPool, main_job_data: Path, reference: dict, tmp_path: Path) -> None:
    """The two-rank checkpoint at step 6 resumed on 1 to 4 ranks continues the same loss
    curve (the CLI's case: `NPROC=3 bash scripts/run.sh --train.steps=...`)."""
    root = tmp_path / "at6"
    rank_pool.run("tests.runtime.cases:train", 2, config=MAIN_JOB,
                  overrides=_overrides(main_job_data, root) + ["--train.stop_at=6"])
    for world in (1, 3):
        copy = tmp_path / f"copy{world}"
        shutil.copytree(root, copy)
        r = rank_pool.run("tests.runtime.cases:train", world, config=MAIN_JOB,
                          overrides=_overrides(main_job_data, copy)
                          + ["--train.stop_at=8"])[0]
        assert r["restored_step"] == 6
        for i, (g, w) in enumerate(zip(r["losses"], reference["losses"][6:8], strict=True)):
            assert abs(g - w) <= LOSS_RTOL * w, f"world {world} step {7 + i}: {g} vs {w}"
