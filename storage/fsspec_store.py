"""Stores on a filesystem and on S3, through fsspec (s3fs for S3)."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import fsspec

from relight.storage.base import TEMP_MARKER, Store, StoreStats
from relight.storage.direct_io import drop_cached, read_aligned, write_file
from relight.storage.retry import RetryPolicy, is_missing_bucket
from relight.storage.settings import S3Settings
from relight.storage.url import StorageLocation

__all__ = ["LocalStore", "S3Store"]

SYNC_THREADS = 8
"""fsyncs a `LocalStore.sync` runs at once."""


class _FsspecStore(Store):
    """Shared primitives over an fsspec filesystem; subclasses say how a put is atomic."""

    fs: fsspec.AbstractFileSystem

    def _get(self, path: str, start: int | None, end: int | None) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def _size(self, path: str) -> int:
        return int(self.fs.info(path)["size"])

    def _exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def _list(self, path: str) -> list[str]:
        try:
            found = self.fs.find(path, detail=True)
        except FileNotFoundError as e:
            if is_missing_bucket(e):  # classified by the retry layer: never an empty root
                raise
            return []
        # Servers with a real directory tree (SeaweedFS's filer) report emptied prefixes
        # as directory entries; only objects are keys.
        return [name for name, info in found.items() if info.get("type") != "directory"]

    def _delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass


class LocalStore(_FsspecStore):
    """A directory on a local or network filesystem."""

    copies_put_buffers = False
    """A put has copied the bytes into the page cache when it returns and keeps no
    reference to them."""

    def __init__(
        self,
        location: StorageLocation,
        retry: RetryPolicy | None = None,
        stats: StoreStats | None = None,
        fsync: bool = True,
        direct_io: bool = False,
    ) -> None:
        super().__init__(location, retry, stats)
        self.fs = fsspec.filesystem("file")
        self.fsync = fsync
        """fsync file and directory on put, so a published object survives a power cut."""
        self.direct_io = direct_io
        """Write large aligned objects around the page cache (`storage.direct_io`), not
        through it. Reads of large ranges take the cache when it holds them, either way."""

    def _root_path(self) -> str:
        return self.location.root

    def get_view(self, key: str, start: int, end: int, scratch: Any) -> memoryview:
        path = self._path(key)
        got = self._retry(lambda: read_aligned(path, start, end, scratch), key, "get")
        if got is None:
            return super().get_view(key, start, end, scratch)
        view, warm = got
        self._got(key, start, end, len(view))
        if warm:
            self.stats.record("bytes_read_cached", len(view))
        return memoryview(view).toreadonly()

    def _drop_cached(self, path: str) -> None:
        drop_cached(path)

    def _with_location(self, location: StorageLocation) -> Store:
        return LocalStore(location, self.retry, self.stats, self.fsync, self.direct_io)

    def _write_temp(self, directory: str, data: bytes, flush: bool) -> tuple[str, list[str]]:
        """Write `data` to a fresh temp file in `directory` (fsynced if `flush` and
        durable); return its path and the directories whose entries a flush must cover:
        `directory` and the parent of each directory this call created. A failed write
        leaves no temp file behind."""
        dirs = [directory]
        tmp = os.path.join(directory, f"{TEMP_MARKER}{uuid.uuid4().hex}")
        for attempt in range(1, DIR_RACE_ATTEMPTS + 1):
            dirs += _make_dirs(directory)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                break
            except FileNotFoundError:
                # A concurrent delete emptied the directory and removed it between our
                # makedirs and this open (`_delete` tidies emptied directories): again.
                if attempt == DIR_RACE_ATTEMPTS:
                    raise
        try:
            try:
                write_file(fd, data, self.direct_io)
                if flush and self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp, list(dict.fromkeys(dirs))

    def _publish(self, path: str, data: bytes, flush: bool) -> list[str]:
        """Temp file + rename; returns the directories whose entries changed."""
        tmp, dirs = self._write_temp(os.path.dirname(path), data, flush)
        try:
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return dirs

    def _put(self, path: str, data: bytes) -> None:
        dirs = self._publish(path, data, flush=True)
        if self.fsync:
            for directory in dirs:
                _fsync_path(directory)

    def _put_unsynced(self, path: str, data: bytes) -> tuple[str, ...]:
        # The file is fsynced here, as for a plain put: its data reaches the disk while
        # the other threads still write theirs (flushing every file at the end measured
        # up to 3x slower with 4 ranks). What waits for `sync` is the directory fsyncs:
        # each forces a journal commit, and at the end the first commits every rename.
        dirs = self._publish(path, data, flush=True)
        return tuple(dirs) if self.fsync else ()

    def _sync_paths(self, paths: list[str]) -> None:
        """fsync each directory whose entries a deferred put changed, once, in parallel:
        after that every published name survives a power cut."""
        if not self.fsync or not paths:
            return
        dirs = sorted(set(paths))
        with ThreadPoolExecutor(max_workers=min(SYNC_THREADS, len(dirs)),
                                thread_name_prefix="store-sync") as pool:
            for _ in pool.map(_fsync_path, dirs):
                pass

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        # Write a temp file, then hard-link it into place: link() fails if the name
        # exists, so of two racing writers exactly one publishes, and never a partial file.
        tmp, dirs = self._write_temp(os.path.dirname(path), data, flush=True)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            _unlink_quietly(tmp)
        if self.fsync:
            for directory in dirs:
                _fsync_path(directory)
        return True

    def _list(self, path: str) -> list[str]:
        if not os.path.isdir(path):
            return [path] if os.path.isfile(path) else []
        found = []
        for dirpath, _dirs, files in os.walk(path):
            found.extend(os.path.join(dirpath, name) for name in files)
        return found

    def _delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        # Keep the tree tidy: remove directories the delete emptied, up to the root.
        directory = os.path.dirname(path)
        root = self.location.root.rstrip("/")
        while directory.startswith(root + "/"):
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = os.path.dirname(directory)

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        path = self.location.child(sub).root if sub else self.location.root
        return {"driver": "file", "path": path.rstrip("/") + "/"}


class S3Store(_FsspecStore):
    """A prefix in an S3 bucket (AWS or any S3-compatible server)."""

    def __init__(
        self,
        location: StorageLocation,
        settings: S3Settings,
        retry: RetryPolicy | None = None,
        stats: StoreStats | None = None,
        fs: Any = None,
        known_buckets: set[str] | None = None,
    ) -> None:
        super().__init__(location, retry, stats)
        self.settings = settings
        self.fs = fs if fs is not None else settings.filesystem()
        self._known_buckets = known_buckets if known_buckets is not None else set()
        """Buckets seen to exist, shared with this store's children."""

    def _root_path(self) -> str:
        return f"{self.location.bucket}/{self.location.root}".rstrip("/")

    def _with_location(self, location: StorageLocation) -> Store:
        return S3Store(location, self.settings, self.retry, self.stats, self.fs,
                       self._known_buckets)

    def _exists(self, path: str) -> bool:
        if self.fs.exists(path):
            return True
        # s3fs answers False for any key of a missing bucket: ask about the bucket once
        # per store family (an absent object is normal; a missing bucket is a wrong URL).
        bucket = self.location.bucket
        if bucket not in self._known_buckets:
            if not self.fs.exists(bucket):
                raise FileNotFoundError(f"NoSuchBucket: {bucket}")
            self._known_buckets.add(bucket)
        return False

    def _put(self, path: str, data: bytes) -> None:
        # One PUT is atomic on S3: readers see the old object or the new one.
        self.fs.pipe_file(path, data)

    def _put_if_absent(self, path: str, data: bytes) -> bool:
        # A conditional PUT (If-None-Match: *): the server refuses it with 412
        # PreconditionFailed when the key exists (AWS S3, SeaweedFS).
        try:
            self.fs.pipe_file(path, data, mode="create")
        except OSError as exc:
            text = f"{exc} {exc.__cause__ or ''}"
            if "PreconditionFailed" in text or "pre-condition" in text or "412" in text:
                return False
            raise
        return True

    def kvstore_spec(self, sub: str = "") -> dict[str, Any]:
        root = self.location.child(sub).root if sub else self.location.root
        return self.settings.kvstore_spec(self.location.bucket, root)

    def ts_context(self) -> Any:
        return self.settings.ts_context()


DIR_RACE_ATTEMPTS = 5
"""Tries to create a temp file whose directory a concurrent delete keeps removing."""


def _make_dirs(directory: str) -> list[str]:
    """Create `directory` and its missing parents; return the parent of each directory
    created (whose entry a flush must cover), deepest first."""
    missing = []
    d = directory
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        missing.append(d)
        d = os.path.dirname(d)
    if missing:
        os.makedirs(directory, exist_ok=True)
    return [os.path.dirname(m) for m in missing]


def _fsync_path(path: str) -> None:
    """fsync a file or a directory by name."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
