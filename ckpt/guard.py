"""`guard_optimizer`: an optimizer's next step waits until a pipelined save has copied
the state (`SaveOptions(pipelined_staging=True)`), so a snapshot is never torn."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from relight.ckpt.checkpointer import wait_staged
from relight.ckpt.handle import SaveHandle

logger = logging.getLogger(__name__)

__all__ = ["guard_optimizer"]


def guard_optimizer(optimizer: Any,
                    source: SaveHandle | Callable[[], SaveHandle | None] | None = None) -> Any:
    """Register a step pre-hook on `optimizer` that waits until the save from `source`
    (a handle, a callable returning the current handle or None; default: this
    process's latest save) no longer reads the state. Returns the hook's handle
    (`.remove()` to take it off). Seconds waited in total: `optimizer.ckpt_waited_s`.

    This guards the optimizer's in-place updates (parameters and their state). A
    state that changes elsewhere before the next step (e.g. BatchNorm running stats in
    the forward pass) needs `ckpt.wait_staged()` before that change."""
    optimizer.ckpt_waited_s = 0.0

    def hook(opt: Any, args: Any, kwargs: Any) -> None:
        if source is None:
            waited = wait_staged()
        else:
            h = source if isinstance(source, SaveHandle) else source()
            waited = h.wait_staged() if h is not None else 0.0
        opt.ckpt_waited_s += waited
        if waited > 0.001:
            logger.debug("optimizer step waited %.3f s for checkpoint staging", waited)

    return optimizer.register_step_pre_hook(hook)
