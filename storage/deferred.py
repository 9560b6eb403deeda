"""`DeferredStore`: puts published at once, made durable together by one `sync()`.

A checkpoint rank publishes tens of objects; flushing each one as it is published (file
and directory) costs a flush per object, while the checkpoint only needs all of them
durable before the rank's index names them. `store.deferred()` returns this view: its
puts publish atomically and remember what is left to flush; `sync()` flushes it all at
once (`LocalStore` fsyncs each file in its put and leaves the directories, each flushed
once at `sync()`; see docs/storage.md for what was measured).

`sync()` is never retried: after a failed flush the kernel may have dropped the dirty
pages, and a second flush could then report success for data that is gone. A failed
sync fails every later `sync()` of the same batch too; write the objects again instead.
"""

from __future__ import annotations

import threading
from typing import Any

from storage.base import ForwardedPrimitives, Store
from storage.errors import StorageError
from storage.retry import classify
from storage.url import StorageLocation

__all__ = ["DeferredStore"]


class _Batch:
    """What a deferred store and its children must flush, and whether a flush failed."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.failed: StorageError | None = None

    def add(self, paths: tuple[str, ...]) -> None:
        if paths:
            with self.lock:
                self.paths.extend(paths)

    def take(self) -> list[str]:
        with self.lock:
            paths, self.paths = self.paths, []
        return list(dict.fromkeys(paths))


class DeferredStore(ForwardedPrimitives, Store):
    """`inner` with deferred durability (see the module docstring). Every operation but
    `put` is the inner store's; `put_if_absent` stays durable on return (it publishes
    markers, which must never wait for a flush)."""

    def __init__(self, inner: Store, _batch: _Batch | None = None) -> None:
        super().__init__(inner.location, inner.retry, inner.stats)
        self.inner = inner
        self._wrapped = inner
        self._batch = _batch or _Batch()

    def sync(self) -> None:
        batch = self._batch
        if batch.failed is not None:
            raise StorageError(f"an earlier sync under {self.url} failed ({batch.failed}); "
                               "objects put before it may not be durable", url=self.url)
        paths = batch.take()
        try:
            self.inner._sync_paths(paths)
        except Exception as exc:  # noqa: BLE001 - classified and re-raised typed
            err = classify(exc, self.url)
            batch.failed = err
            raise err from exc

    def deferred(self) -> Store:
        return self

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        return self.inner.kvstore_spec(sub)

    def ts_context(self) -> Any:
        return self.inner.ts_context()

    # -- primitives: the inner store's, with puts left unflushed -------------------------

    def _with_location(self, location: StorageLocation) -> Store:
        return DeferredStore(self.inner._with_location(location), self._batch)

    def _put(self, path: str, data: bytes) -> None:
        self._batch.add(self.inner._put_unsynced(path, data))
