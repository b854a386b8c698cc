"""Varying-axes tracking for differentiating *through* shard_map on the distributed backend.

On the virtual mesh, ``vmap`` knows which values vary along which axis (batched at that
level or not), and autograd of a replicated value used with varying ones sums the
per-shard cotangents. On real ranks every value is just a local tensor, so when gradients
will flow out of a ``shard_map`` call (an input requires grad), a ``TorchFunctionMode``
tracks the set of axes each tensor varies along — JAX's ``vma`` — and inserts the
implicit ``pvary`` (identity forward, ``psum`` backward) where a replicated value meets a
varying one. With it both backends give the same gradients. Inside the function, under
``torch.func.grad``, no tracking is needed: the collectives' own transposes apply.
"""

from __future__ import annotations

import weakref

import optree
import torch
from torch.overrides import TorchFunctionMode

_ACTIVE: list[VmaMode] = []


class VmaMode(TorchFunctionMode):
    def __init__(self, frame) -> None:
        super().__init__()
        self.frame = frame
        self._vma: dict[int, tuple[weakref.ref, frozenset]] = {}
        self.suspended = 0

    def get(self, t: torch.Tensor) -> frozenset:
        e = self._vma.get(id(t))
        return e[1] if e is not None and e[0]() is t else frozenset()

    def set(self, t: torch.Tensor, axes: frozenset) -> None:
        if axes:
            self._vma[id(t)] = (weakref.ref(t), frozenset(axes))
        else:
            self._vma.pop(id(t), None)

    def __enter__(self):
        _ACTIVE.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _ACTIVE.remove(self)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.suspended:
            return func(*args, **kwargs)
        flat, spec = optree.tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        union = frozenset().union(*(self.get(flat[i]) for i in idx)) if idx else frozenset()
        if union:
            name = getattr(func, "__name__", "")
            inplace = name.endswith("_") and not name.endswith("__")
            changed = False
            for k, i in enumerate(idx):
                if inplace and k == 0:
                    continue
                missing = union - self.get(flat[i])
                if missing and flat[i].requires_grad:
                    flat[i] = self.pvary(flat[i], tuple(a for a in self.frame.mesh.axis_names if a in missing))
                    changed = True
            if changed:
                args, kwargs = optree.tree_unflatten(spec, flat)
        out = func(*args, **kwargs)
        if union:
            for t in optree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.set(t, union)
        return out

    def pvary(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        from fsharded._env import Axes
        from fsharded.collectives import PVARY, _Collective

        mesh = self.frame.mesh
        self.suspended += 1
        try:
            y = _Collective.apply(
                PVARY, (), Axes(axes, tuple(mesh.shape[a] for a in axes), self.frame), x, None
            )
        finally:
            self.suspended -= 1
        self.set(y, self.get(x) | frozenset(axes))
        return y


def active() -> VmaMode | None:
    return _ACTIVE[-1] if _ACTIVE else None


def apply_collective(prim, params, axes, x: torch.Tensor) -> torch.Tensor:
    from fsharded.collectives import (
        ALL_GATHER,
        ALL_GATHER_INVARIANT,
        PMAX,
        PSUM,
        PVARY,
        _Collective,
    )

    mode = active()
    if mode is None or mode.suspended:
        if not (torch.is_grad_enabled() and x.requires_grad) and not torch._C._are_functorch_transforms_active():
            # Nothing to differentiate: skip the autograd Function (tens of us per call).
            from fsharded import distributed
            from fsharded.memory import collective_scope

            with collective_scope():
                return prim.dist(x, distributed.axis_group(axes.frame.mesh, axes.names), params)
        return _Collective.apply(prim, params, axes, x, None)
    have = mode.get(x)
    need = frozenset(axes.names)
    order = tuple(a for a in axes.frame.mesh.axis_names if a in need - have)
    if prim is PVARY:
        return mode.pvary(x, order) if order else x
    if order and x.requires_grad:
        x = mode.pvary(x, order)
    if prim is ALL_GATHER:
        prim = ALL_GATHER_INVARIANT
    mode.suspended += 1
    try:
        y = _Collective.apply(prim, params, axes, x, None)
    finally:
        mode.suspended -= 1
    reduces = prim is PSUM or prim is PMAX or prim is ALL_GATHER_INVARIANT
    mode.set(y, (have - need) if reduces else (have | need))
    return y
