"""Array I/O through tensorstore (zarr v3), on the store's own kvstore spec.

Arrays are opened with `assume_metadata` from metadata we already hold (the plan on
save, the manifest on load), so opening costs no round trip; `fill_missing_data_reads`
is off, so a missing chunk is an error instead of silent zeros. Whole uncompressed
shards bypass tensorstore (`ckpt.shardio`); this module serves the rest.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np
import torch

from relight.ckpt.errors import ChecksumMismatchError, CorruptCheckpointError, MissingChunkError
from relight.storage import Store

__all__ = ["to_numpy", "from_numpy", "open_array", "put_metadata", "map_ts_error"]

# tensorstore and ml_dtypes are imported on first use: together they are over a second
# of a worker's start (ml_dtypes' extension alone ~1.1 s on this 2-core machine), and a
# job whose arrays all take the direct path (`ckpt.shardio`: uncompressed, whole shards)
# never needs them before its first step.


def tensorstore() -> Any:
    """The `tensorstore` module, imported on first use."""
    import tensorstore as ts

    return ts


_CTX_LOCK = threading.Lock()
_CTX: Any = None


def _default_context() -> Any:
    """One tensorstore Context per process for file/memory stores. Few I/O threads: many
    ranks share a host's cores, and page-cache I/O is CPU work (RELIGHT_TS_IO_THREADS)."""
    global _CTX
    with _CTX_LOCK:
        if _CTX is None:
            threads = int(os.environ.get("RELIGHT_TS_IO_THREADS", "8"))
            _CTX = tensorstore().Context({"file_io_concurrency": {"limit": threads}})
        return _CTX


def context_of(store: Store) -> Any:
    ctx = store.ts_context()
    return ctx if ctx is not None else _default_context()


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (bfloat16 through ml_dtypes)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype.name == "bfloat16":  # ml_dtypes' bfloat16, by name: no import for others
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def open_array(store: Store, path: str, meta: dict[str, Any], *, read: bool) -> Any:
    """A future of the tensorstore array `path` (relative to the store root)."""
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": store.kvstore_spec(path),
        "metadata": meta,
        "assume_metadata": True,
        "open": True,
    }
    if read:
        spec["fill_missing_data_reads"] = False
        spec["recheck_cached_data"] = False
    else:
        # Store every chunk, zeros too: reads refuse missing chunks, and by default
        # tensorstore drops chunks equal to the fill value (an all-zero shard or tile
        # would be unreadable). Also what `ckpt.shardio` writes, byte for byte.
        spec["store_data_equal_to_fill_value"] = True
    return tensorstore().open(spec, context=context_of(store))


def put_metadata(store: Store, path: str, meta: dict[str, Any]) -> None:
    """zarr.json, so plain zarr readers can open the array."""
    store.put(f"{path}/zarr.json", json.dumps(meta, indent=1).encode())


def map_ts_error(exc: BaseException, url: str, tensor: str, obj: str) -> CorruptCheckpointError:
    msg = str(exc)
    low = msg.lower()
    where = f"tensor {tensor!r}, object {url}/{obj}"
    if "not_found" in low or "is missing" in low:
        return MissingChunkError(
            f"{where}: a chunk is missing ({msg}); the checkpoint is incomplete, restore an "
            "older one", url=url, tensor=tensor, obj=obj)
    if "checksum" in low or "crc" in low:
        return ChecksumMismatchError(
            f"{where}: checksum mismatch ({msg}); the stored bytes are damaged, restore an "
            "older checkpoint", url=url, tensor=tensor, obj=obj)
    return CorruptCheckpointError(
        f"{where}: could not decode stored data ({msg}); a truncated or damaged chunk, "
        "restore an older checkpoint", url=url, tensor=tensor, obj=obj)
