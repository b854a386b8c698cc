"""An axis of size 1 is typed as at any size, on the virtual mesh and on real ranks: the
same program runs on ``data=1`` and ``data=2`` alike, on both backends."""

from __future__ import annotations

import pytest
import torch
import vma_cases

import fsharded as fs
from fsharded import P


@pytest.mark.parametrize("mesh_axes", [m for ms in vma_cases.SIZE_ONE_MESHES.values() for m in ms],
                         ids=str)
def test_virtual_types_follow_the_rules(mesh_axes):
    assert vma_cases.size_one_types(mesh_axes) == vma_cases.expected_size_one_types(mesh_axes)


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_real_ranks_type_like_the_virtual_mesh(world):
    from fsharded.testing import run_on_ranks

    for r, got in enumerate(run_on_ranks(vma_cases.size_one_types_for_world, world, world)):
        for items, types in got.items():
            assert types == vma_cases.expected_size_one_types(dict(items)), (r, items)


def test_an_invariant_mean_stays_invariant_on_a_size_one_axis():
    # pmean over a size-1 data axis, then a plain op: invariant, so out_specs=P() holds,
    # on data=1 as on data=2 (the value is the mean over data of the shards' sums).
    def f(x, w):
        return 0.1 * fs.pmean(x.sum() * w, "data")

    for data in (1, 2):
        mesh = fs.Mesh({"data": data, "tensor": 2})
        out = fs.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P())(
            torch.ones(4), torch.tensor(2.0))
        torch.testing.assert_close(out, torch.tensor(0.1 * 2.0 * 4 / data))
