"""The goodput benchmark's `torchrun` arm: Relight's model and step, checkpointed the way a
torchrun + DCP user does it.

The same job as the other arms (the runtime's `Trainer`: model, FSDP, data, optimizer,
one `train_step()` per step), with Relight's checkpoints off and
`torch.distributed.checkpoint` in their place: `dcp.async_save` every
`$RELIGHT_CKPT_INTERVAL` steps through DCP's `FileSystemWriter` on a gloo group of its own
(DCP's background collectives must not interleave with training's), the previous save
waited for first, three kept; at start `dcp.load` of the newest step directory whose
`.metadata` exists (what DCP writes last), resharded by DCP to the current world.
Rank 0 appends one JSON line per step to `$RELIGHT_METRICS_PATH`, as the runtime does.

    torchrun --rdzv-backend=c10d ... benchmarks/dcp_train.py --config configs/tiny.toml \\
        [--key=value overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Run as a script (as torchrun runs it), Python puts this directory first on sys.path,
# and benchmarks/ckpt.py would then shadow the `ckpt` package the runtime imports.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

from relight.runtime.config import load_config  # noqa: E402
from relight.runtime.train import Trainer  # noqa: E402

KEEP = 3
"""Checkpoints kept, as the other arms keep theirs."""


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (DCP writes `.metadata` last), oldest first."""
    if not root.is_dir():
        return []
    done = [(int(p.name.removeprefix("step_")), p) for p in root.glob("step_*")
            if (p / ".metadata").exists()]
    return sorted(done)


def _state(trainer: Trainer) -> dict[str, Any]:
    model, optim = get_state_dict(trainer.model, trainer.optimizer)
    return {"model": model, "optim": optim,
            "step": torch.tensor([trainer.step], dtype=torch.int64),
            "data_position": torch.tensor([trainer.data.position], dtype=torch.int64)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    args, overrides = p.parse_known_args(argv)
    root = Path(os.environ["RELIGHT_CKPT_URL"].removeprefix("file://"))
    interval = int(os.environ.get("RELIGHT_CKPT_INTERVAL", "20"))
    cfg = load_config(args.config, [*overrides, "--checkpoint.url=",
                                    f"--train.steps={os.environ.get('RELIGHT_TARGET_STEP', 100)}"])
    t_start = time.time()
    trainer = Trainer(cfg)
    rank = dist.get_rank()
    ckpt_group = dist.new_group(backend="gloo")
    restored: int | None = None
    restore_s = 0.0
    done = _step_dirs(root)
    if done:
        t0 = time.perf_counter()
        state = _state(trainer)
        dcp.load(state, checkpoint_id=str(done[-1][1]), process_group=ckpt_group)
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        trainer.step = restored = int(state["step"].item())
        trainer.data.position = int(state["data_position"].item())
        restore_s = time.perf_counter() - t0
    metrics_path = os.environ["RELIGHT_METRICS_PATH"]
    metrics = open(metrics_path, "a", encoding="utf-8") if rank == 0 else None  # noqa: SIM115
    first: dict[str, Any] = {"startup_s": time.time() - t_start, "restore_s": restore_s}
    pending: Any = None
    try:
        while trainer.step < cfg.train.steps:
            t0 = time.perf_counter()
            rec = trainer.train_step()
            assert rec is not None  # no replica groups here
            step_time = time.perf_counter() - t0
            if metrics is not None:
                metrics.write(json.dumps({
                    "step": trainer.step, "loss": rec["loss"],
                    "data_position": rec["data_position"], "restored_step": restored,
                    "world_size": trainer.world, "layout": trainer.layout.describe(),
                    "time": time.time(), "step_time_s": step_time, **first}) + "\n")
                metrics.flush()
                first = {}
            if trainer.step % interval == 0:
                if pending is not None:
                    pending.result()
                path = root / f"step_{trainer.step:08d}"
                pending = dcp.async_save(_state(trainer), checkpoint_id=str(path),
                                         process_group=ckpt_group)
                if rank == 0:
                    for _, old in _step_dirs(root)[:-KEEP]:
                        shutil.rmtree(old, ignore_errors=True)
        if pending is not None:
            pending.result()
    finally:
        if metrics is not None:
            metrics.close()
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
