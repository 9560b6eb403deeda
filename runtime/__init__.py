"""runtime: the parallel training runtime (model, DP/FSDP/TP/PP/EP on one DeviceMesh,
layout-independent state, deterministic data, the training loop).

    from runtime import load_config, run_training
    result = run_training(load_config("configs/tiny.toml", ["--train.steps=20"]))

Entry points: ``python -m runtime.train --config ...`` and ``runtime.train.main(argv)``.
Names are imported lazily so ``import runtime.config`` does not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Config",
    "ConfigError",
    "LayoutError",
    "TrainResult",
    "Trainer",
    "load_config",
    "main",
    "plan_layout",
    "run_training",
]

_WHERE = {
    "Config": "runtime.config",
    "ConfigError": "runtime.config",
    "load_config": "runtime.config",
    "LayoutError": "runtime.mesh",
    "plan_layout": "runtime.mesh",
    "TrainResult": "runtime.train",
    "Trainer": "runtime.train",
    "main": "runtime.train",
    "run_training": "runtime.train",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
