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

from elastic.etcd_client import EtcdSettings
from elastic.replica import ReplicaManager, ReplicaSettings
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
    p.add_argument("--min-groups", type=int, default=1)
    p.add_argument("--step-sleep", type=float, default=0.05)
    a = p.parse_args()
    settings = ReplicaSettings(
        job=a.job, group=a.group, lease_ttl=2.0, collective_timeout_s=10.0,
        min_groups=a.min_groups,
        etcd=EtcdSettings(endpoints=tuple(a.endpoints.split(",")), prefix="/relight-test",
                          timeout=30.0, attempt_timeout=0.7))
    mgr = ReplicaManager(settings)
    event(a.out, ev="start", group=a.group)
    w = torch.zeros(DIM, dtype=torch.float64)
    step = 0
    while step < a.steps:
        q = mgr.start_step()
        rank, size = q.rank(a.group), q.size
        mine = [step * BATCH_R + j for j in range(BATCH_R) if j % size == rank]
        total = torch.zeros(DIM, dtype=torch.float64)
        for i in mine:
            total += grad_of(w, i)
        time.sleep(a.step_sleep)  # the forward/backward a real step would take
        mgr.allreduce([total])
        if mgr.should_commit(step):
            w = w - LR * total * size / BATCH_R
            event(a.out, ev="step", group=a.group, step=step, quorum=q.id, size=size,
                  samples=mine, digest=hashlib.sha256(w.numpy().tobytes()).hexdigest(),
                  quorum_s=mgr.stats.quorum_s, commit_s=mgr.stats.commit_s,
                  requests=mgr.quorum_client.requests)
            step += 1
        else:
            event(a.out, ev="abandoned", group=a.group, step=step, quorum=q.id)
    event(a.out, ev="done", group=a.group, w=w.tolist())
    mgr.close()


if __name__ == "__main__":
    main()
