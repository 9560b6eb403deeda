"""The root of every error Relight raises on purpose.

Each package keeps its own typed hierarchy (`relight.storage.StorageError`,
`relight.ckpt.CheckpointError`, `relight.elastic.etcd_client.EtcdError`, ...) and its
built-in base (`OSError`, `ValueError`, `RuntimeError`, ...), so existing `except`
clauses keep working; `except relight.RelightError` catches them all.
"""

from __future__ import annotations

__all__ = ["RelightError"]


class RelightError(Exception):
    """Base of every typed error in Relight."""
