"""Flattening a nested state dict into named tensors and JSON values, and back.

A state dict is a nested dict/list of tensors (plain or DTensor), objects with
`state_dict()`/`load_state_dict()`, and plain JSON values. Every leaf gets a name
built from its path (`model/layers.0.weight`, `optim/state/.../exp_avg`); that name
is its identity in the manifest, independent of any rank or layout. A container
that holds no tensor and no stateful object is one JSON value as a whole.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from relight.ckpt.errors import UnsupportedStateError

__all__ = ["FlatState", "TensorRef", "ValueRef", "flatten_state", "name_of", "is_stateful"]

PathT = tuple[str | int, ...]


def name_of(path: PathT) -> str:
    """The manifest name of a path: segments joined by '/', with '%' and '/' escaped."""
    return "/".join(str(s).replace("%", "%25").replace("/", "%2F") for s in path)


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, (Mapping, list, tuple, torch.Tensor))
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


@dataclass
class TensorRef:
    name: str
    path: PathT
    tensor: torch.Tensor


@dataclass
class ValueRef:
    name: str
    path: PathT
    value: Any
    parent: Any = None
    key: Any = None


@dataclass
class FlatState:
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    values: dict[str, ValueRef] = field(default_factory=dict)
    statefuls: list[tuple[Any, dict[str, Any], str]] = field(default_factory=list)
    """(object, the state dict it gave, name) in the order to call load_state_dict."""


def _holds_state(value: Any) -> bool:
    if isinstance(value, torch.Tensor) or is_stateful(value):
        return True
    if isinstance(value, Mapping):
        return any(_holds_state(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_state(v) for v in value)
    return False


def _check_json(value: Any, name: str) -> Any:
    """`value` as plain JSON (tuples become lists), or UnsupportedStateError."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return value  # written as NaN/Infinity, which Python's json reads back
        return float(value)
    if isinstance(value, (list, tuple)):
        return [_check_json(v, f"{name}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise UnsupportedStateError(
                    f"state dict value {name!r} has a non-string key {k!r} inside a JSON "
                    "value; use string keys (JSON objects only have string keys)",
                    tensor=name,
                )
            out[k] = _check_json(v, f"{name}.{k}")
        return out
    raise UnsupportedStateError(
        f"state dict value {name!r} has type {type(value).__name__}, which is neither a "
        "tensor, an object with state_dict()/load_state_dict(), nor a JSON value; convert "
        "it (nothing is pickled)",
        tensor=name,
    )


def flatten_state(state_dict: Mapping[str, Any]) -> FlatState:
    """Walk `state_dict`; call `state_dict()` on stateful objects (once each)."""
    if not isinstance(state_dict, Mapping):
        raise UnsupportedStateError(
            f"a state dict must be a dict, got {type(state_dict).__name__}"
        )
    flat = FlatState()

    def visit(value: Any, path: PathT, parent: Any, key: Any) -> None:
        name = name_of(path)
        if isinstance(value, torch.Tensor):
            if name in flat.tensors or name in flat.values:
                raise UnsupportedStateError(f"two state dict entries share the name {name!r}")
            flat.tensors[name] = TensorRef(name, path, value)
            return
        if is_stateful(value):
            sub = value.state_dict()
            if not isinstance(sub, Mapping):
                raise UnsupportedStateError(
                    f"{name!r}: {type(value).__name__}.state_dict() returned "
                    f"{type(sub).__name__}, not a dict", tensor=name)
            flat.statefuls.append((value, sub, name))
            for k, v in sub.items():
                visit(v, (*path, k), sub, k)
            return
        if _holds_state(value):
            items = value.items() if isinstance(value, Mapping) else enumerate(value)
            for k, v in items:
                if not isinstance(k, (str, int)):
                    raise UnsupportedStateError(
                        f"state dict key {k!r} under {name!r} is neither str nor int")
                visit(v, (*path, k), value, k)
            return
        if name in flat.tensors or name in flat.values:
            raise UnsupportedStateError(f"two state dict entries share the name {name!r}")
        flat.values[name] = ValueRef(name, path, _check_json(value, name), parent, key)

    for k, v in state_dict.items():
        if not isinstance(k, (str, int)):
            raise UnsupportedStateError(f"top-level state dict key {k!r} is neither str nor int")
        visit(v, (k,), state_dict, k)
    return flat


def set_value(ref: ValueRef, value: Any) -> None:
    """Load a JSON value into its parent container: a dict stored over a dict of the
    target is merged into the target's dict in place (the stored keys win, keys only the
    target has keep their values; nested dicts alike), anything else is replaced."""
    parent = ref.parent
    if isinstance(parent, tuple):
        raise UnsupportedStateError(
            f"cannot load JSON value {ref.name!r}: it sits in a tuple; use a list", tensor=ref.name)
    current = parent[ref.key]
    if isinstance(current, dict) and isinstance(value, dict):
        _merge(current, value)
    else:
        parent[ref.key] = value


def _merge(target: dict[str, Any], stored: dict[str, Any]) -> None:
    for k, v in stored.items():
        if isinstance(target.get(k), dict) and isinstance(v, dict):
            _merge(target[k], v)
        else:
            target[k] = v
