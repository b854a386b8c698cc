"""Which parameter leaves a step trains: the ``trainable=`` of ``train_step``.

A frozen leaf (a fine-tuned model's backbone, everything but a LoRA adapter) is an input
of the loss and nothing more: no gradient is computed for it, it has no optimizer state,
no gradient of it is communicated, and it is never updated. It is stored as it was given
(its own dtype, no fp32 master copy), laid out by its spec; at ZeRO-3 it is sharded and
gathered for use like any parameter, since its weights are most of what such a model holds.

Inside the step the trainable leaves form a *view* of a parameter-shaped tree: the same
tree with ``None`` where a leaf is frozen (``None`` is an empty node to optree, so the
optimizer, the gradients and their specs see only the trainable leaves, under their own
paths). ``TrainState.trainable`` records the choice (None when every leaf trains, else a
bool tensor with one entry per parameter leaf, in flatten order): it is saved and loaded
with the state, so a checkpoint says which leaves it trained.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from fsharded.checkpoint._common import _assemble, _dtype, _Reader
from fsharded.checkpoint._index import _blocks, read_manifest
from fsharded.mesh import _tree
from fsharded.mesh._spec import PartitionSpec

__all__ = ["resolve", "view", "merge", "mark", "as_tensor", "from_tensor", "FROZEN_MARK"]

# Set (True) on the tensors of ``fs.nn.functional(m).params`` whose module parameter has
# requires_grad=False: those leaves are detached (plain tensors), so the flag travels here.
FROZEN_MARK = "_fsharded_frozen"


def _flag(x: Any) -> bool:
    """A leaf's own say: frozen if it is an ``nn.Parameter`` with ``requires_grad=False``
    or a leaf ``fs.nn.functional`` marked frozen; a plain tensor trains (its
    ``requires_grad`` is False by default and says nothing)."""
    if getattr(x, FROZEN_MARK, False):
        return False
    if isinstance(x, torch.nn.Parameter):
        return bool(x.requires_grad)
    return True


def _rules(table: Sequence, paths: list[str]) -> list[bool]:
    compiled: list[tuple[str, Callable[[str], bool], bool]] = []
    for item in table:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[1], bool)):
            raise TypeError(f"train_step(trainable=[...]): each rule is a (pattern, bool) pair, got {item!r}")
        pat, flag = item
        if isinstance(pat, re.Pattern):
            compiled.append((pat.pattern, lambda p, r=pat: r.fullmatch(p) is not None, flag))
        elif isinstance(pat, str) and pat.startswith("re:"):
            r = re.compile(pat[3:])
            compiled.append((pat, lambda p, r=r: r.fullmatch(p) is not None, flag))
        elif isinstance(pat, str):
            compiled.append((pat, lambda p, g=pat: fnmatch.fnmatchcase(p, g), flag))
        else:
            raise TypeError(f"train_step(trainable=[...]): a pattern is a glob, 're:<regex>' or a "
                            f"re.Pattern, got {pat!r}")
    used: set[str] = set()
    out, unmatched = [], []
    for p in paths:
        for name, match, flag in compiled:
            if match(p):
                used.add(name)
                out.append(flag)
                break
        else:
            unmatched.append(p)
            out.append(True)
    unused = [name for name, _, _ in compiled if name not in used]
    if unused:
        raise ValueError(f"train_step(trainable=[...]): pattern(s) {unused} match no parameter path; "
                         f"paths look like {paths[:6]}{' ...' if len(paths) > 6 else ''}")
    if unmatched:
        raise ValueError(
            "train_step(trainable=[...]): no rule says whether these parameters train:\n"
            + "\n".join(f"  params.{p}" for p in unmatched[:8]) + ("\n  ..." if len(unmatched) > 8 else "")
            + "\nEnd the table with a rule for the rest, e.g. ('*', False)")
    return out


def resolve(trainable: Any, params: Any) -> list[bool]:
    """One bool per leaf of ``params`` (flatten order) from ``train_step``'s ``trainable``:

    - ``None``: the leaves' own flags (an ``nn.Parameter`` with ``requires_grad=False``, or
      a leaf of ``fs.nn.functional(m).params`` whose parameter has it, is frozen);
    - a bool, or a tree of bools that is a prefix of ``params`` (``{"backbone": False,
      "head": True}``);
    - a list of ``(pattern, bool)`` rules on dotted paths (globs, ``"re:..."`` or compiled
      regexes), the first match wins, every path must match one;
    - a function ``(path, leaf) -> bool``.

    At least one leaf must train."""
    paths, leaves, _ = _tree.tree_flatten_with_paths(params)
    if trainable is None:
        mask = [_flag(x) for x in leaves]
    elif callable(trainable):
        mask = [bool(trainable(p, x)) for p, x in zip(paths, leaves)]
    elif _is_rules(trainable, params):
        mask = _rules(trainable, paths)
    else:
        flat = _bool_prefix(trainable, params)
        mask = [bool(b) for b in flat]
    if leaves and not any(mask):
        raise ValueError("train_step: every parameter is frozen (trainable= and the parameters' "
                         "requires_grad flags leave nothing to train); train at least one leaf")
    return mask


def _is_rules(trainable: Any, params: Any) -> bool:
    """A rule table: a list or tuple of (pattern, ...) pairs (a tree of bools never holds
    a pattern, whatever the parameters' container), or an empty list for a dict of them."""
    if isinstance(trainable, (list, tuple)) and trainable:
        return all(isinstance(r, (tuple, list)) and len(r) == 2 and isinstance(r[0], (str, re.Pattern))
                   for r in trainable)
    return isinstance(trainable, list) and not isinstance(params, (list, tuple))


def _bool_prefix(tree: Any, params: Any) -> list:
    bad: list[str] = []

    def check(path: str, x: Any) -> Any:
        if not isinstance(x, bool):
            bad.append(f"  trainable.{path}: {type(x).__name__} {x!r:.40}")
        return x

    leaves = optree.tree_leaves(tree)
    if not leaves and tree is not None:
        raise ValueError("train_step(trainable=...): an empty tree; give bools")
    _tree.tree_map_with_path(check, tree)
    if bad:
        raise TypeError("train_step(trainable=...): a tree of bools (a prefix of the parameters), a list "
                        "of (pattern, bool) rules or a function (path, leaf) -> bool; these leaves are not "
                        "bools:\n" + "\n".join(bad[:8]))
    # The same prefix rule as spec trees: a bool stands for every leaf below it.
    as_specs = optree.tree_map(lambda b: PartitionSpec("t") if b else PartitionSpec(), tree)
    try:
        flat = _tree.broadcast_prefix(as_specs, params, what="trainable")
    except ValueError as e:  # its lines name the mismatched nodes; the lead speaks of specs
        where = str(e).split("\n", 1)[-1].replace(" trainable have ", " trainable has ")
        raise ValueError("train_step(trainable=...): the tree of bools is not a prefix of the parameter "
                         "tree (a bool stands for every leaf below it):\n" + where) from None
    return [bool(s.axes) for s in flat]


def view(tree: Any, mask: list[bool] | None) -> Any:
    """``tree`` (parameter-shaped) with ``None`` where ``mask`` is False: the trainable
    leaves under their own paths (optree sees no leaf at a ``None``)."""
    if mask is None or all(mask):
        return tree
    leaves, tdef = optree.tree_flatten(tree, is_leaf=_is_spec)
    return optree.tree_unflatten(tdef, [x if t else None for x, t in zip(leaves, mask)])


def merge(trained: Any, full: Any, mask: list[bool] | None) -> Any:
    """``full`` with its trainable leaves replaced by those of ``trained`` (a ``view``)."""
    if mask is None or all(mask):
        return trained
    new = iter(optree.tree_leaves(trained, is_leaf=_is_spec))
    leaves, tdef = optree.tree_flatten(full, is_leaf=_is_spec)
    return optree.tree_unflatten(tdef, [next(new) if t else x for x, t in zip(leaves, mask)])


def mark(tree: Any, mask: list[bool] | None) -> Any:
    """``tree`` with its frozen leaves marked as ``fs.nn.functional`` marks them, so that
    ``step.init(step.params(state))`` (resharding, a new optimizer) trains what the state
    trained instead of every leaf; an explicit ``trainable=`` still decides."""
    if mask is not None:
        for x, t in zip(optree.tree_leaves(tree), mask):
            if not t and isinstance(x, torch.Tensor):
                setattr(x, FROZEN_MARK, True)
    return tree


def pick(items: list, mask: list[bool] | None) -> list:
    """The trainable entries of a per-leaf list."""
    return list(items) if mask is None else [x for x, t in zip(items, mask) if t]


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def as_tensor(mask: list[bool]) -> torch.Tensor | None:
    """``TrainState.trainable``: None when every leaf trains."""
    return None if all(mask) else torch.tensor(mask, dtype=torch.bool)


def from_tensor(t: torch.Tensor | None, n: int) -> list[bool] | None:
    """The mask a state records (None: every leaf trains), checked against its ``n`` leaves."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.dtype != torch.bool or t.dim() != 1 or t.numel() != n:
        raise ValueError(f"train_step: TrainState.trainable must be None or a bool tensor of one entry per "
                         f"parameter leaf ({n}), got {t!r:.80}")
    return [bool(b) for b in t.tolist()]


def saved(directory: Any) -> list[bool] | None:
    """The trained leaves a checkpoint of a ``TrainState`` records (``trainable``): None
    when it has no record (every leaf trained)."""
    manifest = read_manifest(directory)
    entry = next((e for e in manifest["leaves"] if e["path"] == "trainable"), None)
    if entry is None or "shape" not in entry:
        return None
    reader = _Reader(str(directory))
    try:
        t = _assemble(reader, "trainable", _blocks(str(directory), manifest).get("trainable", []),
                      [0] * len(entry["shape"]), list(entry["shape"]), _dtype(entry["dtype"]),
                      torch.device("cpu"))
    finally:
        reader.close()
    return [bool(b) for b in t.reshape(-1).tolist()]


def disagree(paths: list[str], have: list[bool] | None, saved_: list[bool] | None,
             where: str = "the checkpoint") -> list[str]:
    """The leaves whose training ``have`` and ``saved_`` (``where``'s record) decide differently."""
    a = have or [True] * len(paths)
    b = saved_ or [True] * len(paths)
    if len(b) != len(a):
        return [f"  {where} records {len(b)} parameter leaves, this step has {len(a)}"]
    return [f"  params.{p}: {'trained' if y else 'frozen'} in {where}, "
            f"{'trained' if x else 'frozen'} here" for p, x, y in zip(paths, a, b) if x != y]


def check_state(trainable: Any, state: Any, have: list[bool] | None, seen: set) -> None:
    """A state made for other trained leaves than a step's explicit ``trainable=`` says is
    an error, not trained as the state says: its optimizer holds state for the leaves it
    trains only, so another choice needs a new state. ``seen``: the (structure, mask)
    pairs already checked."""
    if trainable is None or callable(trainable):
        # The leaves' own flags (the state's record is the step's choice), or a function of
        # the leaves, which a state holds as shards (on real ranks) and may not re-decide on.
        return
    key = optree.tree_structure(state.params), None if have is None else tuple(have)
    if key in seen:
        return
    paths = _tree.tree_flatten_with_paths(state.params)[0]
    bad = disagree(paths, resolve(trainable, state.params), have, "the state")
    if bad:
        raise ValueError(
            "train_step: the state was made training other parameters than this step's trainable= "
            "says:\n" + "\n".join(bad[:8]) + ("\n  ..." if len(bad) > 8 else "")
            + "\nIts optimizer state covers the leaves it trains only. To train these instead, start a "
              "new state from its weights: state = step.init(old_step.params(state)) (the optimizer "
              "starts anew); or give this step the state's choice")
    seen.add(key)
