"""Expert parallelism: experts sharded over the ``ep`` dim, tokens moved by all-to-all.

torch.distributed has no MoE token dispatch, so that part is written by hand in
:class:`runtime.model.GroupedExperts`; this module only shards the stacked expert weights
``[num_experts, ...]`` as DTensors ``Shard(0)`` over ``ep`` (a checkpoint sees all experts at
their global index) and hands the experts the ep process group.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from relight.runtime.model import Transformer

__all__ = ["apply_ep"]


def apply_ep(model: Transformer, ep_mesh: DeviceMesh) -> None:
    """Shard every MoE layer's experts over ``ep_mesh`` in place."""
    for moe in model.moe_layers():
        experts = moe.experts
        for name, param in list(experts.named_parameters(recurse=False)):
            # Every rank built the same full tensor, so each keeps its own chunk: no traffic.
            dt = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            experts.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))
        experts.ep_group = ep_mesh.get_group()
