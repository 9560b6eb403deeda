"""A user's own training script that Relight's chaos harness can attack and check.

It is not `runtime.train`: it is the kind of small DDP script a user already has, plus the
contract that lets a crash cost at most one checkpoint interval and lets `relight chaos`
prove the resumed run is right:

1. checkpoint through `ckpt.CheckpointManager` (every rank calls `save`; async), and at
   start restore the newest committed checkpoint with `restore(state)` (it falls back to an
   older one when the newest is damaged);
2. keep everything a resume needs in the checkpoint: weights, optimizer state, the step and
   the data position (a global sample index), and derive randomness from (seed, step);
3. rank 0 appends one JSON line per step to the metrics file: `step`, `loss`,
   `data_position` (first global sample of the step), `restored_step`, `world_size`,
   `time`, `step_time_s`.

Run it alone, under torchrun, or under `relight run`:

    relight run --nnodes=1:2 --nproc-per-node=2 -- python examples/user_train.py

Settings come from the environment (the chaos harness sets them): RELIGHT_CKPT_URL,
RELIGHT_METRICS_PATH, RELIGHT_TARGET_STEP, RELIGHT_CKPT_INTERVAL; and
USER_TRAIN_MIN_STEP_S, which pads each step to at least that many seconds. The model is
tiny, so a step takes milliseconds; the padding stands in for real compute so that faults
timed by step or by second land in the middle of the run rather than after it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

from relight import ckpt

log = logging.getLogger("user_train")

GLOBAL_BATCH = 24  # samples per step, whatever the world size (divisible by 1, 2, 3, 4, 6, 8)
FEATURES = 16
SEED = 1234


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global sample `index` of a fixed synthetic regression task (same on every rank)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + index)
    x = torch.randn(FEATURES, generator=g)
    w = torch.linspace(-1.0, 1.0, FEATURES)
    return x, torch.tanh(x @ w).reshape(1) + 0.01 * torch.randn(1, generator=g)


def batch(position: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the global batch that starts at sample `position`."""
    per = GLOBAL_BATCH // world
    pairs = [sample(position + rank * per + i) for i in range(per)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    url = os.environ["RELIGHT_CKPT_URL"]
    metrics_path = os.environ["RELIGHT_METRICS_PATH"]
    target = int(os.environ.get("RELIGHT_TARGET_STEP", "30"))
    interval = int(os.environ.get("RELIGHT_CKPT_INTERVAL", "5"))
    min_step_s = float(os.environ.get("USER_TRAIN_MIN_STEP_S", "0"))

    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} does not divide the global batch {GLOBAL_BATCH}")

    torch.manual_seed(SEED)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step, position, restored = 0, 0, None

    def state() -> dict:
        return {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            "train": {"step": step, "data_position": position},
        }

    manager = ckpt.CheckpointManager(url, keep_last=3)
    if manager.latest_step() is not None:
        sd = state()
        restored = manager.restore(sd)  # newest committed one that loads cleanly
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, optimizer, sd["optim"])
        step, position = sd["train"]["step"], sd["train"]["data_position"]
        log.info("[rank %d] restored step %d (data position %d)", rank, step, position)

    metrics = open(metrics_path, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
    while step < target:
        t0 = time.perf_counter()
        torch.manual_seed(SEED + step)
        x, y = batch(position, rank, world)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages gradients over ranks: the global-batch gradient
        optimizer.step()
        total = loss.detach() * x.shape[0]
        dist.all_reduce(total)
        record = {"step": step + 1, "loss": float(total) / GLOBAL_BATCH,
                  "data_position": position, "restored_step": restored, "world_size": world}
        step, position = step + 1, position + GLOBAL_BATCH
        time.sleep(max(0.0, min_step_s - (time.perf_counter() - t0)))
        # Log the step before checkpointing it: a checkpoint of a step never logged would
        # look like work nobody did.
        if metrics is not None:
            record.update(time=time.time(), step_time_s=time.perf_counter() - t0)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if step % interval == 0 or step == target:
            manager.save(step, state(), async_save=True)
    manager.wait()
    if metrics is not None:
        metrics.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
