"""Relight: a fault-tolerant parallel training runtime for PyTorch.

The public API in one place:

    import relight
    mgr = relight.CheckpointManager("s3://bucket/run-1", keep_last=3)   # sharded, async, atomic
    relight.save(state_dict, url); relight.load(state_dict, url)         # one checkpoint
    replicas = relight.ReplicaManager(relight.ReplicaSettings(job="run-1", group=0), ...)
    except relight.RelightError: ...                                     # every typed error

The packages: `relight.storage` (the one door to bytes), `relight.ckpt` (the checkpoint
engine), `relight.elastic` (etcd rendezvous, `relight run`, replica groups that heal in
place), `relight.runtime` (the parallel training runtime), `relight.chaos` (the chaos
harness). Names load on first use, so `import relight.storage` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from relight.errors import RelightError

__version__ = "0.1.0"

# name -> the module that defines it (imported when the name is first read)
_PUBLIC: dict[str, str] = {
    "CheckpointManager": "relight.ckpt",
    "Checkpointer": "relight.ckpt",
    "SaveOptions": "relight.ckpt",
    "SaveHandle": "relight.ckpt",
    "CheckpointError": "relight.ckpt",
    "save": "relight.ckpt",
    "load": "relight.ckpt",
    "verify": "relight.ckpt",
    "open_store": "relight.storage",
    "StorageError": "relight.storage",
    "ReplicaManager": "relight.elastic.replica",
    "ReplicaOptimizer": "relight.elastic.replica_optim",
    "ReplicaSettings": "relight.elastic.replica",
}
_PACKAGES = ("chaos", "ckpt", "elastic", "runtime", "storage")

__all__ = [
    "CheckpointError",
    "CheckpointManager",
    "Checkpointer",
    "RelightError",
    "ReplicaManager",
    "ReplicaOptimizer",
    "ReplicaSettings",
    "SaveHandle",
    "SaveOptions",
    "StorageError",
    "__version__",
    "chaos",
    "ckpt",
    "elastic",
    "load",
    "open_store",
    "runtime",
    "save",
    "storage",
    "verify",
]

if TYPE_CHECKING:
    from relight import chaos, ckpt, elastic, runtime, storage
    from relight.ckpt import (
        Checkpointer,
        CheckpointError,
        CheckpointManager,
        SaveHandle,
        SaveOptions,
        load,
        save,
        verify,
    )
    from relight.elastic.replica import ReplicaManager, ReplicaSettings
    from relight.elastic.replica_optim import ReplicaOptimizer
    from relight.storage import StorageError, open_store


def __getattr__(name: str) -> Any:
    if name in _PACKAGES:
        return importlib.import_module(f"relight.{name}")
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'relight' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
