"""Synthetic classification data keyed by global sample index."""
import torch

FEATURES, CLASSES = 20, 5


def sample(index: int, seed: int) -> tuple[torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed * 7_919 + index)
    x = torch.randn(FEATURES, generator=g)
    label = int((x[:CLASSES] * torch.arange(1, CLASSES + 1)).argmax())
    return x, label


def shard(position: int, global_batch: int, rank: int, world: int, seed: int):
    per = global_batch // world
    xs, ys = zip(*(sample(position + rank * per + i, seed) for i in range(per)), strict=True)
    return torch.stack(xs), torch.tensor(ys)
