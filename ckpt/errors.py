"""Typed checkpoint errors.

Each subclasses the built-in a caller would catch anyway (`FileNotFoundError`,
`ValueError`, `KeyError`, `RuntimeError`) and names what it is about: the checkpoint
URL, the tensor and the stored object, and says what to do about it.
"""

from __future__ import annotations

from relight.errors import RelightError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "NoLoadableCheckpointError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "ChecksumMismatchError",
    "MissingChunkError",
    "UnsafePathError",
    "AbsurdShapeError",
    "UnsupportedVersionError",
    "StateDictMismatchError",
    "MissingKeyError",
    "UnexpectedKeyError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "CheckpointSaveError",
    "CollectiveError",
    "SavesFailingError",
    "UnsupportedStateError",
]


class CheckpointError(RelightError):
    """Base of every checkpoint error. `url`, `tensor` and `obj` name what it is about."""

    def __init__(
        self, message: str, *, url: str | None = None, tensor: str | None = None,
        obj: str | None = None,
    ) -> None:
        super().__init__(message)
        self.url = url
        self.tensor = tensor
        self.obj = obj

    def __str__(self) -> str:  # KeyError and OSError would otherwise mangle the message
        return str(self.args[0]) if self.args else super().__str__()


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No committed checkpoint at the URL (absent, or its commit marker is missing)."""


class NoLoadableCheckpointError(CheckpointNotFoundError):
    """Committed checkpoints exist and storage answered, but every one is damaged or of
    an unsupported version: no restart can fix this (a transient storage failure raises
    `CheckpointNotFoundError` itself, which a retry may clear)."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint is already at the URL; saves never overwrite one."""


class CorruptCheckpointError(CheckpointError, ValueError):
    """A committed checkpoint whose stored bytes are not what its manifest says."""


class ChecksumMismatchError(CorruptCheckpointError):
    """A chunk, index or manifest failed its crc32c check."""


class MissingChunkError(CorruptCheckpointError):
    """A chunk the manifest refers to is missing or truncated."""


class UnsafePathError(CorruptCheckpointError):
    """A manifest path leaves the checkpoint root (path traversal)."""


class AbsurdShapeError(CorruptCheckpointError):
    """A manifest shape is negative, non-integral or far too large to allocate."""


class UnsupportedVersionError(CheckpointError, ValueError):
    """The checkpoint was written by a format version this reader does not know."""


class StateDictMismatchError(CheckpointError, ValueError):
    """The state dict being loaded does not match the checkpoint."""


class MissingKeyError(StateDictMismatchError, KeyError):
    """A key of the target state dict is not in the checkpoint."""


class UnexpectedKeyError(StateDictMismatchError, KeyError):
    """A key of the checkpoint is not in the target state dict (strict load)."""


class ShapeMismatchError(StateDictMismatchError):
    """A tensor's global shape differs between target and checkpoint."""


class DtypeMismatchError(StateDictMismatchError, TypeError):
    """A tensor's dtype differs between target and checkpoint."""


class UnsupportedStateError(CheckpointError, TypeError):
    """A state-dict value that cannot be checkpointed (e.g. Partial DTensor, non-JSON value)."""


class CheckpointSaveError(CheckpointError, RuntimeError):
    """A save failed. `failures` maps rank -> message for every rank that reported one."""

    def __init__(self, message: str, *, url: str | None = None,
                 failures: dict[int, str] | None = None) -> None:
        super().__init__(message, url=url)
        self.failures = dict(failures or {})


class SavesFailingError(CheckpointSaveError):
    """`CheckpointManager`: the last N saves in a row failed (its `SaveFailurePolicy`);
    the run has no new checkpoint since. `__cause__` is the last failure."""


class CollectiveError(CheckpointError, RuntimeError):
    """A collective of the engine failed or timed out: some rank of the group did not
    make the same call (called on one rank only, died, or is stuck)."""
