"""Checkpoints record their tree's structure: any saved tree (flat dicts of dotted names as
``named_parameters()`` gives, dotted keys, lists, tuples, NamedTuples) loads back without a
template exactly as it was saved, across meshes and ZeRO stages; checkpoints without the
record load as before; a damaged record is refused like any other damage."""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Any, NamedTuple

import checkpoint_cases as C
import optree
import pytest
import structure_cases as S
import torch

import fsharded as fs
from fsharded import P
from fsharded.checkpoint import CheckpointError, CorruptCheckpointError
from fsharded.checkpoint._index import seal

KINDS = ["flat", "nested", "list", "tuple", "namedtuple", "mix"]


def _save(tmp_path, name: str = "flat", directory: str = "ck") -> str:
    tree = S.trees()[name]
    mesh = fs.Mesh({"data": 4})
    d = str(tmp_path / directory)
    fs.checkpoint.save(d, tree, S.specs(tree, 3, mesh), mesh)
    return d


def _edit_manifest(d: str, edit) -> None:
    """Change the manifest as ``edit(manifest)`` does and seal it again: a checkpoint as an
    fsharded that wrote it that way would have."""
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        m = json.load(f)
    m.pop("checksum")
    edit(m)
    with open(path, "w") as f:
        json.dump(seal(m), f)


@pytest.mark.parametrize("name", KINDS)
def test_a_tree_saved_at_zero3_on_4_loads_as_saved_at_zero1_on_2_without_a_template(tmp_path, name):
    tree = S.trees()[name]
    d = _save(tmp_path, name)
    like = fs.checkpoint.tree_like(d)
    assert optree.tree_structure(like) == optree.tree_structure(tree)
    assert all(x.device.type == "meta" for x in optree.tree_leaves(like) if isinstance(x, torch.Tensor))
    mesh = fs.Mesh({"data": 2})
    got = fs.checkpoint.load(d, None, S.specs(tree, 1, mesh), mesh)  # no template
    assert S.differences(got, tree) == []  # types, keys and their order, bits
    # and into one device, replicated
    assert S.differences(fs.checkpoint.load(d, None, P(), fs.Mesh({"data": 1})), tree) == []


def test_subtrees_by_path_with_dotted_keys(tmp_path):
    tree = S.trees()["mix"]
    d = _save(tmp_path, "mix")
    sub = fs.checkpoint.tree_like(d, "z.params")  # a root key with a dot
    assert type(sub) is list and type(sub[0]) is S.Pair and list(sub[1]) == ["b", "a.c"] and sub[1]["a.c"] == 3
    assert list(fs.checkpoint.tree_like(d, "od")) == ["y", "x"]
    assert type(fs.checkpoint.tree_like(d, "od")) is collections.OrderedDict
    assert fs.checkpoint.tree_like(d, "2").dtype == torch.float64  # an int key
    with pytest.raises(CheckpointError, match="no leaves under 'nope'"):
        fs.checkpoint.tree_like(d, "nope")
    with pytest.raises(CheckpointError, match="no leaves under 'none'"):
        fs.checkpoint.tree_like(d, "none")
    d2 = _save(tmp_path, "flat", "flat")
    with pytest.raises(CheckpointError, match=r"no subtree at '0'.*keys with dots"):
        fs.checkpoint.tree_like(d2, "0")  # 0.weight is a key, not 0 then weight
    assert S.differences(fs.checkpoint.load(d, None, P(), fs.Mesh({"data": 1})), tree) == []
    # Two subtrees at one path: which one is meant takes a template.
    fs.checkpoint.save(tmp_path / "two", {"a.b": {"c": torch.ones(2)}, "a": {"b": {"d": torch.zeros(2)}}}, P(),
                       fs.Mesh({"data": 1}))
    with pytest.raises(CheckpointError, match=r"2 subtrees have the path 'a\.b'.*like="):
        fs.checkpoint.tree_like(tmp_path / "two", "a.b")
    assert fs.checkpoint.tree_like(tmp_path / "two", "a.b.c").shape == (2,)


def test_fs_nn_functional_params_with_an_empty_module_between(tmp_path):
    # Sequential(Linear, Tanh, Linear): a list whose middle entry holds no leaf (rebuilt
    # from the paths alone it came back a dict of "0" and "2").
    params = fs.nn.functional(S.module()).params
    assert params[1] == {}
    fs.checkpoint.save(tmp_path / "ck", params, P(), fs.Mesh({"data": 1}))
    got = fs.checkpoint.load(tmp_path / "ck", None, P(), fs.Mesh({"data": 1}))
    assert S.differences(got, params) == []


def test_a_background_save_records_the_structure_too(tmp_path):
    tree = S.trees()["mix"]
    mesh = fs.Mesh({"data": 4})
    fs.checkpoint.save_async(tmp_path / "ck", tree, S.specs(tree, 3, mesh), mesh).wait()
    assert S.differences(fs.checkpoint.load(tmp_path / "ck", None, P(), fs.Mesh({"data": 2})), tree) == []


def test_keys_of_other_types_and_other_containers(tmp_path):
    t = torch.arange(4.0)
    tree = {1: t, "1.5": {True: t + 1, None: t + 2, 2.5: t + 3},
            "dd": collections.defaultdict(list, {"k": t + 4}), "dq": collections.deque([t + 5, 7], maxlen=3),
            "mx": torch.max(torch.stack([t, t + 6]), 0)}  # a structseq (torch.return_types.max)
    mesh = fs.Mesh({"data": 2})
    fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
    got = fs.checkpoint.load(tmp_path / "ck", None, P(), mesh)
    assert S.differences(got, tree) == []
    assert got["dd"].default_factory is list and got["dq"].maxlen == 3
    assert type(got["mx"]) is torch.return_types.max and torch.equal(got["mx"].indices, tree["mx"].indices)


def test_a_train_step_of_named_parameters_loads_without_a_template(tmp_path):
    """The state of a train_step whose parameters are ``dict(model.named_parameters())``,
    saved at ZeRO-3 on data=4, loads at ZeRO-1 on data=2 with no ``like=``: the same flat
    dict (keys in the module's order), every leaf bit for bit, and it trains on."""
    saved = S.save_module_step({"data": 4}, 3, str(tmp_path / "ck"))
    for mesh, stage in (({"data": 2}, 1), ({"data": 1}, 0)):
        got = S.load_module_step(mesh, stage, str(tmp_path / "ck"))
        assert got["type"] is dict and got["keys"] == saved["keys"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert got["structure_equal"]
        assert S.differences(got["state"], saved["state"]) == []
        assert got["loss"] == got["loss"]  # finite: it trained on
    # Manager.restore takes the same path without a template.
    step, _ = S.module_step({"data": 2}, 1)
    mgr = fs.checkpoint.Manager(tmp_path / "runs")
    os.makedirs(tmp_path / "runs")
    os.rename(tmp_path / "ck", mgr.path(2))
    path, state = mgr.restore(step)
    assert path == mgr.path(2) and list(state.params) == saved["keys"]


class _Local(NamedTuple):  # rebuilt as itself: importable by module and qualname
    x: Any
    y: Any


def test_namedtuples_are_imported_or_rebuilt_alike_with_a_warning(tmp_path):
    class Made(NamedTuple):  # defined in a function: no load can import it
        u: Any
        v: Any

    tree = {"here": _Local(torch.ones(2), 1), "there": [Made(torch.zeros(4), "s"), Made(torch.ones(4), "t")]}
    mesh = fs.Mesh({"data": 2})
    fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
    with pytest.warns(UserWarning, match=r"there\.0, there\.1 were saved as the NamedTuple "
                                         r".*Made, which was defined inside a function.*namedtuple\('Made'"):
        got = fs.checkpoint.load(tmp_path / "ck", None, P(), mesh)
    assert type(got["here"]) is _Local
    made = type(got["there"][0])
    assert made is not Made and made.__name__ == "Made" and made._fields == ("u", "v")
    assert got["there"][1].v == "t" and torch.equal(got["there"][0].u, torch.zeros(4))
    with pytest.warns(UserWarning):
        again = fs.checkpoint.tree_like(tmp_path / "ck")
    assert type(again["there"][0]) is made  # one class for it, load after load
    # A class whose fields changed since: rebuilt as saved, with a warning saying so.
    _edit_manifest(str(tmp_path / "ck"), lambda m: m["structure"]["dict"][0][1].update(
        module="structure_cases", qualname="Pair"))
    with pytest.warns(UserWarning, match=r"here was saved as the NamedTuple structure_cases\.Pair, which has the "
                                         r"fields \['a', 'b'\] here, not \['x', 'y'\]"):
        got = fs.checkpoint.tree_like(tmp_path / "ck", "here")
    assert got._fields == ("x", "y") and type(got).__name__ == "Pair"
    # One made with a name of no class of its module (as in a script's __main__).
    Gone = collections.namedtuple("Gone", "w")
    fs.checkpoint.save(tmp_path / "gone", [Gone(torch.ones(2))], P(), mesh)
    with pytest.warns(UserWarning, match=r"0 was saved as the NamedTuple test_checkpoint_structure\.Gone, which cannot "
                                         r"be found here \(AttributeError"):
        assert fs.checkpoint.tree_like(tmp_path / "gone")[0]._fields == ("w",)


def test_other_node_types_save_but_need_a_template(tmp_path):
    class Box:
        def __init__(self, w: Any, b: Any) -> None:
            self.w, self.b = w, b

    everywhere = optree.registry.__dict__["__GLOBAL_NAMESPACE"]
    optree.register_pytree_node(Box, lambda x: ((x.w, x.b), None, ("w", "b")), lambda _, c: Box(*c),
                                namespace=everywhere)
    try:
        tree = {"box": Box(torch.arange(4.0), 2), "plain": [torch.ones(2)]}
        mesh = fs.Mesh({"data": 2})
        fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
        for load in (lambda: fs.checkpoint.tree_like(tmp_path / "ck"),
                     lambda: fs.checkpoint.load(tmp_path / "ck", None, P(), mesh)):
            with pytest.raises(CheckpointError, match=r"box was saved as a .*Box, a pytree node type .* pass the "
                                                      r"tree as like="):
                load()
        assert torch.equal(fs.checkpoint.load(tmp_path / "ck", tree, P(), mesh)["box"].w, torch.arange(4.0))
        assert fs.checkpoint.tree_like(tmp_path / "ck", "plain")[0].shape == (2,)
    finally:
        optree.unregister_pytree_node(Box, namespace=everywhere)


def test_leaves_at_one_path_are_refused_at_save(tmp_path):
    mesh = fs.Mesh({"data": 2})
    for tree, path in (({"a.b": torch.ones(2), "a": {"b": torch.zeros(2)}}, "'a.b'"),
                       ({1: torch.ones(2), "1": torch.zeros(2)}, "'1'")):
        with pytest.raises(ValueError, match=f"several leaves have the dotted path {path}.*rename one"):
            fs.checkpoint.save(tmp_path / "ck", tree, P(), mesh)
    assert os.listdir(tmp_path) == []


# -- checkpoints without the record; a damaged record ----------------------------------------------


def test_a_checkpoint_without_the_structure_loads_as_before(tmp_path):
    """Written before the structure was recorded: the tree nested from the dotted paths,
    as always; where that does not fit, the error says to pass ``like=``."""
    d = _save(tmp_path, "flat")
    _edit_manifest(d, lambda m: m.pop("structure"))
    tree = S.trees()["flat"]
    assert list(fs.checkpoint.tree_like(d)) == ["0", "2"]  # nested from the paths
    assert list(fs.checkpoint.tree_like(d)["0"]) == ["bias", "weight"]
    mesh = fs.Mesh({"data": 2})
    with pytest.raises(CheckpointError, match=r"(?s)predates recorded tree structures.*fs\.checkpoint\.load\(directory, "
                                              r"like, specs, mesh\)"):
        fs.checkpoint.load(d, None, S.specs(tree, 1, mesh), mesh)
    assert S.differences(fs.checkpoint.load(d, tree, S.specs(tree, 1, mesh), mesh), tree) == []
    # A step's state: step.load without like= names step.load(directory, like=params).
    saved = S.save_module_step({"data": 4}, 3, str(tmp_path / "st"))
    _edit_manifest(str(tmp_path / "st"), lambda m: m.pop("structure"))
    step, params = S.module_step({"data": 2}, 1)
    with pytest.raises(CheckpointError, match=r"(?s)step\.load: .*the tree saved under 'params' does not fit.*predates "
                                              r".*step\.load\(directory, like=params\)"):
        step.load(tmp_path / "st")
    state = step.load(tmp_path / "st", like=params)
    assert S.differences(C.global_state(step, state), saved["state"]) == []


def test_a_damaged_structure_record_is_refused(tmp_path):
    d = _save(tmp_path, "flat")
    path = os.path.join(d, "manifest.json")
    with open(path) as f:
        text = f.read()
    # An edit without the checksum: refused by it.
    with open(path, "w") as f:
        f.write(text.replace('["0.bias", "*"]', '["0.bias", {"list": ["*"]}]'))
    for load in (lambda: fs.checkpoint.tree_like(d), lambda: fs.checkpoint.load(d, None, P(), fs.Mesh({"data": 2}))):
        with pytest.raises(CorruptCheckpointError, match="does not match its checksum"):
            load()
    # Written so (sealed again): what it says does not hold the leaves listed.
    for edit, what in [
        (lambda m: m["structure"]["dict"][0].__setitem__(0, "0.bias2"),
         r"does not match its leaves: 4 leaves in it, 4 listed; \['0.bias2'\] only in it; \['0.bias'\] only in "
         r"the list"),
        (lambda m: (m["structure"]["dict"].pop(), m["structure"].pop("order")),
         "does not match its leaves: 3 leaves in it, 4 listed"),
        (lambda m: m["structure"].update(order=[0, 0, 1, 2]), "is not a permutation"),
        (lambda m: m.update(structure={"set": []}), "is malformed"),
    ]:
        with open(path, "w") as f:
            f.write(text)
        _edit_manifest(d, edit)
        with pytest.raises(CorruptCheckpointError, match=what):
            fs.checkpoint.tree_like(d)
        assert re.search(what, fs.checkpoint._dir.damage(d))
    # Manager.restore passes over it to the older checkpoint.
    step, _ = S.module_step({"data": 2}, 1)
    mgr = fs.checkpoint.Manager(tmp_path / "runs")
    S.save_module_step({"data": 2}, 1, mgr.path(1))
    S.save_module_step({"data": 2}, 1, mgr.path(2), n=3)
    _edit_manifest(mgr.path(2), lambda m: m["structure"]["namedtuple"][1]["dict"][0].__setitem__(0, "0.b"))
    with pytest.warns(UserWarning, match="damaged"):
        got, _ = mgr.restore(step)
    assert got == mgr.path(1)


@pytest.mark.multiprocess
def test_gloo_ranks_save_and_load_without_a_template(tmp_path):
    from fsharded.testing import run_on_ranks

    # 2 ranks at ZeRO-3 -> the virtual mesh at ZeRO-1, no template.
    saved = run_on_ranks(S.save_module_step, 2, {"data": 2}, 3, str(tmp_path / "a"))[0]
    virt = S.load_module_step({"data": 2}, 1, str(tmp_path / "a"))
    assert virt["keys"] == saved["keys"] and S.differences(virt["state"], saved["state"]) == []
    # The virtual mesh at ZeRO-3 on data=4 -> 2 ranks at ZeRO-1, no template.
    saved = S.save_module_step({"data": 4}, 3, str(tmp_path / "b"))
    for r in run_on_ranks(S.load_module_step, 2, {"data": 2}, 1, str(tmp_path / "b")):
        assert r["type"] is dict and r["keys"] == saved["keys"]
        assert S.differences(r["state"], saved["state"]) == []
    # Any tree, saved from 2 ranks' shards at ZeRO-3 and loaded there at ZeRO-1.
    run_on_ranks(S.save_tree_on_ranks, 2, "mix", str(tmp_path / "c"), 3)
    for r in run_on_ranks(S.load_tree_on_ranks, 2, "mix", str(tmp_path / "c"), 1):
        assert S.differences(r, S.trees()["mix"]) == []
