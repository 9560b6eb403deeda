"""A user's own DDP training script as it lives in the user's repository: a 3-layer MLP,
AdamW with a linear LR warm-up, data keyed by sample index from `data.py` beside it,
hyperparameters from `conf/hparams.json` relative to the working directory, Relight only
through `ckpt.CheckpointManager`. tests/chaos/test_e2e.py copies this folder outside the
Relight checkout and runs `ci/chaos.toml` from there. BROKEN_RESUME=1 plants a resume
bug (one batch skipped)."""
import argparse
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from data import CLASSES, FEATURES, shard
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel as DDP

from relight import ckpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--min-step-s", type=float, default=0.0)
    args, _unknown = p.parse_known_args()   # the harness may append --key=value overrides
    with open("conf/hparams.json") as fh:  # relative to the working directory
        hp = json.load(fh)
    url = os.environ["RELIGHT_CKPT_URL"]
    metrics_path = os.environ["RELIGHT_METRICS_PATH"]
    target = int(os.environ["RELIGHT_TARGET_STEP"])
    interval = int(os.environ["RELIGHT_CKPT_INTERVAL"])
    broken = os.environ.get("BROKEN_RESUME") == "1"

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(hp["seed"])
    net = nn.Sequential(nn.Linear(FEATURES, hp["hidden"]), nn.ReLU(),
                        nn.Linear(hp["hidden"], hp["hidden"]), nn.ReLU(),
                        nn.Linear(hp["hidden"], CLASSES))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / hp["warmup_steps"]))
    step, position, restored = 0, 0, None

    def state():
        return {"model": get_model_state_dict(model),
                "optim": get_optimizer_state_dict(model, opt),
                "sched": sched.state_dict(), "step": step, "position": position}

    manager = ckpt.CheckpointManager(url, keep_last=3)
    if manager.latest_step() is not None:
        sd = state()
        restored = manager.restore(sd)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        sched.load_state_dict(sd["sched"])
        step, position = sd["step"], sd["position"]
        if broken:
            position += hp["global_batch"]  # the bug: one batch skipped on resume

    out = open(metrics_path, "a") if rank == 0 else None
    while step < target:
        t0 = time.perf_counter()
        x, y = shard(position, hp["global_batch"], rank, world, hp["seed"])
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        total = loss.detach() * x.shape[0]
        dist.all_reduce(total)
        rec = {"step": step + 1, "loss": total.item() / hp["global_batch"],
               "data_position": position, "restored_step": restored, "world_size": world}
        step, position = step + 1, position + hp["global_batch"]
        time.sleep(max(0.0, args.min_step_s - (time.perf_counter() - t0)))
        if out:
            rec["time"] = time.time()
            out.write(json.dumps(rec) + "\n")
            out.flush()
        if step % interval == 0 or step == target:
            manager.save(step, state())
    manager.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
