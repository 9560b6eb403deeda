"""Loss on held-out samples, computed by every rank on its share and summed over the world.

The first ``n`` held-out samples of the corpus (`runtime.data.Corpus.eval_samples`) are cut
into ``ceil(n / dp)`` samples per data rank and run in micro-batches without gradients
(where ``n`` does not divide evenly, the last ranks read samples past ``n`` too, so every
rank runs the same number of forwards, and those carry weight 0). Every rank of a data
shard runs the forward (TP and FSDP collectives need them all); only the ranks that report
the loss contribute to the sum. The result is the mean token loss over the ``n`` samples,
the same under every layout up to floating-point order.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from relight.runtime.data import Corpus

__all__ = ["eval_loss"]


@torch.no_grad()
def eval_loss(model: nn.Module, corpus: Corpus, *, n: int, micro_batch: int, dp: int,
              dp_rank: int, reports: bool, device: torch.device,
              forward: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
    """Mean next-token loss over held-out samples ``0 .. n-1`` (collective: every rank)."""
    share = math.ceil(n / dp)
    first = dp_rank * share
    total = torch.zeros(2, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        for start in range(first, first + share, micro_batch):
            count = min(micro_batch, first + share - start)
            batch = corpus.eval_samples(start, count)
            valid = max(0, min(count, n - start))
            x, y = batch[:, :-1].to(device), batch[:, 1:].to(device)
            logits = (forward or model)(x)
            if reports and valid:
                per_sample = F.cross_entropy(logits.float().transpose(1, 2), y,
                                             reduction="none").mean(1)
                total[0] += per_sample[:valid].double().sum()
                total[1] += valid
    finally:
        model.train(was_training)
    dist.all_reduce(total)
    return float(total[0] / total[1])
