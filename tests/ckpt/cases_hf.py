"""A user's own training script around a model the project did not write: Hugging Face
`LlamaForCausalLM` built from a tiny config (random init, no weights downloaded), AdamW,
`ckpt.CheckpointManager` as the README shows it, state dicts from
`torch.distributed.checkpoint.state_dict`. Runs inside the rank pool (see _pool.py);
each function runs on every rank and returns JSON-able results.

    save_fsdp2       FSDP2 on 4 ranks: 2 steps, save step 2
    restore_fsdp2    FSDP2 on ranks 0-1 (another world size)
    restore_plain    a plain module in one process (rank 0)
    restore_tp       TP x FSDP2 on a 2 x 2 mesh

Each returns, on rank 0, a digest of the full (unsharded) model and optimizer state, so
the test can compare them bitwise.
"""

from __future__ import annotations

import functools
import hashlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from relight import ckpt

TIMEOUT = timedelta(seconds=120)


def _llama(tie: bool, seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=32, tie_word_embeddings=tie,
                      attn_implementation="eager")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


@functools.cache
def _groups() -> dict[str, Any]:
    """Groups and meshes of every phase, made once, in the same order on every rank."""
    pair = dist.new_group([0, 1], timeout=TIMEOUT)
    solo = dist.new_group([0], timeout=TIMEOUT)
    return {"world": init_device_mesh("cpu", (4,)), "pair": pair, "solo": solo,
            "pair_mesh": DeviceMesh.from_group(pair, "cpu") if dist.get_rank() < 2 else None,
            "2d": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}


def _fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any] | None:
    """sha256 of every full tensor of the model and optimizer state (rank 0; collective
    over the model's mesh), plus the optimizer's hyperparameters."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                   cpu_offload=True))
    if dist.get_rank() != 0:
        return None

    def h(t: torch.Tensor) -> str:
        raw = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
        return hashlib.sha256(raw).hexdigest()

    out: dict[str, Any] = {f"model/{k}": h(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{fqn}/{k}"] = h(v)
    out["lr"] = [g["lr"] for g in osd["param_groups"]]
    return out


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)  # creates the optimizer's state if it has none
    return {"model": msd, "optim": osd, "meta": {"step": 0, "epoch": 0}}


def _restore(root: str, model: torch.nn.Module, opt: torch.optim.Optimizer,
             group: Any) -> dict[str, Any]:
    sd = _state(model, opt)
    mgr = ckpt.CheckpointManager(root, process_group=group)
    step = mgr.restore(sd)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return {"step": step, "meta": sd["meta"], "digest": _digest(model, opt)}


def save_fsdp2(root: str, tie: bool) -> dict[str, Any]:
    g = _groups()
    model = _fsdp(_llama(tie, seed=0), g["world"])
    opt = _optimizer(model)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # each rank its own batch
    losses = []
    for _ in range(2):
        ids = torch.randint(0, 96, (2, 16), generator=gen)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    sd = _state(model, opt)
    sd["meta"] = {"step": 2, "epoch": 1}
    mgr = ckpt.CheckpointManager(root, keep_last=2)
    mgr.save(2, sd, async_save=True)
    mgr.wait()
    return {"digest": _digest(model, opt), "losses": losses}


def restore_fsdp2(root: str, tie: bool) -> dict[str, Any]:
    g = _groups()
    if dist.get_rank() >= 2:
        return {}
    model = _fsdp(_llama(tie, seed=1), g["pair_mesh"])
    return _restore(root, model, _optimizer(model), g["pair"])


def restore_plain(root: str, tie: bool) -> dict[str, Any]:
    g = _groups()
    if dist.get_rank() != 0:
        return {}
    model = _llama(tie, seed=2)
    return _restore(root, model, _optimizer(model), g["solo"])


def restore_tp(root: str, tie: bool) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    g = _groups()
    mesh = g["2d"]
    model = _llama(tie, seed=3)
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}
    for layer in model.model.layers:
        parallelize_module(layer, mesh["tp"], plan)
    model = _fsdp(model, mesh["dp"])
    return _restore(root, model, _optimizer(model), None)
