"""torchrun's local elastic agent with four changes for preemptible fleets.

`relight run` installs `RelightAgent` for the duration of the launch (`installed()`); a
plain `torchrun --rdzv-backend=relight-etcd` keeps torchrun's own agent, without them.

**A round whose store host dies is retried.** After a rendezvous round completes,
torchrun's agent assigns worker ranks through the round's store (`_assign_worker_ranks`:
every agent writes its role, the rank 0 agent reads them all and writes the assignment
back). That store is the c10d TCPStore the round's rank 0 node hosts. If that node dies
inside this window (milliseconds to a store timeout), the other agents' `store.get`
raises `DistNetworkError` (or `DistStoreError` on a timeout) straight out of the agent's
run loop, and every surviving agent exits: one node's death kills the job (seen in chaos
preemptible-fleet seed 8). Here the whole rendezvous is retried instead: the handler is
asked for the next round (for `relight-etcd`, a node calling `next_rendezvous` after a
complete round opens a new one, which forms without the dead node once its lease is
gone), and the ranks are assigned through the new round's store. No restart slot is
spent and no worker is touched (none run yet at this point).

**A preemption does not spend a restart slot.** Workers stopped by a preemption notice
save and exit `PREEMPTED_EXIT_CODE` (76); torchrun's agent counts that group like a
crashed one against `--max-restarts`, so a job on spot capacity would die after
max-restarts preemptions however healthy it is. Here a group whose failed workers all
exited 76 gets its slot back, as torchrun already does for membership changes, unless it
stopped within `preemption_free_after_s()` of its start: a notice that never clears would
otherwise restart it forever.

**A failure no restart can fix ends the job.** A group whose failed workers all exited
with a status of `relight.exit_codes.FATAL_EXIT_CODES` (bad config; every committed
checkpoint damaged) is not restarted: torchrun's agent would spend every slot rerunning
the same failure (chaos preemptible-fleet seed 9 restarted 40 times in 26 minutes).

**A spare that was never needed exits 0.** A hot spare waits in the rendezvous for as
long as the job lives; when the job finishes, the rendezvous closes and the handler raises
`RendezvousGracefulExitError`. torchrun's agent then returns no result, which its launcher
fails on; here the spare's run succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator

from torch.distributed import DistError
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from relight.elastic.rendezvous import record_event
from relight.exit_codes import FATAL_EXIT_CODES, PREEMPTED_EXIT_CODE

__all__ = ["MAX_ROUND_RETRIES", "PREEMPTION_FREE_AFTER_ENV", "RelightAgent", "installed",
           "preemption_free_after_s"]

logger = logging.getLogger(__name__)

MAX_ROUND_RETRIES = 5
"""Rounds abandoned in a row because their store failed before the agent gives up."""
PREEMPTION_FREE_AFTER_ENV = "RELIGHT_PREEMPTION_FREE_AFTER_S"
"""Seconds a worker group must have run for a preemption exit not to spend a restart slot
(default 60)."""


def preemption_free_after_s() -> float:
    raw = os.environ.get(PREEMPTION_FREE_AFTER_ENV, "60")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{PREEMPTION_FREE_AFTER_ENV}={raw!r} is not a number of seconds"
                         ) from None
    if value < 0:
        raise ValueError(f"{PREEMPTION_FREE_AFTER_ENV}={raw!r} must be >= 0")
    return value


class RelightAgent(LocalElasticAgent):
    """A `LocalElasticAgent` that retries a round whose store failed, gives a preempted
    group its restart slot back and does not restart a fatal failure (see the module
    docstring)."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - torchrun's
        super().__init__(*args, **kwargs)
        self._free_after_s = preemption_free_after_s()
        self._group_started = time.monotonic()
        self._last_result: RunResult | None = None

    def run(self, role: str = "default") -> RunResult:
        result = super().run(role)
        if result is None:
            # torchrun's agent returns nothing after RendezvousGracefulExitError (a hot
            # spare whose job finished) and its launcher then fails on the missing
            # result; a spare that was never needed has succeeded.
            logger.info("the job finished while this node waited as a spare: exiting 0")
            return RunResult(state=WorkerState.SUCCEEDED)
        return result

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

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, object]:
        self._group_started = time.monotonic()
        return super()._start_workers(worker_group)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = self._last_result = super()._monitor_workers(worker_group)
        if (result.state == WorkerState.FAILED and result.failures
                and all(f.exitcode in FATAL_EXIT_CODES for f in result.failures.values())
                and self._remaining_restarts > 0):
            codes = sorted({f.exitcode for f in result.failures.values()})
            logger.error("worker group failed with exit status %s, which no restart can fix "
                         "(relight/exit_codes.py): not restarting (%d restarts left unused)",
                         codes, self._remaining_restarts)
            record_event("restart_refused", run_id=worker_group.spec.rdzv_handler
                         .get_run_id(), exit_codes=codes, ranks=sorted(result.failures))
            self._remaining_restarts = 0  # torchrun's loop then stops the group and exits
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # The agent loop spent a slot just before calling this for a failed group.
        result, lived = self._last_result, time.monotonic() - self._group_started
        if (result is not None and result.state == WorkerState.FAILED and result.failures
                and all(f.exitcode == PREEMPTED_EXIT_CODE for f in result.failures.values())):
            ranks = sorted(result.failures)
            if lived >= self._free_after_s:
                self._remaining_restarts += 1
                logger.info("worker group preempted (ranks %s exited %d after %.0f s): "
                            "restarting without spending a restart slot (%d left)", ranks,
                            PREEMPTED_EXIT_CODE, lived, self._remaining_restarts)
                record_event("restart_not_counted", run_id=worker_group.spec.rdzv_handler
                             .get_run_id(), reason="preempted", ranks=ranks,
                             lived_s=round(lived, 3))
            else:
                logger.warning("worker group preempted %.0f s after its start (< %.0f s, "
                               "%s): this restart spends a slot", lived, self._free_after_s,
                               PREEMPTION_FREE_AFTER_ENV)
        super()._restart_workers(worker_group)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Make torchrun's launcher build `RelightAgent` instead of its own agent."""
    import torch.distributed.launcher.api as launcher

    saved = launcher.LocalElasticAgent
    launcher.LocalElasticAgent = RelightAgent
    try:
        yield
    finally:
        launcher.LocalElasticAgent = saved
