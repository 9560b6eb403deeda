"""A user's optimizer that trains in replica groups healing in place, in the two calls a
training loop already makes: `zero_grad()` starts the step (agrees on the quorum; a heal
may land here), `step()` sums the gradients across the groups and applies them only when
the step committed.

    replicas = relight.ReplicaManager(settings, state=lambda: state)
    optimizer = relight.ReplicaOptimizer(replicas, torch.optim.AdamW(model.parameters()))
    state = {"model": model, "optim": optimizer}       # what a joining group receives
    while optimizer.steps < total_steps:
        optimizer.zero_grad()                           # the step's quorum
        x, y = batch(optimizer.steps, optimizer.rank, optimizer.size)
        loss_fn(model(x), y).backward()
        optimizer.step()                                # applied only if committed

The wrapper counts committed steps (`steps`) and carries the count in its state dict, so a
healed group resumes at the live groups' step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from relight.elastic.quorum import Quorum
from relight.elastic.replica import ReplicaManager

__all__ = ["ReplicaOptimizer"]


class ReplicaOptimizer(torch.optim.Optimizer):
    """`optimizer` (any `torch.optim.Optimizer`) driven by a `ReplicaManager`.

    It is an `Optimizer` (LR schedulers take it), delegating `param_groups` and `state` to
    the optimizer it wraps, which stays reachable as `.optimizer`. `weight`: this group's
    weight in the cross-group sum (default: the mean over the quorum's groups); a
    callable is asked at every step with the quorum."""

    def __init__(self, manager: ReplicaManager, optimizer: torch.optim.Optimizer, *,
                 weight: float | Callable[[Quorum], float] | None = None) -> None:
        # No super().__init__: the wrapped optimizer owns the parameter groups and state.
        self.manager = manager
        self.optimizer = optimizer
        self.weight = weight
        self.steps = 0
        """Committed steps: the number of the next step to train."""
        self.quorum: Quorum | None = None
        self.committed: bool | None = None
        """Whether the last `step()` was applied (None before the first)."""

    # -- what torch.optim.Optimizer users and schedulers read --------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __repr__(self) -> str:
        return f"ReplicaOptimizer({self.optimizer!r}, group={self.manager.group!r})"

    # -- the step -----------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This group's index in the step's quorum (its share of the global batch)."""
        if self.quorum is None:
            raise RuntimeError("ReplicaOptimizer: call zero_grad() to start the step first")
        return self.quorum.rank(self.manager.group)

    @property
    def size(self) -> int:
        """The number of groups that train the step."""
        if self.quorum is None:
            raise RuntimeError("ReplicaOptimizer: call zero_grad() to start the step first")
        return self.quorum.size

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients and start the step: its quorum (`rank`, `size`). A group
        that heals receives the live state here, `steps` included."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        self.quorum = self.manager.start_step()

    def step(self, closure: Callable[[], float] | None = None) -> bool:  # type: ignore[override]
        """Sum the gradients across the groups and apply them if the step committed.
        Returns whether it did; when it did not, nothing changed here and the same step
        (the same `steps`) is trained again after the next `zero_grad()`."""
        if closure is not None:
            raise ValueError("ReplicaOptimizer.step: closures are not supported (the step "
                             "is reduced across groups once)")
        if self.quorum is None:
            raise RuntimeError("ReplicaOptimizer.step before zero_grad()")
        grads = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.grad is None:  # every group must pass the same tensors
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        weight = self.weight(self.quorum) if callable(self.weight) else self.weight
        self.manager.allreduce(grads, weight=weight)
        self.committed = self.manager.should_commit(self.steps)
        if self.committed:
            self.optimizer.step()
            self.steps += 1
        return self.committed

    # -- what a heal and a checkpoint carry --------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.steps = int(state_dict["steps"])
