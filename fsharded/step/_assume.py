"""The varying-axes typing assumed while the loss is differentiated (``VmaMode.assuming``).

Where every differentiated parameter varies over every mesh axis of size > 1 once marked
varying over the batch axes (data parallelism and ZeRO: its spec's axes plus the batch
axes cover them), no implicit ``pvary`` can arise in the loss until a collective reduces a
differentiated value over such an axis: the loss then runs with the typing off torch's
stack, free of its per-op cost. A loss that needs the typing after all (such a reduction,
or a question about a value the assumption does not cover) stops with ``NeedsTyping``; this
plan is typed from then on and the step runs its gradients again (``TrainStep._gradients``:
the same keys, the same collectives on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree

from fsharded.spmd import _env, _manifest, _vma
from fsharded.step._layout import Layout

__all__ = ["Assumed", "assumable"]


def assumable(layout: Layout, batch_axes: tuple[str, ...]) -> frozenset | None:
    """The axes of size > 1 when every trained leaf, as differentiated (its ``params``
    layout), varies over all of them once marked varying over the batch axes; else None
    (tensor parallelism: a leaf invariant over such an axis meets varying values)."""
    mesh = layout.mesh
    full = frozenset(a for a in mesh.axis_names if mesh.shape[a] > 1)
    if not full:
        return None  # one device: nothing is typed
    marked = {a for a in batch_axes if mesh.shape[a] > 1}
    if all(full <= marked | set(s.axes) for s in layout.t_params):
        return full
    return None


class Assumed:
    """A differentiator (``_differentiate.differentiator``) run with the typing assumed
    over ``axes`` (None: typed as always). ``drain``: waits for what a stopped forward left
    in flight (the per-block loss's prefetched gathers)."""

    def __init__(self, grad: Callable, axes: frozenset | None, drain: Callable[[], None]) -> None:
        self.grad, self.axes, self.drain = grad, axes, drain

    def __call__(self, f: Callable, x0: Any, batch: Any, **kw: Any) -> tuple:
        frame = _env.current()
        # Typed while collectives are recorded (a manifest, a schedule check): a stopped
        # stretch would leave its collectives in the record beside the typed run's.
        mode = frame.vma if frame is not None and self.axes is not None and not _manifest.active() else None
        if mode is None:
            return self.grad(f, x0, batch, **kw)
        try:
            with mode.assuming(self.axes):
                g, (out, aux) = self.grad(f, x0, batch, mode=mode, **kw)
            if mode.assume_failed:  # raised, and caught inside the loss function
                raise _vma.NeedsTyping
        except _vma.NeedsTyping:
            self.axes = None
            self.drain()
            raise
        for t in optree.tree_leaves(g):  # a cotangent has its primal's type
            if not mode.known(t):  # (reduced in backward: typed by the reduction)
                mode.set(t, self.axes)
        mode.set(out, self.axes)
        return g, (out, aux)
