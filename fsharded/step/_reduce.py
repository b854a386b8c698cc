"""The gradient reduction a placement implies, leaf by leaf from its specs.

Each trained leaf's gradient leaves differentiation laid out as its ``params`` spec (a
leaf gathered inside the loss comes back reduce-scattered, i.e. summed over the gather
axis, by the gather's transpose). ``Reduction`` averages it over the batch axes into its
``grads`` spec, in flat buckets (DeepSpeed's reduce buckets; ``_buckets.reduce_leaves``):
divided where it is already summed, reduce-scattered where ``grads`` adds an axis,
all-reduced elsewhere; then keeps this rank's slice where ``master`` adds an axis over
``grads`` (ZeRO-1). On real ranks the same buckets can be reduced while backward runs
(``during_backward``).

>>> reduce = Reduction(layout, ("data",), cap=500_000_000, dtype=torch.float32)
>>> placed = reduce(grad_leaves)  # inside shard_map: one list entry per trained leaf
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch

from fsharded.comm import _trace
from fsharded.parallel import _buckets as B
from fsharded.parallel import zero3
from fsharded.spmd import _env, _manifest
from fsharded.step import _trainable as T
from fsharded.step._layout import Layout

__all__ = ["Reduction"]


def _as_is(leaves: list) -> list:
    return leaves


class Reduction:
    """``__call__(grads) -> placed``: the trained leaves' gradients (in their ``params``
    layout, the list consumed) averaged over the batch axes into their ``master`` layout.
    ``place``: the last part alone (``grads`` -> ``master``, a slice), for gradients already
    reduced into ``grads``."""

    def __init__(self, layout: Layout, batch_axes: tuple[str, ...], cap: int, dtype: torch.dtype) -> None:
        self.src, self.grads, self.master = layout.t_params, layout.t_grads, layout.t_master
        self.batch_axes, self.mesh, self.cap, self.dtype = batch_axes, layout.mesh, cap, dtype
        self.to_host, self.pin = layout.grads_to_host, layout.pin
        # The leaves whose gradients come back summed over the ZeRO axis by a gather's
        # transpose (ZeRO-3): their reduction is a division, which the host can do.
        self.summed = T.pick(layout.moves.gather_in_loss, layout.updated)
        self.axis = layout.axis
        sliced = T.pick(layout.moves.slice, layout.updated)
        self.place = functools.partial(B.slice_leaves, from_specs=self.grads, to_specs=self.master,
                                       axis=layout.axis, mesh=self.mesh) if any(sliced) else _as_is
        # The reduction can run in backward where no gradient comes back summed already
        # (a leaf gathered inside the loss is reduce-scattered by the gather's transpose).
        self.in_backward = not any(T.pick(layout.moves.gather_in_loss, layout.updated))
        self._layouts: dict[tuple, B.InBackwardLayout | None] = {}  # by the leaves' shapes

    def __call__(self, grads: list) -> list:
        with _trace.phase("reduce"):
            return self.place(B.reduce_leaves(grads, self.src, self.grads, self.batch_axes, self.mesh, self.cap))

    def host_sink(self) -> B.HostSink | None:
        """Real ranks, plain autograd, the optimizer state in a memory tier: the gradients
        of the leaves a gather's transpose reduce-scatters (ZeRO-3) copied to the host as
        backward makes them (``_buckets.HostSink``), where only the division by the axis
        size is left of their reduction; None where another batch axis would reduce them
        too (a collective, which stays on the device), or nothing is to be sunk."""
        if not self.to_host or _manifest.dry() or not any(self.summed):
            return None
        live = [a for a in self.batch_axes if self.mesh.shape[a] > 1]
        if live != [self.axis]:
            return None
        return B.HostSink(list(self.summed), zero3.in_flight, pin=self.pin)

    def during_backward(self, x0: Any) -> B.InBackward | None:
        """Real ranks, plain autograd: the bucketed reduction into ``grads`` run inside
        backward (``_buckets.InBackward``, hooked on ``x0``, the differentiated leaves), so
        a reduce-scattered gradient never exists whole at once; None where it cannot (a
        dry run, several batch axes, a leaf sharded over the batch axis) and the
        reduction runs after backward. With the optimizer state in a memory tier each
        reduced bucket is copied to the host while backward goes on (``InBackward``'s
        ``to_host``)."""
        if _manifest.dry():
            return None
        frame = _env.current()
        shapes = tuple(tuple(x.shape) for x in optree.tree_leaves(x0))
        if shapes not in self._layouts:  # (which axes are bound is the step's, not the call's)
            self._layouts[shapes] = B.InBackwardLayout.of(list(shapes), self.src, self.grads, self.batch_axes,
                                                          self.mesh, self.cap)
        layout = self._layouts[shapes]
        if layout is None:
            return None
        return B.InBackward(layout, self.dtype, frame.vma if frame is not None else None, to_host=self.to_host,
                            pin=self.pin)
