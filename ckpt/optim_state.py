"""Optimizer state that `torch.optim` creates lazily, created before a load.

A `torch.optim` optimizer has no per-parameter state until its first `step()`: a fresh
AdamW's `state_dict()` holds `{"state": {}, ...}` where a trained one holds `exp_avg`,
`exp_avg_sq` and `step` for every parameter. A load (a checkpoint restore or a live heal
into a new process) fills the target's tensors in place, so the target must already have
them. `materialize_optimizer_states` gives every such optimizer in a state dict its state
by one step with zero gradients and a learning rate of zero (what
`torch.distributed.checkpoint.state_dict` does for its own loads): parameters are left
bitwise unchanged (AdamW's decoupled decay multiplies them by `1 - lr * wd` = 1), and the
load then overwrites every value the step created.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["materialize_optimizer_states"]


def _optimizers(value: Any, found: list[torch.optim.Optimizer]) -> None:
    if isinstance(value, torch.optim.Optimizer):
        # A wrapper that is an Optimizer and holds the real one as `.optimizer` (as
        # `relight.ReplicaOptimizer` does): the real one's step creates the state.
        inner = getattr(value, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            value = inner
        if all(o is not value for o in found):
            found.append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _optimizers(v, found)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _optimizers(v, found)


def materialize_optimizer_states(state_dict: Mapping[str, Any]) -> int:
    """Create the lazy state of every `torch.optim.Optimizer` in `state_dict` (nested
    anywhere) that has none yet. Returns how many were initialised. Optimizers that
    already hold state, and parameters that already hold a gradient, are left alone
    (a stateless optimizer such as plain SGD never gains state: nothing to create)."""
    found: list[torch.optim.Optimizer] = []
    _optimizers(state_dict, found)
    done = 0
    for optim in found:
        params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
        if optim.state or not params or any(p.grad is not None for p in params):
            continue
        lrs = [g.get("lr") for g in optim.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        try:
            optim.step()
        finally:
            for g, lr in zip(optim.param_groups, lrs, strict=True):
                if lr is not None:
                    g["lr"] = lr
            optim.zero_grad(set_to_none=True)
        done += 1
    return done
