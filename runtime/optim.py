"""AdamW, the warmup + cosine learning-rate schedule, and global gradient-norm clipping."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from relight.runtime.config import OptimConfig

__all__ = ["LRSchedule", "build_optimizer", "clip_grad_norm_", "grad_norm"]


def build_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    # foreach=False: the per-parameter path gives bitwise identical updates whatever the
    # mix of DTensor meshes a rank holds, and these models are small.
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
        weight_decay=cfg.weight_decay, foreach=False,
    )


@dataclass(frozen=True, slots=True)
class LRSchedule:
    """Linear warmup to ``lr`` then cosine to ``lr * min_lr_ratio`` at ``total_steps``.

    A pure function of the step index, so its checkpointed state is just its parameters.
    """

    lr: float
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float

    def __call__(self, step: int) -> float:
        """LR for the optimizer step with 0-based index ``step``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        low = self.lr * self.min_lr_ratio
        return low + (self.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def state_dict(self) -> dict[str, float | int | str]:
        return {"kind": "warmup_cosine", "lr": self.lr, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "min_lr_ratio": self.min_lr_ratio}


def clip_grad_norm_(
    params: list[torch.nn.Parameter], max_norm: float, pp_group: dist.ProcessGroup | None,
    *, total: float | None = None,
) -> float:
    """Clip gradients to a global L2 norm of ``max_norm`` (0: only measure); returns the norm.
    `total`: the norm already measured (`grad_norm`), e.g. agreed between replica groups of
    different layouts, whose own sums would round differently."""
    if total is None:
        total = grad_norm(params, pp_group)
    if max_norm > 0 and total > max_norm:
        coef = max_norm / (total + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def grad_norm(params: list[torch.nn.Parameter], pp_group: dist.ProcessGroup | None) -> float:
    """The global L2 norm of the gradients.

    Gradients may be DTensors on different meshes (dense params on dp x tp, experts on
    edp x ep), so norms are taken per mesh and combined; pipeline stages hold disjoint
    parameters, so their squared norms are summed over ``pp_group``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    # On the grads' device: the pipeline all-reduce below may run over NCCL.
    device = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=device)
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type=2.0, foreach=False)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        sq += norm.detach().double() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, group=pp_group)
    return float(sq.sqrt())
