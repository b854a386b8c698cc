"""Bad input gets a ValueError naming the leaf path, spec, shape and mesh, and what to do."""

from __future__ import annotations

import pytest
import torch

import fsharded as fs
from fsharded import P

MESH = fs.Mesh({"data": 2, "tensor": 2})


def _ident(*a):
    return a[0] if len(a) == 1 else a


def sm(in_specs, out_specs=P(), f=_ident, **kw):
    return fs.shard_map(f, mesh=MESH, in_specs=in_specs, out_specs=out_specs, **kw)


def test_axis_not_in_mesh_names_path_spec_shape_mesh():
    with pytest.raises(ValueError) as e:
        sm(({"w": P("expert")},))({"w": torch.zeros(4, 6)})
    msg = str(e.value)
    for part in ("args[0].w", "PartitionSpec('expert')", "(4, 6)", "Mesh(data=2, tensor=2)",
                 "'expert' is not in the mesh"):
        assert part in msg, (part, msg)


def test_axis_used_twice():
    with pytest.raises(ValueError, match=r"(?s)args\[0\].*axis 'data' is used twice"):
        sm((P("data", "data"),))(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="used twice"):
        sm((P(("data", "tensor"), "data"),))(torch.zeros(4, 4))


def test_spec_longer_than_rank():
    with pytest.raises(ValueError, match=r"spec has 3 entries but the tensor has rank 2"):
        sm((P(None, None, "data"),))(torch.zeros(4, 4))


def test_dim_not_divisible_by_axis_product():
    with pytest.raises(ValueError, match=r"dim 0 of size 6 is not divisible by 4 \(data=2 x tensor=2\)"):
        sm((P(("data", "tensor")),))(torch.zeros(6))


def test_every_failing_leaf_is_listed():
    params = {"a": torch.zeros(3), "b": {"c": torch.zeros(2, 2)}, "ok": torch.zeros(2)}
    with pytest.raises(ValueError) as e:
        sm(({"a": P("data"), "b": {"c": P(None, "nope")}, "ok": P("data")},))(params)
    msg = str(e.value)
    assert "2 leaf spec(s)" in msg and "args[0].a" in msg and "args[0].b.c" in msg
    assert "args[0].ok" not in msg


def test_spec_tree_not_matching_value_tree():
    with pytest.raises(ValueError, match=r"(?s)args\[0\]: in_specs have dict with keys \['v'\].*keys \['w'\]"):
        sm(({"v": P()},))({"w": torch.zeros(2)})
    with pytest.raises(ValueError, match="one entry per positional argument"):
        sm((P(), P()))(torch.zeros(2))


def test_prefix_spec_trees_are_accepted():
    params = {"a": torch.ones(4), "b": [torch.ones(2, 4), torch.ones(4)]}
    out = sm(({"a": P("data"), "b": P()},), out_specs={"a": P("data"), "b": P()})(params)
    torch.testing.assert_close(out, params)


def test_collective_over_unbound_axis():
    with pytest.raises(ValueError, match=r"(?s)psum: axis 'seq' is not bound.*\['data', 'tensor'\]"):
        sm((P(),), f=lambda x: fs.psum(x, "seq"))(torch.zeros(2))
    with pytest.raises(ValueError, match="all_gather: axis 'seq'"):
        sm((P(),), f=lambda x: fs.all_gather(x, ("data", "seq")))(torch.zeros(2))


def test_collective_outside_shard_map():
    with pytest.raises(ValueError, match="called outside shard_map"):
        fs.psum(torch.zeros(2), "data")
    with pytest.raises(ValueError, match="outside shard_map"):
        fs.axis_index("data")


def test_out_specs_leaving_out_a_varying_axis_is_an_error_by_default():
    """check_vma is on by default (as in JAX): the error lists every offending output with
    its varying axes and its out_spec, and no other output."""
    f = sm((P("data"),), out_specs={"y": P(), "z": P("data")}, f=lambda x: {"y": x * 2, "z": x})
    with pytest.raises(ValueError) as e:
        f(torch.arange(4.0))
    msg = str(e.value)
    assert "output.y: varies over ['data']" in msg and "PartitionSpec()" in msg
    assert "output.z" not in msg and "check_vma=False" in msg
    # check_rep is the old name and means the same.
    g = sm((P("data"),), out_specs=P(), f=lambda x: x * 2, check_rep=True)
    with pytest.raises(ValueError, match="output: varies over"):
        g(torch.arange(4.0))
    # Unchecked, shard 0's value is taken.
    g = sm((P("data"),), out_specs=P(), f=lambda x: x * 2, check_vma=False)
    torch.testing.assert_close(g(torch.arange(4.0)), torch.tensor([0.0, 2.0]))
    # A reduced value is invariant and passes.
    h = sm((P("data"),), out_specs=P(), f=lambda x: fs.psum(x, "data"))
    torch.testing.assert_close(h(torch.arange(4.0)), torch.tensor([2.0, 4.0]))


def test_check_vma_names_the_axis_that_varies():
    f = sm((P("tensor"),), out_specs=P(), f=lambda x: fs.psum(x, "tensor") + fs.axis_index("tensor"))
    with pytest.raises(ValueError, match=r"varies over \['tensor'\]"):
        f(torch.zeros(2))
    with pytest.raises(ValueError, match="disagree"):
        fs.shard_map(lambda x: x, mesh=MESH, in_specs=P(), out_specs=P(), check_vma=False,
                     check_rep=True)


def test_out_specs_errors():
    with pytest.raises(ValueError, match=r"(?s)output: spec .* 'nope' is not in the mesh"):
        sm((P(),), out_specs=P("nope"))(torch.zeros(2))
    with pytest.raises(ValueError, match="outputs must be tensors"):
        sm((P(),), f=lambda x: "three")(torch.zeros(2))
    # A Python number is returned as JAX returns it: an array (here a 0-d tensor).
    assert torch.equal(sm((P(),), f=lambda x: 3)(torch.zeros(2)), torch.tensor(3))


def test_bad_collective_arguments():
    with pytest.raises(ValueError, match="not divisible by the size 2"):
        sm((P(),), f=lambda x: fs.psum_scatter(x, "data"))(torch.zeros(3))
    with pytest.raises(ValueError, match="must equal the size 2"):
        sm((P(),), f=lambda x: fs.psum_scatter(x, "data", tiled=False))(torch.zeros(4))
    with pytest.raises(ValueError, match="perm"):
        sm((P(),), f=lambda x: fs.ppermute(x, "data", [(0, 1), (1, 1)]))(torch.zeros(2))
    with pytest.raises(ValueError, match="split_dim 0 of size 3"):
        sm((P(),), f=lambda x: fs.all_to_all(x, "data", split_dim=0, concat_dim=0))(torch.zeros(3))
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        sm((P(),), f=lambda x: fs.all_gather(x, "data", dim=2))(torch.zeros(3))
    with pytest.raises(TypeError, match="axis must be a mesh axis name"):
        sm((P(),), f=lambda x: fs.psum(x, 3))(torch.zeros(3))


def test_mesh_and_spec_construction_errors():
    with pytest.raises(ValueError, match="positive int size"):
        fs.Mesh({"a": 0})
    with pytest.raises(ValueError, match="unique"):
        fs.Mesh([("a", 2), ("a", 2)])
    with pytest.raises(TypeError, match="PartitionSpec entries"):
        P(3)
    with pytest.raises(ValueError, match="not in Mesh"):
        fs.NamedSharding(MESH, P("expert"))
    with pytest.raises(TypeError, match="fsharded.Mesh"):
        fs.shard_map(_ident, mesh={"data": 2}, in_specs=P(), out_specs=P())


def test_world_size_mismatch_message():
    from fsharded import distributed

    with pytest.raises(RuntimeError, match="initialised process group"):
        distributed.check_world(MESH)
