"""`SaveOptions`: how a save is planned and persisted."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SaveOptions"]


@dataclass(kw_only=True)
class SaveOptions:
    """How a save is planned and persisted."""

    compression: str | None = None
    """None (default) or "zstd" (level 1) on every inner chunk; see docs/ckpt.md."""
    pack_bytes: int = 512 * 1024
    """Tensors no larger than this are packed into one byte array per writer."""
    inner_bytes: int = 4 << 20
    """Target size of the inner (crc32c-checked, separately readable) chunks of a shard:
    the granularity of partial reads when loading into another layout."""
    packed_inner: int = 64 * 1024
    """Inner chunk size of packed arrays."""
    pipelined_staging: bool = False
    """Async saves only: `save()` returns once the staging copy is scheduled and the copy
    runs in the background thread. The saved tensors must not change in place until
    `handle.wait_staged()` (or `ckpt.wait_staged()`) returns; `ckpt.guard_optimizer`
    makes an optimizer's next step wait for it. See docs/ckpt.md."""
    commit_timeout_s: float = 600.0
    """How long the coordinator waits for every rank's index before giving up."""
    collective_timeout_s: float = 300.0
    """How long each collective of the save waits for the other ranks of the group."""
    commit_over_group: bool = True
    """Async saves only: the background thread gathers the ranks' indexes and shares the
    commit over a gloo group of its own (`ckpt.commit_group`), as a synchronous save does
    over the caller's group. False: ranks meet through storage only (the coordinator
    reads every rank's index object; the others poll for the commit marker)."""

    def __post_init__(self) -> None:
        if self.compression not in (None, "zstd"):
            raise ValueError(f"compression must be None or 'zstd', got {self.compression!r}")

