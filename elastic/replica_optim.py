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

With DDP (the group's own data parallelism, or a world of one), `register_ddp(model)`
moves the cross-group sum into the backward pass: each gradient bucket, once DDP has
averaged it over the group's ranks, is summed across the groups on a thread of its own
while autograd computes the next buckets, and `step()` only decides and applies. FSDP
and tensor-parallel gradients (DTensors) are reduced shard by shard in `step()`, each
rank with the same rank of every other group.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

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
        self._bucket_reducer: ThreadPoolExecutor | None = None
        """`register_ddp`: the one thread that reduces DDP's buckets, in DDP's order."""
        self._reduced_in_backward = False
        """This step's gradients were summed across the groups by the DDP hook."""

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
        self._reduced_in_backward = False
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
        if not self._reduced_in_backward:
            self._sum_grads()
        self.committed = self.manager.should_commit(self.steps)
        if self.committed:
            self.optimizer.step()
            self.steps += 1
        return self.committed

    @property
    def reduced_in_backward(self) -> bool:
        """Whether this step's gradients were summed across the groups during backward
        (`register_ddp`), not by `step()`."""
        return self._reduced_in_backward

    def _weight(self) -> float | None:
        assert self.quorum is not None
        return self.weight(self.quorum) if callable(self.weight) else self.weight

    def _sum_grads(self) -> None:
        grads = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p.grad is None:  # every group must pass the same tensors
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        self.manager.allreduce(grads, weight=self._weight())

    # -- DDP -------------------------------------------------------------------------

    def register_ddp(self, model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Sum `model`'s gradients across the groups during its backward pass (see the
        module's doc). `model` wraps the parameters this optimizer steps; its process
        group is this replica group's own ranks (DDP averages over them first). In a
        quorum whose groups' layouts differ, the hook leaves the cross-group sum to
        `step()`, which pairs the tensors by name."""
        if self._bucket_reducer is not None:
            raise RuntimeError("ReplicaOptimizer.register_ddp: already registered")
        self._bucket_reducer = ThreadPoolExecutor(max_workers=1,
                                                  thread_name_prefix="replica-buckets")
        model.register_comm_hook(model.process_group, self._ddp_bucket_hook)

    # Unannotated on purpose: DDP checks the annotations against the classes, and this
    # module's are strings (`from __future__ import annotations`).
    def _ddp_bucket_hook(self, group, bucket):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
        """DDP's comm hook (`bucket`: a `dist.GradBucket`; returns the future of its
        reduced buffer): the bucket, averaged over `group` (the replica group's ranks)
        and summed across the groups, on the reducer thread. One thread, so that every
        rank of every group issues its collectives in DDP's bucket order; DDP waits for
        every bucket's future before `backward()` returns. A failed cross-group sum is
        remembered by the manager, not raised, and `step()` then applies nothing; a
        failed sum within the group (one of its own ranks gone) is raised by backward."""
        if self.quorum is None:
            raise RuntimeError("ReplicaOptimizer: call zero_grad() before backward() "
                               "(the step's quorum decides what the gradients are summed with)")
        assert self._bucket_reducer is not None
        buf = bucket.buffer()
        across = not self.manager.layouts_differ
        if across:
            self._reduced_in_backward = True
        weight = self._weight()
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()

        def reduce() -> None:
            try:
                ranks = 1 if group is None else group.size()
                if ranks > 1:
                    buf.div_(ranks)
                    dist.all_reduce(buf, group=group)
                if across:
                    self.manager.allreduce([buf], weight=weight)
                done.set_result(buf)
            except BaseException as e:  # noqa: BLE001 - raised by DDP in backward()
                done.set_exception(e)

        self._bucket_reducer.submit(reduce)
        return done

    # -- what a heal and a checkpoint carry --------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.steps = int(state_dict["steps"])
