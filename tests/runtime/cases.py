"""Functions the rank pool runs on every rank (see ``pool.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def train(config: str = "configs/tiny.toml", overrides: list[str] | None = None) -> dict[str, Any]:
    from runtime.config import load_config
    from runtime.train import run_training

    cfg = load_config(ROOT / config, overrides or [])
    res = run_training(cfg)
    return {"losses": res.losses, "layout": res.layout, "final_step": res.final_step,
            "restored_step": res.restored_step}


def grads(config: str = "configs/tiny.toml", overrides: list[str] | None = None) -> dict[str, Any]:
    """Full (global) gradients after one forward/backward of step 0, for the keys this rank has."""
    from torch.distributed.tensor import DTensor

    from runtime.config import load_config
    from runtime.train import Trainer

    trainer = Trainer(load_config(ROOT / config, overrides or []))
    trainer._forward_backward(trainer.data.next_step())
    out = {}
    for name, p in trainer.model.named_parameters():
        g = p.grad
        out[name] = (g.full_tensor() if isinstance(g, DTensor) else g).clone()
    return out
