"""What `relight run` needs to know of a Relight training command, read from its config.

The launcher (`relight.elastic.launch`) knows no trainer; the `relight` command hands it
this reader, so that a job of `-m relight.runtime.train` or `relight train` gets an agent
shutdown timeout above its configured preemption grace, its metrics the checkpoint
root, and its rendezvous the node counts its layout can train on, without the user
repeating them as flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from relight.elastic.launch import TrainingHints
from relight.runtime.config import Config, ConfigError, load_config

__all__ = ["layout_refusal", "training_hints", "trainer_arguments"]


def trainer_arguments(positional: Sequence[str]) -> list[str] | None:
    """The trainer's own arguments when torchrun's positional command runs Relight's
    trainer (`--module relight.runtime.train ...` or `--no-python .../relight train ...`),
    else None."""
    positional = list(positional)
    if positional[:2] == ["--module", "relight.runtime.train"]:
        return positional[2:]
    if (positional[:1] == ["--no-python"] and len(positional) > 2
            and os.path.basename(positional[1]) == "relight" and positional[2] == "train"):
        return positional[3:]
    return None


def training_hints(positional: Sequence[str]) -> TrainingHints | None:
    """The grace period (None when preemption handling is off) and checkpoint root of
    Relight's trainer, from its config loaded the way the trainer loads it; None for
    another command or a config that does not load (the trainer reports that itself,
    with its exit status 2)."""
    train_args = trainer_arguments(positional)
    if train_args is None:
        return None
    sub = argparse.ArgumentParser(add_help=False)
    sub.add_argument("--config")
    known, overrides = sub.parse_known_args(train_args)
    try:
        cfg = load_config(known.config, overrides)
    except (ConfigError, OSError, ValueError) as exc:
        print(f"relight run: could not read the training config ({exc}); using the "
              "default preemption grace", file=sys.stderr)
        return None
    grace = cfg.preemption.grace_s if cfg.preemption.enabled else None
    return TrainingHints(grace, cfg.checkpoint.url or None, layout_refusal(cfg))


def layout_refusal(cfg: Config) -> Callable[[int], str | None]:
    """Why `cfg`'s layout cannot train on a world of that many ranks (None: it can): the
    trainer's own check (`runtime.mesh.plan_layout`), asked ahead of the rendezvous."""

    def why(world: int) -> str | None:
        # Imported when asked: the launcher reads hints before it imports torch.
        from relight.runtime.mesh import LayoutError, plan_layout

        try:
            plan_layout(world, cfg)
        except LayoutError as exc:
            return str(exc)
        return None

    return why
