"""Export, import and compare checkpoints: safetensors, torch.distributed.checkpoint (DCP).

Every export streams: shapes and dtypes come from the manifest, then each tensor is read
whole from the checkpoint, written out and dropped, so memory holds at most one tensor
(plus tensorstore's buffers). The safetensors file is written by hand (8-byte little-endian
header length, a JSON header of dtype/shape/data_offsets, then the raw bytes) so no extra
package is needed.

Each function takes an optional `progress(done, total, item)` callback (bytes done and in
all, the tensor or phase at hand; `total == 0` while the size is unknown): the CLI's bars.

`import_dcp` reads a DCP checkpoint: DCP's own `.metadata` file is a pickle, unpickled by
`torch.distributed.checkpoint` itself. That is DCP's format, reached only by this explicit,
user-started import of a local directory; Relight's own load paths never unpickle.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from relight.ckpt.checkpointer import save
from relight.ckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    MissingKeyError,
    UnsupportedStateError,
)
from relight.ckpt.format import DTYPES, dtype_name
from relight.ckpt.manifest import Manifest, TensorEntry, read_manifest
from relight.ckpt.reader import RegionReader
from relight.storage import Store, open_store

__all__ = [
    "DiffReport",
    "TensorDiff",
    "diff",
    "export_dcp",
    "export_safetensors",
    "import_dcp",
    "iter_tensors",
    "read_tensor",
    "select_tensors",
]

MODEL_PREFIX = "model/"

Progress = Callable[[int, int, str], None]
"""`progress(done, total, item)`: units done and in all (0: unknown yet), what is at hand."""


def _nbytes(t: TensorEntry) -> int:
    return t.nbytes


SAFETENSORS_DTYPES: dict[str, str] = {
    "float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL",
}


def _store(url: str | Store) -> Store:
    return url if isinstance(url, Store) else open_store(url)


def read_tensor(store: Store, m: Manifest, name: str) -> torch.Tensor:
    """One tensor of a committed checkpoint, whole, on the CPU."""
    if name not in m.tensors:
        raise MissingKeyError(f"tensor {name!r} is not in checkpoint {store.url}",
                              url=store.url, tensor=name)
    t = m.tensors[name]
    box = ((0,) * len(t.shape), t.shape)
    reader = RegionReader(store, m, name, box, DTYPES[t.dtype])
    out = reader.result()
    # The reader's packed-tensor converters close over the reader (a cycle): drop them,
    # or each tensor would live until the cyclic GC runs and memory would hold several.
    reader.parts.clear()
    return out


def select_tensors(m: Manifest, all_tensors: bool = False) -> list[str]:
    """The manifest names to export: `model/...` tensors, or every tensor with `all_tensors`."""
    names = sorted(m.tensors)
    return names if all_tensors else [n for n in names if n.startswith(MODEL_PREFIX)]


def iter_tensors(store: Store, m: Manifest, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` one at a time; the caller drops each before the next."""
    for name in names:
        yield name, read_tensor(store, m, name)


def _export_selection(url: str | Store, all_tensors: bool,
                      ) -> tuple[Store, Manifest, list[str], dict[str, str]]:
    """The store, manifest, tensor names and exported keys shared by every export."""
    store = _store(url)
    m = read_manifest(store)
    names = select_tensors(m, all_tensors)
    if not names:
        raise MissingKeyError(
            f"checkpoint {store.url} has no {'tensors' if all_tensors else 'model/... tensors'}"
            "; pass --all to export every tensor", url=store.url)
    return store, m, names, _keys(m, names, all_tensors, store.url)


def read_all(url: str | Store) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `url`, whole, by manifest name (for comparisons
    and tools; a training process loads into its own layout with `ckpt.load`)."""
    store = _store(url)
    m = read_manifest(store)
    return dict(iter_tensors(store, m, sorted(m.tensors)))


def _out_key(m: Manifest, name: str, all_tensors: bool) -> str:
    """The exported key. Model-only exports drop the `model` segment and join the rest
    with `.`, so the file loads into `model.load_state_dict` directly; `--all` keeps the
    path (segments joined with `.`, as DCP and `state_dict()` name them)."""
    path = m.tensors[name].path or name.split("/")
    segs = [str(s) for s in path]
    if not all_tensors and segs and segs[0] == "model" and len(segs) > 1:
        segs = segs[1:]
    return ".".join(segs)


def _keys(m: Manifest, names: list[str], all_tensors: bool, url: str) -> dict[str, str]:
    keys: dict[str, str] = {}
    seen: dict[str, str] = {}
    for n in names:
        k = _out_key(m, n, all_tensors)
        if k in seen:
            raise UnsupportedStateError(
                f"tensors {seen[k]!r} and {n!r} of checkpoint {url} would both be exported as "
                f"{k!r}; rename one", url=url, tensor=n)
        seen[k] = n
        keys[n] = k
    return keys


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def export_safetensors(url: str | Store, out: str | os.PathLike[str], *,
                       all_tensors: bool = False, metadata: dict[str, str] | None = None,
                       progress: Progress | None = None) -> dict[str, Any]:
    """Write the checkpoint's tensors as one safetensors file at local path `out`,
    streamed (header from the manifest first, then one tensor at a time), atomically
    (a temp file renamed into place). Returns `{"tensors", "bytes", "path"}`."""
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little endian
        raise UnsupportedStateError("safetensors export needs a little-endian host")
    store, m, names, keys = _export_selection(url, all_tensors)
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "relight_step": str(m.step),
                                               "relight_url": store.url, **(metadata or {})}}
    offset = 0
    for n in names:
        t = m.tensors[n]
        nbytes = _nbytes(t)
        header[keys[n]] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                           "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, like the reference writer
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for n, tensor in iter_tensors(store, m, names):
                raw = _raw_bytes(tensor)
                want = header[keys[n]]["data_offsets"]
                if len(raw) != want[1] - want[0]:
                    raise CheckpointError(
                        f"tensor {n!r} of {store.url}: read {len(raw)} bytes, the manifest "
                        f"says {want[1] - want[0]}", url=store.url, tensor=n)
                f.write(raw)
                if progress is not None:
                    progress(want[1], offset, n)
                del tensor, raw
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return {"tensors": len(names), "bytes": offset, "path": str(out)}


# ------------------------------------------------------------------------- DCP


def _lazy_planner(store: Store, m: Manifest, key_to_name: dict[str, str],
                  progress: Progress | None = None) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    total = sum(_nbytes(m.tensors[n]) for n in key_to_name.values())
    done = 0

    class _LazyPlanner(DefaultSavePlanner):
        """Plans from meta-tensor placeholders; `resolve_data` reads each tensor from the
        Relight checkpoint only when DCP's writer asks for it (one at a time with the
        serial loader a single-threaded FileSystemWriter uses on CPU). JSON values are
        DCP's own bytes entries."""

        def resolve_data(self, write_item: Any) -> Any:
            nonlocal done
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            name = key_to_name[write_item.index.fqn]
            tensor = read_tensor(store, m, name)
            done += _nbytes(m.tensors[name])
            if progress is not None:
                progress(done, total, name)
            return tensor

    # DCP flattens the nested state dict itself, as `dcp.load` will flatten the target's,
    # and records each key's path (planner_data): the keys match on both sides.
    return _LazyPlanner(flatten_state_dict=True, flatten_sharded_tensors=False)


def _name_path(name: str) -> list[str]:
    """The path segments of a manifest name (`ckpt.flatten.name_of`, reversed)."""
    return [seg.replace("%2F", "/").replace("%25", "%") for seg in name.split("/")]


def _set_path(root: dict[str, Any], path: list[Any] | tuple[Any, ...], value: Any,
              where: str) -> None:
    """Put `value` at `path` in nested dicts (str segments) and lists (int segments),
    creating the containers on the way."""
    cur: Any = root
    for i, seg in enumerate(path):
        last = i == len(path) - 1
        fresh: Any = value if last else ([] if isinstance(path[i + 1], int) else {})
        if isinstance(cur, list):
            if not isinstance(seg, int):
                if not str(seg).isdigit():
                    raise UnsupportedStateError(f"{where}: segment {seg!r} of {list(path)} "
                                                "indexes a list", tensor=where)
                seg = int(seg)
            cur.extend([None] * (seg + 1 - len(cur)))
            if last or cur[seg] is None:
                cur[seg] = fresh
            cur = cur[seg]
        elif isinstance(cur, dict):
            if last:
                if seg in cur:
                    raise UnsupportedStateError(f"{where}: two entries at {list(path)}",
                                                tensor=where)
                cur[seg] = value
            cur = cur.setdefault(seg, fresh)
        else:
            raise UnsupportedStateError(f"{where}: {list(path[:i])} holds a value, not a "
                                        "container", tensor=where)


def export_dcp(url: str | Store, out_dir: str | os.PathLike[str], *,
               all_tensors: bool = False, progress: Progress | None = None) -> dict[str, Any]:
    """Write the checkpoint as a torch.distributed.checkpoint directory that
    `torch.distributed.checkpoint.load` reads, without a process group. Keys are the
    state-dict paths joined with `.` (`model.layers.0.weight`; without `all_tensors` the
    `model.` prefix is dropped, as in the safetensors export). With `all_tensors` the
    JSON values are written too (DCP's bytes entries: `optim.param_groups.0.lr`, the
    step), so a full model + optimizer state dict loads with `dcp.load`. Tensors are read
    lazily, one at a time, while DCP writes them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    store, m, names, _ = _export_selection(url, all_tensors)
    nested: dict[str, Any] = {}
    key_to_name: dict[str, str] = {}
    for n in names:
        path: list[Any] = list(m.tensors[n].path or _name_path(n))
        if not all_tensors and path[0] == "model" and len(path) > 1:
            path = [".".join(str(p) for p in path[1:])]
        placeholder = torch.empty(m.tensors[n].shape, dtype=DTYPES[m.tensors[n].dtype],
                                  device="meta")
        _set_path(nested, path, placeholder, n)
        key_to_name[".".join(str(p) for p in path)] = n  # DCP's flattened key of the path
    values = sorted(m.values) if all_tensors else []
    for v in values:  # after the tensors: their paths say which containers are lists
        _set_path(nested, _name_path(v), m.values[v], v)
    writer = FileSystemWriter(str(out_dir), single_file_per_rank=True, sync_files=True,
                              thread_count=1)
    with warnings.catch_warnings():  # "no process group: single process" is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(nested, storage_writer=writer, planner=_lazy_planner(
            store, m, key_to_name, progress), no_dist=True)
    nbytes = sum(_nbytes(m.tensors[n]) for n in names)
    return {"tensors": len(names), "values": len(values), "bytes": nbytes,
            "path": str(out_dir)}


def _dcp_path(key: str, planner_data: Any) -> tuple[Any, ...]:
    """A DCP key's path in the state dict that was saved: DCP's metadata records it
    (`planner_data`, e.g. `('optim', 'state', 'model.embed.weight', 'exp_avg')`); keys of
    checkpoints without it are split at the first `.` (`model.layers.0.weight` ->
    `('model', 'layers.0.weight')`)."""
    if isinstance(planner_data, dict) and isinstance(planner_data.get(key), (tuple, list)):
        return tuple(planner_data[key])
    head, _, rest = key.partition(".")
    return (head, rest) if rest else (head,)


def import_dcp(dcp_dir: str | os.PathLike[str], url: str | Store, *,
               step: int | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """Save a DCP checkpoint directory as a Relight checkpoint: at `url` itself (with
    `ckpt.save`), or with `step` as step `step` of the run root `url` (`CheckpointManager`).

    Every entry lands at the path DCP recorded for it (its metadata's `planner_data`), so
    `{"model": ..., "optim": ...}` saved with `dcp.save` restores into the same nested
    state dict: `optim.state.<fqn>.exp_avg` becomes `optim/state/<fqn>/exp_avg`. Non-tensor
    entries (`param_groups`, counters) are imported as JSON values; one that is not JSON
    (a pickled object) is skipped and returned under `"skipped"`. Holds the whole state in
    memory (one `ckpt.save`).

    Security: DCP's `.metadata` is a pickle that `torch.distributed.checkpoint` unpickles;
    import only directories you trust. Non-tensor entries are read with
    `torch.load(weights_only=True)`. Relight's own load paths never unpickle.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from relight.ckpt.flatten import _check_json

    if not (Path(dcp_dir) / ".metadata").is_file():
        raise CheckpointNotFoundError(
            f"{dcp_dir} is not a DCP checkpoint (no .metadata file)", url=str(dcp_dir))
    reader = FileSystemReader(str(dcp_dir))
    meta = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, md in sorted(meta.state_dict_metadata.items()):
        if isinstance(md, TensorStorageMetadata):
            dtype = md.properties.dtype
            dtype_name(dtype, key)  # refuse dtypes the Relight format does not hold
            flat[key] = torch.empty(tuple(md.size), dtype=dtype)
        else:
            flat[key] = None  # a bytes entry: DCP's planner replaces it with the value
    if not any(isinstance(v, torch.Tensor) for v in flat.values()):
        raise MissingKeyError(f"DCP checkpoint {dcp_dir} holds no tensors", url=str(dcp_dir))
    total = sum(t.numel() * t.element_size() for t in flat.values()
                if isinstance(t, torch.Tensor))

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            # Plain values only (numbers, strings, lists, dicts): no arbitrary objects.
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    # DCP reads everything in one call and ckpt.save writes in one: two phases, no finer.
    if progress is not None:
        progress(0, total, f"reading {dcp_dir}")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=FileSystemReader(str(dcp_dir)),
                 planner=_Planner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=True)
    state: dict[str, Any] = {}
    skipped: list[str] = []
    tensors = values = 0
    for key, v in flat.items():
        if not isinstance(v, torch.Tensor):
            try:
                v = _check_json(v, key)
            except UnsupportedStateError:
                skipped.append(key)
                continue
            values += 1
        else:
            tensors += 1
        _set_path(state, _dcp_path(key, meta.planner_data), v, key)
    config = {"imported_from": str(dcp_dir)}
    if progress is not None:
        progress(total // 2, total, f"saving to {url if isinstance(url, str) else url.url}")
    if step is None:
        save(state, url, config=config).wait()
    else:  # a run root, as the training loop writes it: `ls`/`restore` find the step
        from relight.ckpt.manager import CheckpointManager

        CheckpointManager(url, keep_last=None, config=config).save(step, state,
                                                                   async_save=False).wait()
    if progress is not None:
        progress(total, total, "saved")
    return {"tensors": tensors, "values": values, "skipped": skipped, "bytes": total}


# ------------------------------------------------------------------------ diff


@dataclass
class TensorDiff:
    """How one tensor differs: `max_abs` = max |a - b|; `max_rel` = max |a - b| / max(|a|, |b|)
    over elements (0 where both are 0). `identical` compares the raw bytes."""

    name: str
    identical: bool
    max_abs: float
    max_rel: float


@dataclass
class DiffReport:
    url_a: str
    url_b: str
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)
    tensors: list[TensorDiff] = field(default_factory=list)
    values_differ: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.mismatched or self.values_differ
                    or any(not t.identical for t in self.tensors))

    def to_json(self) -> dict[str, Any]:
        return {"a": self.url_a, "b": self.url_b, "identical": self.identical,
                "only_a": self.only_a, "only_b": self.only_b, "mismatched": self.mismatched,
                "values_differ": self.values_differ,
                "tensors": {t.name: {"identical": t.identical, "max_abs": _num(t.max_abs),
                                     "max_rel": _num(t.max_rel)} for t in self.tensors}}


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)  # JSON has no inf/nan


def _compare(name: str, a: torch.Tensor, b: torch.Tensor) -> TensorDiff:
    same = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) \
        if a.numel() else True
    if same or a.numel() == 0:
        return TensorDiff(name, same, 0.0, 0.0)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    d = (a64 - b64).abs()
    scale = torch.maximum(a64.abs(), b64.abs())
    rel = torch.where(scale > 0, d / scale, torch.zeros_like(d))
    # NaN == NaN bitwise but not numerically: the byte comparison above already says
    # whether they differ; here NaNs count as a difference of inf.
    d = torch.where(torch.isnan(d), torch.full_like(d, math.inf), d)
    rel = torch.where(torch.isnan(rel), torch.full_like(rel, math.inf), rel)
    return TensorDiff(name, False, float(d.max()), float(rel.max()))


def diff(url_a: str | Store, url_b: str | Store, *,
         progress: Progress | None = None) -> DiffReport:
    """Compare two committed checkpoints tensor by tensor (one pair in memory at a time)."""
    sa, sb = _store(url_a), _store(url_b)
    ma, mb = read_manifest(sa), read_manifest(sb)
    r = DiffReport(sa.url, sb.url)
    r.only_a = sorted(set(ma.tensors) - set(mb.tensors))
    r.only_b = sorted(set(mb.tensors) - set(ma.tensors))
    common = sorted(set(ma.tensors) & set(mb.tensors))
    total, done = 2 * sum(_nbytes(ma.tensors[n]) for n in common), 0
    for name in common:
        ta, tb = ma.tensors[name], mb.tensors[name]
        done += _nbytes(ta) + _nbytes(tb)
        if ta.shape != tb.shape or ta.dtype != tb.dtype:
            r.mismatched[name] = f"{ta.dtype}{ta.shape} vs {tb.dtype}{tb.shape}"
            continue
        r.tensors.append(_compare(name, read_tensor(sa, ma, name), read_tensor(sb, mb, name)))
        if progress is not None:
            progress(min(done, total), total, name)
    va, vb = ma.values, mb.values
    r.only_a += sorted(set(va) - set(vb))
    r.only_b += sorted(set(vb) - set(va))
    r.values_differ = sorted(k for k in set(va) & set(vb) if va[k] != vb[k])
    return r
