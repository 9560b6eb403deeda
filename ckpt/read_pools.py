"""The threads, lock and buffers every load of a process shares: `read_pools()`.

They are the process's, not a checkpointer's: the cores they run on are the process's,
and two managers loading at once should share them, not double them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from relight.storage import Store
from relight.storage.direct_io import BufferPool

__all__ = ["READ_GAP_BYTES", "READ_THREADS", "ReadPools", "read_pools"]

READ_THREADS = {"memory": 2, "direct": 8, "remote": 8}
"""Shard-read threads per process: a read from memory (`memory`) is a copy, CPU work on
cores the ranks share; a read of files, around the page cache unless it holds the
range (`direct`, `storage.direct_io`), and a request to S3 (`remote`) wait on the
device or the network, so more in flight hide the latency. On local files 2, 4 and 8
threads measured alike (the device's speed moved more between passes than between
settings); S3 needs them in flight. The measurements: docs/design/ckpt-load-path.md."""


READ_GAP_BYTES = {"memory": 0, "direct": 0, "remote": 4 << 20}
"""How far apart two needed inner chunks of one shard object may lie and still come in
one ranged get, the bytes between them fetched and dropped. On S3 a request costs its
first-byte latency and the client's CPU, as long as moving megabytes takes (tens of ms
at ~100 MB/s on real S3; against the loopback S3 server here ~4 ms and ~1.5 ms of client
CPU per get, the bytes at ~2 MB per ms); a read of local files or memory costs little
per call, so nothing is fetched for nothing there. The measurements:
docs/design/ckpt-load-path.md."""


def _kind(store: Store) -> str:
    return {"file": "direct", "memory": "memory"}.get(store.location.scheme, "remote")


class ReadPools:
    """Shard-read threads by kind of store, the lock that serializes chunk decoding, and
    the buffers fetched shard bytes land in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self.decode_lock = threading.Lock()
        """One thread per process checks and copies fetched chunks (CPU); fetches overlap."""
        self.buffers = BufferPool()
        """What the read threads fetch shard bytes into, reused within a load and dropped
        when it ends (`ckpt.loader.load`)."""

    def pool(self, store: Store) -> ThreadPoolExecutor:
        """Threads for direct shard reads of `store`'s kind, shared by every load."""
        kind = _kind(store)
        with self._lock:
            if kind not in self._pools:
                self._pools[kind] = ThreadPoolExecutor(
                    max_workers=READ_THREADS[kind], thread_name_prefix="ckpt-read")
            return self._pools[kind]

    @staticmethod
    def gap_bytes(store: Store) -> int:
        """`READ_GAP_BYTES` for `store`'s kind."""
        return READ_GAP_BYTES[_kind(store)]


_READ_POOLS = ReadPools()


def read_pools() -> ReadPools:
    """This process's `ReadPools`."""
    return _READ_POOLS
