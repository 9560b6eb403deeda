"""Stopgap: make `storage.open_store` honour RELIGHT_FAULT_PLAN in training processes.

The chaos runner puts this directory on PYTHONPATH of the processes it starts, so Python
imports this file at start-up. When RELIGHT_FAULT_PLAN is set, it waits for `storage.open`
to be imported (no import cost otherwise) and wraps every store `open_store` returns with
`chaos.fault_env.wrap_store_from_env`. It does nothing when storage honours the variable
itself (`storage.open.FAULT_PLAN_ENV_HOOK = True`): that is where the hook belongs, and
then this file can go.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys


def _patch(module) -> None:  # noqa: ANN001 - the freshly executed storage.open module
    if getattr(module, "FAULT_PLAN_ENV_HOOK", False):
        return
    from chaos.fault_env import wrap_store_from_env
    from storage.base import Store

    original = module.open_store

    def open_store(url, *args, **kwargs):  # noqa: ANN001, ANN202 - same signature
        store = original(url, *args, **kwargs)
        return store if isinstance(url, Store) else wrap_store_from_env(store)

    open_store.__doc__ = original.__doc__
    module.open_store = open_store
    module.FAULT_PLAN_ENV_HOOK = True


class _StorageOpenFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        if name != "storage.open":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module) -> None:  # noqa: ANN001
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get("RELIGHT_FAULT_PLAN") and "storage.open" not in sys.modules:
    sys.meta_path.insert(0, _StorageOpenFinder())
