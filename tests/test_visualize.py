"""fs.visualize_sharding: which device holds which block, against hand-written layouts for
1-D, 2-D and 3-D meshes, tuple-axis specs and replicated axes; the local view inside
shard_map; the picture; real ranks (rank 0 prints)."""

from __future__ import annotations

import itertools
import textwrap

import pytest
import torch
import visualize_cases as V

import fsharded as fs
from fsharded import P
from fsharded.mesh._layout import local_slice

MESH2 = fs.Mesh({"data": 2, "tensor": 2})


def boxes(view) -> list:
    return [(b.box, b.devices) for b in view.blocks]


def test_one_axis_mesh():
    v = fs.visualize_sharding(torch.zeros(8, 3), P("data"), fs.Mesh({"data": 2}))
    assert boxes(v) == [(((0, 4), (0, 3)), (0,)), (((4, 8), (0, 3)), (1,))]
    assert v.text() == textwrap.dedent("""\
        float32 [8, 3] PartitionSpec('data') on Mesh(data=2)
        rows: dim 0 over data
        ┌───────┐
        │ [0:4] │
        │ dev 0 │
        ├───────┤
        │ [4:8] │
        │ dev 1 │
        └───────┘""")


def test_two_axis_mesh_rows_and_columns():
    v = fs.visualize_sharding(torch.zeros(8, 6), P("data", "tensor"), MESH2)
    assert boxes(v) == [(((0, 4), (0, 3)), (0,)), (((0, 4), (3, 6)), (1,)),
                        (((4, 8), (0, 3)), (2,)), (((4, 8), (3, 6)), (3,))]
    assert v.replicated_over == ()
    assert str(v) == textwrap.dedent("""\
        float32 [8, 6] PartitionSpec('data', 'tensor') on Mesh(data=2, tensor=2)
        rows: dim 0 over data; columns: dim 1 over tensor
        ┌────────────┬────────────┐
        │ [0:4, 0:3] │ [0:4, 3:6] │
        │   dev 0    │   dev 1    │
        ├────────────┼────────────┤
        │ [4:8, 0:3] │ [4:8, 3:6] │
        │   dev 2    │   dev 3    │
        └────────────┴────────────┘""")


def test_tuple_axes_cut_in_their_order():
    # P(("data", "tensor")): data major, as JAX (and shard_map) order a tuple of axes
    v = fs.visualize_sharding(torch.zeros(8), P(("data", "tensor")), MESH2)
    assert boxes(v) == [(((0, 2),), (0,)), (((2, 4),), (1,)), (((4, 6),), (2,)), (((6, 8),), (3,))]
    assert "columns: dim 0 over (data, tensor)" in v.text()  # a vector is a row
    w = fs.visualize_sharding(torch.zeros(8), P(("tensor", "data")), MESH2)
    assert [b.devices for b in w.blocks] == [(0,), (2,), (1,), (3,)]


def test_replicated_axes_are_shown_as_such():
    v = fs.visualize_sharding(torch.zeros(4, 4), P(None, "tensor"), MESH2)
    assert boxes(v) == [(((0, 4), (0, 2)), (0, 2)), (((0, 4), (2, 4)), (1, 3))]
    assert v.replicated_over == ("data",)
    assert v.header().endswith("; replicated over data")
    assert "│ dev 0,2 │ dev 1,3 │" in v.text()
    whole = fs.visualize_sharding(torch.zeros(4, 4), P(), MESH2)
    assert boxes(whole) == [(((0, 4), (0, 4)), (0, 1, 2, 3))]
    assert "dev all 4" in whole.text() and whole.replicated_over == ("data", "tensor")


def test_three_axis_mesh_facets():
    mesh = fs.Mesh({"pipe": 2, "data": 2, "tensor": 2})
    v = fs.visualize_sharding(torch.zeros(4, 4, 4), P("pipe", "data", "tensor"), mesh)
    assert len(v.blocks) == 8 and all(len(b.devices) == 1 for b in v.blocks)
    assert v.holders((3, 0, 3)) == (5,)  # pipe 1, data 0, tensor 1
    text = v.text()
    assert "rows: dim 0 over pipe; columns: dim 1 over data; facets: dim 2 over tensor" in text
    assert text.count("dim 2 [0:2]") == 1 and text.count("dim 2 [2:4]") == 1
    # a 3-D mesh on a 2-D tensor: one axis replicated
    w = fs.visualize_sharding(torch.zeros(4, 4), P("pipe", "tensor"), mesh)
    assert [b.devices for b in w.blocks] == [(0, 2), (1, 3), (4, 6), (5, 7)]


@pytest.mark.parametrize("spec", [P("data"), P(None, "tensor"), P(("tensor", "data")), P("tensor", "data"), P()])
def test_every_device_holds_the_shard_shard_map_gives_it(spec):
    x = torch.arange(8 * 4).reshape(8, 4)
    v = fs.visualize_sharding(x, spec, MESH2)
    for dev in range(MESH2.size):
        mine = local_slice(x, spec, MESH2, MESH2.coords(dev))
        held = [b for b in v.blocks if dev in b.devices]
        assert len(held) == 1
        (r0, r1), (c0, c1) = held[0].box
        assert torch.equal(mine, x[r0:r1, c0:c1])
    for idx in itertools.product(range(8), range(4)):  # every element has its holders
        assert v.holders(idx)


def test_a_tree_with_its_specs():
    tree = {"w": torch.zeros(4, 6), "b": torch.zeros(6), "n": 3}
    v = fs.visualize_sharding(tree, {"w": P(None, "tensor"), "b": P(), "n": P()}, MESH2)
    assert [x.name for x in v.views] == ["b", "w"]
    assert v.views[1].text().startswith("w: float32 [4, 6] PartitionSpec(None, 'tensor')")


def test_inside_shard_map_the_local_view():
    seen = []

    def body(x, w):
        seen.append(fs.visualize_sharding(x))
        seen.append(fs.visualize_sharding(fs.psum(x.sum(), "data")))
        return x

    fs.shard_map(body, mesh=MESH2, in_specs=(P("data"), P()), out_specs=P("data"))(torch.zeros(8, 6), torch.zeros(2))
    assert seen[0].shape == (4, 6) and seen[0].varying == ("data",)
    assert seen[1].varying == ()
    assert seen[0].text() == "local float32[4, 6] inside shard_map on Mesh(data=2, tensor=2); varies over: data"


def test_the_picture():
    pytest.importorskip("matplotlib")
    v = fs.visualize_sharding(torch.zeros(8, 6), P("data", "tensor"), MESH2)
    png = v._repr_png_()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    fig = fs.visualize_sharding(torch.zeros(4, 4, 4), P("data", None, "tensor"), MESH2).figure()
    assert len(fig.axes) == 1  # dim 2 is the second sharded dim: columns, no facets
    assert len(fig.axes[0].patches) == 4


def test_pictures_leave_the_notebooks_backend_alone(tmp_path):
    """Drawing a view (or a metrics file) must not switch matplotlib's backend: in a
    notebook that would stop every later figure from showing."""
    matplotlib = pytest.importorskip("matplotlib")
    from fsharded.plot import plot_metrics

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        fs.visualize_sharding(torch.zeros(8, 6), P("data"), MESH2)._repr_png_()
        (tmp_path / "m.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n')
        plot_metrics([tmp_path / "m.jsonl"], tmp_path / "m.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(before)


def test_mistakes_are_named():
    with pytest.raises(ValueError, match="do not fit Mesh"):
        fs.visualize_sharding(torch.zeros(5, 4), P("data"), MESH2)
    with pytest.raises(ValueError, match="give the mesh"):
        fs.visualize_sharding(torch.zeros(4), P("data"))
    with pytest.raises(TypeError, match="must be a PartitionSpec"):
        fs.visualize_sharding(torch.zeros(4), "data", MESH2)


@pytest.mark.multiprocess
def test_two_gloo_ranks_rank_0_prints():
    from fsharded.testing import run_on_ranks

    want = fs.visualize_sharding(torch.zeros(8, 6), P("data"), fs.Mesh({"data": 2})).text()
    got = sorted(run_on_ranks(V.on_rank, 2), key=lambda r: r["rank"])
    assert [r["text"] for r in got] == [want, want]  # the shard's global layout, on every rank
    assert got[0]["printed"] == want + "\n" and got[1]["printed"] == ""
