"""Imports flow one way: every import statement of the installed package (module level,
inside functions and under TYPE_CHECKING alike) reads from its own layer or a lower one.

    relight.errors, relight.exit_codes, relight.rank_log   leaf modules every layer may use
    relight.storage                         the one door to bytes
    relight.ckpt                            the checkpoint engine
    relight.elastic                         etcd, the launcher, replica groups
    relight.runtime                         the training runtime
    relight.chaos                           the chaos harness
    relight.benchmarks                      the side-by-side measurements
    relight.cli, relight (the facade)       the application on top
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["relight.errors", "relight.exit_codes", "relight.rank_log", "relight.storage",
          "relight.ckpt", "relight.elastic", "relight.runtime", "relight.chaos",
          "relight.benchmarks", "relight.cli"]
LEAVES = {"relight.errors", "relight.exit_codes", "relight.rank_log"}
FOLDERS = {"storage": "relight.storage", "ckpt": "relight.ckpt", "elastic": "relight.elastic",
           "runtime": "relight.runtime", "chaos": "relight.chaos",
           "benchmarks": "relight.benchmarks"}
SUBPACKAGES = {name.split(".")[1] for name in LAYERS}


def layer_of(module: str) -> int | None:
    """The layer of a `relight...` module; the bare facade `relight` is the top."""
    if module == "relight":
        return len(LAYERS) - 1
    for i, name in enumerate(LAYERS):
        if module == name or module.startswith(name + "."):
            return 0 if name in LEAVES else i
    return None


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) for every import of a `relight` module in the tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "relight"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "relight":  # `from relight import ckpt` names a subpackage
                found += [(node.lineno, f"relight.{a.name}" if a.name in SUBPACKAGES
                           else "relight") for a in node.names]
            elif node.module.split(".")[0] == "relight":
                found.append((node.lineno, node.module))
    return found


def package_modules() -> list[tuple[Path, str]]:
    files = [(p, "relight." + p.stem) for p in (ROOT / "relight").glob("*.py")
             if p.stem != "__init__"]
    for folder, package in FOLDERS.items():
        files += [(p, package) for p in (ROOT / folder).rglob("*.py")]
    return files


def violations(files: list[tuple[Path, str]]) -> list[str]:
    bad = []
    for path, package in files:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        own = layer_of(package)
        assert own is not None, path
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            target = layer_of(module)
            if target is None:
                bad.append(f"{where}:{line}: {module} is in no layer")
            elif target > own:
                bad.append(f"{where}:{line}: {package} imports {module}")
    return bad


def test_no_import_runs_from_a_lower_layer_to_a_higher_one() -> None:
    files = package_modules()
    assert len(files) > 100  # the whole package was read
    assert violations(files) == []


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    """The same check on planted files: an upward import is reported, wherever it sits."""
    planted = tmp_path / "planted.py"
    planted.write_text("from relight.errors import RelightError\n"
                       "from relight.storage import open_store\n"
                       "def f():\n    from relight.runtime.config import Config\n"
                       "from relight import chaos, RelightError\n")
    found = violations([(planted, "relight.ckpt")])
    assert sorted(v.split(": ", 1)[1] for v in found) == [
        "relight.ckpt imports relight",
        "relight.ckpt imports relight.chaos",
        "relight.ckpt imports relight.runtime.config"]


PUBLIC_CKPT = {"relight.ckpt", "relight.ckpt.state_layout"}
"""What the fault-tolerance layer may import of the checkpoint engine: its package API and
its layout API, not the modules behind them."""


def test_upper_layers_reach_the_checkpoint_engine_only_through_its_public_api() -> None:
    """The fault-tolerance layer and the trainer. (The chaos harness's checkpoint probe
    inspects the stored objects themselves, and the benchmarks time the engine's
    internals: both look behind the API on purpose.)"""
    reached = []
    for path, package in package_modules():
        if package not in ("relight.elastic", "relight.runtime"):
            continue
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            if module.startswith("relight.ckpt") and module not in PUBLIC_CKPT:
                reached.append(f"{path.relative_to(ROOT)}:{line}: {module}")
    assert reached == []
    import relight.ckpt.state_layout as layout_api

    assert all(hasattr(layout_api, name) for name in layout_api.__all__)
