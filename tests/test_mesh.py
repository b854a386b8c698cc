"""Mesh, PartitionSpec, NamedSharding, pytree paths and rules."""

from __future__ import annotations

import pickle
import re

import torch

import fsharded as fs
from fsharded import P
from fsharded.mesh._tree import broadcast_prefix


def test_mesh_basics():
    m = fs.Mesh({"data": 2, "tensor": 3})
    assert m.shape == {"data": 2, "tensor": 3}
    assert m.axis_names == ("data", "tensor") and m.size == 6
    assert repr(m) == "Mesh(data=2, tensor=3)"
    assert m == fs.Mesh([("data", 2), ("tensor", 3)]) and hash(m) == hash(fs.Mesh({"data": 2, "tensor": 3}))
    assert m != fs.Mesh({"tensor": 3, "data": 2})  # order matters: it fixes the rank layout
    assert m.coords(5) == {"data": 1, "tensor": 2} and m.rank_of({"data": 1, "tensor": 2}) == 5
    assert m.axis_size(("data", "tensor")) == 6
    assert pickle.loads(pickle.dumps(m)) == m
    try:
        m.foo = 1
        raise AssertionError("Mesh must be immutable")
    except AttributeError:
        pass


def test_partition_spec():
    s = P("data", None, ("tensor", "data2"))
    assert s == ("data", None, ("tensor", "data2")) and s.axes == ("data", "tensor", "data2")
    assert repr(s) == "PartitionSpec('data', None, ('tensor', 'data2'))"
    assert P(("data",)) == P("data") and P(()) == P(None)
    assert hash(P("a")) == hash(P("a")) and {P("a"): 1}[P("a")] == 1
    assert pickle.loads(pickle.dumps(s)) == s and type(pickle.loads(pickle.dumps(s))) is fs.PartitionSpec
    assert fs.PartitionSpec is P


def test_named_sharding_shard_shape():
    m = fs.Mesh({"data": 2, "tensor": 4})
    assert fs.NamedSharding(m, P("data")).shard_shape((8, 3)) == (4, 3)
    assert fs.NamedSharding(m, P(None, ("data", "tensor"))).shard_shape((8, 16)) == (8, 2)
    assert fs.NamedSharding(m, P()).shard_shape((8, 16)) == (8, 16)
    assert fs.NamedSharding(m, P("data")).is_replicated_over("tensor")


def test_paths_and_rules():
    params = {"blocks": [{"attn": {"qkv": {"w": torch.zeros(4, 12), "b": torch.zeros(12)}}},
                         {"attn": {"qkv": {"w": torch.zeros(4, 12), "b": torch.zeros(12)}}}],
              "emb": torch.zeros(10, 4)}
    paths, leaves, _ = fs.tree_flatten_with_paths(params)
    assert "blocks.0.attn.qkv.w" in paths and "emb" in paths and len(leaves) == 5
    specs = fs.rules(params, {"blocks.*.attn.qkv.w": P(None, "tensor"),
                              re.compile(r"blocks\.\d+\..*\.b"): P("tensor"),
                              "re:emb": P("tensor", None)})
    assert specs["blocks"][1]["attn"]["qkv"]["w"] == P(None, "tensor")
    assert specs["blocks"][0]["attn"]["qkv"]["b"] == P("tensor")
    assert specs["emb"] == P("tensor", None)
    # First match wins, unmatched leaves get the default.
    s2 = fs.rules(params, {"*.w": P("a"), "blocks.0.*": P("b")}, default=P("z"))
    assert s2["blocks"][0]["attn"]["qkv"]["w"] == P("a")
    assert s2["blocks"][0]["attn"]["qkv"]["b"] == P("b")
    assert s2["emb"] == P("z")
    got = fs.tree_map_with_path(lambda p, x: p, {"a": {"b": 1}})
    assert got == {"a": {"b": "a.b"}}


def test_broadcast_prefix():
    tree = {"a": torch.zeros(1), "b": [torch.zeros(1), torch.zeros(1)]}
    assert broadcast_prefix(P("x"), tree) == [P("x")] * 3
    assert broadcast_prefix({"a": None, "b": P("y")}, tree) == [P(), P("y"), P("y")]
    assert broadcast_prefix({"a": P(), "b": [P("1"), P("2")]}, tree) == [P(), P("1"), P("2")]
