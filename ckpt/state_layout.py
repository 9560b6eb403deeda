"""How a state dict lies on this rank, as the checkpoint engine sees it: the public layout
API other layers build on (the live heal and the cross-group reduction of
`relight.elastic` route the same boxes a resharded load reads).

- `flatten_state(sd)` -> `FlatState`: every tensor (`TensorRef`) and JSON value of a state
  dict under its flat name, stateful objects expanded; `set_value` writes one back.
- `rank_layout(flat, rank)` -> `(RankLayout, {name: [Piece]})`: the global boxes this
  rank holds of each tensor, and the local views that hold them; `layout_digest` names
  a layout; `describe_placements` a DTensor's placements.
- `Box`, `TensorLayout`, `intersect`: the boxes' geometry.
- `materialize_optimizer_states(sd)`: an optimizer that has not stepped yet gets its
  state tensors, so that it can receive another's.
"""

from relight.ckpt.flatten import FlatState, TensorRef, flatten_state, set_value
from relight.ckpt.layout import Piece, describe_placements, rank_layout
from relight.ckpt.optim_state import materialize_optimizer_states
from relight.ckpt.plan import Box, RankLayout, TensorLayout, intersect, layout_digest

__all__ = ["Box", "FlatState", "Piece", "RankLayout", "TensorLayout", "TensorRef",
           "describe_placements", "flatten_state", "intersect", "layout_digest",
           "materialize_optimizer_states", "rank_layout", "set_value"]
