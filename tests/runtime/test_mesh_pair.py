"""`runtime.mesh._pair_mesh`: the (replicate, shard) mesh sliced from the root's fine dims
has the rank grid that slicing the two flattened dims gives (where torch can slice
them), for every mix of size-1 and larger fine dims, and says which layouts it cannot
build. One process, torch's fake backend."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from relight.runtime.mesh import _FINE, LayoutError, _pair_mesh

FLAT = {"dp_replicate": ("rep_out", "rep_ep"), "dp_shard": ("shard_out", "shard_ep"),
        "edp_replicate": ("rep_out",), "edp_shard": ("shard_out",)}


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=16)
    yield
    dist.destroy_process_group()


def test_pair_mesh_matches_slicing_the_flattened_dims(fake_world) -> None:
    checked = 0
    for sizes in itertools.product((1, 2), repeat=len(_FINE)):
        if sizes.count(2) > 4:
            continue
        root = init_device_mesh("cpu", sizes, mesh_dim_names=_FINE)
        for name, dims in FLAT.items():
            root[dims]._flatten(name)
        for pair in (("dp_replicate", "dp_shard"), ("edp_replicate", "edp_shard")):
            wide = any(sum(sizes[_FINE.index(d)] > 1 for d in FLAT[n]) > 1 for n in pair)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if wide:
                    with pytest.raises(LayoutError, match="use a newer torch"):
                        _pair_mesh(root, pair, FLAT)
                    continue
                built = _pair_mesh(root, pair, FLAT)
                try:
                    sliced = root[pair]
                except KeyError:  # torch 2.11: the case the fallback exists for
                    continue
            assert built.mesh.tolist() == sliced.mesh.tolist(), (sizes, pair)
            checked += 1
    assert checked > 50
