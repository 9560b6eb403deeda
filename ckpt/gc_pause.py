"""`gc_paused`: run a function with Python's cyclic garbage collector paused.

Planning at thousands of ranks and parsing a manifest of thousands of tensors allocate
millions of small objects and no cycles; every full collection walks all of them (and
whatever the process already holds) again. Planning grew faster than the number of
pieces because of it (at 256 ranks of Llama-3-8B on FSDP, 40% of `plan_save`), and the
first parse of a 16,384-rank manifest took three times as long as the next ones. The
pause is process-wide for the call's duration (seconds at most).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["gc_paused"]

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(fn: Callable[P, R]) -> Callable[P, R]:
    """`fn` with the cyclic garbage collector paused while it runs (left as it was when
    it was already off)."""

    @functools.wraps(fn)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused
