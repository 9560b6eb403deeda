"""Pipeline parallelism with ``torch.distributed.pipelining``.

Each pp rank keeps a contiguous run of blocks (the first stage also the embedding, the last
the final norm and output projection) of the full model, which keeps global module names, so
the state dict is the same as without pipelining. The schedule (GPipe or 1F1B) runs all of a
rank's micro-batches in one ``step``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from relight.runtime.config import PipelineSchedule
from relight.runtime.model import Transformer

__all__ = ["build_pipeline", "prune_to_stage", "stage_layers"]

_SCHEDULES = {PipelineSchedule.GPIPE: ScheduleGPipe, PipelineSchedule.ONE_F_ONE_B: Schedule1F1B}


def stage_layers(n_layers: int, pp: int) -> list[range]:
    """Contiguous, balanced layer ranges per stage (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    out, start = [], 0
    for s in range(pp):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def prune_to_stage(model: Transformer, stage: int, pp: int) -> None:
    """Drop, in place, every part of ``model`` that pipeline stage ``stage`` does not own."""
    keep = stage_layers(len(model.layers), pp)[stage]
    for name in list(model.layers.keys()):
        if int(name) not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
    if stage != pp - 1:
        model.norm = None
        model.output = None


def build_pipeline(
    stage_module: Transformer,
    pp_mesh: DeviceMesh,
    *,
    device: torch.device,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    schedule: PipelineSchedule,
) -> ScheduleGPipe | Schedule1F1B:
    """The schedule for this rank's stage. ``loss_fn`` already divides by ``n_microbatches``,
    so the schedule does not rescale gradients."""
    stage = PipelineStage(
        stage_module,
        stage_index=pp_mesh.get_local_rank(),
        num_stages=pp_mesh.size(),
        device=device,
        group=pp_mesh.get_group(),
    )
    return _SCHEDULES[schedule](stage, n_microbatches, loss_fn=loss_fn, scale_grads=False)
