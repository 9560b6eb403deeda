"""One replica group (a single process here) of a job that heals in place: the tiny
float64 regression of tiny_train.py, its global batch split across the quorum's groups,
gradients averaged by `elastic.replica.ReplicaManager`.

Every committed step appends an event with a digest of the weights, so the test can
check that replicas stay bitwise identical after every step and that no sample is
skipped or repeated (the samples of step s are s*BATCH ... s*BATCH+BATCH-1, split by
quorum rank, whatever the number of groups).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time

import torch

from relight.elastic.etcd_client import EtcdSettings
from relight.elastic.replica import ReplicaManager, ReplicaSettings
from tests.elastic.scripts.tiny_train import DIM, LR, grad_of

BATCH_R = 12
"""Global batch: divisible by 1, 2, 3 and 4 groups."""


def event(out: str, **fields: object) -> None:
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **fields})
    fd = os.open(os.path.join(out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoints", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-file", default=None,
                   help="a file whose content, once it exists, replaces --steps")
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--state-mb", type=float, default=0.0,
                   help="extra state (float32, the same on every group) a heal must carry")
    p.add_argument("--heal", action=argparse.BooleanOptionalAction, default=None,
                   help="join without state and heal from a live group (default: heal "
                        "when other groups are training)")
    p.add_argument("--die-before-apply-at", type=int, default=None, metavar="STEP",
                   help="exit at once after this step's reduction, before its apply")
    a = p.parse_args()
    settings = ReplicaSettings(
        job=a.job, group=a.group, lease_ttl=5.0, collective_timeout_s=5.0,
        min_groups=a.min_groups,
        etcd=EtcdSettings(endpoints=tuple(a.endpoints.split(",")), prefix="/relight-test",
                          timeout=30.0, attempt_timeout=1.0))
    # The live state: what a healing group receives from a healthy one's memory.
    state = {"w": torch.zeros(DIM, dtype=torch.float64), "progress": {"step": 0},
             "extra": torch.zeros(int(a.state_mb * 2**20) // 4)}
    if a.heal is not True:  # a joiner's copy arrives by the heal
        state["extra"].copy_(torch.arange(state["extra"].numel(), dtype=torch.float32))
    mgr = ReplicaManager(settings, state=lambda: state, heal=a.heal)
    event(a.out, ev="start", group=a.group, heal=mgr.healing)
    target = a.steps
    while state["progress"]["step"] < target:
        q = mgr.start_step()
        step, w = state["progress"]["step"], state["w"]  # a heal may have set both
        if mgr.heal_stats is not None and not mgr.healing:
            event(a.out, ev="healed", group=a.group, step=step, quorum=q.id,
                  seconds=mgr.heal_stats.seconds, bytes=mgr.heal_stats.bytes)
            mgr.heal_stats = None
        rank, size = q.rank(a.group), q.size
        mine = [step * BATCH_R + j for j in range(BATCH_R) if j % size == rank]
        total = torch.zeros(DIM, dtype=torch.float64)
        for i in mine:
            total += grad_of(w, i)
        time.sleep(a.step_sleep)  # the forward/backward a real step would take
        # Logged before the reduction: a group killed while its peers' reduction completes
        # (with its share in the sum) still accounts for its share. A reduction that
        # fails everywhere is redone in the next quorum, and the checks count only the
        # quorum that committed the step.
        event(a.out, ev="reduced", group=a.group, step=step, quorum=q.id, samples=mine)
        mgr.allreduce([total])
        if step == a.die_before_apply_at:
            os._exit(9)  # killed between the reduction and the apply
        if mgr.should_commit(step):
            w.sub_(LR * total * size / BATCH_R)
            state["progress"]["step"] = step + 1
            event(a.out, ev="step", group=a.group, step=step, quorum=q.id, size=size,
                  samples=mine, digest=hashlib.sha256(w.numpy().tobytes()).hexdigest(),
                  quorum_s=mgr.stats.quorum_s, commit_s=mgr.stats.commit_s,
                  requests=mgr.requests)
        else:
            event(a.out, ev="abandoned", group=a.group, step=step, quorum=q.id,
                  samples=mine)
        if a.stop_file and os.path.exists(a.stop_file):
            target = int(open(a.stop_file).read() or target)
    extra = hashlib.sha256(state["extra"].numpy().tobytes()).hexdigest()
    event(a.out, ev="done", group=a.group, w=state["w"].tolist(), extra=extra)
    mgr.close()


if __name__ == "__main__":
    main()
