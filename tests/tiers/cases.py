"""Functions the rank pool (tests/runtime/pool.py) runs on every rank for the tier tests."""

from __future__ import annotations

from typing import Any

from tests.runtime.cases import _full, _trainer


def train(overrides: list[str], config: str = "configs/tiny.toml",
          node_per_rank: bool = False) -> dict[str, Any]:
    """Train per config; return the final state (full tensors), what the restore read
    from the persistent store and what each tier served. `node_per_rank`: each rank is a
    node of its own (`checkpoint.local_tier_node=n<rank>`), as on a cluster."""
    import torch.distributed as dist

    from relight.runtime.state import flat_names

    if node_per_rank:
        overrides = [*overrides, f"--checkpoint.local_tier_node=n{dist.get_rank()}"]
    trainer = _trainer(config, overrides)
    try:
        res = trainer.run()
        root = trainer.checkpoints.root
        if root is not None and root.tiered is not None:
            root.tiered.flush()
    finally:
        trainer.close()
    return {"restored_step": res.restored_step, "final_step": res.final_step,
            "tiers": trainer.checkpoints.tier_stats(),
            "restore_io": trainer.checkpoints.restore_io,
            "state": {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}}
