"""Per-stage storage: with a pipelined loss on real ranks, each rank along the pipe axis
keeps the training state of its own stages' leaves only.

A leaf no stage of this rank reads is a *placeholder* on it: a zero broadcast to the
leaf's local shape (``zeros(()).expand(shape)``: the right shape and dtype, one element of
memory), in the master weights and in every optimizer-state subtree shaped like them. The
state's structure and shapes are the same on every rank, so the step's plans, the layout
checks and the checkpoint's entries are; what differs is which leaves each rank updates:

- the gradient side of the step (reductions, clipping, the update) sees ``Layout.updated``,
  the trained leaves this rank holds;
- a leaf two pipe ranks hold (a tied embedding, on the first and the last stage) is
  updated by both from the same summed gradient, so the two copies stay equal;
- the global gradient norm adds each rank's part once over the pipe axis, a shared leaf
  counted on its first holder only;
- a checkpoint's blocks of a leaf are written by its first holder (``owners`` of
  ``checkpoint.save``), and a load reads a leaf only where it is held;
- ``step.params`` sends each leaf from its first holder to the other pipe ranks.

On the virtual mesh every pipe rank is this process, which holds every leaf.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import comm, optim
from fsharded.mesh._layout import dims
from fsharded.mesh._mesh import Mesh
from fsharded.spmd import _env, _vma
from fsharded.step import _trainable as T

__all__ = ["placeholder", "Holding", "view_state", "merge_state"]


def placeholder(shape: Any, dtype: torch.dtype, device: Any = "cpu") -> torch.Tensor:
    """A stand-in for a leaf this rank does not hold: zeros of ``shape``, one element stored."""
    return torch.zeros((), dtype=dtype, device=device).expand(tuple(shape))


class Holding:
    """Which pipe ranks hold each parameter leaf (``owners``: one set of coordinates along
    ``axis`` per leaf, flatten order), and what this process holds: on a real rank its own
    coordinate's leaves (``here``), on the virtual mesh all of them (``here`` is None)."""

    def __init__(self, owners: list[frozenset[int]], axis: str, mesh: Mesh, distributed: bool) -> None:
        self.owners, self.axis, self.mesh = owners, axis, mesh
        self.size = mesh.shape[axis]
        self.me = comm.axis_group(mesh, (axis,)).index if distributed else None
        self.here = [self.me in o for o in owners] if distributed else None
        # Leaves more than one pipe rank holds: their gradient parts are summed over the axis.
        self.shared = [len(o) > 1 for o in owners]

    @property
    def partial(self) -> bool:
        """Whether this process holds only some leaves (the norm is then summed over the axis)."""
        return self.here is not None and not all(self.here)

    def counted(self, i: int) -> bool:
        """Whether leaf ``i`` counts in this process's part of the global norm: held here,
        and here its first holder (a shared leaf is counted once)."""
        return self.me is None or min(self.owners[i]) == self.me

    def checkpoint_owners(self) -> list[tuple[str, frozenset[int]] | None]:
        """Per parameter leaf, ``checkpoint.save``'s ``owners`` entry (None: every rank)."""
        every = frozenset(range(self.size))
        return [None if o == every else (self.axis, o) for o in self.owners]

    def broadcast(self, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """``leaves`` (global values; the ones not held here placeholders) with each leaf
        sent from its first holder to the other ranks of this rank's pipe group."""
        if self.here is None:
            return leaves
        g = comm.axis_group(self.mesh, (self.axis,))
        out = []
        for x, o, held in zip(leaves, self.owners, self.here):
            if len(o) == self.size:
                out.append(x)
                continue
            buf = x.contiguous() if held else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dist.broadcast(buf, src=g.ranks[min(o)], group=g.group)
            out.append(buf)
        return out


def _moment_index(opt_state: Any, params: Any) -> list[int]:
    """Per leaf of ``opt_state``: the index of the parameter leaf a moment leaf belongs to
    (a subtree shaped like ``params``), -1 for the others (counters)."""
    ptree = optree.tree_structure(params)
    index = optree.tree_unflatten(ptree, list(range(ptree.num_leaves)))
    return optree.tree_leaves(optim.moments_like(opt_state, params, index, -1))


def view_state(opt_state: Any, params: Any, mask: list[bool]) -> Any:
    """The optimizer state ``opt_state`` of ``params`` as the state of ``T.view(params,
    mask)``: None (an empty node) at the moment leaves of the leaves ``mask`` marks False."""
    leaves, tdef = optree.tree_flatten(opt_state)
    idx = _moment_index(opt_state, params)
    return optree.tree_unflatten(tdef, [None if i >= 0 and not mask[i] else x for x, i in zip(leaves, idx)])


def merge_state(new: Any, old: Any, params: Any, mask: list[bool]) -> Any:
    """``old`` (the optimizer state of ``params``) with its leaves replaced by ``new``'s (the
    state of ``T.view(params, mask)``, as ``view_state`` gives it) but for the moments of
    the leaves ``mask`` marks False, kept."""
    leaves, tdef = optree.tree_flatten(old)
    idx = _moment_index(old, params)
    fresh = iter(optree.tree_leaves(new))
    out = [x if i >= 0 and not mask[i] else next(fresh) for x, i in zip(leaves, idx)]
    return optree.tree_unflatten(tdef, out)


def init_held(optimizer: Any, master: Any, mask: list[bool] | None, here: list[bool]) -> tuple[Any, Any]:
    """``(master, opt_state)`` of a rank that holds the leaves ``here`` marks: the others
    placeholders in both, the optimizer state made for the held trained leaves only (the
    others' moments never exist whole)."""
    leaves, tdef = optree.tree_flatten(master)
    device = next((x.device for x in leaves), torch.device("cpu"))
    master = optree.tree_unflatten(tdef, [x if h else placeholder(x.shape, x.dtype, x.device)
                                          for x, h in zip(leaves, here)])
    trained = T.view(master, mask)
    updated = [h and (mask is None or t) for h, t in zip(here, mask or here)]
    held_state = optimizer.init(T.view(master, updated))
    # The state's structure and shapes for every trained leaf, made on the meta device.
    skeleton = optimizer.init(optree.tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta"), trained))
    skeleton = optree.tree_map(
        lambda x: placeholder(x.shape, x.dtype, device) if isinstance(x, torch.Tensor) and x.is_meta else x, skeleton)
    return master, merge_state(held_state, skeleton, trained, T.pick(here, mask))


def gathered_shape(x: torch.Tensor, src: Any, dst: Any, mesh: Mesh) -> tuple[int, ...]:
    """The shape of ``x`` (a shard laid out by the spec ``src``) gathered to the spec ``dst``."""
    shape = list(x.shape)
    for d, (a, b) in enumerate(zip(dims(src, x.dim()), dims(dst, x.dim()))):
        shape[d] *= math.prod(mesh.shape[ax] for ax in a if ax not in b)
    return tuple(shape)


def stand_in(x: torch.Tensor, src: Any, dst: Any, mesh: Mesh) -> torch.Tensor:
    """A placeholder for ``x`` gathered from ``src`` to ``dst``, typed as the gather's result
    (varying over the axes ``dst`` shards on)."""
    out = x.new_zeros(()).expand(gathered_shape(x, src, dst, mesh))
    frame = _env.current()
    if frame is not None and frame.vma is not None:
        frame.vma.set(out, _vma.axis_set(dst))
    return out


def on_held(gather: Any, leaves: list, here: list[bool]) -> list:
    """``gather(leaves)`` (a ``_differentiate._Gather``) for the leaves held here; a
    placeholder of the gathered shape for the others."""
    idx = [i for i, h in enumerate(here) if h]
    got = iter(gather.part([leaves[i] for i in idx], idx))
    mesh = gather.layout.mesh
    return [next(got) if h else stand_in(x, s, d, mesh)
            for x, h, s, d in zip(leaves, here, gather.src, gather.dst)]


def state_owners(state: Any, owners: list, mask: list[bool] | None) -> list:
    """One entry per leaf of a ``TrainState`` (flatten order): the parameter leaves' and
    their moments' ``owners``, None for everything else."""
    out: list = []
    for name, value in zip(state._fields, state):
        n = len(optree.tree_leaves(value))
        if name == "params":
            out += owners
        elif name == "opt_state":
            trained = T.pick(owners, mask)
            out += [trained[i] if i >= 0 else None
                    for i in _moment_index(value, T.view(state.params, mask))]
        else:
            out += [None] * n
    return out
