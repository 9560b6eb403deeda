"""A user's own training loop whose replica groups heal in place: plain PyTorch (a model,
AdamW, data addressed by global sample index) plus a few lines of `relight`: a
`ReplicaManager`, the optimizer wrapped in a `ReplicaOptimizer` (whose `zero_grad()`
starts the step and whose `step()` applies it only when the groups' reduction committed),
and a `CheckpointManager` for the loss of every group at once.

Start one process per replica group, each with its own `--group`, all with the same
`--job` and etcd; kill one and start it again: the others never stop, and the new one
copies the live state (weights and AdamW's moments) from a live group's memory.

    python examples/replica_user_loop.py --etcd 127.0.0.1:2379 --job demo --group g0 &
    python examples/replica_user_loop.py --etcd 127.0.0.1:2379 --job demo --group g1 &

With `--ddp` the model is wrapped in DistributedDataParallel over the group's own ranks
(here one process per group) and `optimizer.register_ddp(model)` sums each gradient
bucket across the groups while backward runs; the weights come out bitwise the same.

Every committed step appends one JSON line to `--events` (when given): the step, the
quorum, the samples this group trained and a digest of its weights, which is the same on
every group after every step.

It also meets the chaos harness's contract for a user's script (docs/chaos.md), and
`scenarios/replica-user-loop.toml` runs it as two replica groups under faults: it takes
the arguments the harness gives every replica group's command (`--replica.job=`,
`--replica.etcd=`, `--replica.host=`, `--replica.min_groups=`, the group id in
`$RELIGHT_REPLICA_GROUP`; arguments it does not know are ignored), and the checkpoint
root, metrics file, target step and checkpoint interval from `--ckpt`, `--metrics-path`,
`--steps`, `--ckpt-every` or the harness's RELIGHT_CKPT_URL, RELIGHT_METRICS_PATH,
RELIGHT_TARGET_STEP, RELIGHT_CKPT_INTERVAL. The quorum's first group checkpoints every
interval and at the last step (the groups hold the same state); a group that starts
while no live group holds the state restores the newest checkpoint. Each group appends
one metrics line per committed step, with the fields the harness checks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import zlib

import torch
from torch import nn

import relight
from relight.ckpt.state_layout import materialize_optimizer_states
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


def digest(model: nn.Module) -> int:
    """crc32 of the weights' bytes: equal on every group after every committed step."""
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
    return crc


def append_line(path: str, fields: dict) -> None:
    # One write of the whole line in append mode: the groups' lines never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(fields) + "\n").encode())
    finally:
        os.close(fd)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # The second spelling of each is what the chaos harness passes a replica group.
    p.add_argument("--etcd", "--replica.etcd", required=True,
                   help="etcd endpoints, comma separated")
    p.add_argument("--job", "--replica.job", required=True)
    p.add_argument("--group", default=env("RELIGHT_REPLICA_GROUP"),
                   help="this group's id (default: $RELIGHT_REPLICA_GROUP)")
    p.add_argument("--host", "--replica.host", default="127.0.0.1",
                   help="address the other groups reach this one on")
    p.add_argument("--min-groups", "--replica.min_groups", type=int, default=1)
    p.add_argument("--steps", type=int, default=int(env("RELIGHT_TARGET_STEP", "200")))
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--step-s", type=float, default=0.0,
                   help="pad each step to this many seconds (stands in for real compute)")
    p.add_argument("--ckpt", default=env("RELIGHT_CKPT_URL"), help="checkpoint root URL")
    p.add_argument("--ckpt-every", type=int, default=int(env("RELIGHT_CKPT_INTERVAL", "10")))
    p.add_argument("--metrics-path", default=env("RELIGHT_METRICS_PATH"),
                   help="append one JSON line per committed step here (the harness's fields)")
    p.add_argument("--events", default=None, help="append one JSON line per step here")
    p.add_argument("--stop-file", default=None, help="stop at the next step once it exists")
    p.add_argument("--ddp", action="store_true",
                   help="wrap the model in DDP and sum its gradient buckets during backward")
    a, _ = p.parse_known_args(argv)  # a scenario's overrides are not this script's
    if not a.group:
        p.error("--group or $RELIGHT_REPLICA_GROUP is required")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO,  # ckpt's commit lines date the commits
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    a = parse_args(argv)

    model = make_model(a.width)
    forward = model
    if a.ddp:  # the group's own data parallelism: here a world of this one process
        torch.distributed.init_process_group(
            "gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
        forward = nn.parallel.DistributedDataParallel(model)
    replicas = relight.ReplicaManager(
        relight.ReplicaSettings(job=a.job, group=a.group, min_groups=a.min_groups,
                                host=a.host, lease_ttl=5.0, collective_timeout_s=5.0,
                                etcd=EtcdSettings(endpoints=tuple(a.etcd.split(",")))),
        state=lambda: state,      # what a joining group receives, and where it lands
        restore=lambda: restore())  # no live group holds the state: storage does
    optimizer = relight.ReplicaOptimizer(
        replicas, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01))
    if a.ddp:
        optimizer.register_ddp(forward)
    state = {"model": model, "optim": optimizer}  # the optimizer carries the step count
    checkpoints = relight.CheckpointManager(a.ckpt, keep_last=3) if a.ckpt else None
    restored: int | None = None
    once: dict = {}  # fields of the next metrics line only

    def restore() -> None:
        nonlocal restored
        if checkpoints is None or checkpoints.latest_step() is None:
            return  # nothing saved yet: start from step 0
        once["restore_started_at"] = time.time()
        materialize_optimizer_states(state)  # a fresh AdamW has no moments to load into
        restored = checkpoints.restore(state)

    if not replicas.healing:  # no group is training: the job (re)starts from storage
        restore()

    def record(**fields: object) -> None:
        if a.events:
            append_line(a.events, {"t": time.time(), "pid": os.getpid(), "group": a.group,
                                   **fields})

    record(ev="start", heal=replicas.healing)
    abandoned, heal_seen = 0, None
    try:
        while optimizer.steps < a.steps:
            if a.stop_file and os.path.exists(a.stop_file):
                break
            t0 = time.monotonic()
            optimizer.zero_grad()                 # starts the step: a heal may land here
            step, quorum = optimizer.steps, optimizer.quorum
            if replicas.heal_stats is not heal_seen:
                heal_seen = replicas.heal_stats
                once["healed_bytes"] = heal_seen.bytes
            x, y, indices = batch(step, optimizer.rank, optimizer.size)
            loss = nn.functional.mse_loss(forward(x), y)
            loss.backward()
            global_loss = loss.detach().clone()
            replicas.allreduce([global_loss])     # the mean over groups: the job's loss
            time.sleep(max(0.0, a.step_s - (time.monotonic() - t0)))
            if not optimizer.step():              # summed across groups; applied if committed
                abandoned += 1                    # not applied: redone next quorum
                record(ev="abandoned", step=step, quorum=quorum.id)
                continue
            crc = digest(model)
            record(ev="step", step=step, quorum=quorum.id, size=quorum.size,
                   samples=indices, digest=crc, etcd_requests=replicas.stats.etcd_requests,
                   in_backward=optimizer.reduced_in_backward)
            done = optimizer.steps
            if a.metrics_path:  # logged before the step is checkpointed
                append_line(a.metrics_path, {
                    "step": done, "loss": float(global_loss),
                    "data_position": step * GLOBAL_BATCH, "restored_step": restored,
                    "world_size": 1, "time": time.time(),
                    "step_time_s": time.monotonic() - t0, "replica_group": a.group,
                    "quorum": quorum.id, "quorum_size": quorum.size,
                    "abandoned_steps": abandoned, "state_crc": [crc], **once})
                once.clear()
            if (checkpoints is not None and optimizer.rank == 0  # the quorum's first group
                    and (done % a.ckpt_every == 0 or done == a.steps)):
                checkpoints.save(done, state, async_save=True)
        if checkpoints is not None:
            checkpoints.wait()
    except relight.RelightError as exc:
        record(ev="error", type=type(exc).__name__, message=str(exc))
        raise
    finally:
        replicas.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
