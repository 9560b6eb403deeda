"""Save and load planning at simulated world sizes: Relight's planners vs DCP's.

Run as a worker (`python -m relight.benchmarks.scale_plan --system relight|dcp ...`), one
process per (config, system), world sizes in ascending order; it prints one JSON line
when an arm's timed part starts and one with its result, so the parent can stop a DCP
arm at the time cap without losing the arms before it. Inputs are built before the
clock starts; peak memory is the process's RSS above its value at the start of the
arm, sampled every 5 ms (the planners are pure Python; the sampler costs nothing
measurable next to them). Times are CPU seconds of the worker (`Clock`), wall seconds
beside them in the JSON; the cap is on wall time.

Relight (what `ckpt.saver` and `ckpt.loader` run on every rank): the parse of every
rank's layout as the exchange delivers it, `plan_save`, this rank's `writes_of`; the parse
of every rank's load needs, `plan_load` and this rank's tasks (`LoadPlan.mine`), loading
into the layout saved; then the manifest built from the plan as the coordinator builds it
(`ckpt.commit`), its bytes, and its parse time (`parse_manifest`: json + checks, as
`read_manifest` does on each rank).

DCP (torch.distributed.checkpoint's default planners): save is
`DefaultSavePlanner.create_global_plan` over one synthetic local `SavePlan` per rank
(dedup, metadata, global validation: the coordinator's step); load is the local plan
of a rank, `create_read_items_for_chunk_list` for each of its shards against the saved
metadata, as `create_default_local_load_plan` does for a DTensor: every rank runs it in
parallel, so the slowest of the sampled ranks stands for the step. DCP's `.metadata`
file (a pickle) is not measured: no Relight module imports pickle.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

from relight.benchmarks.scale_state import (
    CONFIGS,
    ITEMSIZE,
    MESHES,
    MODELS,
    MOMENTS,
    Box,
    rank_pieces,
    stage_of,
)

__all__ = ["relight_arm", "dcp_arm", "main"]


class PeakRSS:
    """Peak RSS above the start, sampled in a thread while the block runs."""

    def __init__(self, period_s: float = 0.005) -> None:
        import psutil

        self._proc = psutil.Process(os.getpid())
        self.period_s = period_s
        self.base = self.peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, self._proc.memory_info().rss)

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def mib(self) -> float:
        return (self.peak - self.base) / 2**20


class Clock:
    """CPU seconds of this process (the planners are single-threaded Python: on an idle
    core that is their wall time, and on a shared machine it does not count the time
    other processes held the core) and wall seconds, of the block."""

    cpu = wall = 0.0

    def __enter__(self) -> Clock:
        self._cpu, self._wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu = time.process_time() - self._cpu
        self.wall = time.perf_counter() - self._wall


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


# --------------------------------------------------------------------------- relight


def stage_grids(config: str, world: int) -> dict[tuple[int, str], Any]:
    """(stage, tensor name) -> the `MeshGrid` a rank of that stage would report for it, as
    `ckpt.layout.mesh_grid` derives it from the DTensor: the stage's mesh is (replicate,
    fsdp / ep, ep, tp) in `rank_pieces`'s numbering; tensor parallelism splits first and
    FSDP within its blocks (strided sharding), experts over ep and each expert's dim 1
    over the rest of fsdp. Mesh dims of one rank are left out, as the engine does."""
    from relight.ckpt.grid import MeshGrid

    model, mesh = MODELS[CONFIGS[config][0]], MESHES[CONFIGS[config][1]].at(world)
    shape = (mesh.replicate, mesh.fsdp // mesh.ep, mesh.ep, mesh.tp)
    strides = (mesh.pp * mesh.fsdp * mesh.tp, mesh.ep * mesh.tp, mesh.tp, 1)
    out = {}
    for stage in range(mesh.pp):
        start = stage * mesh.fsdp * mesh.tp
        for p in model.params():
            if stage_of(p, model.n_layers, mesh.pp) != stage:
                continue
            splits: list[tuple[int, ...]] = [()] * len(p.shape)
            if p.expert and mesh.ep > 1:
                splits[0], splits[1] = (2,), (1,)
            else:
                fsdp = (1, 2)
                if p.tp == "col":
                    splits[0] = (3, *fsdp)
                elif p.tp == "row":
                    splits[1], splits[0] = (3,), fsdp
                else:
                    splits[0] = fsdp
            kept = tuple(tuple(m for m in sp if shape[m] > 1) for sp in splits)
            grid = MeshGrid(shape, start, tuple(st if n > 1 else 0 for n, st in
                                                zip(shape, strides, strict=True)), kept)
            for prefix in ("model/", *(f"optim/{m}/" for m in MOMENTS)):
                out[(stage, prefix + p.name)] = grid
    return out


def relight_inputs(config: str, world: int
                   ) -> tuple[list[tuple[bytes, bytes]], list[tuple[bytes, bytes]], int]:
    """What the save's and the load's exchanges deliver to each rank, loading into the
    layout saved: per rank, the layout (`RankLayout.compact` through
    `Comm.allgather_shared`: the tensors with a grid, one bytes object per distinct
    text, and the others with the rank's own box), and the load's needs (the grid needs
    and wanted names as `grid_needs_json`, shared likewise, and the JSON document
    `all_or_raise` carries with the rank's other needs); and the number of pieces."""
    from relight.ckpt.plan import RankLayout, TensorLayout, grid_needs_json

    model, mesh = MODELS[CONFIGS[config][0]], MESHES[CONFIGS[config][1]].at(world)
    grids = stage_grids(config, world)
    # The shared texts depend on the stage only: made once per stage from its first
    # rank; the own parts (tensors without a grid) per (stage, shard, tp rank).
    shared_of: dict[int, tuple[bytes, bytes]] = {}
    own_of: dict[tuple[int, int, int], tuple[bytes, bytes]] = {}
    out, needs, pieces = [], [], 0
    for rank, held in rank_pieces(model, mesh):
        t = rank % mesh.tp
        f = rank // mesh.tp % mesh.fsdp
        stage = rank // (mesh.tp * mesh.fsdp) % mesh.pp
        if stage not in shared_of:
            tensors = [TensorLayout(name, tuple(name.split("/")), shape, "float32", "sim",
                                    (box,), grids[(stage, name)])
                       for name, shape, box in held
                       if grids[(stage, name)].chunks(shape) is not None]
            shared, _ = RankLayout(rank, tuple(tensors), ()).compact()
            wants = [(x.name, x.shape, ITEMSIZE, x.grid) for x in tensors]
            shared_of[stage] = (shared, grid_needs_json(wants, sorted(n for n, _, _ in held)))
        key = (stage, f, t)
        if key not in own_of:
            plain = [TensorLayout(name, tuple(name.split("/")), shape, "float32", "sim", (box,))
                     for name, shape, box in held
                     if grids[(stage, name)].chunks(shape) is None]
            _, own = RankLayout(rank, tuple(plain), ()).compact()
            doc = {"err": None, "data": {"needs": [
                (x.name, [list(x.pieces[0][0]), list(x.pieces[0][1])], ITEMSIZE)
                for x in plain]}}
            own_of[key] = (own, json.dumps(doc, separators=(",", ":")).encode())
        out.append((shared_of[stage][0], own_of[key][0]))
        needs.append((shared_of[stage][1], own_of[key][1]))
        pieces += len(held)
    return out, needs, pieces


def relight_manifest(plan: Any, world: int) -> tuple[bytes, Any, bytes]:
    """The manifest the coordinator would write for `plan` and its chunk crc32c table,
    with one made-up crc32c per inner chunk of every data object (the values do not
    change either's size)."""
    from relight.ckpt.commit import build_manifest, encode_manifest, plan_manifest
    from relight.ckpt.format import CHUNK_CRCS, DATA_PREFIX
    from relight.ckpt.manifest import chunk_objects

    attempt = "0123456789abcdef"
    meta = {"step": 1000, "config": {}, "layout": {"world": world}}
    kw = dict(inner_bytes=4 << 20, compression=None, meta=meta)
    data = f"{DATA_PREFIX}{attempt}"
    bare = plan_manifest(plan, attempt, data, {}, **kw)
    crcs = {k: [(zlib.crc32(k.encode()) + i) & 0xFFFFFFFF for i in range(n)]
            for k, _, n in chunk_objects(bare)}
    m, table = build_manifest(plan, attempt, data, {0: {"values": {}, CHUNK_CRCS: crcs}}, **kw)
    return encode_manifest(m), m, table


def table_path(manifest_path: str | Path) -> Path:
    """Where the planning arm leaves the chunk crc32c table beside a manifest it wrote."""
    return Path(manifest_path).with_suffix(".crc32c.bin")


def relight_arm(config: str, world: int, manifest_out: str | None = None,
                manifest: bool = True) -> dict[str, Any]:
    from relight.ckpt.comm import parse_json_list
    from relight.ckpt.manifest import parse_manifest
    from relight.ckpt.plan import (
        GridPieces,
        layouts_from_parts,
        needs_from_json,
        parse_grid_needs,
        plan_load,
        plan_save,
    )

    blobs, needs, pieces = relight_inputs(config, world)
    ranks = tuple(range(world))
    _emit({"event": "start", "world": world})
    with PeakRSS() as mem_save, Clock() as save:
        layouts = layouts_from_parts(blobs, ranks)
        plan = plan_save(layouts, ranks)
        plan.writes_of(0)
    with PeakRSS() as mem_load, Clock() as load:
        # What `ckpt.loader.load` runs on each rank once the exchanges are done.
        docs = parse_json_list([doc for _, doc in needs])
        own = needs_from_json([d["data"]["needs"] for d in docs], ranks)
        lplan = plan_load(own, grids=parse_grid_needs([text for text, _ in needs], ranks))
        lplan.mine(0)
    out: dict[str, Any] = {
        "world": world, "pieces": pieces, "save_s": save.cpu, "load_s": load.cpu,
        "save_wall_s": save.wall, "load_wall_s": load.wall,
        "save_mib": mem_save.mib, "load_mib": mem_load.mib,
        "save_bytes": sum(t.nbytes for t in plan.tensors.values()),
        "grid_tensors": sum(isinstance(t.pieces, GridPieces) for t in plan.tensors.values()),
        "tensors": len(plan.tensors),
        # What each rank receives in the layout exchange: a digest and its own part per
        # rank, and each distinct shared text once.
        "layout_bytes": sum(24 + len(o) for _, o in blobs)
        + sum(len(t) for t in {id(s): s for s, _ in blobs}.values()),
        "read_bytes": lplan.total_read_bytes,
        "grid_reads": len(lplan.grid_reads),
        # What the ranks receive: a region several ranks need is read once and sent on.
        "load_bytes": sum(math.prod(t.box[1]) * ITEMSIZE * (1 + len(t.receivers))
                          for t in lplan.tasks)
        + sum(g.nbytes * g.grid.replicas for g in lplan.grid_reads),
    }
    del layouts, blobs, needs, lplan, docs, own
    if not manifest:
        return out
    # The planning figures survive a manifest step that runs past the cap.
    _emit({"event": "partial", **out})
    _emit({"event": "start", "world": world, "phase": "manifest"})
    t0 = time.perf_counter()
    raw, _, table = relight_manifest(plan, world)
    out["manifest_build_s"] = time.perf_counter() - t0
    out["manifest_bytes"] = len(raw)
    out["crc_table_bytes"] = len(table)
    with Clock() as parse:  # what read_manifest does after fetching and checking the bytes
        parse_manifest(raw, "scale://")
    out["manifest_parse_s"], out["manifest_parse_wall_s"] = parse.cpu, parse.wall
    if manifest_out:
        Path(manifest_out).write_bytes(raw)
        table_path(manifest_out).write_bytes(table)
    return out


# ------------------------------------------------------------------------------ dcp


def dcp_inputs(config: str, world: int) -> list[Any]:
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )

    model, mesh = MODELS[CONFIGS[config][0]], MESHES[CONFIGS[config][1]].at(world)
    props = TensorProperties(dtype=torch.float32)
    sizes: dict[tuple[int, ...], torch.Size] = {}
    shared: dict[tuple[str, Box], WriteItem] = {}
    plans = []
    for _rank, held in rank_pieces(model, mesh):
        items = []
        for name, shape, box in held:
            item = shared.get((name, box))
            if item is None:
                size = sizes.setdefault(shape, torch.Size(shape))
                off = torch.Size(box[0])
                item = shared[(name, box)] = WriteItem(
                    index=MetadataIndex(name, off), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(box[1])),
                        properties=props, size=size))
            items.append(item)
        plans.append(SavePlan(items))
    return plans


def _sample(world: int, k: int) -> list[int]:
    if world <= k:
        return list(range(world))
    return sorted({round(i * (world - 1) / (k - 1)) for i in range(k)})


def dcp_arm(config: str, world: int, load_ranks: int = 8) -> dict[str, Any]:
    from torch.distributed.checkpoint.default_planner import (
        DefaultSavePlanner,
        create_default_global_load_plan,
    )
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    plans = dcp_inputs(config, world)
    _emit({"event": "start", "world": world})
    planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=False)
    with PeakRSS() as mem_save, Clock() as save:
        global_plan, metadata = planner.create_global_plan(plans)
    save_bytes = sum(
        ITEMSIZE * _numel(it.tensor_data.chunk.sizes) for p in global_plan for it in p.items)
    md = metadata.state_dict_metadata
    sampled = _sample(world, load_ranks)
    local_plans, slowest, slowest_wall, load_bytes = [], 0.0, 0.0, 0
    with PeakRSS() as mem_load:
        for r in sampled:
            with Clock() as one:
                items = []
                for it in plans[r].items:
                    items += create_read_items_for_chunk_list(
                        it.index.fqn, md[it.index.fqn], [it.tensor_data.chunk])
                local_plans.append(LoadPlan(items))
            slowest, slowest_wall = max(slowest, one.cpu), max(slowest_wall, one.wall)
            load_bytes += sum(ITEMSIZE * _numel(i.lengths) for i in items)
        with Clock() as glob:
            create_default_global_load_plan(local_plans)
    # DCP's `.metadata` is a pickle: its size and unpickle time are not measured here,
    # since no Relight module imports pickle (tests/test_security.py holds it to that).
    del metadata
    return {
        "world": world, "pieces": sum(len(p.items) for p in plans),
        "save_s": save.cpu, "load_s": slowest + glob.cpu, "save_wall_s": save.wall,
        "load_wall_s": slowest_wall + glob.wall, "load_ranks_sampled": len(sampled),
        "save_mib": mem_save.mib, "load_mib": mem_load.mib,
        "save_bytes": save_bytes,
        "load_bytes": load_bytes if len(sampled) == world else None,
        "metadata_bytes": None, "metadata_parse_s": None, "metadata_parse_wall_s": None,
    }


def _numel(shape: Any) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--system", choices=("relight", "dcp"), required=True)
    ap.add_argument("--config", choices=sorted(CONFIGS), required=True)
    ap.add_argument("--worlds", required=True, help="comma-separated, ascending")
    ap.add_argument("--manifest-dir", default=None,
                    help="relight: write each world's manifest here as w<N>.json")
    args = ap.parse_args(argv)
    for w in (int(x) for x in args.worlds.split(",")):
        if args.system == "relight":
            path = (os.path.join(args.manifest_dir, f"w{w}.json")
                    if args.manifest_dir else None)
            res = relight_arm(args.config, w, path)
        else:
            res = dcp_arm(args.config, w)
        _emit({"event": "result", **res})
    return 0


if __name__ == "__main__":
    sys.exit(main())
