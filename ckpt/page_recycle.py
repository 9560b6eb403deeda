"""A save's shard objects take the page-cache pages of this process's earlier saves,
never those of its newest committed one.

Objects are written through the page cache, so recent checkpoints stay cached for a
load on the same node (a restarted process, a healed rank, a script that reloads what
it saved). Each page a write takes must come from somewhere: with earlier checkpoints
kept on disk, the free pages run out and every new page costs a reclaim, and on a
virtual machine whose host backs guest memory lazily (a balloon that reports free
pages), a fault on the host as well. A page freed a moment before the write that takes
it costs neither. So before each shard object goes out, the writer drops the cached
pages of about as many bytes of an older save's objects (`Store.drop_cached`), oldest
first, and the next save writes into them.

The newest save of this process that committed is never taken from: it is the
checkpoint a restore reads, and a restore right after the next save (an async save
that follows a sync one, a crash during the save after it) must find it in memory, as
it finds any buffered writer's. A process therefore keeps two checkpoints' worth of
pages while it saves (the newest committed and the one being written), and those of a
save that failed are taken first among the older ones, by age.

Measured on the 2-core VM (4 processes each writing 128 MiB per round, buffered + fsync,
files kept, two sequences of 8 rounds): taking new pages, 0.81-1.22 s per round;
dropping the previous round's pages first, 0.19-0.28 s in 13 of the 14 rounds that had
one to drop (one 0.62 s; the first round of each, with nothing to drop, 0.86 and
1.06 s). Around the cache (`O_DIRECT`): 0.18-0.23 s in one sequence, 0.73-0.93 s in
one run right after the buffered sequence. docs/design/ckpt-load-path.md has why the
newest committed checkpoint keeps its pages.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from relight.storage import Store

logger = logging.getLogger(__name__)

__all__ = ["PageRecycler"]

MAX_HELD = 100_000
"""Objects remembered at most: older saves' leftovers beyond it are forgotten (their
pages are the kernel's to reclaim, as any file's are)."""


@dataclass(eq=False)
class _Save:
    objects: deque[tuple[Store, str, int]] = field(default_factory=deque)
    committed: bool = False


class PageRecycler:
    """The shard objects of this process's saves, oldest save first, whose cached pages
    the next writes take, save by save, except the newest committed save's.
    Thread-safe; one per process (`ckpt.resources`).

    Call order per save: `begin_save()` (returns the save's token), `make_room` before
    each object it writes, `committed(token)` once every rank knows it committed."""

    def __init__(self) -> None:
        self._saves: deque[_Save] = deque()
        self._kept: _Save | None = None
        """The newest committed save: its objects stay cached."""
        self._current: _Save | None = None
        self._lock = threading.Lock()

    def begin_save(self) -> object:
        """A save starts writing: the objects of the saves before it, except the newest
        committed one's, become recyclable. Returns the token `committed` takes."""
        with self._lock:
            save = _Save()
            self._saves.append(save)
            self._current = save
            held = sum(len(s.objects) for s in self._saves)
            while held > MAX_HELD and self._saves[0] is not save:
                gone = self._saves.popleft()
                held -= len(gone.objects)
                if gone is self._kept:
                    self._kept = None
            return save

    def committed(self, token: object) -> None:
        """The save of `token` committed: from now on its pages are the ones kept, and
        the save kept before it becomes recyclable."""
        with self._lock:
            if not isinstance(token, _Save) or token not in self._saves:
                return
            token.committed = True
            if self._kept is None or self._saves.index(token) > self._saves.index(self._kept):
                self._kept = token

    def make_room(self, store: Store, key: str, nbytes: int) -> int:
        """Before `nbytes` go to `key` of `store`: drop the cached pages of at least that
        many bytes of earlier saves' objects (fewer if fewer are held; never the newest
        committed save's), and remember `key` as the current save's. Returns the bytes
        dropped. A failure to drop is logged, never raised: the pages are a cache, the
        write goes on."""
        with self._lock:
            current = self._current
            if current is None:  # a writer that did not begin a save: one of its own
                current = self._current = _Save()
                self._saves.append(current)
            current.objects.append((store, key, nbytes))
            taken: list[tuple[Store, str, int]] = []
            dropped = 0
            for save in list(self._saves):
                if dropped >= nbytes:
                    break
                if save is self._kept or save is current:
                    continue
                while save.objects and dropped < nbytes:
                    item = save.objects.popleft()
                    taken.append(item)
                    dropped += item[2]
                if not save.objects:
                    self._saves.remove(save)
        for old_store, old_key, _ in taken:
            try:
                old_store.drop_cached(old_key)
            except OSError as e:
                logger.debug("could not drop the cached pages of %s: %s",
                             old_store.url_of(old_key), e)
        return dropped

    def kept(self) -> list[str]:
        """The keys of the save whose pages are kept (tests)."""
        with self._lock:
            return [] if self._kept is None else [k for _, k, _ in self._kept.objects]

    def forget(self) -> None:
        """Hold nothing (tests; a process that stops saving)."""
        with self._lock:
            self._saves.clear()
            self._kept = self._current = None
