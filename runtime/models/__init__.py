"""The model registry: models by name, each with its parallelize function, and a user's own
``torch.nn.Module`` from a factory (torchtitan's train specs play this part there).

``create_model(cfg, pmesh, device)`` is what the trainer calls: it builds the model named by
``model.name`` (or ``model.factory``), applies the layout's parallelisms and initialises the
weights, deterministically and the same under every layout.

Registered names:

``llama``
    `runtime.model.Transformer`, dense (RMSNorm, rotary attention, SwiGLU): built on the meta
    device, parallelized by `runtime.parallelize` (DP/FSDP/HSDP, TP, PP, EP), then
    materialised shard by shard, so no rank ever holds the full model.
``moe``
    The same transformer with routed experts (``model.num_experts`` > 0 required).

Register another with :func:`register_model`. A factory model is covered in
`runtime.models.factory`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from relight.runtime.config import Config, ConfigError
from relight.runtime.mesh import ParallelMesh

__all__ = ["ModelSpec", "create_model", "get_model_spec", "model_names", "model_vocab_size",
           "register_model"]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """How to build, parallelize and initialise one kind of model.

    ``build(cfg)`` runs under ``torch.device("meta")``; ``parallelize(model, pmesh, cfg)``
    shards it in place; the model is then materialised with ``to_empty`` and must provide
    ``init_buffers()`` and ``init_weights(seed)`` (each parameter's full value a function of
    the seed and its name, the local shard kept) and ``set_aux_scale(scale)``."""

    name: str
    build: Callable[[Config], nn.Module]
    parallelize: Callable[[nn.Module, ParallelMesh, Config], nn.Module]
    doc: str = ""


_REGISTRY: dict[str, ModelSpec] = {}


def register_model(spec: ModelSpec) -> None:
    """Make ``spec`` available as ``--model.name=<spec.name>``."""
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"model {spec.name!r} is already registered")
    _REGISTRY[spec.name] = spec


def model_names() -> list[str]:
    return sorted(_REGISTRY)


def get_model_spec(name: str) -> ModelSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConfigError(f"model.name={name!r} is not a registered model; known: "
                          f"{model_names()} (or set model.factory=package.module:function "
                          "for your own)") from None


def _build_transformer(cfg: Config) -> nn.Module:
    from relight.runtime.model import Transformer

    return Transformer(cfg.model)


def _build_moe(cfg: Config) -> nn.Module:
    if cfg.model.num_experts < 1:
        raise ConfigError("model.name='moe' needs model.num_experts >= 1 (e.g. "
                          "--model.num_experts=4)")
    return _build_transformer(cfg)


def _parallelize_transformer(model: nn.Module, pmesh: ParallelMesh, cfg: Config) -> nn.Module:
    from relight.runtime.parallelize import parallelize

    return parallelize(model, pmesh, cfg)


register_model(ModelSpec("llama", _build_transformer, _parallelize_transformer,
                         "the runtime's dense decoder-only transformer"))
register_model(ModelSpec("moe", _build_moe, _parallelize_transformer,
                         "the runtime's transformer with routed experts (EP-capable)"))


def create_model(cfg: Config, pmesh: ParallelMesh, device: torch.device) -> nn.Module:
    """The model of ``cfg``, parallelized over ``pmesh`` and initialised on ``device``."""
    if cfg.model.factory:
        from relight.runtime.models.factory import create_factory_model

        return create_factory_model(cfg, pmesh, device)
    spec = get_model_spec(cfg.model.name)
    with torch.device("meta"):
        model = spec.build(cfg)
    spec.parallelize(model, pmesh, cfg)
    model.to_empty(device=device)
    model.init_buffers()
    model.init_weights(cfg.train.seed)
    return model


def model_vocab_size(model: nn.Module, cfg: Config) -> int:
    """Token ids the model can embed: a factory model's own, else ``model.vocab_size``."""
    own = getattr(model, "vocab_size", None)
    return cfg.model.vocab_size if own is None else int(own)
