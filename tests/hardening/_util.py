"""Shared pieces of the hardening tests: a small state dict, bitwise comparison, a
snapshot of every stored object (to prove an older checkpoint was not touched), the
manifest re-signer, what counts as a typed error, and the tally of what was tried."""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from relight import ckpt, storage
from relight.ckpt.format import COMMIT_KEY, MANIFEST_KEY
from relight.ckpt.manifest import crc32c

TYPED = (ckpt.CheckpointError, storage.StorageError)
"""Every failure of a load or save must be one of these (each subclasses a built-in)."""

TALLY_ENV = "RELIGHT_HARDENING_TALLY"
_TALLY_LOCK = threading.Lock()


def tally(counter: str, n: int = 1) -> None:
    """Add `n` to `counter` in the JSON file named by RELIGHT_HARDENING_TALLY (if set):
    docs/hardening.md's figures are these counts, summed over one test run."""
    path = os.environ.get(TALLY_ENV)
    if not path:
        return
    with _TALLY_LOCK:
        try:
            with open(path) as fh:
                counts = json.load(fh)
        except (FileNotFoundError, ValueError):
            counts = {}
        counts[counter] = counts.get(counter, 0) + n
        with open(path + ".tmp", "w") as fh:
            json.dump(counts, fh, indent=1, sort_keys=True)
        os.replace(path + ".tmp", path)


def make_state(seed: int) -> dict[str, Any]:
    """Grid tensors (several inner chunks), packed small ones, four dtypes, JSON values."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(256, 192, generator=g),
        "h": torch.randn(128, 64, generator=g).half(),
        "bf": torch.randn(96, 80, generator=g).bfloat16(),
        "hi": torch.randint(-(2**15), 2**15, (128, 64), generator=g, dtype=torch.int16),
        "b": torch.randn(32, generator=g),
        "idx": torch.randint(-(2**40), 2**40, (9,), generator=g),
        "n": seed + 3,
        "cfg": {"lr": 0.5 * (seed + 1), "tags": ["a", "b"]},
    }


OPTIONS = ckpt.SaveOptions(pack_bytes=4 << 10, inner_bytes=16 << 10)
"""w, h, bf as their own arrays of several crc32c-checked inner chunks; b, idx packed."""


def local_store(path: str | os.PathLike[str]) -> storage.Store:
    """A directory store without fsync: these tests check what is published, not
    durability across power cuts, and fsync on a shared CI disk costs most of their time."""
    from relight.storage.fsspec_store import LocalStore

    return LocalStore(storage.parse_url(os.fspath(path)), fsync=False)


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None
            for k, v in state.items()}


def assert_bitwise(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert got.keys() == want.keys()
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            a, b = got[k], v
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), k
        else:
            assert got[k] == v, k


def snapshot(store: storage.Store, prefix: str = "") -> dict[str, str]:
    """key -> sha256 of every object under `prefix`."""
    return {k: hashlib.sha256(store.get(k)).hexdigest() for k in store.list(prefix)}


def resign(store: storage.Store, raw: bytes) -> None:
    """Store `raw` as the manifest and make the commit marker vouch for it, as a buggy or
    hostile writer would: the checksum then no longer protects the reader."""
    store.put(MANIFEST_KEY, raw)
    commit = json.loads(store.get(COMMIT_KEY))
    commit.update(manifest_bytes=len(raw), manifest_crc32c=crc32c(raw))
    store.put(COMMIT_KEY, json.dumps(commit).encode())


def edit_manifest(store: storage.Store, edit: Callable[[dict[str, Any]], Any]) -> None:
    m = json.loads(store.get(MANIFEST_KEY))
    edit(m)
    resign(store, json.dumps(m).encode())


def run_bounded(fn: Callable[[], Any], timeout_s: float) -> tuple[Any, BaseException | None]:
    """Run `fn` in a thread; fail the test if it has not returned within `timeout_s`."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(timeout_s)
    assert not th.is_alive(), f"call still running after {timeout_s} s (a hang)"
    return box.get("value"), box.get("error")
