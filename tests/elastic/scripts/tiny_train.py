"""A tiny deterministic data-parallel training job for the failure tests.

Linear regression on float64 weights. Global batch `B` per step; sample `i` is drawn
from a generator seeded with `i`, so the data is a pure function of the global step.
Each rank computes per-sample gradients for its share; an all_gather brings every
per-sample gradient to every rank, and they are summed in global sample order. The
update is therefore bitwise identical whatever the world size, so a resumed run must
match `reference(steps)` exactly, even after a resize.

Checkpoints are plain JSON written atomically by rank 0 (temp file + rename) every
`--ckpt-every` steps. Every process appends JSON-line events (start, resume, step,
done, watchdog) to `{out}/events.jsonl` for the tests to measure recovery, each with
the rendezvous round its agent joined (`RELIGHT_RDZV_ROUND`).

`--watchdog S` starts a progress watchdog thread: no completed step for S seconds
means a peer hangs (this worker is blocked in a collective). It SIGKILLs sibling
workers of the same agent that are stopped (state T: a SIGSTOPped process ignores
the agent's SIGTERM until SIGKILL, which would cost the agent's 30 s shutdown
grace), then exits with code 70, so the agent restarts the group at once.
torch's own FileTimerServer is not used: on expiry it SIGKILLs the agent too,
which turns a hung worker into a lost node.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import threading
import time
from datetime import timedelta

import torch

DIM = 8
BATCH = 8
LR = 0.05


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(DIM, generator=g, dtype=torch.float64)
    w_true = torch.arange(1, DIM + 1, dtype=torch.float64) / DIM
    y = x @ w_true + 0.01 * torch.randn((), generator=g, dtype=torch.float64)
    return x, y


def grad_of(w: torch.Tensor, i: int) -> torch.Tensor:
    x, y = sample(i)
    return 2.0 * (x @ w - y) * x


def apply(w: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    total = torch.zeros(DIM, dtype=torch.float64)
    for g in grads:  # global sample order: identical for any world size
        total = total + g
    return w - LR * total / BATCH


def reference(steps: int) -> list[float]:
    """Weights after `steps` steps of an uninterrupted single-process run."""
    w = torch.zeros(DIM, dtype=torch.float64)
    for step in range(1, steps + 1):
        w = apply(w, [grad_of(w, (step - 1) * BATCH + j) for j in range(BATCH)])
    return w.tolist()


def event(out: str, ev: str, **fields: object) -> None:
    line = json.dumps({"ev": ev, "t": time.time(), "pid": os.getpid(),
                       # Under warm starts the parent is the fork server.
                       "agent_pid": int(os.environ.get("RELIGHT_WARM_PARENT_PID",
                                                       os.getppid())),
                       "round": int(os.environ.get("RELIGHT_RDZV_ROUND", "-1")), **fields})
    fd = os.open(os.path.join(out, "events.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def latest_checkpoint(out: str) -> tuple[int, torch.Tensor]:
    files = sorted(glob.glob(os.path.join(out, "ckpt-*.json")))
    if not files:
        return 0, torch.zeros(DIM, dtype=torch.float64)
    with open(files[-1]) as f:
        doc = json.load(f)
    return int(doc["step"]), torch.tensor(doc["w"], dtype=torch.float64)


def save(out: str, name: str, step: int, w: torch.Tensor) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump({"step": step, "w": w.tolist()}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, name))


def stopped_siblings() -> list[int]:
    """Pids of processes with our parent (the agent) that are stopped (state T)."""
    me, parent, found = os.getpid(), os.getppid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] in ("T", "t") and int(fields[1]) == parent:
            found.append(int(entry))
    return found


class Watchdog:
    """Exits the process when no step completes for `limit` seconds."""

    def __init__(self, out: str, limit: float, rank: int) -> None:
        self.out, self.limit, self.rank = out, limit, rank
        self.last = time.monotonic()
        threading.Thread(target=self._run, daemon=True).start()

    def progress(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        while True:
            time.sleep(min(0.2, self.limit / 4))
            if time.monotonic() - self.last > self.limit:
                victims = stopped_siblings()
                for pid in victims:
                    os.kill(pid, signal.SIGKILL)
                event(self.out, "watchdog", rank=self.rank, killed=victims)
                os._exit(70)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10**9, help="stop at this step")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.02)
    p.add_argument("--collective-timeout", type=float, default=30.0)
    p.add_argument("--watchdog", type=float, default=0.0,
                   help="seconds a step may take before the agent's watchdog kills us")
    args = p.parse_args()
    out = args.out

    import torch.distributed as dist

    t_start = time.time()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.collective_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    event(out, "start", rank=rank, world=world, restart=restart, t_proc=t_start,
          group_rank=int(os.environ.get("GROUP_RANK", "0")))

    step, w = latest_checkpoint(out)
    event(out, "resume", rank=rank, world=world, restart=restart, step=step)
    per_rank = BATCH // world
    if per_rank * world != BATCH:
        raise SystemExit(f"world size {world} must divide the global batch {BATCH}")
    stop_file = os.path.join(out, "STOP")
    watchdog = Watchdog(out, args.watchdog, rank) if args.watchdog > 0 else None
    while step < args.steps:
        step += 1
        base = (step - 1) * BATCH + rank * per_rank
        mine = torch.stack([grad_of(w, base + j) for j in range(per_rank)])
        stop = float(rank == 0 and os.path.exists(stop_file))
        payload = torch.cat([mine.flatten(), torch.tensor([stop], dtype=torch.float64)])
        gathered = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(gathered, payload)
        grads = [g[:-1].view(per_rank, DIM)[j] for g in gathered for j in range(per_rank)]
        w = apply(w, grads)
        time.sleep(args.step_sleep)
        if watchdog is not None:
            watchdog.progress()
        event(out, "step", rank=rank, world=world, restart=restart, step=step)
        if rank == 0 and step % args.ckpt_every == 0:
            save(out, f"ckpt-{step:08d}.json", step, w)
        if gathered[0][-1].item() > 0:
            break
    if rank == 0:
        save(out, "final.json", step, w)
    event(out, "done", rank=rank, world=world, restart=restart, step=step)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
