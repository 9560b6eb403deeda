"""Cross-group process groups: one per quorum, from a factory the replica manager is given.

Every new quorum gets a process group of its own, built from a fresh store prefix, and a
failed collective throws it away (`ReplicaManager`). What builds it is a
`ProcessGroupFactory`:

- `GlooGroups`: CPU tensors, or CUDA tensors staged through host memory. Every operation
  is bounded by the group's timeout, so a dead peer fails the step instead of hanging it.
- `NcclGroups`: CUDA tensors reduced on the device (no host copy of the gradients). A
  communicator is created per quorum (never reused across quorums: a member that failed
  may have left it mid-operation); a collective that fails or outlives the timeout
  aborts the communicator (`abort`), so no kernel stays queued on a dead peer and the
  next quorum starts from a fresh one. Waits are bounded on the host
  (`Work.wait(timeout)`), as gloo's are by its options.

`default_factory(device)` picks NCCL for CUDA state when torch was built with it, gloo
otherwise. Mixed-layout quorums (groups whose layouts differ) route boxes point to point
(`elastic.regions`) over gloo whatever the factory: their transfers are host-side.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["GlooGroups", "NcclGroups", "ProcessGroupFactory", "default_factory"]


@runtime_checkable
class ProcessGroupFactory(Protocol):
    """Builds and tears down the cross-group process group of one quorum."""

    backend: str
    """`"gloo"` or `"nccl"`: for logs and for choosing the tensors' device."""
    device: torch.device
    """Where the reduction's buffers live (CPU for gloo, the rank's GPU for NCCL)."""

    def create(self, store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroup:
        """A process group of `size` members on `store` (a prefix of the quorum's
        own), every operation bounded by `timeout`."""
        ...

    def wait(self, work: dist.Work, timeout: timedelta) -> None:
        """Wait for `work`, raising (RuntimeError / DistError) if it failed or ran past
        `timeout`."""
        ...

    def abort(self, pg: dist.ProcessGroup) -> None:
        """Release a failed group: after a collective failed on it, or when its quorum
        is replaced. Must not block on peers."""
        ...


class GlooGroups:
    """Gloo process groups on `host`'s interface (the address other groups reach)."""

    backend = "gloo"

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.device = torch.device("cpu")

    def create(self, store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroup:
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
        return dist.ProcessGroupGloo(store, rank, size, options)

    def wait(self, work: dist.Work, timeout: timedelta) -> None:
        # Gloo's own timeout (set at creation) bounds every operation already.
        work.wait()

    def abort(self, pg: dist.ProcessGroup) -> None:
        # Only gloo's destructor closes its sockets (its abort() and shutdown() leave a
        # peer blocked in a collective with us until its timeout): the caller drops the
        # last reference, and must not keep the failed collective's exception (its
        # traceback holds the work, which holds the group).
        del pg


class NcclGroups:
    """NCCL process groups on `device` (default: the current CUDA device)."""

    backend = "nccl"

    def __init__(self, device: torch.device | None = None) -> None:
        if not dist.is_nccl_available():
            raise RuntimeError("NcclGroups: this torch build has no NCCL "
                               f"(torch {torch.__version__}); use GlooGroups")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if device.type != "cuda":
            raise ValueError(f"NcclGroups needs a CUDA device, got {device}")
        self.device = device

    def create(self, store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroup:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A communicator per quorum, bound to this rank's device: created at once (not
        # lazily at the first collective), so a peer that never arrives fails the build.
        pg = dist.ProcessGroupNCCL(store, rank, size, options)
        # Eager init: one tiny collective on the device.
        probe = torch.zeros(1, device=self.device)
        self.wait(pg.allreduce([probe]), timeout)
        return pg

    def wait(self, work: dist.Work, timeout: timedelta) -> None:
        # `wait(timeout)` blocks the host until the kernel completed (or raises past
        # `timeout`); plain `wait()` only orders the current stream after it.
        if not work.wait(timeout):
            raise RuntimeError(f"NCCL collective did not complete within {timeout}")

    def abort(self, pg: dist.ProcessGroup) -> None:
        try:
            pg.abort()
        except (RuntimeError, AttributeError) as exc:  # already torn down by the watchdog
            logger.debug("aborting a failed NCCL group: %s", exc)


def default_factory(device: torch.device | str | None, host: str = "127.0.0.1"
                    ) -> ProcessGroupFactory:
    """NCCL for CUDA state when torch was built with it; gloo otherwise."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda" and dist.is_nccl_available():
        return NcclGroups(dev)
    return GlooGroups(host)
