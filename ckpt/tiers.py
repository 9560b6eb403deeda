"""`open_checkpoint_root`: the store stack a run's checkpoints go through.

Without tiers that is the persistent store alone. With `TierOptions`, every rank fronts
it with a `TieredStore` (`ckpt.tiered`) over its node's local tier (`ckpt.local_tier`),
and with `peer_replicas` > 0 the node's first rank also runs the node's replica server
(`ckpt.peer`) and every rank copies to the next k nodes in name order. A restore then
reads each data object from the first tier of `ckpt.tiered.RESTORE_ORDER` that may
serve it.

Call order, on every rank of the process group: `open_checkpoint_root` (collective when
tiers are on: node names, the peers' token and the servers' addresses travel in two
all-gathers, on the calling thread), then a `CheckpointManager` over `root.store`; at the
end `root.drop_local_tier()` (collective) when the run is complete, and `root.close()`.
"""

from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from relight.ckpt.comm import Comm
from relight.ckpt.local_tier import REPLICA_DIR, TierStats, local_tier_dir, tier_node
from relight.ckpt.peer import PeerServer
from relight.ckpt.tiered import TieredStore
from relight.rank_log import rank_step_prefix
from relight.storage import Store, open_store

logger = logging.getLogger(__name__)

__all__ = ["CheckpointRoot", "TierOptions", "open_checkpoint_root"]


@dataclass(frozen=True, kw_only=True, slots=True)
class TierOptions:
    """The node-local tier and its peers (docs/tiers.md)."""

    local_dir: str
    """Base directory of the tier, a tmpfs such as ``/dev/shm/relight`` (survives a worker
    restart, not a reboot); the tier lives in ``<local_dir>/<job>/<node>``
    (`ckpt.local_tier.local_tier_dir`)."""
    budget_bytes: int
    """Node memory the tier may use, split evenly over the node's ranks."""
    node: str = ""
    """The node's name in the tier's directory and among peers; empty: `tier_node()`
    ($RELIGHT_LOCAL_TIER_NODE if set, else the host name)."""
    peer_replicas: int = 0
    """Copy each node's data objects to this many other nodes' replica servers too (0:
    the local tier only). A node's server holds at most ``peer_replicas x budget_bytes``."""
    peer_host: str = ""
    """The address the node's replica server binds and is reached at; empty: all
    interfaces (see `ckpt.peer.PeerServer.address`)."""
    peer_toward: str | None = None
    """A host the nodes share (the job's master): with `peer_host` empty and a host name
    that resolves to loopback, the server advertises the interface that routes there."""

    def __post_init__(self) -> None:
        if not self.local_dir:
            raise ValueError("TierOptions.local_dir must name a directory (no options: no "
                             "tiers)")
        if self.budget_bytes < 0:
            raise ValueError(f"TierOptions.budget_bytes must be >= 0, got {self.budget_bytes}")
        if self.peer_replicas < 0:
            raise ValueError(f"TierOptions.peer_replicas must be >= 0, got "
                             f"{self.peer_replicas}")


@dataclass(eq=False)
class CheckpointRoot:
    """What `open_checkpoint_root` built for this rank."""

    store: Store
    """The store a `CheckpointManager` is given: `tiered` when the tiers are on, else the
    persistent store."""
    persistent: Store
    """The source of truth."""
    tiered: TieredStore | None = None
    """The tiered view (None without tiers)."""
    peer_server: PeerServer | None = None
    """This node's replica server, on the node's first rank (None elsewhere)."""

    @property
    def tier_stats(self) -> TierStats | None:
        """What each tier served (None without tiers)."""
        return None if self.tiered is None else self.tiered.tier_stats

    def served_by_every_rank(self, process_group: Any = None,
                             timeout_s: float = 300.0) -> dict[str, int]:
        """Bytes each tier served, summed over the ranks of `process_group` (what a
        restore's metrics report). Collective; {} on every rank without tiers."""
        stats = self.tier_stats
        mine = {} if stats is None else stats.snapshot()["served"]
        total: dict[str, int] = {}
        for served in Comm(process_group, timeout_s).allgather_json(
                mine, "the tier statistics of a restore (every rank must ask)"):
            for tier, n in served.items():
                total[tier] = total.get(tier, 0) + n
        return total

    def drop_local_tier(self, process_group: Any = None, timeout_s: float = 300.0) -> bool:
        """The run is complete: free the node memory the local tier holds, after every
        rank of `process_group` has flushed its copies (so none lands after the delete).
        Collective. Returns False (and does nothing) without tiers.

        Raises:
            CollectiveError: a rank did not reach the barrier within `timeout_s`.
        """
        if self.tiered is None:
            return False
        self.tiered.flush()
        Comm(process_group, timeout_s).barrier(
            f"the drop of the local tier {self.tiered.local_dir} (every rank flushes its "
            "copies first)")
        self.tiered.drop_local()
        return True

    def close(self) -> None:
        """Stop this node's replica server, if this rank runs it."""
        if self.peer_server is not None:
            self.peer_server.close()
            self.peer_server = None


def open_checkpoint_root(url: str | os.PathLike[str] | Store, tiers: TierOptions | None = None,
                         *, process_group: Any = None) -> CheckpointRoot:
    """Open a run's checkpoint root, fronted by the node-local tier and its peers when
    `tiers` is given.

    Args:
        url: the persistent root (a `storage` URL or `Store`).
        tiers: the local tier and peers; None: the persistent store alone.
        process_group: the ranks that save and restore together (default: the world).
            With tiers, every rank of it must call this.

    Returns:
        The `CheckpointRoot`: `store` for the `CheckpointManager`, the tiered view and the
        replica server when they exist.

    Raises:
        InvalidStorageURLError: `url` is not a storage URL.
        CollectiveError: with tiers, a rank did not join the exchange of node names or
            server addresses.
        OSError: the replica server could not bind `tiers.peer_host`.
    """
    persistent = open_store(url)
    if tiers is None:
        return CheckpointRoot(store=persistent, persistent=persistent)
    comm = Comm(process_group)
    node = tier_node(tiers.node)
    # With peers, the first rank draws the token the replica servers will ask for; it
    # rides on the gather of node names.
    token = (secrets.token_hex(32) if comm.is_coordinator and tiers.peer_replicas > 0
             else None)
    gathered = comm.allgather_json([node, token], "the exchange of node names for the "
                                   "checkpoint tiers")
    nodes = [n for n, _ in gathered]
    budget = tiers.budget_bytes // nodes.count(node)
    tiered = TieredStore(persistent, local_tier_dir(tiers.local_dir, persistent.url, node),
                         budget, writer=comm.rank)
    logger.info("%s local tier %s, %d MiB for this rank", rank_step_prefix(comm.rank),
                tiered.local_dir, budget >> 20)
    server = None
    if tiers.peer_replicas > 0:
        server = _attach_peers(tiered, tiers, comm, node, nodes, gathered[0][1])
    return CheckpointRoot(store=tiered, persistent=persistent, tiered=tiered,
                          peer_server=server)


def _attach_peers(tiered: TieredStore, tiers: TierOptions, comm: Comm, node: str,
                  nodes: list[str], token: str) -> PeerServer | None:
    """The node's first rank serves the node's replicas (returned; None on the other
    ranks); every rank learns the servers' addresses (one all-gather) and copies to the
    next `peer_replicas` nodes in name order. The servers answer only requests carrying
    `token`."""
    server = None
    if comm.ranks[nodes.index(node)] == comm.rank:
        # Each of the k nodes pushing here holds at most budget_bytes: the node's memory
        # stays within (1 + k) x the budget (docs/tiers.md).
        server = PeerServer(
            os.path.join(tiered.local_dir, REPLICA_DIR), host=tiers.peer_host or "0.0.0.0",
            toward=tiers.peer_toward, also_serve=(tiered.local_dir,),
            budget_bytes=tiers.peer_replicas * tiers.budget_bytes, token=token)
    mine = server.address if server is not None else None
    addrs = {n: a for n, a in comm.allgather_json(
        [node, mine], "the exchange of the replica servers' addresses") if a is not None}
    ring = sorted(addrs)
    others = [ring[(ring.index(node) + i) % len(ring)] for i in range(1, len(ring))]
    tiered.attach_peers([addrs[n] for n in others[:tiers.peer_replicas]],
                        [addrs[n] for n in others], token)
    logger.info("%s peer tier: replicas to %s, %d peer(s) to fetch from",
                rank_step_prefix(comm.rank), others[:tiers.peer_replicas] or "no other node",
                len(others))
    return server
