"""`verify(url)`: is a checkpoint committed, complete and undamaged?

Reads the commit marker and manifest (checksummed), checks that every object the
manifest implies exists, and reads every chunk through tensorstore so each crc32c is
checked. Problems are collected, each naming the tensor and the object, not raised.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckpt.errors import CheckpointError
from ckpt.format import DATA_PREFIX
from ckpt.manifest import Manifest, read_manifest
from ckpt.tsio import map_ts_error, open_array
from storage import StorageError, Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    url: str
    ok: bool = True
    problems: list[str] = field(default_factory=list)
    step: int | None = None
    tensors: int = 0
    objects: int = 0
    bytes: int = 0

    def add(self, problem: str) -> None:
        self.ok = False
        self.problems.append(problem)

    def to_json(self) -> dict[str, Any]:
        return {"url": self.url, "ok": self.ok, "problems": self.problems, "step": self.step,
                "tensors": self.tensors, "objects": self.objects, "bytes": self.bytes}


def _regions(shape: list[int], chunks: list[int]):
    if not shape:
        yield ()
        return
    grids = [range(math.ceil(s / c)) for s, c in zip(shape, chunks, strict=True)]
    for cell in itertools.product(*grids):
        yield tuple(slice(i * c, min((i + 1) * c, s))
                    for i, c, s in zip(cell, chunks, shape, strict=True))


def verify(url: str | os.PathLike[str] | Store, *, read_data: bool = True,
           progress: Callable[[int, int, str], None] | None = None) -> VerifyReport:
    """Check the checkpoint at `url`; `read_data=False` skips reading chunk contents.
    `progress(done, total, tensor)` is called before each tensor is read (a CLI bar)."""
    store = open_store(url)
    report = VerifyReport(store.url)
    try:
        m: Manifest = read_manifest(store)
    except (CheckpointError, StorageError) as e:
        report.add(str(e))
        return report
    report.step = m.step
    report.tensors = len(m.tensors)
    try:
        present = set(store.list(f"{DATA_PREFIX}{m.raw.get('attempt')}/"))
        present |= set(store.list("index/"))
    except StorageError as e:
        report.add(f"cannot list {store.url}: {e}")
        return report
    expected = m.expected_objects()
    report.objects = len(expected)
    missing_tensors: set[str] = set()
    for key, tensor in sorted(expected.items()):
        if key not in present:
            report.add(f"missing object {store.url}/{key}"
                       + (f" of tensor {tensor!r}" if tensor else " (packed small tensors)"))
            missing_tensors.add(tensor)
    for rank, key in (m.raw.get("index") or {}).items():
        if key not in present:
            report.add(f"missing index object {store.url}/{key} of rank {rank}")
    if not read_data:
        return report
    for i, (name, t) in enumerate(m.tensors.items()):
        if progress is not None:
            progress(i, len(m.tensors), name)
        if name in missing_tensors:
            continue
        try:
            if t["storage"] == "grid":
                arr = open_array(store, t["array"], m.meta_of(name), read=True).result()
                for region in _regions(t["shape"], t["chunks"]):
                    obj = t["array"]
                    try:
                        a = (arr[region] if region else arr).read().result()
                    except Exception as e:  # noqa: BLE001
                        raise map_ts_error(e, store.url, name, obj) from e
                    report.bytes += a.nbytes
            elif t["storage"] == "pieces":
                for p in t["pieces"]:
                    arr = open_array(store, p["array"], m.meta_of(name, p), read=True).result()
                    try:
                        report.bytes += arr.read().result().nbytes
                    except Exception as e:  # noqa: BLE001
                        raise map_ts_error(e, store.url, name, p["array"]) from e
        except CheckpointError as e:
            report.add(str(e))
        except Exception as e:  # noqa: BLE001
            report.add(f"tensor {name!r}: {type(e).__name__}: {e}")
    for arr_path in m.raw.get("packed", {}):
        if f"{arr_path}/zarr.json" not in present:
            continue
        users = sorted(n for n, t in m.tensors.items() if t["storage"] == "packed"
                       and any(p["array"] == arr_path for p in t["pieces"]))
        first = next(iter(users), "")
        try:
            piece = {"array": arr_path}
            arr = open_array(store, arr_path, m.meta_of(first, piece), read=True).result()
            report.bytes += arr.read().result().nbytes
        except Exception as e:  # noqa: BLE001
            err = map_ts_error(e, store.url, ", ".join(users[:3]) + ("..." if len(users) > 3
                                                                       else ""), arr_path)
            report.add(str(err))
    if not report.ok:
        logger.warning("verify %s: %d problem(s), first: %s", store.url, len(report.problems),
                       report.problems[0])
    return report
