"""`storage.checksum.crc32c`: the same value from either implementation, any buffer."""

from __future__ import annotations

import google_crc32c
import numpy as np
import pytest

import relight.storage.checksum as checksum


@pytest.mark.parametrize("fast", [True, False], ids=["crc32c", "google_crc32c"])
def test_crc32c_matches_the_reference_on_every_buffer_type(fast, monkeypatch) -> None:
    if not fast:
        monkeypatch.setattr(checksum, "_fast", None)
    elif checksum._fast is None:
        pytest.skip("the crc32c package is not installed")
    assert checksum.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    data = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8)
    want = google_crc32c.value(data.tobytes())
    for buf in (data, data.tobytes(), bytearray(data.tobytes()), memoryview(data)):
        assert checksum.crc32c(buf) == want
    # A slice of an array (how shard chunks are checked) and continuing from a value.
    assert checksum.crc32c(data[100:300]) == google_crc32c.value(data[100:300].tobytes())
    assert checksum.crc32c(data[1000:], checksum.crc32c(data[:1000])) == want
    assert checksum.crc32c(b"") == 0
