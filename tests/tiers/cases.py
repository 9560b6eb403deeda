"""Functions the rank pool (tests/runtime/pool.py) runs on every rank for the tier tests."""

from __future__ import annotations

from typing import Any

from tests.runtime.cases import _full, _trainer


def train(overrides: list[str], config: str = "configs/tiny.toml") -> dict[str, Any]:
    """Train per config; return the final state (full tensors), the storage counters of
    the persistent store and what each tier served."""
    from runtime.state import flat_names

    trainer = _trainer(config, overrides)
    res = trainer.run()
    store = trainer.ckpt_mgr.store
    if hasattr(store, "flush"):
        store.flush()
    return {"restored_step": res.restored_step, "final_step": res.final_step,
            "tiers": trainer.tier_stats(), "restore_io": trainer.restore_io,
            "state": {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}}
