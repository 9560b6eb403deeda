"""An in-process store (`memory://name/prefix`), for tests and the in-memory tier.

It lives in tensorstore's `memory` kvstore under one process-wide Context, so arrays
that tensorstore writes (opened with `ts_context()`) and the small objects written
here share one namespace, exactly as files and S3 objects do for the other stores.
"""

from __future__ import annotations

import threading
from typing import Any

import tensorstore as ts

from relight.storage.base import Store, StoreStats
from relight.storage.retry import RetryPolicy
from relight.storage.url import StorageLocation

__all__ = ["MemoryStore"]

_CONTEXT_LOCK = threading.Lock()
_CONTEXT: Any = None


def _shared_context() -> Any:
    global _CONTEXT
    with _CONTEXT_LOCK:
        if _CONTEXT is None:
            _CONTEXT = ts.Context()
        return _CONTEXT


class MemoryStore(Store):
    """Objects in this process's memory; gone when the process exits."""

    def __init__(
        self,
        location: StorageLocation,
        retry: RetryPolicy | None = None,
        stats: StoreStats | None = None,
    ) -> None:
        super().__init__(location, retry, stats)
        self._kv = ts.KvStore.open({"driver": "memory"}, context=_shared_context()).result()

    def _root_path(self) -> str:
        return f"{self.location.bucket}/{self.location.root}".rstrip("/")

    def _with_location(self, location: StorageLocation) -> Store:
        return MemoryStore(location, self.retry, self.stats)

    def _put(self, path: str, data: bytes) -> None:
        self._kv.write(path, data).result()

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        # The namespace lives in this process only, so a process-wide lock makes the
        # check-then-write atomic against every other writer.
        with _CONTEXT_LOCK:
            if self._exists(path):
                return False
            self._kv.write(path, data).result()
        return True

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        result = self._kv.read(path).result()
        if result.state != "value":
            raise FileNotFoundError(path)
        value = bytes(result.value)
        if start is None and end is None:
            return value
        return value[start or 0 : end]

    def _size(self, path: str) -> int:
        return len(self._get(path, None, None))

    def _exists(self, path: str) -> bool:
        return self._kv.read(path).result().state == "value"

    def _list(self, path: str) -> list[str]:
        if self._exists(path):
            return [path]
        prefix = path.rstrip("/") + "/"
        keys = self._kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + "0")).result()
        return [k.decode() if isinstance(k, bytes) else k for k in keys]

    def _delete(self, path: str) -> None:
        self._kv.delete_range(ts.KvStore.KeyRange(path, path + "\x00")).result()

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        loc = self.location.child(sub) if sub else self.location
        root = f"{loc.bucket}/{loc.root}".rstrip("/") + "/"
        return {"driver": "memory", "path": root}

    def ts_context(self) -> Any:
        return _shared_context()
