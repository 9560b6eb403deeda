"""Data parallelism with FSDP2: ``fully_shard`` over the ``(dp_replicate, dp_shard)`` mesh.

One call covers the three modes: a 2-D mesh ``(R, 1)`` is plain replicated DP (gradient
all-reduce), ``(1, S)`` is FSDP, ``(R, S)`` is HSDP. Each block is its own FSDP unit (its
parameters are gathered just before it runs and freed after), the root unit holds the
embedding, final norm and output projection.

Experts under EP are held by only ``dp / ep`` data ranks (``edp``), so they get their own FSDP
unit on that mesh, sharded on dim 1 (dim 0 is already split over ``ep``). Their gradient is a
sum over the tokens of all ``ep`` ranks, so it is divided by the full ``dp`` rather than by the
``edp`` size FSDP would use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from relight.runtime.mesh import ParallelMesh
from relight.runtime.model import Transformer

__all__ = ["apply_fsdp"]


def _expert_placement(param: torch.nn.Parameter) -> Shard:
    return Shard(1) if isinstance(param, DTensor) else Shard(0)


def apply_fsdp(
    model: Transformer,
    pmesh: ParallelMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> None:
    """Wrap ``model`` (a whole model or one pipeline stage) with FSDP2 in place."""
    layout = pmesh.layout
    dp_mesh = pmesh["dp_replicate", "dp_shard"]
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for block in model.layers.values():
        moe = getattr(block.feed_forward, "experts", None)
        if moe is not None and layout.ep > 1:
            fully_shard(
                moe,
                mesh=pmesh["edp_replicate", "edp_shard"],
                mp_policy=mp,
                reshard_after_forward=reshard_after_forward,
                shard_placement_fn=_expert_placement,
            )
            moe.set_gradient_divide_factor(float(layout.dp))
            if dist.get_backend() == "gloo" and layout.dp_shard // layout.shard_ep > 1:
                # A custom divide factor reduce-scatters with PREMUL_SUM, which gloo lacks, so
                # force SUM + post-divide. Only when there is a reduce-scatter: with a size-1
                # shard group FSDP already divides while copying, and forcing SUM would divide
                # a second time (torch 2.13, _fsdp_collectives.foreach_reduce).
                moe.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp_mesh, mp_policy=mp,
                    reshard_after_forward=reshard_after_forward)
    # The root unit is gathered for the whole step anyway (its params run first and last).
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
