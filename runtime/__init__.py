"""runtime: the parallel training runtime (model, DP/FSDP/TP/PP/EP on one DeviceMesh,
layout-independent state, deterministic data, the training loop).

    from relight.runtime import load_config, run_training
    result = run_training(load_config("configs/tiny.toml", ["--train.steps=20"]))

Entry points: ``python -m relight.runtime.train --config ...`` and ``runtime.train.main(argv)``.
Names are imported lazily so ``import relight.runtime.config`` does not pay for torch.
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
    "Config": "relight.runtime.config",
    "ConfigError": "relight.runtime.config",
    "load_config": "relight.runtime.config",
    "LayoutError": "relight.runtime.mesh",
    "plan_layout": "relight.runtime.mesh",
    "TrainResult": "relight.runtime.train",
    "Trainer": "relight.runtime.train",
    "main": "relight.runtime.train",
    "run_training": "relight.runtime.train",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
