"""The process group an asynchronous save's background thread commits over.

An asynchronous commit through storage alone costs the coordinator one GET per rank's
index object after the last rank is durable (4,096 ranks on a loopback S3 server:
15.8 s). A synchronous save gathers the indexes over the process group instead, but the
background thread of an asynchronous save may not use the training's group: its
collectives would interleave with the training's in an order that differs between
ranks. So the background thread gets a gloo group of its own, `CommitGroup`.

- It is a plain `ProcessGroupGloo` over a `PrefixStore` of the default store, named by
  the attempt id of the save that created it (agreed in that save's handshake). It is
  not registered with `torch.distributed`: it takes no part in the order of
  `new_group` calls, and `destroy_process_group()` in a user's script leaves it alone.
- It connects in the background thread, at the first commit that uses it, and serves
  every later asynchronous save of the same ranks. A process runs one save at a time,
  so its collectives never interleave.
- Ranks agree on it in every save's handshake (`handshake_id`): only when every rank
  holds the same healthy group is it used; otherwise every rank drops its own and the
  save builds a new one.
- Storage stays the ground truth: every rank still writes its index and the commit
  marker decides. A rank whose collective fails marks the group broken, aborts it (so
  its peers' collectives fail at once instead of timing out) and finishes the commit
  through storage (`ckpt.commit.wait_for_indexes` / `wait_for_commit`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from relight.ckpt.comm import Comm, ranks_text
from relight.ckpt.errors import CollectiveError

logger = logging.getLogger(__name__)

__all__ = ["NO_GROUP", "CommitGroup", "commit_group_for"]

NO_GROUP = "-" * 16
"""What a rank without a usable commit group sends in the save handshake."""

STORE_PREFIX = "relight/ckpt/commit-group"


class _GroupComm(Comm):
    """A `Comm` over an unregistered gloo group: its collectives call the group's own
    methods (group-local root), not `torch.distributed`'s registry."""

    def __init__(self, pg: Any, ranks: tuple[int, ...], rank: int, timeout_s: float) -> None:
        self.active = True
        self.group = pg
        self.timeout = timedelta(seconds=timeout_s)
        self.rank, self.size, self.ranks = rank, len(ranks), ranks
        self.device = torch.device("cpu")

    def _all_gather(self, out: list[torch.Tensor], buf: torch.Tensor) -> Any:
        return self._start(lambda: self.group.allgather([out], [buf]))

    def _gather(self, buf: torch.Tensor, out: list[torch.Tensor] | None) -> Any:
        opts = dist.GatherOptions()
        opts.rootRank = 0  # the coordinator: the group's first rank
        opts.timeout = self.timeout
        return self._start(lambda: self.group.gather([out] if out is not None else [],
                                                     [buf], opts))

    def _broadcast(self, buf: torch.Tensor, src: int) -> Any:
        opts = dist.BroadcastOptions()
        opts.rootRank = self.ranks.index(src)
        opts.rootTensor = 0
        opts.timeout = self.timeout
        return self._start(lambda: self.group.broadcast([buf], opts))

    def _start(self, op: Callable[[], Any]) -> Any:
        """Start `op` on the group; a group that is aborted or closed raises
        `CollectiveError`, as a failed wait does."""
        if self.group is None:
            raise CollectiveError("the commit group was closed")
        try:
            return op()
        except (RuntimeError, ValueError) as e:
            raise CollectiveError(f"rank {self.rank}: the commit group failed: "
                                  f"{type(e).__name__}: {e}") from e


class CommitGroup:
    """One gloo group of a save's ranks for the background thread's commit; built on
    first use (`comm()`), then reused until a collective on it fails (`broken`)."""

    def __init__(self, ident: str, store: Any, ranks: tuple[int, ...], rank: int,
                 timeout_s: float) -> None:
        self.ident = ident
        """The attempt id of the save that created it: the same on every rank."""
        self.ranks = ranks
        self.rank = rank
        self.timeout_s = timeout_s
        self.broken = False
        self._store = store
        self._pg: Any = None
        self._comm: _GroupComm | None = None
        self._lock = threading.Lock()

    def comm(self) -> Comm:
        """The group's `Comm`, connecting every rank of it on first use (blocks until
        all of them have, up to `timeout_s`); raises `CollectiveError` when it cannot."""
        with self._lock:
            if self.broken:
                raise CollectiveError(f"the commit group {self.ident} is broken")
            if self._comm is None:
                prefixed = dist.PrefixStore(f"{STORE_PREFIX}/{self.ident}/", self._store)
                try:
                    pg = dist.ProcessGroupGloo(prefixed, self.ranks.index(self.rank),
                                               len(self.ranks),
                                               timedelta(seconds=self.timeout_s))
                except (RuntimeError, ValueError) as e:  # a peer never connected
                    raise CollectiveError(
                        f"rank {self.rank}: connecting the commit group {self.ident} of "
                        f"ranks {ranks_text(self.ranks)} failed: {type(e).__name__}: {e}") from e
                self._pg = pg
                self._comm = _GroupComm(pg, self.ranks, self.rank, self.timeout_s)
            return self._comm

    def mark_broken(self, why: BaseException, pre: str = "ckpt:") -> None:
        """Stop using the group after a failed collective (see `close`); the save that
        met the failure commits through storage."""
        if not self.broken:
            logger.warning("%s commit group %s of ranks %s dropped, committing through "
                           "storage: %s", pre, self.ident, ranks_text(self.ranks), why)
        self.close()

    def close(self) -> None:
        """Abort the group, so that a peer still waiting in a collective on it fails now
        rather than at its timeout; a later `comm()` raises."""
        with self._lock:
            self.broken = True
            pg, self._pg, self._comm = self._pg, None, None
        if pg is not None:
            try:
                pg.abort()
            except Exception as e:  # noqa: BLE001 - best effort: dropping it closes it too
                logger.debug("aborting commit group %s: %s", self.ident, e)

    def handshake_id(self, ranks: tuple[int, ...]) -> str:
        """What this rank sends in a save's handshake: the group's id when it can serve
        a save of `ranks`, else `NO_GROUP`."""
        return self.ident if not self.broken and ranks == self.ranks else NO_GROUP


def commit_group_for(current: CommitGroup | None, agreed: bool, attempt: str,
                     comm: Comm, timeout_s: float) -> CommitGroup | None:
    """The commit group of an asynchronous save: `current` when the handshake found that
    every rank holds it (`agreed`); otherwise a new one named by the save's `attempt`
    (each rank drops the group it had). None when the save's group is one process or
    torch.distributed has no default store."""
    if not comm.active or comm.size == 1:
        if current is not None:
            current.close()
        return None
    if agreed and current is not None:
        return current
    if current is not None:
        current.close()  # not every rank of this save holds it: every rank drops its own
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError) as e:
        logger.info("ckpt: no default store for a commit group (%s); async commits go "
                    "through storage", e)
        return None
    return CommitGroup(attempt, store, comm.ranks, comm.rank, timeout_s)

