"""Write trained parameters back into an ``nn.Module``, in place."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from fsharded import _tree
from fsharded.nn._names import collect

__all__ = ["LoadResult", "load_into"]


class LoadResult(NamedTuple):
    """What ``load_into(..., strict=False)`` left out (both empty when ``strict``)."""

    missing: list[str]  # module parameters ``params`` had no value for (left as they were)
    unexpected: list[str]  # paths of ``params`` that name no parameter (ignored)


def load_into(module: nn.Module, params: Any, *, strict: bool = True) -> LoadResult:
    """Copy ``params`` (a tree laid out like ``fs.nn.functional(module).params``, or a flat
    ``{name: tensor}`` dict: both give the same dotted paths) into ``module``'s parameters
    in place, under ``torch.no_grad()``; values are cast to each parameter's dtype and
    device. A tied weight is written once, at its first name (the other names are the
    same tensor). ``strict``: the names must match exactly; a shape mismatch is an error
    either way. Errors list every offending name. Afterwards the module is an ordinary
    module again (``model.save_pretrained(...)``, ``torch.save(model.state_dict())``).

    >>> state, _ = step(state, batch)
    >>> fs.nn.load_into(model, step.params(state))
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"fs.nn.load_into: expected an nn.Module, got {type(module).__name__}")
    named = collect(module, "parameters")
    paths, leaves, _ = _tree.tree_flatten_with_paths(params)
    given = dict(zip(paths, leaves))
    missing = [n for n in named.tensors if n not in given]
    unexpected = [p for p in paths if p not in named.tensors]
    problems = []
    for p in paths:
        if p not in named.tensors:
            continue
        v, t = given[p], named.tensors[p]
        if not isinstance(v, torch.Tensor):
            problems.append(f"  {p}: a {type(v).__name__}, not a tensor")
        elif tuple(v.shape) != tuple(t.shape):
            problems.append(f"  {p}: shape {tuple(v.shape)} given, the module's is {tuple(t.shape)}")
    if strict:
        problems += [f"  missing: {n}" for n in missing]
        problems += [f"  unexpected: {p}" + (f" (tied to {named.aliases[p]}: give it once, at "
                                             f"{named.aliases[p]})" if p in named.aliases else "")
                     for p in unexpected]
    if problems:
        raise ValueError(
            f"fs.nn.load_into({type(module).__name__}): the parameters do not fit the module "
            f"({len(problems)} problem(s)); nothing was written:\n" + "\n".join(problems)
            + "\nPass the tree fs.nn.functional(module).params is laid out like (e.g. "
              "step.params(state))" + ("" if not strict else ", or strict=False to load the names that match")
        )
    with torch.no_grad():
        for p in paths:
            if p in named.tensors:
                named.tensors[p].copy_(given[p])
    return LoadResult(missing, unexpected)
