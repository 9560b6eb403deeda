"""The one place that turns a world size and a config into a DeviceMesh.

Planning (:func:`plan_layout`, pure, testable without processes) is apart from doing
(:func:`build_mesh`, creates process groups).

Layout rules:

* ``tp``, ``pp``, ``ep`` and ``dp_replicate`` come from the config; ``dp_shard`` too when it
  is not -1, otherwise it fills what is left: ``world = pp * dp_replicate * dp_shard * tp``.
* Expert parallelism borrows data-parallel ranks, as in torchtitan: the ``ep`` ranks each
  read different data, and every expert is held by ``dp / ep`` of them. ``ep`` must divide
  ``dp_shard`` (or ``dp_replicate`` when ``dp_shard`` is 1).
* The global batch is dealt over any ``dp`` (`runtime.data.BatchPlan`): when ``dp`` does not
  divide its micro-batches the data ranks take uneven, weighted shares, so a job keeps its
  batch on any number of ranks the fixed degrees divide. Pipelines deal whole micro-batches
  (at least one per data rank; 1F1B at least ``pp``), replica groups runs of ``dp`` of them.

The root mesh has fine-grained dims ``pp, rep_out, rep_ep, shard_out, shard_ep, tp`` (a size-1
dim costs nothing). Flattened dims give the names the parallelisms use: ``dp_replicate``,
``dp_shard``, ``dp`` (data rank), ``ep``, and ``edp_replicate``/``edp_shard`` (the ranks that
hold the same experts and average their gradients).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from relight.errors import RelightError
from relight.runtime.config import Config, PipelineSchedule

__all__ = ["Layout", "LayoutError", "ParallelMesh", "build_mesh", "plan_layout"]

log = logging.getLogger(__name__)


class LayoutError(RelightError, ValueError):
    """The world size and the parallel config cannot form a mesh; the message says why."""


@dataclass(frozen=True, slots=True)
class Layout:
    world: int
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    rep_ep: int
    """Part of ``ep`` borrowed from ``dp_replicate`` (1 or ep)."""
    shard_ep: int
    """Part of ``ep`` borrowed from ``dp_shard`` (1 or ep)."""

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def as_dict(self) -> dict[str, int]:
        return {"world": self.world, "pp": self.pp, "dp_replicate": self.dp_replicate,
                "dp_shard": self.dp_shard, "tp": self.tp, "ep": self.ep}

    def describe(self) -> str:
        parts = [f"{n}{v}" for n, v in (("pp", self.pp), ("dp_rep", self.dp_replicate),
                 ("dp_shard", self.dp_shard), ("tp", self.tp), ("ep", self.ep)) if v > 1]
        return "x".join(parts) or "single"


def _check_batch_split(cfg: Config, dp: int) -> None:
    """Refuse the data-parallel sizes the global batch cannot be dealt over. Any ``dp``
    takes it by samples (`runtime.data.BatchPlan`: uneven shares, weighted); a pipeline
    needs whole micro-batches on every data rank, 1F1B at least ``pp`` of them, and
    replica groups deal the batch in runs of ``dp`` micro-batches."""
    p = cfg.parallel
    local_batch = cfg.data.global_batch_size // cfg.data.micro_batch_size
    if cfg.replica.enabled and local_batch % dp:
        raise LayoutError(
            f"global_batch_size/micro_batch_size = {cfg.data.global_batch_size}/"
            f"{cfg.data.micro_batch_size} = {local_batch} micro-batches do not split over "
            f"dp={dp} data-parallel ranks, and replica groups deal the batch in runs of dp "
            f"micro-batches; make it a multiple of {dp}")
    if p.pp == 1:
        return
    if local_batch < dp:
        raise LayoutError(
            f"pipeline parallelism runs whole micro-batches: {local_batch} micro-batches "
            f"(global_batch_size/micro_batch_size = {cfg.data.global_batch_size}/"
            f"{cfg.data.micro_batch_size}) cannot give each of dp={dp} data ranks one; "
            f"lower data.micro_batch_size or use fewer ranks")
    fewest = local_batch // dp
    if p.pp_schedule == PipelineSchedule.ONE_F_ONE_B and fewest < p.pp:
        raise LayoutError(
            f"1f1b needs at least pp={p.pp} micro-batches per data rank, and {local_batch} "
            f"micro-batches over dp={dp} leave {fewest} to the fewest; raise "
            f"data.global_batch_size, lower data.micro_batch_size, or use pp_schedule=gpipe")


def plan_layout(world: int, cfg: Config) -> Layout:
    """Check the config against ``world`` and return the layout (raises LayoutError)."""
    p, m = cfg.parallel, cfg.model
    fixed = p.pp * p.dp_replicate * p.tp
    if world % fixed:
        raise LayoutError(
            f"world size {world} is not divisible by pp*dp_replicate*tp = "
            f"{p.pp}*{p.dp_replicate}*{p.tp} = {fixed}; change the parallel degrees or the "
            f"number of ranks"
        )
    dp_shard = world // fixed if p.dp_shard == -1 else p.dp_shard
    if fixed * dp_shard != world:
        raise LayoutError(
            f"pp*dp_replicate*dp_shard*tp = {p.pp}*{p.dp_replicate}*{dp_shard}*{p.tp} = "
            f"{fixed * dp_shard} does not equal the world size {world}; set "
            f"parallel.dp_shard=-1 to fill it"
        )
    if p.pp > m.n_layers:
        raise LayoutError(
            f"pp={p.pp} pipeline stages but only n_layers={m.n_layers} layers; each stage "
            f"needs at least one layer"
        )
    if p.ep > 1:
        if m.num_experts == 0:
            raise LayoutError(f"ep={p.ep} but the model has no experts (model.num_experts=0)")
        if p.ep > m.num_experts:
            raise LayoutError(
                f"ep={p.ep} expert-parallel ranks but only num_experts={m.num_experts} experts"
            )
        if m.num_experts % p.ep:
            raise LayoutError(
                f"num_experts={m.num_experts} is not divisible by ep={p.ep}"
            )
        if p.tp > 1:
            raise LayoutError(
                f"ep={p.ep} with tp={p.tp} is not supported (experts are not tensor-parallel); "
                f"use tp=1 with expert parallelism"
            )
    if p.sequence_parallel and m.num_experts > 0 and p.tp > 1:
        raise LayoutError("sequence_parallel with MoE layers is not supported; disable one")
    if p.ep > 1 and dp_shard % p.ep == 0:
        rep_ep, shard_ep = 1, p.ep
    elif p.ep > 1 and dp_shard == 1 and p.dp_replicate % p.ep == 0:
        rep_ep, shard_ep = p.ep, 1
    elif p.ep > 1:
        raise LayoutError(
            f"ep={p.ep} must divide dp_shard={dp_shard} (or dp_replicate={p.dp_replicate} "
            f"when dp_shard is 1): expert parallelism borrows data-parallel ranks"
        )
    else:
        rep_ep, shard_ep = 1, 1
    edp_shard = dp_shard // shard_ep
    if p.ep > 1 and edp_shard > 1:
        # Stacked experts are split over ep on dim 0 already, so FSDP shards them on dim 1
        # (`runtime.parallel.dp_fsdp`), and FSDP cannot shard a dim other than 0 unevenly.
        for name, size in (("model.dim", m.dim), ("model.mlp_hidden", m.mlp_hidden)):
            if size % edp_shard:
                raise LayoutError(
                    f"experts are FSDP-sharded on their {name}={size} dim over "
                    f"dp_shard/ep = {dp_shard}/{shard_ep} = {edp_shard} ranks, which must "
                    f"divide it; change the number of ranks or parallel.ep")
    _check_batch_split(cfg, p.dp_replicate * dp_shard)
    if cfg.data.seq_len % p.tp and p.sequence_parallel:
        raise LayoutError(
            f"sequence_parallel needs data.seq_len={cfg.data.seq_len} divisible by tp={p.tp}"
        )
    return Layout(world=world, pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=dp_shard,
                  tp=p.tp, ep=p.ep, rep_ep=rep_ep, shard_ep=shard_ep)


@dataclass(slots=True)
class ParallelMesh:
    layout: Layout
    root: DeviceMesh
    device_type: str
    meshes: dict[str | tuple[str, ...], DeviceMesh]
    """Every (sub)mesh the parallelisms use, sliced once at build time."""

    def __getitem__(self, name: str | tuple[str, ...]) -> DeviceMesh:
        return self.meshes[name]

    def coord(self, name: str) -> int:
        return self.meshes[name].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.coord("dp")

    @property
    def pp_rank(self) -> int:
        return self.coord("pp")


_FINE = ("pp", "rep_out", "rep_ep", "shard_out", "shard_ep", "tp")


def _pair_mesh(root: DeviceMesh, pair: tuple[str, str],
               flat: dict[str, tuple[str, ...]]) -> DeviceMesh:
    """The 2-D mesh of two flattened dims, sliced from the root's fine dims instead.

    torch 2.11 refuses to slice two flattened dims when the first has size 1 ("Mesh dim
    indices should be in ascending order"). When each side has at most one fine dim
    larger than 1, the pair is that fine dim (or, for a side of size 1, its first one):
    the same rank grid, sliced from the root, so FSDP can still combine it with the tp
    mesh. Only the dim names differ, and FSDP reads a mesh by position."""
    picked = []
    for name in pair:
        big = [d for d in flat[name] if root.mesh.size(_FINE.index(d)) > 1]
        if len(big) > 1:
            raise LayoutError(
                f"torch {torch.__version__} cannot slice the ({pair[0]}, {pair[1]}) mesh of "
                f"this layout ({name} spans {big}); use a newer torch (2.13 slices it) or "
                "another layout")
        picked.append(big[0] if big else flat[name][0])
    return root[tuple(picked)]


def build_mesh(layout: Layout, device_type: str) -> ParallelMesh:
    """Create the mesh and its flattened dims on every rank (a collective)."""
    if dist.get_world_size() != layout.world:
        raise LayoutError(
            f"layout planned for world {layout.world} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    sizes = (layout.pp, layout.dp_replicate // layout.rep_ep, layout.rep_ep,
             layout.dp_shard // layout.shard_ep, layout.shard_ep, layout.tp)
    root = init_device_mesh(device_type, sizes, mesh_dim_names=_FINE)
    flat = {
        "dp_replicate": ("rep_out", "rep_ep"),
        "dp_shard": ("shard_out", "shard_ep"),
        "dp": ("rep_out", "rep_ep", "shard_out", "shard_ep"),
        "ep": ("rep_ep", "shard_ep"),
        "edp_replicate": ("rep_out",),
        "edp_shard": ("shard_out",),
    }
    meshes: dict[str | tuple[str, ...], DeviceMesh] = {
        name: root[dims]._flatten(name) for name, dims in flat.items()
    }
    meshes["pp"] = root["pp"]
    meshes["tp"] = root["tp"]
    with warnings.catch_warnings():
        # FSDP needs 2-D (replicate, shard) meshes made of flattened dims, and slicing
        # flattened dims from the root is the way to get them; slice once, here.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        for pair in (("dp_replicate", "dp_shard"), ("edp_replicate", "edp_shard")):
            try:
                meshes[pair] = root[pair]
            except KeyError:
                meshes[pair] = _pair_mesh(root, pair, flat)
    log.debug("mesh %s over %d ranks: %s", layout.describe(), layout.world, root)
    return ParallelMesh(layout=layout, root=root, device_type=device_type, meshes=meshes)
