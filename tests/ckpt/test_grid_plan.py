"""Planning from a mesh's closed form (`ckpt.grid`) against planning from every rank's
pieces: the same pieces, each written once by a rank that holds it, packed slots that
never overlap. Pure: no processes."""

from __future__ import annotations

import math

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from relight.ckpt.errors import UnsupportedStateError
from relight.ckpt.grid import MeshGrid
from relight.ckpt.plan import (
    GridPieces,
    RankLayout,
    TensorLayout,
    grid_needs_json,
    layouts_from_parts,
    parse_grid_needs,
    plan_load,
    plan_save,
)


def _coords(mesh: tuple[int, ...]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for size in mesh:
        out = [c + (i,) for c in out for i in range(size)]
    return out


@st.composite
def meshes(draw) -> MeshGrid:  # noqa: ANN001
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    # A slice of a bigger row-major mesh: every stride a multiple of the next one's span.
    spread = draw(st.integers(1, 3))
    strides, span = [], spread
    for size in reversed(mesh):
        strides.append(span if size > 1 else 0)
        span *= size
    return MeshGrid(mesh, draw(st.integers(0, 5)), tuple(reversed(strides)), ())


@st.composite
def states(draw) -> tuple[MeshGrid, list[tuple[str, tuple[int, ...], MeshGrid]], int]:  # noqa: ANN001
    base = draw(meshes())
    tensors = []
    for i in range(draw(st.integers(1, 5))):
        ndim = draw(st.integers(1, 3))
        splits: list[list[int]] = [[] for _ in range(ndim)]
        for m in draw(st.permutations(range(len(base.mesh)))):
            d = draw(st.integers(-1, ndim - 1))  # -1: replicated over this mesh dim
            if d >= 0:
                splits[d].append(m)
        grid = MeshGrid(base.mesh, base.start, base.strides, tuple(map(tuple, splits)))
        # Where several mesh dims split one tensor dim: equal outer blocks.
        shape = []
        for split in splits:
            outer = math.prod(base.mesh[m] for m in split[:-1])
            shape.append(outer * draw(st.integers(1, 7)))
        if grid.chunks(tuple(shape)) is not None:  # else no closed form: planned by pieces
            tensors.append((f"t{i}", tuple(shape), grid))
    assume(tensors)
    return base, tensors, draw(st.sampled_from([0, 64, 4096]))


def _layouts(base: MeshGrid, tensors: list[tuple[str, tuple[int, ...], MeshGrid]],
             grids: bool) -> list[RankLayout]:
    out = []
    for coord in _coords(base.mesh):
        rank = base.rank_at(coord)
        held = []
        for name, shape, grid in tensors:
            box = grid.box_at(coord, shape)
            held.append(TensorLayout(name, (name,), shape, "float32", "",
                                     () if box is None else (box,), grid if grids else None))
        out.append(RankLayout(rank, tuple(held), ("step",)))
    return out


def _compact(layouts: list[RankLayout]) -> list[RankLayout]:
    return layouts_from_parts([lay.compact() for lay in layouts],
                              tuple(lay.rank for lay in layouts))


@settings(max_examples=150, deadline=None)
@given(states())
def test_grid_plan_writes_the_same_pieces_once_each_by_a_holder(case) -> None:  # noqa: ANN001
    base, tensors, pack = case
    ranks = tuple(sorted(base.ranks()))
    pieces_plan = plan_save(_layouts(base, tensors, False), ranks, pack_bytes=pack)
    layouts = _compact(_layouts(base, tensors, True))
    assert len({id(lay.tensors) for lay in layouts}) == 1  # one description, parsed once
    plan = plan_save(layouts, ranks, pack_bytes=pack)
    held = {(lay.rank, t.name): t.grid.box_at(t.grid.coord_of(lay.rank), t.shape)
            for lay in layouts for t in lay.tensors}
    written: dict[tuple[str, tuple], int] = {}
    for r in ranks:
        for tp, p in plan.writes_of(r):
            assert p.writer == r and held[(r, tp.name)] == (p.offset, p.shape)
            assert (tp.name, p.offset) not in written
            written[(tp.name, p.offset)] = r
    for name, tp in plan.tensors.items():
        other = pieces_plan.tensors[name]
        assert isinstance(tp.pieces, GridPieces)
        assert tp.storage == other.storage and tp.chunks == other.chunks
        assert sorted((p.offset, p.shape) for p in tp.pieces) == \
            sorted((p.offset, p.shape) for p in other.pieces)
        assert {(p.offset, p.writer) for p in tp.pieces} == \
            {(o, w) for (n, o), w in written.items() if n == name}
        if tp.storage == "grid":
            assert tp.meta_writer in {p.writer for p in tp.pieces}
    # Packed slots: inside their writer's array and never overlapping.
    spans: dict[int, list[tuple[int, int]]] = {}
    for tp in plan.tensors.values():
        for p in tp.pieces:
            if tp.storage == "packed":
                assert p.array == f"packed/r{p.writer:05d}"
                spans.setdefault(p.writer, []).append(
                    (p.byte_offset, p.byte_offset + math.prod(p.shape) * 4))
    for w, got in spans.items():
        got.sort()
        assert got[-1][1] <= plan.packed_size[w]
        assert all(a[1] <= b[0] for a, b in zip(got, got[1:], strict=False))
    assert sum(plan.write_bytes.values()) == sum(
        math.prod(shape) * 4 for _, shape, _ in tensors)
    assert plan.value_owner == {"step": ranks[0]}


def test_replicas_take_turns_writing() -> None:
    # 2 x 4 mesh: rows over the second dim, replicated over the first (HSDP).
    grid = MeshGrid((2, 4), 0, (4, 1), ((1,), ()))
    tensors = [(f"w{i}", (64, 1024), grid) for i in range(4)]
    plan = plan_save(_compact(_layouts(MeshGrid((2, 4), 0, (4, 1), ()), tensors, True)),
                     tuple(range(8)), pack_bytes=0)
    assert sorted(plan.write_bytes.values()) == [2 * 16 * 1024 * 4] * 8


def test_tensors_without_a_grid_travel_beside_the_shared_ones() -> None:
    base = MeshGrid((4,), 0, (1,), ())
    grid = MeshGrid((4,), 0, (1,), ((0,), ()))
    layouts = _layouts(base, [("a", (8, 8), grid)], True)
    # A second tensor on each rank without a closed form (an uneven nested split).
    rows = [((0,), (3,)), ((3,), (2,)), ((5,), (3,)), ((8,), (2,))]
    layouts = [RankLayout(lay.rank, (*lay.tensors, TensorLayout(
        "b", ("b",), (10,), "float32", "", (rows[lay.rank],))), lay.values)
        for lay in layouts]
    compact = _compact(layouts)
    assert len({id(lay.tensors) for lay in compact}) == 1
    assert [lay.own[0].pieces for lay in compact] == [(r,) for r in rows]
    plan = plan_save(compact, (0, 1, 2, 3), pack_bytes=0)
    assert isinstance(plan.tensors["a"].pieces, GridPieces)
    assert plan.tensors["b"].storage == "pieces"
    assert sorted(p.writer for p in plan.tensors["b"].pieces) == [0, 1, 2, 3]
    assert plan == plan_save(compact, (0, 1, 2, 3), pack_bytes=0)


def test_a_rank_that_misses_a_grid_tensor_plans_it_from_pieces() -> None:
    grid = MeshGrid((4,), 0, (1,), ((0,), ()))
    layouts = _layouts(MeshGrid((4,), 0, (1,), ()), [("a", (8, 8), grid)], True)
    # Rank 3 reports the tensor without its grid: the others' grids become pieces.
    plain = TensorLayout("a", ("a",), (8, 8), "float32", "", (((6, 0), (2, 8)),))
    layouts[3] = RankLayout(3, (plain,), ("step",))
    plan = plan_save(layouts, (0, 1, 2, 3), pack_bytes=0)
    assert not isinstance(plan.tensors["a"].pieces, GridPieces)
    assert sorted(p.offset for p in plan.tensors["a"].pieces) == [(0, 0), (2, 0), (4, 0), (6, 0)]
    # Rank 3 missing altogether leaves a gap, refused as before.
    with pytest.raises(UnsupportedStateError, match="gaps"):
        plan_save(layouts[:3], (0, 1, 2), pack_bytes=0)


def test_grid_coordinates_round_trip() -> None:
    grid = MeshGrid((2, 3, 2), 7, (12, 2, 1), ((2,), (0, 1)))
    for coord in _coords(grid.mesh):
        assert grid.coord_of(grid.rank_at(coord)) == coord
    assert grid.coord_of(6) is None and grid.coord_of(7 + 24) is None
    assert sorted(grid.ranks()) == sorted(grid.rank_at(c) for c in _coords(grid.mesh))
    assert grid.chunks((4, 12)) == (2, 2) and grid.chunks((4, 13)) is None
    # Nested and uneven inside its blocks: 3 blocks of 4 rows over 2 -> cells of 2 rows;
    # 3 blocks of 3 over 2 -> chunks of 2 that do not tile a block.
    assert grid.chunks((4, 12)) == (2, 2) and grid.chunks((4, 9)) is None
    tall = MeshGrid((2, 4), 0, (4, 1), ((0, 1),))
    assert tall.chunks((6,)) == (1,)  # blocks of 3 rows, one row to each of 3 of 4 ranks
    assert tall.box_at((1, 2), (6,)) == ((5,), (1,)) and tall.box_at((1, 3), (6,)) is None


@settings(max_examples=100, deadline=None)
@given(states(), st.booleans())
def test_grid_load_plan_reads_each_cell_once_for_all_its_holders(case, broadcast) -> None:  # noqa: ANN001
    base, tensors, _ = case
    ranks = tuple(sorted(base.ranks()))
    needs = [(name, shape, 4, grid) for name, shape, grid in tensors]
    text = grid_needs_json(needs, sorted(n for n, _, _ in tensors))
    plan = plan_load({}, broadcast, parse_grid_needs([text] * len(ranks), ranks))
    assert len(plan.grid_reads) == len(tensors) and not plan.tasks
    reads: dict[tuple[str, tuple], list[int]] = {}
    for r in ranks:
        coord = base.coord_of(r)
        got = {t.name: t for _, t in plan.mine(r)}
        for name, shape, grid in tensors:
            box = grid.box_at(coord, shape)
            if box is None:
                assert name not in got
                continue
            task = got[name]
            assert task.box == box and (task.reader == r or r in task.receivers)
            if task.reader == r:
                reads.setdefault((name, box[0]), []).append(r)
                for peer in task.receivers:  # each receiver holds the same box
                    assert grid.box_at(base.coord_of(peer), shape) == box
    for (name, _), readers in reads.items():
        grid = next(g for n, _, g in tensors if n == name)
        assert len(readers) == (1 if broadcast else grid.replicas)
    assert plan.total_read_bytes == sum(
        math.prod(s) * 4 * (1 if broadcast else g.replicas) for _, s, g in tensors)
    # Tags: one per tensor, the same on the reader and its receivers.
    tags = {(t.name, tag) for r in ranks for tag, t in plan.mine(r)}
    assert len(tags) == len({n for n, _ in tags})


def test_a_grid_some_rank_loads_otherwise_is_read_by_pieces() -> None:
    grid = MeshGrid((4,), 0, (1,), ((0,), ()))
    ranks = (0, 1, 2, 3)
    text = grid_needs_json([("a", (8, 8), 4, grid)], ["a"])
    other = grid_needs_json([], ["a"])
    # Rank 3 loads "a" whole (a plain tensor): ranks 0-2's cells become boxes.
    plan = plan_load({3: [("a", ((0, 0), (8, 8)), 4)]}, True,
                     parse_grid_needs([text, text, text, other], ranks))
    assert not plan.grid_reads
    assert sorted(t.box for t in plan.tasks) == [
        ((0, 0), (2, 8)), ((0, 0), (8, 8)), ((2, 0), (2, 8)), ((4, 0), (2, 8))]
