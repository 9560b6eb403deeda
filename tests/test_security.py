"""No load path may execute bytes it reads: a static scan of the library packages.

Checkpoints, manifests, configs and etcd values are all read by code in these
packages; the scan refuses every way Python has to turn read bytes into code:
pickle and friends, `torch.load` without `weights_only=True`, `eval`/`exec`,
`numpy.load(allow_pickle=True)` and `yaml.load` without a safe loader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("storage", "ckpt", "elastic", "runtime", "chaos", "benchmarks")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "marshal", "shelve", "cloudpickle"}


def _library_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((kw.value for kw in call.keywords if kw.arg == name), None)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def findings(source: str, filename: str = "<src>") -> list[str]:
    problems = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            problems += [f"{where}: import {a.name}" for a in node.names
                         if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom):
            if (node.module or "").split(".")[0] in UNSAFE_MODULES:
                problems.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in ("eval", "exec", "builtins.eval", "builtins.exec"):
                problems.append(f"{where}: {name}()")
            elif name.endswith("torch.load"):
                weights_only = _keyword(node, "weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    problems.append(f"{where}: torch.load without weights_only=True")
            elif name in ("np.load", "numpy.load"):
                allow = _keyword(node, "allow_pickle")
                if allow is not None and not (isinstance(allow, ast.Constant) and not allow.value):
                    problems.append(f"{where}: numpy.load(allow_pickle=...)")
            elif name == "yaml.load" and _keyword(node, "Loader") is None:
                problems.append(f"{where}: yaml.load without a safe Loader")
    return problems


@pytest.mark.parametrize(
    "snippet",
    [
        "import pickle",
        "from pickle import loads",
        "import torch\ntorch.load(f)",
        "import torch\ntorch.load(f, weights_only=False)",
        "eval(text)",
        "exec(code)",
        "import numpy as np\nnp.load(f, allow_pickle=True)",
        "import yaml\nyaml.load(s)",
    ],
)
def test_scanner_catches_each_unsafe_form(snippet: str) -> None:
    assert findings(snippet), f"scanner missed: {snippet!r}"


def test_scanner_accepts_safe_forms() -> None:
    safe = "import json, torch\njson.loads(s)\ntorch.load(f, weights_only=True)\n"
    assert findings(safe) == []


def test_library_has_no_unsafe_deserialization() -> None:
    files = _library_files()
    assert len(files) > 5, "scan found no library files: wrong root?"
    problems = [p for f in files for p in findings(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == [], "unsafe deserialization on a library path:\n" + "\n".join(problems)
