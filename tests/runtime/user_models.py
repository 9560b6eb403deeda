"""Models the runtime did not write, for ``--model.factory=tests.runtime.user_models:NAME``."""

from __future__ import annotations

import torch
from torch import nn

from relight.runtime.config import ModelConfig


def hf_llama(cfg: ModelConfig) -> nn.Module:
    """A Hugging Face Llama causal LM from a config: random init, no weights downloaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.mlp_hidden,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_heads, max_position_embeddings=cfg.max_seq_len,
        tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = nn.Linear(dim, dim)  # a causal mean over the past, then a projection
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        steps = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        past = h.cumsum(1) / steps[None, :, None]
        return x + self.mix(past) + self.mlp(h)


class CausalMixer(nn.Module):
    """A plain ``nn.Module`` language model returning logits (no framework conventions)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(_Block(cfg.dim, cfg.mlp_hidden) for _ in range(2))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def mixer(cfg: ModelConfig) -> nn.Module:
    return CausalMixer(cfg)


def not_a_module(cfg: ModelConfig) -> object:
    return object()


class TPCausalMixer(CausalMixer):
    """The mixer with a tensor-parallel plan: each block's MLP column- then row-parallel."""

    def relight_tp_plan(self) -> dict:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan: dict = {}
        for i in range(len(self.blocks)):
            plan[f"blocks.{i}.mlp.0"] = ColwiseParallel()
            plan[f"blocks.{i}.mlp.2"] = RowwiseParallel()
        return plan


def mixer_tp(cfg: ModelConfig) -> nn.Module:
    return TPCausalMixer(cfg)
