"""Deterministic synthetic corpus addressed by global sample index.

Each sample is a walk of a fixed random Markov chain: every token has ``branching``
successors chosen with geometric probabilities (1/2, 1/4, ...), so the next-token entropy is
about 1.1 nats while the unigram entropy is near ln(vocab). A model that learns the chain
drives the loss far below the unigram entropy, which a test checks.

Sample ``i`` depends only on ``(seed, i)``: a run resumed at data position ``P`` (a global
sample index) reads exactly the samples an uninterrupted run would, whatever the DP size.
The global batch of step ``t`` is samples ``[P, P + global_batch)``; it is split into
micro-batches of ``micro_batch`` samples, and data rank ``r`` of ``dp`` takes the ``r``-th
contiguous run of them, so every micro-batch holds the same samples under every layout.

A corpus is anything with ``samples(start, count)`` (training samples by global index) and
``eval_samples(start, count)`` (held-out ones): :class:`SyntheticCorpus` here, or a
`runtime.tokens.TokenDataset` of real text (``data.source = "tokens:DIR"``), which
:func:`build_corpus` picks from the config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from relight.runtime.config import DataConfig

__all__ = ["BatchPlan", "Corpus", "DataLoader", "SyntheticCorpus", "build_corpus"]

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
class BatchPlan:
    """Which micro-batches of each step's global batch this data rank computes.

    The global batch is ``global_batch // micro_batch`` micro-batches in index order. With
    replica groups (``replicas > 1``, the groups of the current quorum) they are dealt out
    in runs of ``dp`` (one per data rank of a group): group ``replica_rank`` takes a
    contiguous share, as even as the count allows, and its data rank ``dp_rank`` the
    ``dp_rank``-th contiguous run of that share. One group (the default) is plain data
    parallelism: rank ``r`` of ``dp`` takes the ``r``-th run of ``global / micro / dp``.
    """

    global_batch: int
    micro_batch: int
    dp: int
    dp_rank: int
    replicas: int = 1
    replica_rank: int = 0

    def __post_init__(self) -> None:
        if self.units < self.replicas:
            raise ValueError(
                f"a global batch of {self.global_batch} samples is {self.units} runs of "
                f"{self.dp} micro-batches of {self.micro_batch}: too few for "
                f"{self.replicas} replica groups (each needs at least one)")

    @property
    def units(self) -> int:
        """Runs of ``dp`` micro-batches in the global batch: what groups are dealt."""
        return self.global_batch // self.micro_batch // self.dp

    @property
    def local_microbatches(self) -> int:
        """Micro-batches this data rank runs per step (gradient accumulation steps)."""
        base, extra = divmod(self.units, self.replicas)
        return base + (self.replica_rank < extra)

    @property
    def share(self) -> float:
        """This rank's group's fraction of the global batch: the weight of its gradients
        when the groups' gradients are summed."""
        return self.local_microbatches / self.units

    def microbatch_starts(self, position: int) -> list[int]:
        """First global sample index of each of this rank's micro-batches at ``position``."""
        base, extra = divmod(self.units, self.replicas)
        group_first = self.replica_rank * base + min(self.replica_rank, extra)
        n = self.local_microbatches
        first = group_first * self.dp + self.dp_rank * n
        return [position + (first + j) * self.micro_batch for j in range(n)]


class DataLoader:
    """Yields this rank's micro-batches; ``position`` is the next global sample index."""

    def __init__(self, corpus: Corpus, plan: BatchPlan, position: int = 0) -> None:
        self.corpus = corpus
        self.plan = plan
        self.position = position

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        for start in self.plan.microbatch_starts(self.position):
            s = self.corpus.samples(start, self.plan.micro_batch)
            out.append((s[:, :-1].contiguous(), s[:, 1:].contiguous()))
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
