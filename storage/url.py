"""Parsing storage URLs into a location: scheme, bucket and a root prefix."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import urlsplit

from relight.storage.errors import InvalidKeyError, InvalidStorageURLError

__all__ = ["StorageLocation", "parse_url", "check_key", "join_key"]

SCHEMES = ("file", "s3", "memory")


@dataclass(frozen=True, slots=True)
class StorageLocation:
    """Where a store's root is. `root` has no trailing slash; for S3 it excludes the bucket."""

    scheme: str
    bucket: str
    root: str

    @property
    def url(self) -> str:
        """Canonical URL, safe to log (a URL never carries credentials here)."""
        if self.scheme == "file":
            return f"file://{self.root}"
        tail = f"/{self.root}" if self.root else ""
        return f"{self.scheme}://{self.bucket}{tail}"

    def child(self, sub: str) -> StorageLocation:
        sub = check_key(sub.strip("/"), self.url) if sub.strip("/") else ""
        if not sub:
            return self
        if self.scheme == "file":
            return StorageLocation(self.scheme, self.bucket, f"{self.root.rstrip('/')}/{sub}")
        return StorageLocation(self.scheme, self.bucket, join_key(self.root, sub))


def parse_url(url: str | os.PathLike[str]) -> StorageLocation:
    """`/path`, `relative/path`, `file:///path`, `s3://bucket/prefix`, `memory://name/prefix`."""
    text = os.fspath(url)
    if not text:
        raise InvalidStorageURLError("empty storage URL", url=text)
    if "://" not in text:
        return StorageLocation("file", "", os.path.abspath(text))
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidStorageURLError(
            f"unsupported storage URL scheme {scheme!r} in {text!r}; use one of "
            f"/path, file://, s3://bucket/prefix, memory://name",
            url=text,
        )
    if parts.username or parts.password:
        # Never accept credentials inside a URL: they would end up in logs and manifests.
        raise InvalidStorageURLError(
            f"credentials in a storage URL are not accepted ({scheme}://...@...); "
            "use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
            url=f"{scheme}://{parts.hostname or ''}{parts.path}",
        )
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidStorageURLError(f"file URL with a host: {text!r}", url=text)
        return StorageLocation("file", "", os.path.abspath(parts.path or "/"))
    bucket = parts.netloc
    if not bucket:
        raise InvalidStorageURLError(f"{scheme} URL without a bucket/name: {text!r}", url=text)
    root = parts.path.strip("/")
    if root:
        check_key(root, text)
    return StorageLocation(scheme, bucket, root)


def check_key(key: str, where: str = "") -> str:
    """Return `key` if it is a safe relative key; raise `InvalidKeyError` otherwise."""
    if not isinstance(key, str) or not key:
        raise InvalidKeyError(f"empty or non-string key {key!r} in {where}", url=where)
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise InvalidKeyError(f"key {key!r} is absolute or has illegal characters ({where})", where)
    for segment in key.split("/"):
        if segment in ("", ".", ".."):
            raise InvalidKeyError(f"key {key!r} would leave the store root ({where})", url=where)
    return key


def join_key(*parts: str) -> str:
    return "/".join(p.strip("/") for p in parts if p and p.strip("/"))
