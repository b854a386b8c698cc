"""Peer-side pieces of ``fsharded bench zero``: the functional GPT as an ``nn.Module``
(for DeepSpeed and FSDP2), and bytes sent counted at ``torch.distributed``."""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn as nn

# -- the same model as an nn.Module ---------------------------------------------------------


class _Leaves(nn.Module):
    """The tensor leaves of a parameter subtree as this module's own parameters
    (``recurse=False``), so ZeRO-3's and FSDP2's hooks find them on the module whose
    forward reads them. ``tree()`` rebuilds the subtree from the current attributes (FSDP2
    swaps in unsharded tensors during forward)."""

    def __init__(self, tree: Any):
        super().__init__()
        from fsharded import _tree

        paths, leaves, treedef = _tree.tree_flatten_with_paths(tree)
        self._treedef = treedef
        self._names = [p.replace(".", "__") for p in paths]
        for name, x in zip(self._names, leaves):
            self.register_parameter(name, nn.Parameter(x.detach().clone()))

    def tree(self) -> Any:
        return optree.tree_unflatten(self._treedef, [getattr(self, n) for n in self._names])

    @torch.no_grad()
    def load(self, tree: Any) -> None:
        from fsharded import _tree

        _, leaves, _ = _tree.tree_flatten_with_paths(tree)
        for name, x in zip(self._names, leaves):
            getattr(self, name).copy_(x)


class _Block(_Leaves):
    def forward(self, x: torch.Tensor, **kw: Any) -> torch.Tensor:
        from fsharded.models import gpt

        return gpt.block(self.tree(), x, **kw)


class FunctionalGPT(_Leaves):
    """``gpt.loss`` as an ``nn.Module``: the root holds the embeddings and final norm, each
    block is a submodule, and ``forward(tokens)`` is ``gpt.loss(params, {"tokens":
    tokens})`` with every block run through its module (``block_fn``)."""

    def __init__(self, params: dict):
        super().__init__({k: v for k, v in params.items() if k != "blocks"})
        self.blocks = nn.ModuleList(_Block(b) for b in params["blocks"])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from fsharded.models import gpt

        p = self.tree()
        p["blocks"] = list(self.blocks)
        return gpt.loss(p, {"tokens": tokens}, block_fn=lambda block, mod, x, **kw: mod(x, **kw))

    def load_functional(self, params: dict) -> None:
        self.load({k: v for k, v in params.items() if k != "blocks"})
        for mod, b in zip(self.blocks, params["blocks"]):
            mod.load(b)


# -- bytes sent, counted at torch.distributed ------------------------------------------------


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _ar(b: int, n: int) -> int:
    return 2 * (n - 1) * b // n


def _ag(b: int, n: int) -> int:
    return (n - 1) * b


def _part(b: int, n: int) -> int:
    return (n - 1) * b // n


# op -> (argument holding what this rank contributes, bytes one rank sends for it). The
# ring formulas of fsharded/spmd/_prims.py; rooted ops (broadcast, reduce, gather, scatter)
# are charged their per-rank average, (n - 1)/n of the tensor.
_COUNTED: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "all_reduce": ("tensor", _ar),
    "all_reduce_coalesced": ("tensors", _ar),
    "all_gather": ("tensor", _ag),
    "all_gather_into_tensor": ("input_tensor", _ag),
    "_all_gather_base": ("input_tensor", _ag),
    "all_gather_single": ("input_tensor", _ag),
    "all_gather_coalesced": ("input_tensor_list", _ag),
    "reduce_scatter": ("input_list", _part),
    "reduce_scatter_tensor": ("input", _part),
    "_reduce_scatter_base": ("input", _part),
    "reduce_scatter_single": ("input", _part),
    "all_to_all_single": ("input", _part),
    "all_to_all": ("input_tensor_list", _part),
    "broadcast": ("tensor", _part),
    "reduce": ("tensor", _part),
    "gather": ("tensor", _part),
    "scatter": ("tensor", _part),
    "send": ("tensor", lambda b, n: b),
    "isend": ("tensor", lambda b, n: b),
    "recv": ("tensor", lambda b, n: 0),
    "irecv": ("tensor", lambda b, n: 0),
    "barrier": ("group", lambda b, n: 0),
    "broadcast_object_list": ("object_list", lambda b, n: 0),
    "all_gather_object": ("obj", lambda b, n: 0),
}


class ByteCounter:
    """Wraps ``torch.distributed``'s collectives (in ``torch.distributed`` and in
    ``distributed_c10d``) so that, while ``counting()`` is open, every outermost call is
    charged the bytes this rank sends. Installed before DeepSpeed is imported (its backend
    keeps references to the functions). Pass-through otherwise."""

    def __init__(self) -> None:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.active = False
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        self._depth = threading.local()
        for name, (arg, formula) in _COUNTED.items():
            orig = getattr(c10d, name, None)
            if orig is None or getattr(orig, "_fsharded_counted", False):
                continue
            wrapped = self._wrap(name, orig, arg, formula)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, wrapped)
        from fsharded.comm import _shm

        _shm.set_observer(self._note)  # fsharded's same-host shared-memory collectives

    def _note(self, name: str, x: torch.Tensor, n: int) -> None:
        if self.active and getattr(self._depth, "n", 0) == 0 and n > 1:
            b = _COUNTED[name][1](_nbytes(x), n)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + b

    def _wrap(self, name: str, orig: Callable, arg: str, formula: Callable[[int, int], int]):
        import torch.distributed as dist

        sig = inspect.signature(orig)
        counter = self

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(counter._depth, "n", 0)
            if counter.active and depth == 0:
                bound = sig.bind(*args, **kwargs)
                n = dist.get_world_size(bound.arguments.get("group"))
                b = formula(_nbytes(bound.arguments.get(arg)), n) if n > 1 else 0
                counter.calls[name] = counter.calls.get(name, 0) + 1
                counter.bytes[name] = counter.bytes.get(name, 0) + b
            counter._depth.n = depth + 1
            try:
                return orig(*args, **kwargs)
            finally:
                counter._depth.n = depth

        wrapped._fsharded_counted = True  # type: ignore[attr-defined]
        wrapped.__wrapped__ = orig  # type: ignore[attr-defined]
        return wrapped

    @contextlib.contextmanager
    def counting(self):
        self.calls.clear()
        self.bytes.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False

    def total(self) -> int:
        return sum(self.bytes.values())


# -- the frameworks --------------------------------------------------------------------------
