"""Model-shaped state dicts laid out on simulated meshes, from shapes only.

A `ModelSpec` lists a model's parameters (real names and shapes of Llama-3-8B, -70B and
a 64-expert MoE) with how tensor and expert parallelism split each one; a `MeshSpec`
says how many ranks each mesh dimension has at a world size. `rank_pieces` gives, per
rank, the global box of every tensor it holds (parameter, exp_avg, exp_avg_sq: the
state of an Adam optimizer), following torch's own rules: `fully_shard` splits dim 0
with `torch.chunk` sizes (the last ranks may hold less or nothing), tensor parallelism
splits column-wise (dim 0) or row-wise (dim 1) weights, pipeline stages own contiguous
layers (embedding on the first, final norm and output on the last), expert parallelism
splits stacked experts on dim 0. No tensor memory is ever allocated.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["MODELS", "MESHES", "CONFIGS", "ModelSpec", "MeshSpec", "ParamSpec", "Mesh",
           "rank_pieces", "state_bytes", "stage_of", "Box"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape)
ITEMSIZE = 4  # fp32 master weights and moments, as mixed-precision training keeps them
MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True, slots=True)
class ParamSpec:
    name: str
    shape: tuple[int, ...]
    tp: str
    """"col" (dim 0), "row" (dim 1) or "none" (replicated across tensor parallelism)."""
    layer: int
    """Transformer block index, -1 for the embedding (first stage), -2 for the final norm
    and output (last stage)."""
    expert: bool = False
    """Stacked experts `[num_experts, ...]`: split on dim 0 by expert parallelism."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn: int
    vocab: int
    experts: int = 0
    """Routed experts per block (0: dense)."""

    def params(self) -> list[ParamSpec]:
        hd = self.dim // self.n_heads
        kv = self.n_kv_heads * hd
        out = [ParamSpec("tok_embeddings.weight", (self.vocab, self.dim), "col", -1)]
        for i in range(self.n_layers):
            p = f"layers.{i}."
            out += [
                ParamSpec(p + "attention.wq.weight", (self.dim, self.dim), "col", i),
                ParamSpec(p + "attention.wk.weight", (kv, self.dim), "col", i),
                ParamSpec(p + "attention.wv.weight", (kv, self.dim), "col", i),
                ParamSpec(p + "attention.wo.weight", (self.dim, self.dim), "row", i),
                ParamSpec(p + "attention_norm.weight", (self.dim,), "none", i),
                ParamSpec(p + "ffn_norm.weight", (self.dim,), "none", i),
            ]
            if self.experts:
                e = self.experts
                out += [
                    ParamSpec(p + "moe.router.weight", (e, self.dim), "none", i),
                    ParamSpec(p + "moe.experts.w1", (e, self.ffn, self.dim), "none", i, True),
                    ParamSpec(p + "moe.experts.w3", (e, self.ffn, self.dim), "none", i, True),
                    ParamSpec(p + "moe.experts.w2", (e, self.dim, self.ffn), "none", i, True),
                ]
            else:
                out += [
                    ParamSpec(p + "feed_forward.w1.weight", (self.ffn, self.dim), "col", i),
                    ParamSpec(p + "feed_forward.w3.weight", (self.ffn, self.dim), "col", i),
                    ParamSpec(p + "feed_forward.w2.weight", (self.dim, self.ffn), "row", i),
                ]
        out += [ParamSpec("norm.weight", (self.dim,), "none", -2),
                ParamSpec("output.weight", (self.vocab, self.dim), "col", -2)]
        return out


MODELS: dict[str, ModelSpec] = {
    "llama3-8b": ModelSpec("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    "llama3-70b": ModelSpec("llama3-70b", 8192, 80, 64, 8, 28672, 128256),
    # DeepSeek-MoE-16B's shape: 64 routed experts of hidden 1408 in each of 28 blocks.
    "moe-64e": ModelSpec("moe-64e", 2048, 28, 16, 16, 1408, 102400, experts=64),
}


@dataclass(frozen=True, slots=True)
class Mesh:
    """Ranks per mesh dimension; world = replicate * pp * fsdp * tp (ep splits fsdp)."""

    replicate: int = 1
    pp: int = 1
    fsdp: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.replicate * self.pp * self.fsdp * self.tp


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """How a mesh of one kind grows with the world size."""

    name: str
    tp: int = 1
    pp: int = 1
    shard_group: int = 0
    """HSDP: ranks per FSDP group (the rest replicate); 0: FSDP over all data ranks."""
    ep: int = 0
    """Expert parallel degree (at most the FSDP degree); 0: none."""

    def at(self, world: int) -> Mesh:
        data = world // (self.tp * self.pp)
        if data < 1 or data * self.tp * self.pp != world:
            raise ValueError(f"mesh {self.name}: world {world} is not a multiple of "
                             f"tp*pp = {self.tp * self.pp}")
        replicate, fsdp = 1, data
        if self.shard_group:
            fsdp = min(self.shard_group, data)
            replicate = data // fsdp
        ep = min(self.ep, fsdp) if self.ep else 1
        return Mesh(replicate, self.pp, fsdp, self.tp, ep)


MESHES: dict[str, MeshSpec] = {
    "fsdp": MeshSpec("fsdp"),
    "hsdp": MeshSpec("hsdp", shard_group=32),
    "fsdp-tp8-pp8": MeshSpec("fsdp-tp8-pp8", tp=8, pp=8),
    "ep64": MeshSpec("ep64", ep=64),
}

CONFIGS: dict[str, tuple[str, str]] = {
    "8b-fsdp": ("llama3-8b", "fsdp"),
    "70b-hsdp": ("llama3-70b", "hsdp"),
    "70b-3d": ("llama3-70b", "fsdp-tp8-pp8"),
    "moe-ep": ("moe-64e", "ep64"),
}
"""The (model, mesh) pairs the benchmark measures; "70b-3d" is the 70B layout of the
targets."""


def _chunk(extent: int, parts: int, i: int) -> tuple[int, int]:
    """(offset, length) of part `i` of `torch.chunk(extent, parts)` (maybe empty)."""
    size = -(-extent // parts)
    lo = min(i * size, extent)
    return lo, min(size, extent - lo)


def _split(box: Box, dim: int, parts: int, i: int) -> Box:
    if parts == 1:
        return box
    off, shp = list(box[0]), list(box[1])
    lo, n = _chunk(shp[dim], parts, i)
    off[dim] += lo
    shp[dim] = n
    return tuple(off), tuple(shp)


def stage_of(p: ParamSpec, n_layers: int, pp: int) -> int:
    if p.layer == -1:
        return 0
    if p.layer == -2:
        return pp - 1
    return p.layer * pp // n_layers


def rank_pieces(model: ModelSpec, mesh: Mesh) -> Iterator[tuple[int, list[tuple[str, tuple[
        int, ...], Box]]]]:
    """(rank, [(tensor name, global shape, box)]) for every rank, in rank order; rank =
    ((replicate * pp + stage) * fsdp + shard) * tp + tp_rank. Boxes equal across
    replicas are the same objects (planners see them as the replicas they are)."""
    params = model.params()
    cache: dict[tuple[int, int, int], list[tuple[str, tuple[int, ...], Box]]] = {}
    for rank in range(mesh.world):
        t = rank % mesh.tp
        f = rank // mesh.tp % mesh.fsdp
        stage = rank // (mesh.tp * mesh.fsdp) % mesh.pp
        key = (stage, f, t)
        if key not in cache:
            held = []
            for p in params:
                if stage_of(p, model.n_layers, mesh.pp) != stage:
                    continue
                box: Box = ((0,) * len(p.shape), p.shape)
                if p.expert and mesh.ep > 1:
                    # Experts over ep, then each expert's dim 1 over the rest of fsdp.
                    box = _split(box, 0, mesh.ep, f % mesh.ep)
                    box = _split(box, 1, mesh.fsdp // mesh.ep, f // mesh.ep)
                else:
                    if p.tp == "col":
                        box = _split(box, 0, mesh.tp, t)
                    elif p.tp == "row":
                        box = _split(box, 1, mesh.tp, t)
                    box = _split(box, 0, mesh.fsdp, f)
                for prefix in ("model/", *(f"optim/{m}/" for m in MOMENTS)):
                    held.append((prefix + p.name, p.shape, box))
            cache[key] = held
        yield rank, cache[key]


def state_bytes(model: ModelSpec) -> int:
    """Bytes of parameters and both moments."""
    total = 0
    for p in model.params():
        n = 1
        for s in p.shape:
            n *= s
        total += n
    return total * ITEMSIZE * (1 + len(MOMENTS))
