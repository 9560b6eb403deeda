"""`LayoutMemo`: a save of a state with the structure of the last one reuses its layout
and digest; any change that moves a byte of the plan (a shape, a dtype, a name, the
save's options) makes them again."""

from __future__ import annotations

import torch

from relight.ckpt.flatten import flatten_state
from relight.ckpt.layout import LayoutMemo, rank_layout
from relight.ckpt.plan import layout_digest

EXTRA = [(0,), 1 << 20, 4 << 20, 1 << 16]


def _state(rows: int = 4, dtype: torch.dtype = torch.float32, extra_key: bool = False) -> dict:
    s = {"model": {"w": torch.randn(rows, 3).to(dtype), "b": torch.zeros(3)}, "step": 7}
    if extra_key:
        s["model"]["c"] = torch.ones(2)
    return s


def test_the_same_structure_reuses_the_layout_and_a_change_makes_it_again():
    memo = LayoutMemo()
    first = memo.of(flatten_state(_state()), 0, EXTRA)
    lay, _pieces = rank_layout(flatten_state(_state()), 0, grids=True)
    assert first[2] == layout_digest(lay, EXTRA)
    # New tensors, new values, same structure: the memo's answer.
    assert memo.of(flatten_state(_state()), 0, EXTRA) is first
    for changed, extra in ((_state(rows=5), EXTRA), (_state(dtype=torch.bfloat16), EXTRA),
                           (_state(extra_key=True), EXTRA),
                           (_state(), [(0,), 1 << 20, 8 << 20, 1 << 16])):
        got = memo.of(flatten_state(changed), 0, extra)
        want, _ = rank_layout(flatten_state(changed), 0, grids=True)
        assert got is not first and got[2] != first[2]
        assert got[2] == layout_digest(want, extra) and got[0] == want
        first = memo.of(flatten_state(_state()), 0, EXTRA)  # back to the first structure
    assert memo.of(flatten_state(_state()), 1, EXTRA)[0].rank == 1, "another rank's layout"
