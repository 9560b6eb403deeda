"""examples/user_train.py with a resume bug planted on purpose: after restoring, it skips
one global batch of data (as a loader that restarts at the *next* epoch boundary would).
The chaos harness must catch it (invariant 6, and the loss curve of invariant 5)."""

import runpy
import sys
from pathlib import Path

from relight import ckpt

_restore = ckpt.CheckpointManager.restore


def restore_skipping_a_batch(self, state_dict, *args, **kwargs):  # noqa: ANN001, ANN201
    step = _restore(self, state_dict, *args, **kwargs)
    state_dict["train"]["data_position"] += 24  # the bug
    return step


ckpt.CheckpointManager.restore = restore_skipping_a_batch
script = Path(__file__).resolve().parents[3] / "examples" / "user_train.py"
sys.argv[0] = str(script)
runpy.run_path(str(script), run_name="__main__")
