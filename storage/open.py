"""`open_store(url)`: the one door from a URL to a `Store`."""

from __future__ import annotations

import os
from typing import Any

from storage.base import Store
from storage.fsspec_store import LocalStore, S3Store
from storage.memory_store import MemoryStore
from storage.retry import RetryPolicy
from storage.settings import S3Settings
from storage.url import parse_url

__all__ = ["open_store"]


def open_store(
    url: str | os.PathLike[str] | Store,
    *,
    retry: RetryPolicy | None = None,
    s3: S3Settings | None = None,
    **s3_overrides: Any,
) -> Store:
    """A store for `/path`, `file:///path`, `s3://bucket/prefix` or `memory://name/prefix`.

    S3 settings come from the environment (`AWS_ENDPOINT_URL`, `AWS_REGION`, and the
    credentials) unless `s3` or overrides such as `endpoint_url=` are given. An
    existing `Store` is returned as it is, so APIs can take either.
    """
    if isinstance(url, Store):
        return url
    location = parse_url(url)
    if location.scheme == "file":
        return LocalStore(location, retry)
    if location.scheme == "memory":
        return MemoryStore(location, retry)
    settings = s3 or S3Settings.from_env(**s3_overrides)
    return S3Store(location, settings, retry)
