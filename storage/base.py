"""The `Store` interface: what every part of Relight may do with bytes.

A store is rooted at a URL. Keys are relative to that root and can never leave it
(`check_key`). Every operation is retried on transient errors and raises a typed
`StorageError` otherwise. `kvstore_spec()` gives tensorstore the same location, so
arrays written through tensorstore and small objects written here land together;
tensorstore I/O does not pass through the methods below, so callers that read or
write arrays report those bytes with `stats.record_*`.

`store.deferred()` returns a `DeferredStore`, a view of the store whose puts are
published at once and made durable together by one `sync()`. A checkpoint rank publishes
tens of objects; flushing each one as it is published (file and directory) costs a flush
per object, while the checkpoint only needs all of them durable before the rank's index
names them. The view's puts publish atomically and remember what is left to flush;
`sync()` flushes it all at once (`LocalStore` fsyncs each file in its put and leaves the
directories, each flushed once at `sync()`; see docs/storage.md for what was measured).
The view lives here, beside `Store`, because `Store.deferred()` builds it and it is a
`Store` itself.

`sync()` is never retried: after a failed flush the kernel may have dropped the dirty
pages, and a second flush could then report success for data that is gone. A failed
sync fails every later `sync()` of the same batch too; write the objects again instead.
"""

from __future__ import annotations

import random
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from relight.storage.errors import ObjectTruncatedError, StorageError
from relight.storage.retry import RetryPolicy, call_with_retry, classify
from relight.storage.url import StorageLocation, check_key

T = TypeVar("T")

__all__ = ["DeferredStore", "Store", "StoreStats"]


@dataclass
class StoreStats:
    """Counters shared by a store and every child of it. Thread-safe."""

    bytes_read: int = 0
    bytes_written: int = 0
    reads: int = 0
    writes: int = 0
    lists: int = 0
    deletes: int = 0
    retries: int = 0
    bytes_read_cached: int = 0
    """Of `bytes_read`, those the page cache served whole (`LocalStore` ranges of 1 MiB+)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record_read(self, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.reads += ops

    def record_write(self, nbytes: int, ops: int = 1) -> None:
        with self._lock:
            self.bytes_written += nbytes
            self.writes += ops

    def record(self, counter: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, counter, getattr(self, counter) + n)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return {
                k: getattr(self, k)
                for k in ("bytes_read", "bytes_written", "reads", "writes", "lists", "deletes",
                          "retries", "bytes_read_cached")
            }


class Store(ABC):
    """Objects under one root URL. Subclasses implement the `_`-prefixed primitives
    on absolute backend paths; this class adds key checking, retries and counters."""

    def __init__(
        self,
        location: StorageLocation,
        retry: RetryPolicy | None = None,
        stats: StoreStats | None = None,
    ) -> None:
        self.location = location
        self.retry = retry or RetryPolicy()
        self.stats = stats or StoreStats()
        self._rng = random.Random()

    # -- public surface -------------------------------------------------------------

    @property
    def url(self) -> str:
        """The root URL, safe to log."""
        return self.location.url

    def url_of(self, key: str) -> str:
        return f"{self.url.rstrip('/')}/{key}"

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Publish `data` at `key` atomically: readers see the old object or the whole
        new one, never a part (temp + rename on a filesystem; one PUT on S3)."""
        path = self._path(key)
        payload = self._payload(data)
        self._retry(lambda: self._put(path, payload), key, "put")
        self.stats.record_write(len(payload))

    def put_if_absent(self, key: str, data: bytes | bytearray | memoryview) -> bool:
        """Publish `data` at `key` only if no object is there yet (atomically: of two
        racing callers exactly one wins). Returns False, writing nothing, if one exists.

        A retried call whose first try landed unseen returns False too: callers that must
        tell "I won" from "another won" put an id in `data` and read the object back."""
        path = self._path(key)
        payload = self._payload(data)
        created = self._retry(lambda: self._put_if_absent(path, payload), key, "put_if_absent")
        if created:
            self.stats.record_write(len(payload))
        return created

    copies_put_buffers: bool = True
    """Whether `put` copies a buffer that is not `bytes` into an immutable `bytes`
    before storing it. Most stores must: they may keep it (memory) or send it on later
    (a tier's write-behind copy) while the caller reuses its buffer. A store whose
    primitives have copied the bytes out when they return takes any buffer as it is,
    and a writer may then reuse its buffers without a copy of its own."""

    def _payload(self, data: bytes | bytearray | memoryview) -> bytes | memoryview:
        """What `put` hands to the primitives (see `copies_put_buffers`)."""
        if isinstance(data, bytes):
            return data
        return bytes(data) if self.copies_put_buffers else memoryview(data).cast("B")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object's bytes, or the range [start, end). A range past the end of the
        object raises `ObjectTruncatedError` (a truncated chunk must never look whole)."""
        path = self._path(key)
        data = self._retry(lambda: self._get(path, start, end), key, "get")
        self._got(key, start, end, len(data))
        return data

    def get_view(self, key: str, start: int, end: int, scratch: Any) -> memoryview:
        """Bytes [start, end) of the object as a read-only view: of the page cache's own
        pages where it holds the whole range (`LocalStore`, mapped), of `scratch` (an
        aligned uint8 buffer of at least `storage.direct_io.scratch_bytes(start, end)`
        bytes, or a function that returns one, called only if needed) where the store
        reads into it without a copy of its own (`LocalStore`'s direct reads), else of a
        new `bytes`. Valid until the caller reuses `scratch`. Raises what `get`
        raises."""
        return memoryview(self.get(key, start, end))

    def _got(self, key: str, start: int | None, end: int | None, n: int) -> None:
        """Count a read of `n` bytes of [start, end); a short one raises."""
        if end is not None and n != end - (start or 0):
            raise ObjectTruncatedError(
                f"{self.url_of(key)}: asked for bytes [{start or 0}, {end}), got {n}",
                url=self.url_of(key),
            )
        self.stats.record_read(n)

    def size(self, key: str) -> int:
        path = self._path(key)
        return self._retry(lambda: self._size(path), key, "size")

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return self._retry(lambda: self._exists(path), key, "exists")

    def list(self, prefix: str = "") -> list[str]:
        """Every key under `prefix` (recursively), relative to the root, sorted."""
        base = self._path(prefix) if prefix else self._root_path()
        found = self._retry(lambda: self._list(base), prefix or ".", "list")
        self.stats.record("lists")
        root = self._root_prefix()
        keys = [p[len(root):] for p in found if p.startswith(root)]
        return sorted(k for k in keys if k and not _is_temp(k))

    def delete(self, key: str) -> None:
        """Remove one object; a missing object is not an error."""
        path = self._path(key)
        self._retry(lambda: self._delete(path), key, "delete")
        self.stats.record("deletes")

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix`; returns how many."""
        keys = self.list(prefix.rstrip("/") + "/")
        for key in keys:
            self.delete(key)
        return len(keys)

    def drop_cached(self, key: str) -> None:
        """Let go of this machine's cached copy of the object (the page cache's, for
        files), so that its memory serves the writes that follow; the object itself is
        unchanged, a missing one is not an error. Stores that cache nothing ignore it."""
        self._drop_cached(self._path(key))

    def child(self, sub: str) -> Store:
        """A store rooted at `sub` below this one, sharing settings and counters."""
        return self._with_location(self.location.child(sub))

    def deferred(self) -> Store:
        """A view of this store whose puts are published at once (atomic, visible to
        readers) but made durable only by its `sync()`: one flush for a batch of objects
        instead of one per put. Until `sync()` returns, a power cut may lose
        them, so nothing may reference them before then. Its children share the batch.
        On stores whose puts need no flush (S3, memory, `fsync=False`) both are free."""
        return DeferredStore(self)

    def sync(self) -> None:
        """Make every object put through this view durable (see `deferred()`); on a
        plain store every put is durable when it returns, so there is nothing to do."""
        return None

    @abstractmethod
    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        """The tensorstore kvstore spec of `root/sub/` (no secrets in it)."""

    def ts_context(self) -> Any:
        """The tensorstore Context to open arrays with (shared resources, limits)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"

    # -- helpers for subclasses -------------------------------------------------------

    def _path(self, key: str) -> str:
        # A trailing slash is allowed (a prefix); anything else that is odd is refused.
        key = check_key(key[:-1] if key.endswith("/") else key, self.url)
        root = self._root_path().rstrip("/")
        return f"{root}/{key}" if root or self.location.scheme == "file" else key

    def _root_prefix(self) -> str:
        root = self._root_path().rstrip("/")
        return f"{root}/" if root or self.location.scheme == "file" else ""

    def _retry(self, fn: Callable[[], T], key: str, op: str = "") -> T:
        def count_retry() -> None:
            self.stats.record("retries")

        return call_with_retry(fn, self.url_of(key), self.retry, self._rng,
                               on_retry=count_retry, op=op)

    # -- primitives ---------------------------------------------------------------------

    @abstractmethod
    def _root_path(self) -> str: ...

    @abstractmethod
    def _with_location(self, location: StorageLocation) -> Store: ...

    @abstractmethod
    def _put(self, path: str, data: bytes) -> None: ...

    def _put_unsynced(self, path: str, data: bytes) -> tuple[str, ...]:
        """Publish atomically, leaving the flush to `_sync_paths`; returns the paths that
        flush must cover. By default a put is durable already: nothing is left."""
        self._put(path, data)
        return ()

    def _sync_paths(self, paths: list[str]) -> None:
        """Make the paths `_put_unsynced` returned durable (nothing by default)."""
        return None

    @abstractmethod
    def _put_if_absent(self, path: str, data: bytes) -> bool: ...

    @abstractmethod
    def _get(self, path: str, start: int | None, end: int | None) -> bytes: ...

    @abstractmethod
    def _size(self, path: str) -> int: ...

    @abstractmethod
    def _exists(self, path: str) -> bool: ...

    @abstractmethod
    def _list(self, path: str) -> list[str]: ...

    @abstractmethod
    def _delete(self, path: str) -> None: ...

    def _drop_cached(self, path: str) -> None:
        """Drop the machine's cached copy of the object (nothing by default)."""
        return None


TEMP_MARKER = ".relight-tmp-"


def _is_temp(key: str) -> bool:
    return TEMP_MARKER in key.rsplit("/", 1)[-1]


class ForwardedPrimitives:
    """The storage primitives of a wrapper store, forwarded to the store it wraps
    (`_wrapped`): for wrappers whose public methods do their own work, so that anything
    calling a primitive directly reaches the real store. Put it before `Store` in the
    bases; a wrapper overrides the primitives it changes."""

    _wrapped: Store

    def _root_path(self) -> str:
        return self._wrapped._root_path()

    def _put(self, path: str, data: bytes) -> None:
        self._wrapped._put(path, data)

    def _put_unsynced(self, path: str, data: bytes) -> tuple[str, ...]:
        return self._wrapped._put_unsynced(path, data)

    def _sync_paths(self, paths: list[str]) -> None:
        self._wrapped._sync_paths(paths)

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        return self._wrapped._put_if_absent(path, data)

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        return self._wrapped._get(path, start, end)

    def _size(self, path: str) -> int:
        return self._wrapped._size(path)

    def _exists(self, path: str) -> bool:
        return self._wrapped._exists(path)

    def _list(self, path: str) -> list[str]:
        return self._wrapped._list(path)

    def _delete(self, path: str) -> None:
        self._wrapped._delete(path)

    def _drop_cached(self, path: str) -> None:
        self._wrapped._drop_cached(path)


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

    @property
    def copies_put_buffers(self) -> bool:  # type: ignore[override]
        return self.inner.copies_put_buffers

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        return self.inner.kvstore_spec(sub)

    def ts_context(self) -> Any:
        return self.inner.ts_context()

    # -- primitives: the inner store's, with puts left unflushed -------------------------

    def _with_location(self, location: StorageLocation) -> Store:
        return DeferredStore(self.inner._with_location(location), self._batch)

    def _put(self, path: str, data: bytes) -> None:
        self._batch.add(self.inner._put_unsynced(path, data))
