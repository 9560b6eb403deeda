"""Tensor parallelism with ``parallelize_module``.

Attention and dense MLP are column-parallel in (wq/wk/wv, w1/w3) and row-parallel out (wo,
w2), so each block needs one all-reduce (or, with sequence parallelism, one all-gather and one
reduce-scatter) per sub-layer. The embedding is row-parallel over the vocabulary and the output
projection column-parallel with a replicated result, so the loss is computed on full logits.

MoE feed-forward layers are left unsharded: under TP their (replicated) inputs are identical on
every tp rank, so each rank computes the same result; experts are sharded by EP instead.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from relight.runtime.model import MLP, Transformer

__all__ = ["apply_tp"]


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    """Shard ``model`` (possibly one pipeline stage of it) over ``tp_mesh`` in place."""
    sp = sequence_parallel
    act = Shard(1) if sp else Replicate()
    top: dict[str, ParallelStyle] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=act)
    if model.norm is not None and sp:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(
            input_layouts=act, output_layouts=Replicate(), use_local_output=True
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        plan: dict[str, ParallelStyle] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=act),
        }
        dense = isinstance(block.feed_forward, MLP)
        if dense:
            plan["feed_forward.w1"] = ColwiseParallel()
            plan["feed_forward.w3"] = ColwiseParallel()
            plan["feed_forward.w2"] = RowwiseParallel(output_layouts=act)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        parallelize_module(block, tp_mesh, plan)
