"""What one save's phases share (`ckpt.saver.save`, `ckpt.writer`): the save as the
caller asked for it and as the group decided it (`SaveContext`), and this rank's part of
it (`RankShare`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from relight.ckpt.comm import Comm
from relight.ckpt.commit import CommitHooks
from relight.ckpt.commit_group import CommitGroup
from relight.ckpt.handle import SaveHandle
from relight.ckpt.options import SaveOptions
from relight.ckpt.plan import PieceWrite, SavePlan, TensorPlan
from relight.ckpt.staging import Stager
from relight.storage import Store

if TYPE_CHECKING:
    from relight.ckpt.checkpointer import Checkpointer

__all__ = ["RankShare", "SaveContext"]


@dataclass
class SaveContext:
    """One save, as every phase sees it: set up from the caller's arguments, then the
    handshake fills in the attempt and the global plan the plan and the commit group."""

    checkpointer: Checkpointer
    """The engine the save runs on: its save worker and page recycler."""
    store: Store
    comm: Comm
    opts: SaveOptions
    async_save: bool
    hooks: CommitHooks
    meta: dict[str, Any]
    """What the manifest records besides the tensors: step, config, layout."""
    handle: SaveHandle
    pre: str
    """The log prefix: rank and step."""
    attempt: str = ""
    """The attempt id the coordinator chose in the handshake (names the data objects)."""
    plan: SavePlan | None = None
    group: CommitGroup | None = None
    """Asynchronous saves: the gloo group the commit goes over (None: storage only)."""

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def step(self) -> int | None:
        return self.handle.step

    @property
    def pipelined(self) -> bool:
        """The copy into staging buffers runs in the background, after `save()` returned."""
        return self.async_save and self.opts.pipelined_staging

    def the_plan(self) -> SavePlan:
        assert self.plan is not None, "the global plan is made before anything is written"
        return self.plan


@dataclass
class RankShare:
    """This rank's part of a save under one plan: the pieces it writes, their staged
    copies (or, pipelined, the copy still to make), the JSON values it owns, and what
    went wrong while staging."""

    writes: list[tuple[TensorPlan, PieceWrite]] = field(default_factory=list)
    stager: Stager | None = None
    staged: dict[tuple[str, tuple[int, ...]], torch.Tensor] = field(default_factory=dict)
    packed: np.ndarray | None = None
    values: dict[str, Any] = field(default_factory=dict)
    error: BaseException | None = None
    seconds: float = 0.0
    """How long the copy took (0 when pipelined: the background thread copies)."""
