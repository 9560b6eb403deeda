"""Retry with capped exponential backoff and full jitter, and the classification of
errors into transient (retry) and permanent (fail at once, typed)."""

from __future__ import annotations

import errno
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from relight.storage.errors import (
    BucketNotFoundError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

__all__ = ["RetryPolicy", "classify", "call_with_retry", "is_missing_bucket", "missing_bucket"]

_TRANSIENT_ERRNOS = {
    errno.ECONNRESET,
    errno.ECONNREFUSED,
    errno.ECONNABORTED,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EAGAIN,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
}
_TRANSIENT_MARKERS = (
    "SlowDown",
    "ServiceUnavailable",
    "Service Unavailable",
    "InternalError",
    "RequestTimeout",
    "Connection reset",
    "Connection was closed",
    "ConnectionClosed",
    "Could not connect",
    "Read timeout",
    "timed out",
    "503",
    "500 ",
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How transient storage failures are retried."""

    max_attempts: int = 6
    """Tries in all, the first included; 1 disables retrying."""
    base_delay_s: float = 0.05
    """Delay bound before the second try; doubles each try."""
    max_delay_s: float = 2.0
    """Cap on one delay."""

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 1, got {self.max_attempts}")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("RetryPolicy delays must be >= 0")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
        return rng.uniform(0.0, min(self.max_delay_s, self.base_delay_s * (2**attempt)))


def is_missing_bucket(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) is S3's NoSuchBucket: s3fs
    turns it into a plain `FileNotFoundError` whose cause is botocore's error."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, BucketNotFoundError) or "NoSuchBucket" in type(e).__name__ \
                or "NoSuchBucket" in str(e) or "specified bucket does not exist" in str(e):
            return True
        e = e.__cause__ or e.__context__
    return False


def missing_bucket(url: str) -> BucketNotFoundError:
    """The error for a URL whose S3 bucket does not exist."""
    bucket = url.split("://", 1)[-1].split("/", 1)[0]
    return BucketNotFoundError(
        f"S3 bucket {bucket!r} does not exist ({url}): check the bucket name in the URL "
        f"and the endpoint (AWS_ENDPOINT_URL), or create the bucket", url=url, bucket=bucket)


def classify(exc: BaseException, url: str, op: str = "") -> StorageError:
    """Map any exception from a backend to a typed `StorageError` naming `url`; `op`
    ("put", "get", "list", ...) is the operation that raised it."""
    if isinstance(exc, StorageError):
        return exc
    text = f"{type(exc).__name__}: {exc}"
    if url.startswith("s3://") and is_missing_bucket(exc):
        return missing_bucket(url)
    if isinstance(exc, FileNotFoundError):
        if op in ("put", "put_if_absent"):  # a write found no parent: not a missing object
            return StorageError(f"{op} to {url} failed: its location does not exist ({text})",
                                url=url)
        return ObjectNotFoundError(f"no such object: {url}", url=url)
    if isinstance(exc, PermissionError):
        return StoragePermissionError(
            f"access denied to {url}: check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
            "and the bucket policy",
            url=url,
        )
    if isinstance(exc, TimeoutError | ConnectionError):
        return TransientStorageError(f"transient failure on {url}: {text}", url=url)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return TransientStorageError(f"transient failure on {url}: {text}", url=url)
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        # botocore found no (or half a) key pair: retrying cannot help.
        return StoragePermissionError(
            f"no S3 credentials for {url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
            "(or AWS_PROFILE) in the environment of every process",
            url=url,
        )
    module = type(exc).__module__ or ""
    if module.startswith(("botocore", "aiohttp", "urllib3")) or any(
        marker in text for marker in _TRANSIENT_MARKERS
    ):
        if "NoSuchKey" in text:
            return ObjectNotFoundError(f"no such object: {url}", url=url)
        denied = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch")
        if any(code in text for code in denied):
            return StoragePermissionError(f"access denied to {url}: {type(exc).__name__}", url=url)
        return TransientStorageError(f"transient failure on {url}: {text}", url=url)
    return StorageError(f"storage operation on {url} failed: {text}", url=url)


def call_with_retry(
    fn: Callable[[], T],
    url: str,
    policy: RetryPolicy,
    rng: random.Random | None = None,
    on_retry: Callable[[], None] | None = None,
    op: str = "",
) -> T:
    """Run `fn` (operation `op`); retry transient failures per `policy`; raise a typed
    error otherwise."""
    rng = rng or random.Random()
    attempt = 0
    while True:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - classified below, re-raised typed
            err = classify(exc, url, op)
            attempt += 1
            if not isinstance(err, TransientStorageError) or attempt >= policy.max_attempts:
                if isinstance(err, TransientStorageError) and attempt > 1:
                    err = TransientStorageError(
                        f"{err} (gave up after {attempt} attempts)", url=url
                    )
                raise err from exc
            pause = policy.delay(attempt - 1, rng)
            logger.warning(
                "transient storage error on %s (attempt %d/%d), retrying in %.3fs: %s",
                url, attempt, policy.max_attempts, pause, err,
            )
            if on_retry is not None:
                on_retry()
            time.sleep(pause)
