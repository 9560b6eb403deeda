"""The synthetic corpus: deterministic by global sample index, same micro-batches under any DP
size, resumable at any data position, and learnable."""

from __future__ import annotations

import pytest
import torch

from relight.runtime.data import BatchPlan, DataLoader, SyntheticCorpus
from tests.runtime.pool import RankPool


def corpus(seed: int = 7) -> SyntheticCorpus:
    return SyntheticCorpus(vocab_size=64, seq_len=16, seed=seed)


def test_sample_depends_only_on_seed_and_index() -> None:
    a, b = corpus(), corpus()
    assert torch.equal(a.samples(100, 8), b.samples(100, 8))
    # Any window of indices gives the same samples as a longer read.
    assert torch.equal(a.samples(103, 2), a.samples(100, 8)[3:5])
    assert not torch.equal(a.samples(0, 8), corpus(seed=8).samples(0, 8))
    assert not torch.equal(a.samples(0, 8), a.samples(8, 8))


def _global_batch(dp: int, position: int) -> torch.Tensor:
    parts = []
    for r in range(dp):
        loader = DataLoader(corpus(), BatchPlan(global_batch=16, micro_batch=2, dp=dp,
                                                dp_rank=r), position)
        parts += [torch.cat([x, y[:, -1:]], dim=1) for x, y in loader.next_step()]
    return torch.cat(parts)


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_global_batch_is_the_same_for_every_dp_size(dp: int) -> None:
    assert torch.equal(_global_batch(dp, 32), corpus().samples(32, 16))


def test_gradient_accumulation_makes_up_the_dp_difference() -> None:
    counts = {dp: BatchPlan(global_batch=16, micro_batch=2, dp=dp, dp_rank=0).local_microbatches
              for dp in (1, 2, 4, 8)}
    assert counts == {1: 8, 2: 4, 4: 2, 8: 1}


@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_replica_groups_share_the_global_batch_exactly_once(groups: int, dp: int) -> None:
    """Any number of replica groups (uneven shares included) computes every sample of the
    global batch once, in runs of dp micro-batches, and the shares weigh 1 in all."""
    starts, shares = [], []
    for q in range(groups):
        plans = [BatchPlan(global_batch=16, micro_batch=2, dp=dp, dp_rank=r, replicas=groups,
                           replica_rank=q) for r in range(dp)]
        assert len({p.local_microbatches for p in plans}) == 1  # FSDP averages over dp
        shares.append(plans[0].share)
        starts += [s for p in plans for s in p.microbatch_starts(32)]
    assert sorted(starts) == list(range(32, 48, 2))
    assert sum(shares) == pytest.approx(1.0)
    one = BatchPlan(global_batch=16, micro_batch=2, dp=dp, dp_rank=dp - 1)
    assert one.microbatch_starts(0) == BatchPlan(
        global_batch=16, micro_batch=2, dp=dp, dp_rank=dp - 1, replicas=1).microbatch_starts(0)


def test_more_replica_groups_than_the_batch_can_feed_is_refused() -> None:
    with pytest.raises(ValueError, match="too few for 5 replica groups"):
        BatchPlan(global_batch=16, micro_batch=2, dp=2, dp_rank=0, replicas=5)


def test_resume_at_position_reads_the_same_batches() -> None:
    plan = BatchPlan(global_batch=8, micro_batch=4, dp=2, dp_rank=1)
    straight = DataLoader(corpus(), plan)
    batches = [straight.next_step() for _ in range(6)]
    resumed = DataLoader(corpus(), plan)
    resumed.load_state_dict({"position": 3 * 8})
    for want in batches[3:]:
        got = resumed.next_step()
        for (gx, gy), (wx, wy) in zip(got, want, strict=True):
            assert torch.equal(gx, wx) and torch.equal(gy, wy)
    assert resumed.state_dict() == straight.state_dict() == {"position": 48}


def test_corpus_has_far_less_entropy_than_its_unigrams() -> None:
    c = SyntheticCorpus(vocab_size=64, seq_len=32, seed=1234)
    assert c.unigram_entropy() > 3.5
    assert c.conditional_entropy() < 1.2


@pytest.mark.multirank
@pytest.mark.long  # the main job (scripts/run.sh) learns the same way on real text
def test_tiny_model_learns_well_below_unigram_entropy(rank_pool: RankPool) -> None:
    r = rank_pool.run("tests.runtime.cases:train", 1, overrides=["--train.steps=40"])[0]
    unigram = SyntheticCorpus(vocab_size=64, seq_len=32, seed=1234).unigram_entropy()
    assert r["losses"][-1] < 0.6 * unigram, (r["losses"][-1], unigram)
