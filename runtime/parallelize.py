"""Chains the ``apply_*`` functions of ``runtime.parallel`` for the configured layout.

Order matters: prune to the pipeline stage first, then TP and EP turn parameters into
DTensors on their meshes, then FSDP wraps what is left over the data-parallel mesh.
"""

from __future__ import annotations

import torch

from relight.runtime.config import Config, MixedPrecision
from relight.runtime.mesh import ParallelMesh
from relight.runtime.model import Transformer
from relight.runtime.parallel import apply_ep, apply_fsdp, apply_tp
from relight.runtime.parallel.pp import prune_to_stage

__all__ = ["parallelize", "uses_fsdp"]


def uses_fsdp(pmesh: ParallelMesh) -> bool:
    return pmesh.layout.dp > 1


def parallelize(model: Transformer, pmesh: ParallelMesh, cfg: Config) -> Transformer:
    """Apply the layout's parallelisms to ``model`` (the full, initialised model) in place."""
    layout = pmesh.layout
    if layout.pp > 1:
        prune_to_stage(model, pmesh.pp_rank, layout.pp)
    if layout.tp > 1:
        apply_tp(model, pmesh["tp"], sequence_parallel=cfg.parallel.sequence_parallel)
    if layout.ep > 1:
        apply_ep(model, pmesh["ep"])
    if cfg.train.activation_checkpointing:
        for block in model.layers.values():
            block.activation_checkpointing = True
    if uses_fsdp(pmesh):
        bf16 = cfg.train.mixed_precision == MixedPrecision.BF16
        apply_fsdp(model, pmesh, param_dtype=torch.bfloat16 if bf16 else None,
                   reshard_after_forward=layout.pp == 1)
    return model
