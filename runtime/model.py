"""A small decoder-only transformer (RMSNorm, rotary attention, SwiGLU MLP, optional MoE).

Module names are the state-dict keys, so they are chosen to stay the same under every layout:
blocks live in ``layers`` (a ModuleDict keyed by the *global* layer index, so a pipeline stage
that keeps layers 2 and 3 still names them ``layers.2``/``layers.3``), and experts are stacked
``[num_experts, ...]`` in one parameter per projection. Pipeline stages drop the parts they do
not own by setting them to None; ``forward`` skips what is missing.

Parallelism is applied from outside (``runtime.parallel``); the only hook here is that
:class:`GroupedExperts` exchanges tokens over ``ep_group`` when expert parallelism set one.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from relight.runtime.config import ModelConfig

__all__ = ["Attention", "Block", "GroupedExperts", "MLP", "MoE", "RMSNorm", "Transformer"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """[seq_len, head_dim/2, 2] (cos, sin) table for rotary embeddings."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack([ang.cos(), ang.sin()], dim=-1)


def apply_rotary(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    # x: [b, s, h, d]; rotate consecutive pairs.
    b, s, h, d = x.shape
    xr = x.float().reshape(b, s, h, d // 2, 2)
    cos = table[:s, None, :, 0]
    sin = table[:s, None, :, 1]
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
    return out.reshape(b, s, h, d).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = apply_rotary(self.wq(x).view(b, s, -1, self.head_dim), rope)
        k = apply_rotary(self.wk(x).view(b, s, -1, self.head_dim), rope)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on ``out`` whose backward also sends gradient 1 into ``aux``.

    This adds the (pre-scaled) load-balance loss to the objective without threading it
    through the return value, which a pipeline stage cannot do: the schedule only
    back-propagates the last stage's loss.
    """

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.aux_shape = aux.shape
        ctx.aux_dtype = aux.dtype
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """``num_experts`` SwiGLU experts stacked into ``[num_experts, ...]`` parameters.

    With ``ep_group`` set (by ``runtime.parallel.ep``) the parameters are DTensors sharded on
    dim 0 over the ep ranks and tokens travel to their expert's rank and back with
    ``all_to_all_single``; otherwise every expert runs locally.
    """

    def __init__(self, num_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.ep_group: torch.distributed.ProcessGroup | None = None

    def _run_local(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w3, w2 = _local(self.w1), _local(self.w3), _local(self.w2)
        outs, start = [], 0
        for e, c in enumerate(counts):
            seg = tokens[start : start + c]
            start += c
            outs.append((F.silu(seg @ w1[e]) * (seg @ w3[e])) @ w2[e])
        return torch.cat(outs) if outs else tokens[:0]

    def forward(self, x: torch.Tensor, expert_idx: torch.Tensor) -> torch.Tensor:
        """x: [n, dim] tokens sorted by ``expert_idx`` (ascending); returns expert outputs."""
        counts = torch.bincount(expert_idx, minlength=self.num_experts)
        if self.ep_group is None:
            return self._run_local(x, counts.tolist())
        return self._dispatch(x, counts)

    def _dispatch(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single, wait_tensor

        group = self.ep_group
        ep = dist.get_world_size(group)
        n_local = self.num_experts // ep
        # recv_counts[s, j]: tokens rank s sends to my local expert j.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(ep, n_local)
        send_splits = counts.view(ep, n_local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        # Functional collectives: differentiable, the backward is the reverse exchange.
        received = wait_tensor(all_to_all_single(x, recv_splits, send_splits, group))
        # Received tokens are grouped by source rank, then by expert: regroup by expert.
        local_expert = torch.arange(n_local, device=x.device).repeat(ep)
        local_expert = torch.repeat_interleave(local_expert, recv_counts.flatten())
        order = torch.argsort(local_expert, stable=True)
        out = self._run_local(received[order], recv_counts.sum(0).tolist())
        out = out[torch.argsort(order)]
        return wait_tensor(all_to_all_single(out, send_splits, recv_splits, group))


class MoE(nn.Module):
    """Top-k routed mixture of experts (dropless) with a Switch-style load-balance loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.mlp_hidden)
        self.aux_coef = cfg.aux_loss_coef
        # Multiplies the load-balance loss in backward; the training loop sets it to
        # 1/micro-batches so it is scaled like the language-model loss.
        self.aux_scale = 1.0
        self.last_aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        n = tokens.shape[0]
        probs = torch.softmax(self.router(tokens).float(), dim=-1)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        top_p = (top_p / top_p.sum(-1, keepdim=True)).type_as(x)
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        token_of = torch.arange(n, device=x.device).repeat_interleave(self.top_k)
        out_sorted = self.experts(tokens[token_of[order]], flat_e[order])
        out = out_sorted[torch.argsort(order)] * top_p.reshape(-1, 1)
        out = out.view(n, self.top_k, -1).sum(1).view(shape)
        frac = torch.bincount(flat_e, minlength=self.num_experts).float() / flat_e.numel()
        aux = self.num_experts * (frac * probs.mean(0)).sum()
        self.last_aux_loss = aux.detach()
        if self.training and self.aux_coef > 0:
            out = _AttachAuxLoss.apply(out, aux * (self.aux_coef * self.aux_scale))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.dim, cfg.mlp_hidden)
        )
        self.activation_checkpointing = False

    def _forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.activation_checkpointing and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, use_reentrant=False)
        return self._forward(x, rope)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer(
            "rope", rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for block in self.layers.values():
            h = block(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init keyed by parameter name and independent of the layout: each
        parameter's full value comes from a generator seeded by ``(seed, name)``, and a sharded
        parameter (DTensor, any placement) keeps its own shard of it. So a pipeline stage, a TP
        shard or an FSDP shard holds exactly what the single-process model would, and only one
        full parameter exists at a time (the model itself can be built on the meta device)."""
        out_std = self.cfg.init_std / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape)
            else:
                gen = torch.Generator().manual_seed(
                    (seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF_FFFF)
                std = out_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else (
                    self.cfg.init_std)
                full = torch.randn(p.shape, generator=gen) * std
            full = full.to(device=p.device, dtype=p.dtype)
            if isinstance(p, DTensor):
                # src_data_rank=None: every rank computed the same full value; keep the local
                # shard without communication.
                local = distribute_tensor(full, p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                p.to_local().copy_(local)
            else:
                p.copy_(full)

    def init_buffers(self) -> None:
        """(Re)compute non-persistent buffers, e.g. after ``to_empty`` from the meta device."""
        device = self.rope.device
        self.rope = rotary_tables(self.cfg.dim // self.cfg.n_heads, self.cfg.max_seq_len).to(
            device)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def set_aux_scale(self, scale: float) -> None:
        for m in self.moe_layers():
            m.aux_scale = scale


def build_model(cfg: ModelConfig, seed: int) -> Transformer:
    """The full model on CPU with its deterministic init (for tools and tests; the trainer
    builds on the meta device, parallelizes, then materialises only its shards)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    return model


def num_params(model: nn.Module, active_only_cfg: ModelConfig | None = None) -> int:
    """Parameter count of a full (unparallelized) model; with ``active_only_cfg`` the experts
    count only ``top_k`` of ``num_experts`` (parameters touched per token)."""
    total = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if active_only_cfg is not None and ".experts." in name:
            n = n * active_only_cfg.top_k // active_only_cfg.num_experts
        total += n
    return total
