"""A module's parameters (or buffers) as a pytree addressed by their names.

The tree mirrors the module: a dict per submodule, keyed by attribute name, and a list for
an ``nn.ModuleList`` / ``nn.Sequential`` whose children are named ``0..n-1``, so that a
leaf's dotted path (``_tree.path_str``) is exactly its name in ``named_parameters()``:
``params["transformer"]["h"][0]["attn"]["c_attn"]["weight"]`` is
``"transformer.h.0.attn.c_attn.weight"``. A tensor registered under several names (tied
weights) is one leaf, at the first name ``named_parameters`` gives; the other names are
aliases of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = ["Named", "collect"]


class Named(NamedTuple):
    """``collect``'s result for one kind of tensor (parameters or buffers)."""

    tree: Any  # nested dicts / lists of detached tensors; {} when the module has none
    tensors: dict[str, torch.Tensor]  # canonical name -> the module's own tensor
    aliases: dict[str, str]  # every other name of a tied tensor -> its canonical name


def collect(module: nn.Module, kind: str) -> Named:
    """The ``kind`` (``"parameters"`` or ``"buffers"``) of ``module`` as a ``Named``."""
    if kind == "parameters":
        every = module.named_parameters(remove_duplicate=False)
    elif kind == "buffers":
        every = module.named_buffers(remove_duplicate=False)
    else:
        raise ValueError(f"kind must be 'parameters' or 'buffers', got {kind!r}")
    first: dict[int, str] = {}
    tensors: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    for name, t in every:
        canon = first.setdefault(id(t), name)
        if canon == name:
            tensors[name] = t
        else:
            aliases[name] = canon
    attr = "_parameters" if kind == "parameters" else "_buffers"
    tree = _walk(module, "", tensors, attr)
    return Named({} if tree is None else tree, tensors, aliases)


def _is_list(module: nn.Module, own: dict) -> bool:
    names = list(module._modules)
    return (isinstance(module, (nn.ModuleList, nn.Sequential)) and not own
            and names == [str(i) for i in range(len(names))])


def _walk(module: nn.Module, prefix: str, tensors: dict[str, torch.Tensor], attr: str) -> Any:
    """The subtree of ``module`` (None when nothing below it holds a canonical tensor)."""
    own = {name: tensors[prefix + name].detach() for name, t in getattr(module, attr).items()
           if t is not None and prefix + name in tensors}
    kids = {name: _walk(child, f"{prefix}{name}.", tensors, attr)
            for name, child in module._modules.items() if child is not None}
    if _is_list(module, own):
        if all(k is None for k in kids.values()):
            return None
        # Every index kept (an empty dict for a child without tensors): list positions
        # stay the module's indices, so paths stay its names.
        return [{} if k is None else k for k in kids.values()]
    node = dict(own)
    node.update((name, k) for name, k in kids.items() if k is not None)
    return node or None
