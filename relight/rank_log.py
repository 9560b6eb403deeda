"""The one way log lines name the rank and step they come from: ``[rank R step S]``, or
``[rank R]`` where no step applies.

The trainer, its watchdog and preemption watcher, and the checkpoint engine all prefix
their lines this way, so that one grep follows a rank through a run (docs/operations.md,
"Logs"). A leaf module, like `relight.errors`: every layer may use it.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

__all__ = ["RankStepLogger", "rank_step_prefix"]


def rank_step_prefix(rank: int, step: int | None = None) -> str:
    """``[rank R step S]``, or ``[rank R]`` when `step` is None (no step applies)."""
    return f"[rank {rank}]" if step is None else f"[rank {rank} step {step}]"


class RankStepLogger(logging.LoggerAdapter):
    """`logger` with every message prefixed by ``rank_step_prefix(rank, step)``. The step
    moves with the run: set `step` (or ``extra["step"]``) as it advances."""

    def __init__(self, logger: logging.Logger, rank: int, step: int | None = None) -> None:
        self._fields: dict[str, Any] = {"rank": rank, "step": step}
        super().__init__(logger, self._fields)

    @property
    def rank(self) -> int:
        return self._fields["rank"]

    @property
    def step(self) -> int | None:
        return self._fields["step"]

    @step.setter
    def step(self, step: int | None) -> None:
        self._fields["step"] = step

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]
                ) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{rank_step_prefix(self.rank, self.step)} {msg}", kwargs
