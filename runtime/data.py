"""Deterministic synthetic corpus addressed by global sample index.

Each sample is a walk of a fixed random Markov chain: every token has ``branching``
successors chosen with geometric probabilities (1/2, 1/4, ...), so the next-token entropy is
about 1.1 nats while the unigram entropy is near ln(vocab). A model that learns the chain
drives the loss far below the unigram entropy, which a test checks.

Sample ``i`` depends only on ``(seed, i)``: a run resumed at data position ``P`` (a global
sample index) reads exactly the samples an uninterrupted run would, whatever the DP size.
The global batch of step ``t`` is samples ``[P, P + global_batch)``; data rank ``r`` of ``dp``
takes the ``r``-th contiguous run of them, cut into micro-batches of at most ``micro_batch``
samples (:class:`BatchPlan`: even runs when ``dp`` divides the batch's micro-batches, runs
that differ by one sample otherwise, every micro-batch weighted by its samples), so the
global batch, and the gradient of a step, are the same under every layout.

A corpus is anything with ``samples(start, count)`` (training samples by global index) and
``eval_samples(start, count)`` (held-out ones): :class:`SyntheticCorpus` here, or a
`runtime.tokens.TokenDataset` of real text (``data.source = "tokens:DIR"``), which
:func:`build_corpus` picks from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import numpy as np
import torch

from relight.runtime.config import DataConfig

__all__ = ["BatchPlan", "Corpus", "DataLoader", "Deal", "MicroBatch", "SyntheticCorpus",
           "build_corpus"]

EVAL_OFFSET = 1 << 62
"""Held-out synthetic samples are those from this global index on (training never gets
there)."""


class Corpus(Protocol):
    vocab_size: int

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Training samples ``start .. start+count-1``, int64 ``[count, seq_len + 1]``."""
        ...

    def eval_samples(self, start: int, count: int) -> torch.Tensor:
        """Held-out samples ``start .. start+count-1``, int64 ``[count, seq_len + 1]``."""
        ...

    def unigram_entropy(self) -> float: ...


class SyntheticCorpus:
    def __init__(self, *, vocab_size: int, seq_len: int, seed: int, branching: int = 4) -> None:
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        rng = np.random.default_rng([seed, 0x5EED])
        self.successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
        p = 0.5 ** np.arange(1, branching + 1)
        self.probs = p / p.sum()

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Samples ``start .. start+count-1`` as int64 ``[count, seq_len + 1]``."""
        choices = np.empty((count, self.seq_len), dtype=np.int64)
        first = np.empty(count, dtype=np.int64)
        for j in range(count):
            rng = np.random.default_rng([self.seed, start + j])
            first[j] = rng.integers(0, self.vocab_size)
            choices[j] = rng.choice(len(self.probs), size=self.seq_len, p=self.probs)
        toks = np.empty((count, self.seq_len + 1), dtype=np.int64)
        toks[:, 0] = first
        for t in range(self.seq_len):
            toks[:, t + 1] = self.successors[toks[:, t], choices[:, t]]
        return torch.from_numpy(toks)

    def eval_samples(self, start: int, count: int) -> torch.Tensor:
        """Held-out samples: walks of the same chain that training never reads."""
        return self.samples(EVAL_OFFSET + start, count)

    def conditional_entropy(self) -> float:
        """Entropy (nats) of the next token given the previous one: the best reachable loss."""
        return float(-(self.probs * np.log(self.probs)).sum())

    def unigram_entropy(self, n_samples: int = 512) -> float:
        """Empirical entropy (nats) of the token distribution: what a unigram model reaches."""
        counts = np.bincount(self.samples(10**9, n_samples).flatten().numpy(),
                             minlength=self.vocab_size).astype(np.float64)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward and backward of a step: ``size`` samples from global index ``start``."""

    start: int
    size: int
    divisor: float | None
    """The micro-batch's mean loss is divided by this before its backward: the samples of
    the group's batch over ``size * dp``, so that the data-parallel mean FSDP takes gives
    every sample of the batch the same weight whatever its rank's share. ``None``: a
    padding micro-batch, run only so that a rank with fewer samples than the others runs
    as many forwards (FSDP's all-gathers pair up across the data ranks); its loss is
    multiplied by 0."""

    @property
    def padding(self) -> bool:
        return self.divisor is None


class Deal(StrEnum):
    """How a group's share of the global batch is cut over its data ranks."""

    SAMPLES = "samples"
    """Runs of samples as even as the count allows (they differ by one at most), every
    rank the same number of micro-batches of at most ``micro_batch`` samples, the
    smaller shares padded with weight-0 ones where they hold fewer samples than that
    count: FSDP gathers the parameters for every forward, so the ranks must run equally
    many of them. The least work on the largest share; right when the loss is a mean
    over samples."""
    MICRO_BATCHES = "micro_batches"
    """Whole micro-batches of ``micro_batch`` samples, counts as even as they allow,
    the smaller counts padded with weight-0 micro-batches to the largest. Every
    micro-batch then holds the same samples under every ``dp``, which a term computed
    per micro-batch (MoE's load-balance loss) needs to stay exact."""
    PIPELINE = "pipeline"
    """Whole micro-batches, counts as even as they allow, no padding: a pipeline schedule
    cuts a rank's batch into equal chunks whose shapes it fixes at its first step, and
    under pipelining FSDP gathers and reduces once per step whatever the count. Every
    data rank needs at least one micro-batch."""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Which samples of each step's global batch this data rank computes, in which
    micro-batches, with which weights.

    The global batch is ``global_batch`` samples in index order. With replica groups
    (``replicas > 1``, the groups of the current quorum) it is dealt out in runs of ``dp``
    micro-batches (one per data rank of a group): group ``replica_rank`` takes a
    contiguous share, as even as the count allows. One group (the default) takes the whole
    batch. Inside the group's share, data rank ``dp_rank`` takes the ``dp_rank``-th
    contiguous run, dealt as `Deal` says. When ``dp`` divides the share's micro-batches
    every way gives the same micro-batches: rank ``r`` of ``dp`` takes the ``r``-th run of
    ``global / micro / dp`` micro-batches. Each micro-batch's loss is weighted by its
    number of samples (`MicroBatch.divisor`), so the step's gradient is the mean over the
    global batch's samples at any ``dp``. A step takes as long as its largest share.
    """

    global_batch: int
    micro_batch: int
    dp: int
    dp_rank: int
    replicas: int = 1
    replica_rank: int = 0
    deal: Deal = Deal.SAMPLES

    def __post_init__(self) -> None:
        if self.replicas > 1 and (self.global_batch // self.micro_batch) % self.dp:
            raise ValueError(
                f"replica groups deal the global batch in runs of dp={self.dp} micro-batches: "
                f"{self.global_batch // self.micro_batch} micro-batches of {self.micro_batch} "
                f"do not split into such runs")
        if self.replicas > 1 and self.units < self.replicas:
            raise ValueError(
                f"a global batch of {self.global_batch} samples is {self.units} runs of "
                f"{self.dp} micro-batches of {self.micro_batch}: too few for "
                f"{self.replicas} replica groups (each needs at least one)")
        if self.deal is Deal.PIPELINE and self._group_span()[1] // self.micro_batch < self.dp:
            raise ValueError(
                f"{self._group_span()[1] // self.micro_batch} micro-batches of "
                f"{self.micro_batch} samples cannot give each of dp={self.dp} data ranks a "
                "whole one")

    @property
    def units(self) -> int:
        """Runs of ``dp`` micro-batches in the global batch: what replica groups are dealt."""
        return self.global_batch // self.micro_batch // self.dp

    def _group_span(self) -> tuple[int, int]:
        """(first sample, samples) of this rank's group in the global batch."""
        if self.replicas == 1:
            return 0, self.global_batch
        base, extra = divmod(self.units, self.replicas)
        first = self.replica_rank * base + min(self.replica_rank, extra)
        run = self.dp * self.micro_batch
        return first * run, (base + (self.replica_rank < extra)) * run

    def _rank_span(self, dp_rank: int) -> tuple[int, int]:
        """(first sample, samples) of data rank ``dp_rank`` in the global batch."""
        group_first, group_samples = self._group_span()
        unit = 1 if self.deal is Deal.SAMPLES else self.micro_batch
        base, extra = divmod(group_samples // unit, self.dp)
        first = dp_rank * base + min(dp_rank, extra)
        return group_first + first * unit, (base + (dp_rank < extra)) * unit

    def _sizes(self) -> list[int]:
        """Samples in each of this rank's micro-batches (0: padding)."""
        _, samples = self._rank_span(self.dp_rank)
        largest = self._rank_span(0)[1]  # rank 0 holds a largest share
        if self.deal is not Deal.SAMPLES:
            whole = [self.micro_batch] * (samples // self.micro_batch)
            if self.deal is Deal.PIPELINE:
                return whole
            return whole + [0] * (largest // self.micro_batch - len(whole))
        count = max(1, -(-largest // self.micro_batch))
        base, extra = divmod(samples, count)
        return [base + 1] * extra + [base] * (count - extra)

    @property
    def local_microbatches(self) -> int:
        """Micro-batches this data rank runs per step (gradient accumulation steps)."""
        return len(self._sizes())

    @property
    def share(self) -> float:
        """This rank's group's fraction of the global batch: the weight of its gradients
        when the groups' gradients are summed."""
        if self.replicas == 1:
            return 1.0
        return self._group_span()[1] // (self.dp * self.micro_batch) / self.units

    @property
    def uneven(self) -> bool:
        """Whether the data ranks of the group hold shares of different sizes."""
        return self._rank_span(0)[1] != self._rank_span(self.dp - 1)[1]

    def micro_batches(self, position: int) -> list[MicroBatch]:
        """This rank's micro-batches of the step whose first sample is ``position``."""
        group_first, group_samples = self._group_span()
        first, _ = self._rank_span(self.dp_rank)
        out = []
        for size in self._sizes():
            if size == 0:
                out.append(MicroBatch(position + group_first, 1, None))
                continue
            out.append(MicroBatch(position + first, size,
                                  group_samples / (size * self.dp)))
            first += size
        return out

    def microbatch_starts(self, position: int) -> list[int]:
        """First global sample index of each of this rank's micro-batches at ``position``."""
        return [m.start for m in self.micro_batches(position)]

    def describe(self) -> str:
        """The data ranks' shares, for the start-up log line."""
        sizes = sorted({self._rank_span(r)[1] for r in range(self.dp)}, reverse=True)
        shares = "/".join(str(s) for s in sizes)
        return (f"{self.local_microbatches} micro-batches per rank" if not self.uneven else
                f"uneven shares of {shares} samples over dp={self.dp} "
                f"({self.local_microbatches} micro-batches on this rank)")


class DataLoader:
    """Yields this rank's micro-batches; ``position`` is the next global sample index."""

    def __init__(self, corpus: Corpus, plan: BatchPlan, position: int = 0) -> None:
        self.corpus = corpus
        self.plan = plan
        self.position = position

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor, MicroBatch]]:
        """This rank's micro-batches of the next step: (inputs, targets, which samples and
        their weight)."""
        out = []
        for micro in self.plan.micro_batches(self.position):
            s = self.corpus.samples(micro.start, micro.size)
            out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous(), micro))
        self.position += self.plan.global_batch
        return out

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.position = int(sd["position"])


def build_corpus(cfg: DataConfig, *, model_vocab: int, model: str = "") -> Corpus:
    """The corpus ``cfg.source`` names; a token dataset's vocabulary is checked against the
    model's (`runtime.tokens.VocabMismatchError`, a config error)."""
    if not cfg.tokens_dir:
        return SyntheticCorpus(vocab_size=model_vocab, seq_len=cfg.seq_len, seed=cfg.seed,
                               branching=cfg.branching)
    from relight.runtime.tokens import TokenDataset, check_vocab

    ds = TokenDataset(cfg.tokens_dir, seq_len=cfg.seq_len, seed=cfg.seed,
                      eval_fraction=cfg.eval_fraction, verify=cfg.verify_checksums)
    check_vocab(model_vocab, ds.vocab_size, source=cfg.source, model=model)
    return ds
