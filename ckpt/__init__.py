"""ckpt: Relight's checkpoint engine.

Sharded, asynchronous, atomic checkpoints of PyTorch state dicts (tensors, DTensors on
any mesh, stateful objects, JSON values) as zarr v3 arrays through tensorstore, on any
`storage` URL; loads reshard to whatever layout the target state dict has.

    h = ckpt.save(state_dict, url, async_save=True); h.wait()
    ckpt.load(state_dict, url)
    ckpt.verify(url).ok
    mgr = ckpt.CheckpointManager(root_url, keep_last=3)   # owns its own ckpt.Checkpointer
    root = ckpt.open_checkpoint_root(root_url, ckpt.TierOptions(local_dir="/dev/shm/relight",
                                                                budget_bytes=4 << 30))
    mgr = ckpt.CheckpointManager(root.store)   # restores read the node-local tier first
"""

from relight.ckpt.checkpointer import Checkpointer, default_checkpointer, save, wait_staged
from relight.ckpt.errors import (
    AbsurdShapeError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ChecksumMismatchError,
    CollectiveError,
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingChunkError,
    MissingKeyError,
    NoLoadableCheckpointError,
    SavesFailingError,
    ShapeMismatchError,
    StateDictMismatchError,
    UnexpectedKeyError,
    UnsafePathError,
    UnsupportedStateError,
    UnsupportedVersionError,
)
from relight.ckpt.guard import guard_optimizer
from relight.ckpt.handle import SaveHandle
from relight.ckpt.loader import LoadInfo, load
from relight.ckpt.manager import (
    CheckpointManager,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    SaveFailurePolicy,
)
from relight.ckpt.options import SaveOptions
from relight.ckpt.root_layout import StepRecord, list_records
from relight.ckpt.tiers import CheckpointRoot, TierOptions, open_checkpoint_root
from relight.ckpt.verify import VerifyReport, verify

__all__ = [
    "AbsurdShapeError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "Checkpointer",
    "CheckpointNotFoundError",
    "CheckpointRoot",
    "CheckpointSaveError",
    "ChecksumMismatchError",
    "CollectiveError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "KeepEvery",
    "KeepLast",
    "LoadInfo",
    "MissingChunkError",
    "MissingKeyError",
    "NoLoadableCheckpointError",
    "RetentionPolicy",
    "SaveFailurePolicy",
    "SaveHandle",
    "SaveOptions",
    "SavesFailingError",
    "ShapeMismatchError",
    "StateDictMismatchError",
    "StepRecord",
    "TierOptions",
    "UnexpectedKeyError",
    "UnsafePathError",
    "UnsupportedStateError",
    "UnsupportedVersionError",
    "VerifyReport",
    "default_checkpointer",
    "guard_optimizer",
    "list_records",
    "load",
    "open_checkpoint_root",
    "save",
    "verify",
    "wait_staged",
]
