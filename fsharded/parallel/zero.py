"""ZeRO stages as placements: where parameters, gradients and optimizer state live.

A stage is not a mode of an engine but three spec trees (a ``Placement``):

=====  ==========================  ==================  ==========================
stage  parameters during the step  gradients           master weights + opt state
=====  ==========================  ==================  ==========================
0      as given                    all-reduced, full    as given
1      as given                    all-reduced, full    sharded over ``axis``
2      as given                    reduce-scattered     sharded over ``axis``
3      sharded over ``axis``        reduce-scattered     sharded over ``axis``
=====  ==========================  ==================  ==========================

``train_step`` reads the placement: it keeps master weights and optimizer state in their
(sharded) placement, all-gathers the parameters the step computes with, and reduces each
gradient into its placement.

Which dim a leaf is sharded on (the rule): the first dim whose size, divided by the
axes that already shard it, is divisible by the ``axis`` size; ``axis`` is added as the
minor axis on that dim (``P("tensor")`` -> ``P(("tensor", "data"))``, as DeepSpeed's
flat partitions sit inside a tensor-parallel shard). Leaves with fewer than ``min_size``
elements, or with no such dim, stay replicated over ``axis`` (their state is tiny, and a
non-divisible split would need padding).

>>> plan = zero(2, axis="data")(P(), params)       # every leaf replicated to start with
>>> placement = plan.resolve(Mesh({"data": 4}))   # concrete spec trees for this mesh
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import optree
import torch

from fsharded.mesh import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec, _entry_axes
from fsharded.parallel.offload import Offload, ZenFlow

__all__ = ["Placement", "ZeroPlan", "zero", "shard_leaf_spec"]


class Placement(NamedTuple):
    """Spec trees (full, one spec per parameter leaf) of a training layout."""

    use: Any  # how the loss function sees each parameter (the spec tree given to zero())
    params: Any  # where parameters live between uses (stage 3: sharded, gathered to use)
    grads: Any  # where each gradient ends up after the reduction
    master: Any  # fp32 master weights and the optimizer state shaped like them
    stage: int = 0
    axis: str | None = None
    # ZeRO-3: drop a block's gathered weights after its forward and gather them again in
    # backward (True), or keep them until backward (False: fewer bytes, more memory). None
    # (``zero``'s default): True, but a pipelined loss gathers each stage once per step;
    # True given: a pipelined loss gathers its blocks per micro-batch too.
    reshard_after_forward: bool | None = None

    @property
    def reshards(self) -> bool:
        """Whether a block's gathered weights are freed after its forward (the default)."""
        return self.reshard_after_forward is not False
    # One bool per parameter leaf (flatten order): which leaves train; None: all of them.
    trainable: tuple[bool, ...] | None = None
    # Where the optimizer state lives (``parallel.offload.Offload``); None: device memory.
    offload: Any = None

    def describe(self) -> str:
        """The placement in words, for messages: ``"ZeRO stage 2 over 'data'"``. (The step
        itself reads the spec trees, leaf by leaf, not the stage.)"""
        return (f"ZeRO stage {self.stage}" + (f" over {self.axis!r}" if self.stage and self.axis else "")
                + (f", {self.offload.describe()}" if self.offload is not None and self.offload.active else ""))

    @classmethod
    def replicated(cls, specs: Any) -> Placement:
        """Stage 0: everything laid out as ``specs``."""
        return cls(specs, specs, specs, specs, 0, None)

    def freeze(self, mask: list[bool] | None) -> Placement:
        """This placement with the leaves ``mask`` marks False frozen: no gradient, no
        optimizer state. ZeRO-1/2 partition only those (gradients, optimizer state), so a
        frozen leaf keeps its use layout there; ZeRO-3 shards it like any parameter and
        gathers it for use (its gradient placement is never used)."""
        if mask is None or all(mask):
            return self._replace(trainable=None)
        spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        use, tdef = optree.tree_flatten(self.use, is_leaf=spec)
        if self.stage == 3:
            return self._replace(trainable=tuple(mask))
        kept = [optree.tree_unflatten(tdef, [u if not t else x for u, x, t in
                                             zip(use, optree.tree_leaves(tree, is_leaf=spec), mask)])
                for tree in (self.params, self.grads, self.master)]
        return self._replace(params=kept[0], grads=kept[1], master=kept[2], trainable=tuple(mask))


def shard_leaf_spec(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh, axis: str,
                    min_size: int) -> PartitionSpec:
    """``spec`` with ``axis`` added on the first dim that divides (see the module rule)."""
    if axis in spec.axes or math.prod(shape) < min_size:
        return spec
    n = mesh.shape[axis]
    entries = list(spec) + [None] * (len(shape) - len(spec))
    for d, size in enumerate(shape):
        have = _entry_axes(entries[d])
        k = math.prod(mesh.shape[a] for a in have)
        if size % k == 0 and (size // k) % n == 0:
            entries[d] = (*have, axis) if have else axis
            while entries and entries[-1] is None:
                entries.pop()
            return PartitionSpec(*entries)
    return spec


@dataclass(frozen=True)
class ZeroPlan:
    """A ZeRO stage applied to a spec tree, waiting for the mesh (``resolve``)."""

    stage: int
    axis: str
    specs: Any
    params: Any = field(repr=False)  # (tensors: a repr would print their values)
    min_size: int
    reshard_after_forward: bool | None = None
    offload: Offload | None = None

    def resolve(self, mesh: Mesh) -> Placement:
        if self.axis not in mesh.shape:
            raise ValueError(
                f"zero({self.stage}, axis={self.axis!r}): axis {self.axis!r} is not in {mesh!r}; "
                f"pass axis= one of {list(mesh.axis_names)}"
            )
        flat = _tree.broadcast_prefix(self.specs, self.params, what="param_specs")
        leaves, tdef = optree.tree_flatten(self.params)
        if mesh.shape[self.axis] == 1 and self.stage > 0:
            warnings.warn(
                f"zero({self.stage}, axis={self.axis!r}): the axis has size 1 in {mesh!r}, so the "
                f"stage has no effect", stacklevel=2,
            )
        sharded = [
            shard_leaf_spec(s, tuple(x.shape), mesh, self.axis, self.min_size)
            if isinstance(x, torch.Tensor) else s
            for x, s in zip(leaves, flat)
        ]
        base = optree.tree_unflatten(tdef, flat)
        over = optree.tree_unflatten(tdef, sharded)
        if self.stage == 0:
            pl = Placement(base, base, base, base, 0, self.axis)
        elif self.stage == 1:
            pl = Placement(base, base, base, over, 1, self.axis)
        elif self.stage == 2:
            pl = Placement(base, base, over, over, 2, self.axis)
        else:
            pl = Placement(base, over, over, over, 3, self.axis, self.reshard_after_forward)
        return pl._replace(offload=self.offload) if self.offload is not None else pl


def _shapes_of(params: Any) -> Any:
    def meta(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or x.device.type == "meta":
            return x
        out = torch.empty(x.shape, dtype=x.dtype, device="meta")
        return out.requires_grad_(x.requires_grad) if out.is_floating_point() or out.is_complex() else out

    return optree.tree_map(meta, params)


def zero(stage: int, axis: str = "data", *, min_size: int = 1024, reshard_after_forward: bool | None = None,
         offload_optimizer: str | None = None, nvme_path: str | None = None, offload_params: str | None = None,
         pin_memory: bool = True, bucket_elems: int | None = None, buffer_count: int = 2,
         zenflow: Any = None):
    """The ZeRO ``stage`` (0-3) over mesh ``axis``, as a rewrite of a parameter spec tree.

    ``reshard_after_forward`` (stage 3; FSDP's name for it): ``True`` frees each block's
    gathered weights after its forward and gathers them again in backward, so about one
    block of full weights is alive at a time (3P(n-1)/n bytes per step for the blocks, less
    the last block's re-gather: its backward follows its forward at once, so it is kept);
    ``False`` keeps them from the block's forward until its backward (2P(n-1)/n; the full
    weights of every block are alive at the end of forward), as DeepSpeed does when its
    ``stage3_max_reuse_distance`` and prefetch bucket allow. The default (None) is True,
    except with a pipelined loss: there each stage's weights are gathered once per step
    (at its ``GATHER`` action) and kept until its last action, as torchtitan does for
    pipelines by default; ``True`` given explicitly gathers a stage's blocks for every
    micro-batch instead (about one block whole at a time, m times the bytes).

    ``offload_optimizer`` (``"cpu"`` or ``"nvme"``; ZeRO-Offload, ZeRO-Infinity): the
    optimizer's moments live in host memory or in files under ``nvme_path`` and the step
    streams them through host buffers, ``bucket_elems`` elements at a time with
    ``buffer_count`` buckets in flight, with the same numbers as in device memory
    (``fsharded.parallel.offload``). ``pin_memory``: page-locked host buffers where a GPU is
    the device. ``offload_params`` (``"cpu"`` or ``"nvme"``, stages 1-3, with
    ``offload_optimizer``; ZeRO-Infinity): the master parameters' shards live there too;
    at stage 3 each block's shards are read from the tier (through ``aio`` for NVMe) just
    before its gather, at stages 1-2 every shard at the step's start before the gather of
    the parameters it computes with; the update streams them with the optimizer state.
    The same numbers.

    Returns ``rule(specs, params) -> ZeroPlan``; ``train_step`` resolves the plan against
    its mesh (``plan.resolve(mesh)`` gives the concrete ``Placement``). Specs that already
    use other axes (tensor parallelism) keep them.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero: stage must be 0, 1, 2 or 3, got {stage!r}")
    if not isinstance(axis, str):
        raise ValueError(f"zero: axis must be a mesh axis name, got {axis!r}")
    offload_params = None if offload_params == "none" else offload_params
    if offload_params is not None and stage == 0:
        raise ValueError(f"zero: offload_params={offload_params!r} keeps the master weights' shards in a tier; stage 0 "
                         f"does not shard them (use zero(1, ...) or above)")
    off = None
    zenflow = ZenFlow() if zenflow is True else (None if zenflow is False else zenflow)
    if zenflow is not None and offload_optimizer in (None, "none"):
        raise ValueError("zero: zenflow overlaps the host tier's update with the next step: it needs "
                         "offload_optimizer='cpu' or 'nvme'")
    if offload_optimizer not in (None, "none") or offload_params is not None:
        off = Offload(None if offload_optimizer == "none" else offload_optimizer, offload_params, nvme_path=nvme_path,
                      pin_memory=pin_memory, buffer_count=buffer_count,
                      bucket_elems=Offload.bucket_elems if bucket_elems is None else bucket_elems, zenflow=zenflow)

    def rule(specs: Any, params: Any) -> ZeroPlan:
        _tree.broadcast_prefix(specs, params, what="param_specs")  # fail early, with paths
        # The plan needs the leaves' shapes only: it keeps meta stand-ins, not the values (a
        # step holds its plan for its life, and the values would be a whole model per rank).
        return ZeroPlan(stage, axis, specs, _shapes_of(params), min_size,
                        None if reshard_after_forward is None else bool(reshard_after_forward), off)

    return rule
