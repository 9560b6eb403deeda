"""A user's own training loop whose replica groups heal in place: plain PyTorch (a model,
AdamW, data addressed by global sample index) plus a few lines of `relight`: a
`ReplicaManager`, and the optimizer wrapped in a `ReplicaOptimizer`, whose `zero_grad()`
starts the step and whose `step()` applies it only when the groups' reduction committed.

Start one process per replica group, each with its own `--group`, all with the same
`--job` and etcd; kill one and start it again: the others never stop, and the new one
copies the live state (weights and AdamW's moments) from a live group's memory.

    python examples/replica_user_loop.py --etcd 127.0.0.1:2379 --job demo --group g0 &
    python examples/replica_user_loop.py --etcd 127.0.0.1:2379 --job demo --group g1 &

Every committed step appends one JSON line to `--events` (when given): the step, the
quorum, the samples this group trained and a digest of its weights, which is the same on
every group after every step.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch
from torch import nn

import relight
from relight.elastic.etcd_client import EtcdSettings

GLOBAL_BATCH = 12  # samples per step, whatever the number of groups (1, 2, 3 or 4 divide it)
FEATURES = 8
SEED = 20261205


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample `index` of a fixed regression task: the same on every group."""
    g = torch.Generator().manual_seed(SEED + index)
    x = torch.randn(FEATURES, generator=g)
    return x, torch.sin(x).sum(dim=0, keepdim=True)


def batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """This group's share of step `step`'s global batch: samples are dealt round-robin
    over the quorum's groups, so every sample of the step is trained exactly once."""
    indices = [step * GLOBAL_BATCH + j for j in range(GLOBAL_BATCH) if j % size == rank]
    xs, ys = zip(*(sample(i) for i in indices), strict=True)
    return torch.stack(xs), torch.stack(ys), indices


def make_model(width: int) -> nn.Module:
    torch.manual_seed(SEED)  # every group starts from the same weights
    return nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, 1))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--etcd", required=True, help="etcd endpoints, comma separated")
    p.add_argument("--job", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--step-s", type=float, default=0.0,
                   help="pad each step to this many seconds (stands in for real compute)")
    p.add_argument("--events", default=None, help="append one JSON line per step here")
    p.add_argument("--stop-file", default=None, help="stop at the next step once it exists")
    a = p.parse_args(argv)

    model = make_model(a.width)
    replicas = relight.ReplicaManager(
        relight.ReplicaSettings(job=a.job, group=a.group, min_groups=a.min_groups,
                                etcd=EtcdSettings(endpoints=tuple(a.etcd.split(","))),
                                lease_ttl=5.0, collective_timeout_s=5.0),
        state=lambda: state)  # what a joining group receives, and where it lands
    optimizer = relight.ReplicaOptimizer(
        replicas, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    state = {"model": model, "optim": optimizer}  # the optimizer carries the step count

    def record(**fields: object) -> None:
        if a.events:
            line = json.dumps({"t": time.time(), "pid": os.getpid(), "group": a.group,
                               **fields})
            with open(a.events, "a") as f:  # one short write per line: no interleaving
                f.write(line + "\n")

    record(ev="start", heal=replicas.healing)
    try:
        while optimizer.steps < a.steps:
            if a.stop_file and os.path.exists(a.stop_file):
                break
            t0 = time.monotonic()
            optimizer.zero_grad()                 # starts the step: a heal may land here
            step, quorum = optimizer.steps, optimizer.quorum
            x, y, indices = batch(step, optimizer.rank, optimizer.size)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            time.sleep(max(0.0, a.step_s - (time.monotonic() - t0)))
            if optimizer.step():                  # summed across groups; applied if committed
                record(ev="step", step=step, quorum=quorum.id, size=quorum.size,
                       samples=indices, digest=digest(model),
                       etcd_requests=replicas.stats.etcd_requests)
            else:                                 # not applied: redone next quorum
                record(ev="abandoned", step=step, quorum=quorum.id)
    except relight.RelightError as exc:
        record(ev="error", type=type(exc).__name__, message=str(exc))
        raise
    finally:
        replicas.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
