"""Functions the rank pool runs on every rank (see ``pool.py``). Each returns plain data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _full(v: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(v, DTensor):
        v = v.full_tensor()
    return v.detach().clone() if hasattr(v, "detach") else v


def _trainer(config: str, overrides: list[str] | None):
    from relight.runtime.config import load_config
    from relight.runtime.train import Trainer

    return Trainer(load_config(ROOT / config, overrides or []))


def train(config: str = "configs/tiny.toml", overrides: list[str] | None = None,
          grads: bool = False, dump: bool = False) -> dict[str, Any]:
    """Train per config; optionally return the step-0 gradients and the final state, all as
    full (global) tensors keyed by global name, for the entries this rank holds."""
    from relight.runtime.state import flat_names

    trainer = _trainer(config, overrides)
    captured: dict[str, Any] = {}

    def capture(t) -> None:  # noqa: ANN001
        if not captured:
            for name, p in t.model.named_parameters():
                captured[name] = _full(p.grad)

    if grads:
        trainer.on_grads = capture
    res = trainer.run()
    out: dict[str, Any] = {"losses": res.losses, "layout": res.layout,
                           "final_step": res.final_step, "restored_step": res.restored_step,
                           "grads": captured}
    if dump:
        out["state"] = {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}
    return out


def state_shapes(config: str = "configs/tiny.toml",
                 overrides: list[str] | None = None) -> dict[str, Any]:
    """Checkpoint names and global shapes of the state this rank would save."""
    import torch

    from relight.runtime.state import flat_names

    trainer = _trainer(config, overrides)
    trainer.train_step()  # the optimizer state exists after one step
    out = {}
    for name, v in flat_names(trainer.state_dict()).items():
        out[name] = tuple(v.shape) if isinstance(v, torch.Tensor) else v
    return out


def warm_up_leaves_no_trace(config: str = "configs/tiny.toml",
                            overrides: list[str] | None = None) -> dict[str, Any]:
    """A healing group's warm-up step: whether the state, the data position and the
    gradients are as before it, and the losses of the two steps that follow it against
    those of a trainer that never warmed up."""
    import torch

    from relight.runtime.state import flat_names

    trainer = _trainer(config, overrides)
    trainer.train_step()  # the optimizer state exists: the warm-up must not touch it
    before = {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}
    position = trainer.data.position
    trainer._warm_up()
    after = {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}
    changed = sorted(k for k in before if not (
        torch.equal(before[k], after[k]) if isinstance(before[k], torch.Tensor)
        else before[k] == after[k]))
    grads = [n for n, p in trainer.model.named_parameters() if p.grad is not None]
    warmed = [trainer.train_step()["loss"] for _ in range(2)]
    plain = _trainer(config, overrides)
    plain.train_step()
    unwarmed = [plain.train_step()["loss"] for _ in range(2)]
    return {"changed": changed, "position": (position, trainer.data.position - 2 *
                                             trainer.plan.global_batch),
            "grads": grads, "warmed": warmed, "unwarmed": unwarmed}


def cli(argv: list[str]) -> int:
    from relight.runtime.train import main

    return main(argv)


def train_on_slow_storage(plan_json: str, overrides: list[str]) -> dict[str, Any]:
    """Train with the checkpoint store slowed by a fault plan (RELIGHT_FAULT_PLAN, read by
    open_store); report the manager's wait/skip counters and the committed steps."""
    import os

    os.environ["RELIGHT_FAULT_PLAN"] = plan_json
    try:
        trainer = _trainer("configs/tiny.toml", overrides)
        res = trainer.run()
        mgr = trainer.ckpt_mgr
        return {"final_step": res.final_step, "skipped": mgr.skipped_saves,
                "waited": mgr.waited_saves, "committed": mgr.committed_steps()}
    finally:
        os.environ.pop("RELIGHT_FAULT_PLAN", None)


def train_recording_samples(config: str = "configs/tiny.toml",
                            overrides: list[str] | None = None,
                            dump: bool = False) -> dict[str, Any]:
    """Train per config and report, besides the losses, the samples each step's counted
    micro-batches held on this rank (`(step, first sample, samples)`; weight-0 padding left
    out), and optionally the final state as full tensors."""
    from relight.runtime.state import flat_names

    trainer = _trainer(config, overrides)
    samples: list[tuple[int, int, int]] = []
    read = trainer.data.next_step

    def recording() -> list:
        for m in trainer.plan.micro_batches(trainer.data.position):
            if not m.padding:
                samples.append((trainer.step, m.start, m.size))
        return read()

    trainer.data.next_step = recording
    res = trainer.run()
    out: dict[str, Any] = {"losses": res.losses, "layout": res.layout,
                           "final_step": res.final_step, "restored_step": res.restored_step,
                           "samples": samples, "dp": trainer.layout.dp,
                           "plan": trainer.plan.describe()}
    if dump:
        out["state"] = {k: _full(v) for k, v in flat_names(trainer.state_dict()).items()}
    return out
