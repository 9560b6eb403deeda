"""storage: the one door to bytes.

`open_store(url)` turns `/path`, `file://`, `s3://bucket/prefix` or `memory://` into a
`Store`: atomic puts, ranged gets, listing, deletes, retried on transient errors,
typed errors otherwise, and the tensorstore kvstore spec of the same location.
Nothing else in Relight talks to a filesystem or S3 directly.

Fault injection (`FaultyStore`, `FaultPlan`, `corrupt_object`, the `RELIGHT_FAULT_PLAN`
hook of `open_store`) is a testing surface of its own: `storage.testing`.
"""

from relight.storage.base import DeferredStore, Store, StoreStats
from relight.storage.errors import (
    BucketNotFoundError,
    InjectedFaultError,
    InvalidKeyError,
    InvalidStorageURLError,
    ObjectNotFoundError,
    ObjectTruncatedError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)
from relight.storage.open import open_store
from relight.storage.retry import RetryPolicy
from relight.storage.settings import S3Settings
from relight.storage.url import StorageLocation, parse_url

__all__ = [
    "BucketNotFoundError",
    "DeferredStore",
    "InjectedFaultError",
    "InvalidKeyError",
    "InvalidStorageURLError",
    "ObjectNotFoundError",
    "ObjectTruncatedError",
    "RetryPolicy",
    "S3Settings",
    "StorageError",
    "StorageLocation",
    "StoragePermissionError",
    "Store",
    "StoreStats",
    "TransientStorageError",
    "open_store",
    "parse_url",
]
