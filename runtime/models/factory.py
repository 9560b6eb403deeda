"""A user's own model, ``model.factory = "package.module:function"``, under the runtime.

The function gets the run's `runtime.config.ModelConfig` (its sizes are there to use or to
ignore) and returns a ``torch.nn.Module`` mapping token ids ``[batch, seq]`` to logits
``[batch, seq, vocab]``, or to an output holding them (``.logits``, as Hugging Face causal
LMs return, or the first element of a tuple). It is called once per rank on the CPU with
torch's RNG seeded from ``train.seed``, so every rank builds the same initial weights by the
module's own init; then it is moved to the device and parallelized:

- DP / FSDP / HSDP: ``fully_shard`` over the ``(dp_replicate, dp_shard)`` mesh, one FSDP unit
  per block (the classes a Hugging Face model lists in ``_no_split_modules``, else the
  children of its longest ``nn.ModuleList``) and the rest in the root unit;
- TP when the module defines ``relight_tp_plan()`` returning a ``parallelize_module`` plan
  (``{submodule name: ParallelStyle}``); PP and EP need the runtime's own model.

It is wrapped in :class:`FactoryModel`, so its state-dict keys are ``module.<its own
names>`` and checkpoints, resharding, preemption handling and the chaos harness treat it as
they treat the runtime's transformer. Unlike the registered models it is built in full on
every rank before being sharded (its init is its own code, which may not run on the meta
device).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from relight.runtime.config import Config, ConfigError, MixedPrecision
from relight.runtime.mesh import LayoutError, ParallelMesh

__all__ = ["FactoryModel", "create_factory_model", "find_blocks", "load_factory"]

log = logging.getLogger(__name__)


class FactoryModel(nn.Module):
    """A user's module behind the interface the trainer uses (logits out; init hooks)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "use_cache", False):
            config.use_cache = False  # training: no key/value cache is built or returned

    @property
    def vocab_size(self) -> int | None:
        """The vocabulary the module embeds, when it can be told: a Hugging Face
        ``config.vocab_size``, else its first ``nn.Embedding``'s size."""
        config = getattr(self.module, "config", None)
        if config is not None and isinstance(getattr(config, "vocab_size", None), int):
            return int(config.vocab_size)
        emb = next((m for m in self.module.modules() if isinstance(m, nn.Embedding)), None)
        return None if emb is None else int(emb.num_embeddings)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.module(tokens)
        if isinstance(out, torch.Tensor):
            return out
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, tuple | list) and out:
            logits = out[0]
        if not isinstance(logits, torch.Tensor):
            raise TypeError(f"the factory model returned {type(out).__name__}; it must return "
                            "logits [batch, seq, vocab] or an output with .logits")
        return logits

    def init_buffers(self) -> None:
        """Nothing to do: the module was built on a real device with its own buffers."""

    def init_weights(self, seed: int) -> None:
        """Nothing to do: the factory ran its own init under ``torch.manual_seed(seed)``."""

    def set_aux_scale(self, scale: float) -> None:
        """No auxiliary losses in a factory model."""


def load_factory(path: str) -> Callable[..., Any]:
    mod_name, _, fn_name = path.partition(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ConfigError(f"model.factory={path!r}: cannot import {mod_name!r} ({e}); is it on "
                          "PYTHONPATH?") from None
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ConfigError(f"model.factory={path!r}: {mod_name} has no function {fn_name!r}")
    return fn


def find_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks to shard one by one: modules whose class is named in
    ``_no_split_modules`` (Hugging Face's list), else the longest ``nn.ModuleList``'s items."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    if names:
        blocks = [m for m in module.modules() if m is not module and type(m).__name__ in names]
        if blocks:
            return blocks
    lists = [m for m in module.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _check_layout(pmesh: ParallelMesh, module: nn.Module, path: str) -> None:
    layout = pmesh.layout
    if layout.pp > 1 or layout.ep > 1:
        raise LayoutError(f"model.factory={path!r} runs under DP/FSDP/HSDP (and TP with a "
                          f"relight_tp_plan()); layout {layout.describe()} asks for pipeline "
                          "or expert parallelism: set parallel.pp=1 and parallel.ep=1")
    if layout.tp > 1 and not callable(getattr(module, "relight_tp_plan", None)):
        raise LayoutError(f"model.factory={path!r}: parallel.tp={layout.tp} needs the module "
                          "to define relight_tp_plan() -> {submodule: ParallelStyle}")


def create_factory_model(cfg: Config, pmesh: ParallelMesh, device: torch.device) -> nn.Module:
    """Build ``cfg.model.factory``'s module, identically on every rank, and parallelize it."""
    path = cfg.model.factory
    fn = load_factory(path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        module = fn(cfg.model)
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model.factory={path!r} returned {type(module).__name__}, not a "
                          "torch.nn.Module")
    _check_layout(pmesh, module, path)
    model = FactoryModel(module).to(device)
    if pmesh.layout.tp > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(module, pmesh["tp"], module.relight_tp_plan())
    if pmesh.layout.dp > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16 = cfg.train.mixed_precision == MixedPrecision.BF16
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None,
                                  reduce_dtype=torch.float32)
        dp_mesh = pmesh["dp_replicate", "dp_shard"]
        blocks = find_blocks(module)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, mp_policy=mp)
        fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False)
        log.debug("factory model %s: %d FSDP units plus the root", path, len(blocks))
    return model
