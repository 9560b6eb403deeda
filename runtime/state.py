"""The one place that names state-dict keys.

The checkpointed state is a nested dict whose names never mention a rank or a layout (the
checkpoint engine names each leaf by its path, joined with ``/``):

``model/<fqn>``
    A parameter, by its global module name (``model/layers.3.attention.wq.weight``): blocks
    keep their global index under pipeline parallelism, experts are stacked
    ``[num_experts, ...]`` (``model/layers.1.feed_forward.experts.w1``). Values are DTensors
    (global shape, any placement) or plain tensors; a pipeline stage holds only its own keys.
``optim/<fqn>/exp_avg``, ``optim/<fqn>/exp_avg_sq``, ``optim/<fqn>/step``
    AdamW state per parameter (moments in the parameter's layout, ``step`` a scalar tensor),
    obtained and applied through ``torch.distributed.checkpoint.state_dict``.
``train``
    One JSON value: ``step`` (completed optimizer steps), ``data_position`` (global index of
    the next training sample), ``lr_schedule`` (the schedule's parameters; the LR itself is a
    function of the step), ``rng`` (how randomness is derived: every step reseeds torch from
    ``(seed, step)``, so the RNG state is a function of the step and restores exactly) and
    ``layout`` (the layout that wrote it; informational).

The resolved run config travels with each checkpoint through the checkpoint manager's
``config`` (see ``runtime.train``). Python values are JSON; nothing here pickles.
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

from relight.errors import RelightError

__all__ = ["MODEL", "OPTIM", "TRAIN", "StateError", "TrainState", "apply_state_dict",
           "build_state_dict", "flat_names"]

MODEL = "model"
OPTIM = "optim"
TRAIN = "train"

_OPTS = StateDictOptions(full_state_dict=False, cpu_offload=False)


class StateError(RelightError, RuntimeError):
    """A state dict does not match the model or optimizer; the message names the key."""


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
    layout: str,
) -> dict[str, Any]:
    """The checkpointable state. Tensors are the live parameters / optimizer tensors (no copies),
    so a checkpoint engine loading in place writes straight into them.

    Pass ``optimizer=None`` to leave the optimizer out. Building the optimizer part of a fresh
    optimizer initialises its state with one zero-gradient step (that is how
    ``get_optimizer_state_dict`` works), so only do that when a restore will overwrite it.
    """
    sd: dict[str, Any] = {MODEL: dict(get_model_state_dict(model, options=_OPTS))}
    if optimizer is not None:
        osd = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        sd[OPTIM] = {fqn: dict(per_param) for fqn, per_param in osd["state"].items()}
    sd[TRAIN] = {
        "step": train.step,
        "data_position": train.data_position,
        "lr_schedule": lr_schedule,
        "rng": rng,
        "layout": layout,
    }
    return sd


def apply_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, sd: dict[str, Any]
) -> TrainState:
    """Push a loaded state dict into the model and optimizer; returns the training state."""
    set_model_state_dict(model, sd[MODEL], options=StateDictOptions(strict=True))
    if optimizer is not None:
        current = get_optimizer_state_dict(model, optimizer, options=_OPTS)
        loaded = sd.get(OPTIM, {})
        state: dict[str, dict[str, Any]] = {}
        for fqn, per_param in current["state"].items():
            state[fqn] = {}
            for name in per_param:
                if name not in loaded.get(fqn, {}):
                    raise StateError(f"state dict has no {OPTIM}/{fqn}/{name} for the optimizer")
                state[fqn][name] = loaded[fqn][name]
        set_optimizer_state_dict(
            model, optimizer, {"state": state, "param_groups": current["param_groups"]},
            options=_OPTS,
        )
    train = sd.get(TRAIN)
    for key in ("step", "data_position"):
        if not isinstance(train, dict) or not isinstance(train.get(key), int):
            raise StateError(f"state dict {TRAIN}/{key} must be an int, got {train!r}")
    return TrainState(step=train["step"], data_position=train["data_position"])


def flat_names(sd: dict[str, Any]) -> dict[str, Any]:
    """``{path: leaf}`` with ``/``-joined paths, the names a checkpoint sees (for tests/tools).
    ``train`` is one JSON leaf."""
    out: dict[str, Any] = {}
    for fqn, t in sd.get(MODEL, {}).items():
        out[f"{MODEL}/{fqn}"] = t
    for fqn, per_param in sd.get(OPTIM, {}).items():
        for name, t in per_param.items():
            out[f"{OPTIM}/{fqn}/{name}"] = t
    if TRAIN in sd:
        out[TRAIN] = sd[TRAIN]
    return out
