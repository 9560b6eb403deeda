"""The one place that names state-dict keys.

The checkpointed state is a flat dict whose keys never mention a rank or a layout:

``model/<fqn>``
    A parameter, by its global module name (``model/layers.3.attention.wq.weight``): blocks
    keep their global index under pipeline parallelism, experts are stacked
    ``[num_experts, ...]`` (``model/layers.1.feed_forward.experts.w1``). Values are DTensors
    (global shape, any placement) or plain tensors; a pipeline stage holds only its own keys.
``optim/<fqn>/<name>``
    AdamW state per parameter: ``exp_avg``, ``exp_avg_sq`` (same layout as the parameter) and
    ``step`` (a scalar tensor), through ``torch.distributed.checkpoint.state_dict``.
``train/step``
    Completed optimizer steps (int).
``train/data_position``
    Global index of the next training sample (int).
``train/lr_schedule``
    The schedule's parameters (JSON; the LR itself is a function of the step).
``train/rng``
    How randomness is derived (JSON): every step reseeds torch from ``(seed, step)``, so the
    RNG state is a function of the step and restores exactly.
``train/config``
    The resolved run config (JSON), saved with each checkpoint for the record.
``train/layout``
    The layout that wrote the checkpoint (JSON, informational; loading ignores it).

Python values are JSON-able; nothing here pickles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = [
    "MODEL",
    "OPTIM",
    "StateError",
    "TrainState",
    "apply_state_dict",
    "build_state_dict",
    "model_key",
    "optim_key",
]

MODEL = "model/"
OPTIM = "optim/"
STEP = "train/step"
DATA_POSITION = "train/data_position"
LR_SCHEDULE = "train/lr_schedule"
RNG = "train/rng"
CONFIG = "train/config"
LAYOUT = "train/layout"

_OPTS = StateDictOptions(full_state_dict=False, cpu_offload=False)


class StateError(RuntimeError):
    """A state dict does not match the model or optimizer; the message names the key."""


def model_key(fqn: str) -> str:
    return MODEL + fqn


def optim_key(fqn: str, name: str) -> str:
    return f"{OPTIM}{fqn}/{name}"


@dataclass(slots=True)
class TrainState:
    step: int = 0
    data_position: int = 0


def build_state_dict(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    train: TrainState,
    *,
    lr_schedule: dict[str, Any],
    rng: dict[str, Any],
    config: dict[str, Any],
    layout: str,
) -> dict[str, Any]:
    """The checkpointable state. Tensors are the live parameters / optimizer tensors (no copies),
    so a checkpoint engine loading in place writes straight into them.

    Pass ``optimizer=None`` to leave the optimizer out. Building the optimizer part of a fresh
    optimizer initialises its state with one zero-gradient step (that is how
    ``get_optimizer_state_dict`` works), so only do that when a restore will overwrite it.
    """
    sd: dict[str, Any] = {model_key(k): v for k, v in
                          get_model_state_dict(model, options=_OPTS).items()}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        for fqn, per_param in osd["state"].items():
            for name, value in per_param.items():
                sd[optim_key(fqn, name)] = value
    sd[STEP] = train.step
    sd[DATA_POSITION] = train.data_position
    sd[LR_SCHEDULE] = lr_schedule
    sd[RNG] = rng
    sd[CONFIG] = config
    sd[LAYOUT] = layout
    return sd


def apply_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, sd: dict[str, Any]
) -> TrainState:
    """Push a loaded state dict into the model and optimizer; returns the training state."""
    msd = {k[len(MODEL):]: v for k, v in sd.items() if k.startswith(MODEL)}
    set_model_state_dict(model, msd, options=StateDictOptions(strict=True))
    if optimizer is not None:
        current = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        state: dict[str, dict[str, Any]] = {}
        for fqn, per_param in current["state"].items():
            state[fqn] = {}
            for name in per_param:
                key = optim_key(fqn, name)
                if key not in sd:
                    raise StateError(f"state dict has no {key!r} for the optimizer")
                state[fqn][name] = sd[key]
        set_optimizer_state_dict(
            model, optimizer, {"state": state, "param_groups": current["param_groups"]},
            options=_OPTS,
        )
    for key in (STEP, DATA_POSITION):
        if not isinstance(sd.get(key), int):
            raise StateError(f"state dict key {key!r} must be an int, got {sd.get(key)!r}")
    return TrainState(step=sd[STEP], data_position=sd[DATA_POSITION])
