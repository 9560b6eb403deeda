"""`open_store(url)`: the one door from a URL to a `Store`."""

from __future__ import annotations

import os
from typing import Any

from relight.storage.base import Store
from relight.storage.fault_env import FAULT_PLAN_ENV, wrap_store_from_env
from relight.storage.fsspec_store import LocalStore, S3Store
from relight.storage.retry import RetryPolicy
from relight.storage.settings import S3Settings
from relight.storage.url import parse_url

__all__ = ["DIRECT_IO_ENV", "open_store"]

DIRECT_IO_ENV = "RELIGHT_DIRECT_IO"
"""Set to 1 to write large local objects around the page cache (`O_DIRECT`,
`storage.direct_io`); by default they are written through it."""


def open_store(
    url: str | os.PathLike[str] | Store,
    *,
    retry: RetryPolicy | None = None,
    s3: S3Settings | None = None,
    **s3_overrides: Any,
) -> Store:
    """A store for `/path`, `file:///path`, `s3://bucket/prefix` or `memory://name/prefix`.

    Files: ranges of 1 MiB and more are read from the page cache when it holds them
    whole, else around it (`O_DIRECT`, where the filesystem takes it); objects are
    written through the cache, or around it with `RELIGHT_DIRECT_IO=1`.

    S3 settings come from the environment (`AWS_ENDPOINT_URL`, `AWS_REGION`, and the
    credentials) unless `s3` or overrides such as `endpoint_url=` are given. An
    existing `Store` is returned as it is, so APIs can take either.

    Testing hook: only when the environment sets `RELIGHT_FAULT_PLAN` (the chaos
    harness does for the processes it starts; a test may) is the store wrapped in a
    fault-injecting store following that plan (`storage.testing`). Unset, the plain
    store is returned.

    Args:
        url: a path, a `file://`, `s3://` or `memory://` URL, or a `Store`.
        retry: the retry policy for transient errors (default: `RetryPolicy()`).
        s3: S3 settings (default: from the environment, with `s3_overrides`).
        **s3_overrides: fields of `S3Settings` (e.g. `endpoint_url=`, `region=`) over the
            environment's, when `s3` is not given.

    Returns:
        The `Store` (nothing is contacted yet: opening costs no request).

    Raises:
        InvalidStorageURLError: the URL is empty, of an unknown scheme, or lacks a bucket.
        FaultPlanError: `RELIGHT_FAULT_PLAN` is set but not a valid fault plan
            (`storage.testing.FaultPlanError`).
    """
    if isinstance(url, Store):
        return url
    location = parse_url(url)
    store: Store
    if location.scheme == "file":
        direct = os.environ.get(DIRECT_IO_ENV, "0").strip().lower() in ("1", "true", "yes")
        store = LocalStore(location, retry, direct_io=direct)
    elif location.scheme == "memory":
        # Only here: the memory store lives in tensorstore, whose import is over a
        # second of a process's start; file and S3 stores never need it.
        from relight.storage.memory_store import MemoryStore

        store = MemoryStore(location, retry)
    else:
        settings = s3 or S3Settings.from_env(**s3_overrides)
        store = S3Store(location, settings, retry)
    if os.environ.get(FAULT_PLAN_ENV, "").strip():
        return wrap_store_from_env(store)
    return store
