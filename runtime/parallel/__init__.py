"""One module per parallelism; each applies itself to a model and a mesh."""

from relight.runtime.parallel.dp_fsdp import apply_fsdp
from relight.runtime.parallel.ep import apply_ep
from relight.runtime.parallel.pp import build_pipeline, stage_layers
from relight.runtime.parallel.tp import apply_tp

__all__ = ["apply_ep", "apply_fsdp", "apply_tp", "build_pipeline", "stage_layers"]
