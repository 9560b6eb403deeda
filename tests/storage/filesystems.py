"""What the tests need to know of the filesystem under a path."""

from __future__ import annotations

MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose pages are the file: `drop_cached` cannot drop them."""


def on_memory_filesystem(path: str) -> bool:
    """Whether `path` lies on a filesystem whose pages are the file."""
    return fstype(path) in MEMORY_FILESYSTEMS


def fstype(path: str) -> str:
    """The type of the filesystem holding `path` (longest mount point that contains it)."""
    best, kind = "", ""
    with open("/proc/mounts") as f:
        for line in f:
            _dev, mnt, found = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, kind = mnt, found
    return kind
