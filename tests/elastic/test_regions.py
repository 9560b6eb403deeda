"""Region routing and exchange between layouts: which rank sends which box, and the copy
and the sum carried over real gloo process groups (one per thread, in this process)."""

from __future__ import annotations

import math
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from relight.ckpt.layout import Piece
from relight.ckpt.plan import RankLayout, TensorLayout
from relight.elastic.regions import (
    RegionError,
    copy_regions,
    plan_copy,
    plan_sum,
    route,
    sum_regions,
)

SHAPE = (4, 6)


def _layout(rank: int, held: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]],
            shapes: dict[str, tuple[int, ...]] | None = None) -> RankLayout:
    shapes = shapes or {}
    return RankLayout(rank, tuple(
        TensorLayout(name, (name,), shapes.get(name, SHAPE), "float64", "test", tuple(boxes))
        for name, boxes in sorted(held.items())), ())


def rows(lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (lo, 0), (hi - lo, SHAPE[1])


def cols(lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
    return (0, lo), (SHAPE[0], hi - lo)


def test_route_from_two_row_shards_to_a_whole_tensor() -> None:
    sources = [_layout(0, {"w": [rows(0, 2)]}), _layout(1, {"w": [rows(2, 4)]})]
    segs = route(_layout(2, {"w": [rows(0, 4)]}), sources)
    assert [(s.src, s.box) for s in segs] == [(0, rows(0, 2)), (1, rows(2, 4))]
    assert all(s.dst == 2 and s.dst_piece == 0 for s in segs)


def test_route_between_row_and_column_shards_covers_every_element_once() -> None:
    sources = [_layout(0, {"w": [cols(0, 3)]}), _layout(1, {"w": [cols(3, 6)]})]
    for dst_rank, box in ((5, rows(0, 2)), (6, rows(2, 4))):
        segs = route(_layout(dst_rank, {"w": [box]}), sources)
        assert sum(math.prod(s.box[1]) for s in segs) == math.prod(box[1])
        assert {s.src for s in segs} == {0, 1}


def test_route_spreads_replicated_boxes_over_their_holders() -> None:
    # Two ranks hold the whole tensor (a TP-replicated parameter): destinations alternate.
    sources = [_layout(0, {"w": [rows(0, 4)]}), _layout(1, {"w": [rows(0, 4)]})]
    picked = {d: route(_layout(d, {"w": [rows(0, 4)]}), sources)[0].src for d in (4, 5, 6, 7)}
    assert picked == {4: 0, 5: 1, 6: 0, 7: 1}


def test_route_refuses_a_gap_an_overlap_and_other_shapes() -> None:
    whole = _layout(9, {"w": [rows(0, 4)]})
    with pytest.raises(RegionError, match="covers 12 of the 24"):
        route(whole, [_layout(0, {"w": [rows(0, 2)]})])
    with pytest.raises(RegionError, match="covers 30 of the 24"):
        route(whole, [_layout(0, {"w": [rows(0, 3)]}), _layout(1, {"w": [rows(2, 4)]})])
    with pytest.raises(RegionError, match=r"'w' is \[4, 6\] float64 at rank 9 and \[4, 7\]"):
        route(whole, [_layout(0, {"w": [((0, 0), (4, 7))]}, {"w": (4, 7)})])
    with pytest.raises(RegionError, match=r"1 tensor\(s\) at rank 9 that no rank of the"):
        route(_layout(9, {"w": [rows(0, 4)], "v": [rows(0, 4)]}), [_layout(0, {"w": [rows(0, 4)]})])
    # A source holding more than the destination (another pipeline stage's layers) is fine.
    assert len(route(whole, [_layout(0, {"w": [rows(0, 4)], "v": [rows(0, 4)]})])) == 1


# -- over gloo -----------------------------------------------------------------------------

# Group 0: ranks 0 and 1 hold the rows of `w` in halves and `s` (a plain scalar) each.
# Group 1: ranks 2 and 3 hold its columns in halves (as tensor parallelism would).
HELD = {0: {"w": [rows(0, 2)], "s": [((), ())]},
        1: {"w": [rows(2, 4)], "s": [((), ())]},
        2: {"w": [cols(0, 3)], "s": [((), ())]},
        3: {"w": [cols(3, 6)], "s": [((), ())]}}
GROUP_OF = [0, 0, 1, 1]


def _layouts() -> list[RankLayout]:
    return [RankLayout(r, tuple(
        TensorLayout(n, (n,), SHAPE if n == "w" else (), "float64", "test", tuple(b))
        for n, b in sorted(held.items())), ()) for r, held in HELD.items()]


def _local(rank: int, full: torch.Tensor, s: float) -> dict[str, torch.Tensor]:
    (off, shape), = HELD[rank]["w"]
    return {"w": full[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]].clone(),
            "s": torch.tensor(s, dtype=torch.float64)}


def _pieces(rank: int) -> dict[str, list[Piece]]:
    (off, shape), = HELD[rank]["w"]
    return {"w": [Piece(off, shape, (0, 0))], "s": [Piece((), (), ())]}


def _on_gloo(body, ranks: int = len(HELD)) -> list:  # noqa: ANN001 - body(pg, rank)
    store = dist.HashStore()
    results: list = [None] * ranks

    def run(rank: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = timedelta(seconds=60)
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            pg = dist.ProcessGroupGloo(store, rank, ranks, opts)
            results[rank] = body(pg, rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[rank] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)  # generous: a few gloo groups and a few small messages
    for r in range(ranks):
        if isinstance(results[r], BaseException):
            raise results[r]
    return results


@pytest.mark.parametrize("message_bytes", [64 << 20, 40])
def test_copy_and_sum_over_gloo_between_layouts(message_bytes: int, monkeypatch) -> None:
    # 40 bytes: every segment of `w` (48 bytes) a message of its own, `s` with the next,
    # and a sender waits for each message before it packs the next.
    monkeypatch.setattr("elastic.regions.MESSAGE_BYTES", message_bytes)
    if message_bytes < 48:
        monkeypatch.setattr("elastic.regions.SEND_WINDOW", 1)
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(SHAPE, generator=gen, dtype=torch.float64), torch.randn(
        SHAPE, generator=gen, dtype=torch.float64)
    layouts = _layouts()

    def copy(pg, rank):  # noqa: ANN001, ANN202
        t = _local(rank, a if GROUP_OF[rank] == 0 else torch.zeros(SHAPE, dtype=torch.float64),
                   1.5 if GROUP_OF[rank] == 0 else 0.0)
        plan = plan_copy(layouts, [0, 1], [2, 3], rank)
        got = copy_regions(pg, plan, t, _pieces(rank), timeout_s=60)
        return t, got

    out = _on_gloo(copy)
    assert torch.equal(out[2][0]["w"], a[:, :3]) and torch.equal(out[3][0]["w"], a[:, 3:])
    assert all(float(out[r][0]["s"]) == 1.5 for r in HELD)
    assert out[2][1] == 12 * 8 + 8  # w from both halves of the rows, s from one holder
    assert out[0][1] == out[1][1] == 0

    def add(pg, rank):  # noqa: ANN001, ANN202
        g = GROUP_OF[rank]
        t = _local(rank, a if g == 0 else b, 1.0 if g == 0 else 2.0)
        plan = plan_sum(layouts, [[0, 1], [2, 3]], rank)
        sum_regions(pg, plan, t, _pieces(rank), GROUP_OF, timeout_s=60)
        return t

    total = a + b
    out = _on_gloo(add)
    for rank in HELD:
        assert torch.equal(out[rank]["w"], _local(rank, total, 0)["w"]), rank
        assert float(out[rank]["s"]) == 3.0


def test_a_sum_of_three_groups_adds_in_group_order_on_every_rank() -> None:
    """Rows in halves, the whole tensor, columns in halves: every rank ends with
    ((a + b) + c) on its box, bit for bit, whichever group it is in."""
    held = [rows(0, 2), rows(2, 4), rows(0, 4), cols(0, 3), cols(3, 6)]
    group_of = [0, 0, 1, 2, 2]
    layouts = [RankLayout(r, (TensorLayout("w", ("w",), SHAPE, "float32", "t", (b,)),), ())
               for r, b in enumerate(held)]
    gen = torch.Generator().manual_seed(5)
    values = [torch.randn(SHAPE, generator=gen) * 10 ** k for k in range(3)]  # scales differ

    def part(t: torch.Tensor, rank: int) -> torch.Tensor:
        (o, n) = held[rank]
        return t[o[0]:o[0] + n[0], o[1]:o[1] + n[1]]

    def add(pg, rank):  # noqa: ANN001, ANN202
        t = {"w": part(values[group_of[rank]], rank).clone()}
        pieces = {"w": [Piece(held[rank][0], held[rank][1], (0, 0))]}
        plan = plan_sum(layouts, [[0, 1], [2], [3, 4]], rank)
        sum_regions(pg, plan, t, pieces, group_of, timeout_s=60)
        return t["w"]

    out = _on_gloo(add, ranks=len(held))
    total = (values[0] + values[1]) + values[2]
    assert not torch.equal(total, values[0] + (values[1] + values[2]))  # order matters
    for rank, got in enumerate(out):
        assert torch.equal(got, part(total, rank)), rank
