"""The pure planners: no processes, no storage."""

from __future__ import annotations

import pytest

from relight.ckpt.errors import UnsupportedStateError
from relight.ckpt.format import inner_chunk_shape
from relight.ckpt.plan import RankLayout, TensorLayout, plan_load, plan_save


def lay(rank: int, *tensors: TensorLayout, values: tuple[str, ...] = ()) -> RankLayout:
    return RankLayout(rank, tensors, values)


def t(name: str, shape, pieces, dtype: str = "float32") -> TensorLayout:
    return TensorLayout(name, (name,), tuple(shape), dtype, "",
                        tuple((tuple(o), tuple(s)) for o, s in pieces))


def test_replicas_written_once_spread_over_holders() -> None:
    # dp2 x tp2, Replicate over dp: ranks (0,2) hold rows 0:64, ranks (1,3) rows 64:128
    top, bottom = ((0, 0), (64, 256)), ((64, 0), (64, 256))
    layouts = [lay(r, *(t(f"w{i}", (128, 256), [top if r in (0, 2) else bottom])
                        for i in range(4))) for r in range(4)]
    plan = plan_save(layouts, (0, 1, 2, 3), pack_bytes=0)
    writers = [p.writer for tp in plan.tensors.values() for p in tp.pieces]
    assert len(writers) == 8  # 4 tensors x 2 distinct pieces, not 16
    assert sorted(plan.write_bytes.values()) == [2 * 64 * 256 * 4] * 4  # evenly spread
    assert all(tp.storage == "grid" and tp.chunks == (64, 256) for tp in plan.tensors.values())


def test_uneven_shard_is_a_grid_nested_is_pieces() -> None:
    # 10 rows over 4 ranks (torch.chunk style): 3,3,3,1 -> regular grid, last chunk partial
    rows = [(0, 3), (3, 3), (6, 3), (9, 1)]
    layouts = [lay(r, t("a", (10, 1000), [((o, 0), (n, 1000))])) for r, (o, n) in enumerate(rows)]
    plan = plan_save(layouts, (0, 1, 2, 3), pack_bytes=0)
    assert plan.tensors["a"].storage == "grid" and plan.tensors["a"].chunks == (3, 1000)
    # nested split of one dim: 0:3, 3:5, 5:8, 8:10 -> no regular grid
    rows = [(0, 3), (3, 2), (5, 3), (8, 2)]
    layouts = [lay(r, t("a", (10, 1000), [((o, 0), (n, 1000))])) for r, (o, n) in enumerate(rows)]
    plan = plan_save(layouts, (0, 1, 2, 3), pack_bytes=0)
    assert plan.tensors["a"].storage == "pieces" and len(plan.tensors["a"].pieces) == 4


def test_small_tensors_packed_per_writer() -> None:
    layouts = [lay(r, *(t(f"n{i}", (64,), [((0,), (64,))]) for i in range(100))) for r in range(2)]
    plan = plan_save(layouts, (0, 1))
    assert {tp.storage for tp in plan.tensors.values()} == {"packed"}
    assert set(plan.packed_size) == {0, 1}  # both replicas share the packing work
    offsets = sorted((p.writer, p.byte_offset) for tp in plan.tensors.values() for p in tp.pieces)
    assert len(set(offsets)) == 100


def test_gaps_and_disagreements_are_refused() -> None:
    with pytest.raises(UnsupportedStateError, match="gaps"):
        plan_save([lay(0, t("a", (8,), [((0,), (4,))]))], (0,))
    with pytest.raises(UnsupportedStateError, match="agree"):
        plan_save([lay(0, t("a", (8,), [((0,), (8,))])),
                   lay(1, t("a", (9,), [((0,), (9,))]))], (0, 1))


def test_inner_chunks_divide_and_bound() -> None:
    for shape in [(546, 2048), (1000, 1536), (7, 3, 5), (97, 1031), (4096,)]:
        inner = inner_chunk_shape(shape, 4, 256 * 1024)
        assert all(s // i >= 2 for s, i in zip(shape, inner, strict=True) if s >= 256
                   and s % 2 == 0), (shape, inner)
        assert all(s % i == 0 for s, i in zip(shape, inner, strict=True)), (shape, inner)
    assert inner_chunk_shape((1024, 4096), 4, 1 << 20) == (512, 512)
    assert inner_chunk_shape((546, 2048), 4, 4 << 20) == (273, 1024)


def test_load_plan_one_reader_per_replica_group() -> None:
    box_a, box_b = ((0, 0), (32, 64)), ((32, 0), (32, 64))
    needs = {0: [("w", box_a, 4)], 1: [("w", box_b, 4)], 2: [("w", box_a, 4)],
             3: [("w", box_b, 4)]}
    plan = plan_load(needs, broadcast=True)
    assert len(plan.tasks) == 2
    for task in plan.tasks:
        assert len(task.receivers) == 1
    direct = plan_load(needs, broadcast=False)
    assert len(direct.tasks) == 4 and all(not t.receivers for t in direct.tasks)


def test_index_runs_are_maximal_and_in_local_order() -> None:
    """`ckpt.layout._runs` turns a rank's global indices along one dim (contiguous for
    Shard, strided or interleaved for nested shardings) into (local start, length,
    global start) runs, vectorized: a flat state can hold tens of millions per rank."""
    import torch

    from relight.ckpt.layout import _runs

    assert _runs(torch.arange(5, 9)) == [(0, 4, 5)]
    assert _runs(torch.tensor([0, 1, 4, 5, 6, 2, 3, 9])) == [
        (0, 2, 0), (2, 3, 4), (5, 2, 2), (7, 1, 9)]
    assert _runs(torch.tensor([7])) == [(0, 1, 7)]
    assert _runs(torch.empty(0, dtype=torch.long)) == []
    big = torch.cat([torch.arange(0, 3_000_000), torch.arange(5_000_000, 6_000_000)])
    assert _runs(big) == [(0, 3_000_000, 0), (3_000_000, 1_000_000, 5_000_000)]
