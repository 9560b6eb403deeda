"""A digest of the files a training command runs: the reference cache's key must change
when the script does, not only when its command line does.

`--reference-cache` reuses an uninterrupted reference run across seeds. Keyed on the
command alone, an edited script (a fixed bug, a new learning-rate schedule) was compared
with the old script's reference, and every seed failed (or, worse, passed) for a reason
that had nothing to do with faults. The digest covers each file the command names (the
script, a config passed to it) and, for a Python script, the modules it imports from
its own folder, followed through their own imports: reading a few small files is cheap
next to a reference run. Installed packages are not followed (their version is part of
the environment, not of the user's repository).
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

__all__ = ["files_digest", "local_imports"]


def local_imports(script: Path) -> list[Path]:
    """`script` and the Python files under its folder that it imports, directly or
    through one another (`import helper`, `from pkg import mod`, `from . import x`
    inside a package), in a stable order. A file that does not parse is itself only."""
    root = script.resolve().parent
    seen: dict[Path, None] = {}
    todo = [script.resolve()]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen[path] = None
        todo.extend(p for p in _imported_files(path, root) if p not in seen)
    return sorted(seen)


def _imported_files(path: Path, root: Path) -> Iterable[Path]:
    try:
        tree = ast.parse(path.read_text(errors="replace"), filename=str(path))
    except (OSError, SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield from _module_files(alias.name, root)
        elif isinstance(node, ast.ImportFrom):
            base = root if node.level == 0 else _up(path.parent, node.level - 1)
            if node.module:
                yield from _module_files(node.module, base)
                for alias in node.names:  # `from pkg import mod`: mod may be a module
                    yield from _module_files(f"{node.module}.{alias.name}", base)
            else:
                for alias in node.names:
                    yield from _module_files(alias.name, base)


def _up(folder: Path, levels: int) -> Path:
    for _ in range(levels):
        folder = folder.parent
    return folder


def _module_files(dotted: str, base: Path) -> Iterable[Path]:
    """The files under `base` that importing `dotted` runs: each package's
    `__init__.py` on the way, and the module itself."""
    folder = base
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        module, package = folder / f"{part}.py", folder / part / "__init__.py"
        if package.is_file():
            yield package.resolve()
        elif module.is_file() and i == len(parts) - 1:
            yield module.resolve()
            return
        if not (folder / part).is_dir():
            return
        folder = folder / part


def files_digest(paths: Iterable[Path], root: Path) -> str:
    """sha256 over each file's name (relative to `root` when under it, so a repository
    checked out elsewhere keeps its key) and bytes (a file that cannot be read counts by
    its name alone), in the order given."""
    h = hashlib.sha256()
    for path in paths:
        name = path.relative_to(root) if path.is_relative_to(root) else path
        h.update(str(name).encode() + b"\0")
        try:
            h.update(path.read_bytes())
        except OSError:
            h.update(b"<unreadable>")
        h.update(b"\0")
    return h.hexdigest()
