"""Typed storage errors. Each subclasses the built-in a caller would catch anyway
(`FileNotFoundError`, `PermissionError`, `ValueError`), and each names the URL of
the object it is about, never the credentials used to reach it."""

from __future__ import annotations

from relight.errors import RelightError

__all__ = [
    "StorageError",
    "ObjectNotFoundError",
    "BucketNotFoundError",
    "StoragePermissionError",
    "TransientStorageError",
    "InjectedFaultError",
    "ObjectTruncatedError",
    "InvalidStorageURLError",
    "InvalidKeyError",
]


class StorageError(RelightError, OSError):
    """Base of every error raised by `storage`. `url` names the object (no secrets)."""

    def __init__(self, message: str, url: str | None = None) -> None:
        super().__init__(message)
        self.url = url

    def __str__(self) -> str:  # OSError's default str drops our message when errno is unset
        return self.args[0] if self.args else super().__str__()


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """The object (or bucket) does not exist. Permanent: never retried."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The S3 bucket of the URL does not exist (a typo in the URL, or not created yet).
    Permanent: never retried. Not an `ObjectNotFoundError`: a missing bucket must never
    read as an empty checkpoint root. `bucket` names it."""

    def __init__(self, message: str, url: str | None = None, bucket: str = "") -> None:
        super().__init__(message, url=url)
        self.bucket = bucket


class StoragePermissionError(StorageError, PermissionError):
    """Credentials are missing or refused (HTTP 403). Permanent: never retried."""


class TransientStorageError(StorageError):
    """A failure worth retrying (connection reset, timeout, 500/503/SlowDown).
    Raised to the caller only once the retry budget is spent."""


class InjectedFaultError(TransientStorageError):
    """A fault injected on purpose by `FaultyStore` (tests and chaos)."""


class ObjectTruncatedError(StorageError):
    """An object is shorter than the byte range asked of it."""


class InvalidStorageURLError(StorageError, ValueError):
    """The URL has an unknown scheme or is malformed."""


class InvalidKeyError(StorageError, ValueError):
    """A key that would leave the store's root (`..`, absolute, empty segments)."""
