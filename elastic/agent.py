"""torchrun's local elastic agent, surviving the loss of a round's store host.

After a rendezvous round completes, torchrun's agent assigns worker ranks through the
round's store (`_assign_worker_ranks`: every agent writes its role, the rank 0 agent
reads them all and writes the assignment back). That store is the c10d TCPStore the
round's rank 0 node hosts. If that node dies inside this window (milliseconds to a
store timeout), the other agents' `store.get` raises `DistNetworkError` (or
`DistStoreError` on a timeout) straight out of the agent's run loop, and every surviving
agent exits: one node's death kills the job (seen in chaos preemptible-fleet seed 8).

`RoundRetryingAgent` retries the whole rendezvous instead: the handler is asked for the
next round (for `relight-etcd`, a node calling `next_rendezvous` after a complete round
opens a new one, which forms without the dead node once its lease is gone), and the
ranks are assigned through the new round's store. It changes nothing else about the
agent: no restart slot is spent, workers are not touched (none run yet at this point).

`relight run` installs it for the duration of the launch (`installed()`); a plain
`torchrun --rdzv-backend=relight-etcd` keeps torchrun's own agent and this window.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elastic.rendezvous import record_event

__all__ = ["MAX_ROUND_RETRIES", "RoundRetryingAgent", "installed"]

logger = logging.getLogger(__name__)

MAX_ROUND_RETRIES = 5
"""Rounds abandoned in a row because their store failed before the agent gives up."""


class RoundRetryingAgent(LocalElasticAgent):
    """A `LocalElasticAgent` whose rendezvous is retried when the round's store fails."""

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        for attempt in range(1, MAX_ROUND_RETRIES + 2):
            try:
                super()._rendezvous(worker_group)
                return
            except DistError as exc:
                if attempt > MAX_ROUND_RETRIES:
                    raise
                handler = worker_group.spec.rdzv_handler
                logger.warning(
                    "the store of the rendezvous round failed while assigning ranks "
                    "(%s: %s); its host is likely gone. Opening a new round "
                    "(retry %d of %d)", type(exc).__name__, exc, attempt, MAX_ROUND_RETRIES)
                record_event("rdzv_store_lost", run_id=handler.get_run_id(),
                             attempt=attempt, error=f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Make torchrun's launcher build `RoundRetryingAgent` instead of its own agent."""
    import torch.distributed.launcher.api as launcher

    saved = launcher.LocalElasticAgent
    launcher.LocalElasticAgent = RoundRetryingAgent
    try:
        yield
    finally:
        launcher.LocalElasticAgent = saved
