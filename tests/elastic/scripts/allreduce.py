"""A tiny gloo job for torchrun: every rank all-reduces rank+1 and writes what it saw."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "sum": t.item(),
                   "group_rank": int(os.environ["GROUP_RANK"]),
                   "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
