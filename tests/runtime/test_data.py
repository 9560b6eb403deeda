"""The synthetic corpus: deterministic by global sample index, same global batch under any DP
size (uneven shares weighted exactly), resumable at any data position, and learnable."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from relight.runtime.data import BatchPlan, DataLoader, Deal, SyntheticCorpus
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


def _global_batch(dp: int, position: int, micro: int = 2, *,
                  deal: Deal = Deal.SAMPLES) -> torch.Tensor:
    parts = []
    for r in range(dp):
        loader = DataLoader(corpus(), BatchPlan(global_batch=16, micro_batch=micro, dp=dp,
                                                dp_rank=r, deal=deal), position)
        parts += [torch.cat([x, y[:, -1:]], dim=1) for x, y, m in loader.next_step()
                  if not m.padding]
    return torch.cat(parts)


@pytest.mark.parametrize("deal", list(Deal))
@pytest.mark.parametrize("dp", [1, 2, 3, 4, 5, 6, 7, 8, 16])
def test_global_batch_is_the_same_for_every_dp_size(dp: int, deal: Deal) -> None:
    if deal is Deal.PIPELINE and dp > 8:
        return  # fewer micro-batches than data ranks: refused (below)
    assert torch.equal(_global_batch(dp, 32, deal=deal), corpus().samples(32, 16))
    if deal is not Deal.PIPELINE:
        assert torch.equal(_global_batch(dp, 32, micro=8, deal=deal),
                           corpus().samples(32, 16))


@pytest.mark.parametrize("dp", [3, 5, 6, 7])
def test_pipelined_plans_deal_whole_micro_batches(dp: int) -> None:
    """A pipeline cuts a rank's batch into equal chunks: uneven counts of full
    micro-batches, no padding."""
    plans = [BatchPlan(global_batch=16, micro_batch=2, dp=dp, dp_rank=r,
                       deal=Deal.PIPELINE) for r in range(dp)]
    assert {m.size for p in plans for m in p.micro_batches(0)} == {2}
    assert sum(p.local_microbatches for p in plans) == 8
    with pytest.raises(ValueError, match="cannot give each of dp=9 data ranks a whole one"):
        BatchPlan(global_batch=16, micro_batch=2, dp=9, dp_rank=0, deal=Deal.PIPELINE)


@given(batch=st.integers(1, 64), micro=st.integers(1, 16), dp=st.integers(1, 24),
       position=st.integers(0, 10**6), deal=st.sampled_from(list(Deal)))
@settings(max_examples=400, deadline=None)
def test_any_dp_computes_every_sample_once_with_weights_summing_to_one(
        batch: int, micro: int, dp: int, position: int, deal: Deal) -> None:
    """Any data-parallel size: every sample of the global batch in exactly one counted
    micro-batch, contiguous per rank and in rank order, at most `micro` samples each (all
    `micro` when whole micro-batches are dealt: the same micro-batches as under any dp);
    every rank runs as many forwards (FSDP pairs its gathers) except under pipelining;
    and each sample's weight in the data-parallel mean of the weighted micro-batch losses
    is exactly 1 / batch."""
    batch = batch * micro  # the config requires a multiple of the micro-batch
    if deal is Deal.PIPELINE and batch // micro < dp:
        with pytest.raises(ValueError, match="whole one"):
            BatchPlan(global_batch=batch, micro_batch=micro, dp=dp, dp_rank=0,
                      deal=Deal.PIPELINE)
        return
    plans = [BatchPlan(global_batch=batch, micro_batch=micro, dp=dp, dp_rank=r,
                       deal=deal) for r in range(dp)]
    seen: list[int] = []
    weight = Fraction(0)
    for p in plans:
        counted = [m for m in p.micro_batches(position) if not m.padding]
        assert all(1 <= m.size <= micro for m in p.micro_batches(position))
        seen += [i for m in counted for i in range(m.start, m.start + m.size)]
        # A micro-batch's mean loss over `size` samples, divided by `divisor`, then
        # averaged over dp: each of its samples weighs 1 / (size * divisor * dp).
        for m in counted:
            each = 1 / (m.size * Fraction(m.divisor) * dp)
            assert abs(each * batch - 1) < Fraction(1, 10**12)
            weight += each * m.size
    assert seen == list(range(position, position + batch))
    assert abs(weight - 1) < Fraction(1, 10**12)
    if deal is not Deal.PIPELINE:
        assert len({p.local_microbatches for p in plans}) == 1
    if deal is not Deal.SAMPLES:
        assert all(m.size == micro for p in plans for m in p.micro_batches(0)
                   if not m.padding)
    sizes = [sum(m.size for m in p.micro_batches(0) if not m.padding) for p in plans]
    assert max(sizes) - min(sizes) <= (1 if deal is Deal.SAMPLES else micro)
    assert plans[0].uneven == (len(set(sizes)) > 1)


def test_an_even_split_weighs_micro_batches_by_their_count() -> None:
    """Where dp divides the micro-batches, the plan is the plain one: full micro-batches,
    each loss divided by the accumulation count (bitwise the same arithmetic)."""
    plan = BatchPlan(global_batch=16, micro_batch=2, dp=2, dp_rank=1)
    assert not plan.uneven
    assert [(m.start, m.size, m.divisor) for m in plan.micro_batches(100)] == [
        (108, 2, 4.0), (110, 2, 4.0), (112, 2, 4.0), (114, 2, 4.0)]


def test_main_jobs_batch_over_three_ranks() -> None:
    """16 samples in micro-batches of 8 over 3 data ranks: one micro-batch each, of 6, 5
    and 5 samples, the larger weighted more."""
    plans = [BatchPlan(global_batch=16, micro_batch=8, dp=3, dp_rank=r) for r in range(3)]
    got = [[(m.start, m.size) for m in p.micro_batches(0)] for p in plans]
    assert got == [[(0, 6)], [(6, 5)], [(11, 5)]]
    assert [p.micro_batches(0)[0].divisor for p in plans] == [16 / 18, 16 / 15, 16 / 15]
    assert "uneven shares of 6/5 samples over dp=3" in plans[0].describe()


def test_whole_micro_batches_pad_the_smaller_counts() -> None:
    """The main job's batch over 3 data ranks with a per-micro-batch loss term: the two
    micro-batches stay whole, the third rank runs a weight-0 one."""
    plans = [BatchPlan(global_batch=16, micro_batch=8, dp=3, dp_rank=r,
                       deal=Deal.MICRO_BATCHES) for r in range(3)]
    got = [[(m.start, m.size, m.divisor) for m in p.micro_batches(0)] for p in plans]
    assert got == [[(0, 8, 2 / 3)], [(8, 8, 2 / 3)], [(0, 1, None)]]


def test_a_rank_short_of_samples_pads_with_weight_zero() -> None:
    plans = [BatchPlan(global_batch=16, micro_batch=1, dp=3, dp_rank=r) for r in range(3)]
    assert [p.local_microbatches for p in plans] == [6, 6, 6]
    assert [sum(m.padding for m in p.micro_batches(0)) for p in plans] == [0, 1, 1]
    pad = plans[2].micro_batches(32)[-1]
    assert (pad.start, pad.size, pad.divisor) == (32, 1, None)


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
    with pytest.raises(ValueError, match="runs of dp=3 micro-batches"):
        BatchPlan(global_batch=16, micro_batch=2, dp=3, dp_rank=0, replicas=2)


def test_resume_at_position_reads_the_same_batches() -> None:
    plan = BatchPlan(global_batch=8, micro_batch=4, dp=2, dp_rank=1)
    straight = DataLoader(corpus(), plan)
    batches = [straight.next_step() for _ in range(6)]
    resumed = DataLoader(corpus(), plan)
    resumed.load_state_dict({"position": 3 * 8})
    for want in batches[3:]:
        got = resumed.next_step()
        for (gx, gy, _), (wx, wy, _) in zip(got, want, strict=True):
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
