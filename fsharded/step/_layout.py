"""What the step does with each parameter leaf, read off a placement's spec trees.

A ``Placement`` (``fsharded.parallel.zero``) gives every leaf four specs: ``use`` (how the
loss sees it), ``params`` (where it lives between uses), ``grads`` (where its gradient
ends up) and ``master`` (the master weights and the optimizer state). The step compares
them leaf by leaf, never a stage number:

- ``master`` adds an axis over ``params``: the master shards are gathered before the
  loss, outside the differentiated function (ZeRO-1, -2);
- ``params`` adds an axis over ``use``: gathered inside the differentiated function, so
  its gradient comes back reduce-scattered by the gather's transpose (ZeRO-3);
- ``grads`` adds an axis over ``params``: the gradient is reduce-scattered over the batch
  axes (ZeRO-2); ``grads`` equal to ``params``: all-reduced (averaged);
- ``master`` adds an axis over ``grads``: this rank's slice of the reduced gradient is
  kept (ZeRO-1).

``Moves.of(placement)`` holds those predicates (``estimate_memory`` reads the same, so
the estimate and the step cannot disagree); ``Layout`` adds what a step needs besides:
the parameter paths, the block list, the trainable leaves and, with per-stage storage
(``_held``), the leaves this process holds.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree

from fsharded import _tree
from fsharded.mesh._mesh import Mesh
from fsharded.mesh._spec import PartitionSpec
from fsharded.step import _trainable as T

__all__ = ["Moves", "Layout", "block_mask"]


def _flat(tree: Any) -> tuple[PartitionSpec, ...]:
    return tuple(optree.tree_leaves(tree, is_leaf=lambda x: isinstance(x, PartitionSpec)))


def _adds(outer: PartitionSpec, inner: PartitionSpec) -> frozenset[str]:
    """The mesh axes ``outer`` shards on that ``inner`` does not."""
    return frozenset(outer.axes) - frozenset(inner.axes)


class Moves(NamedTuple):
    """A placement's flat specs (one per parameter leaf, flatten order) and, per leaf, what
    moves it (see the module table). Derived once, when a step's plan is built."""

    use: tuple[PartitionSpec, ...]
    params: tuple[PartitionSpec, ...]
    grads: tuple[PartitionSpec, ...]
    master: tuple[PartitionSpec, ...]
    axis: str | None  # the mesh axis leaves move over; None: no leaf moves
    gather_before: tuple[bool, ...]  # master shards gathered to ``params`` before the loss
    gather_in_loss: tuple[bool, ...]  # ``params`` gathered to ``use`` inside the differentiated function
    scatter: tuple[bool, ...]  # gradient reduce-scattered into ``grads``
    slice: tuple[bool, ...]  # this rank's slice of the reduced gradient kept for ``master``

    @classmethod
    def of(cls, pl: Any) -> Moves:
        use, params, grads, master = (_flat(t) for t in (pl.use, pl.params, pl.grads, pl.master))
        pairs = {"gather_before": (master, params), "gather_in_loss": (params, use),
                 "scatter": (grads, params), "slice": (master, grads)}
        added = {k: [_adds(o, i) for o, i in zip(*v)] for k, v in pairs.items()}
        axes = sorted(set().union(*(a for v in added.values() for a in v)))
        if len(axes) > 1:
            raise NotImplementedError(
                f"a placement whose leaves move over several mesh axes {axes} (between their use, "
                f"params, grads and master specs): the step gathers and scatters over one axis; "
                f"shard the training state over one of them (fs.parallel.zero(..., axis=...))")
        return cls(use, params, grads, master, axes[0] if axes else None,
                   *(tuple(bool(a) for a in added[k]) for k in pairs))


class Layout:
    """One state layout of a step: its placement's specs and moves, flat (one per parameter
    leaf), the parameter paths, where the block list is, and which leaves train. The
    gradient side (``t_*``: reductions, clipping, the update) sees only the trainable
    leaves this process holds (``updated``); the loss sees every leaf."""

    def __init__(self, pl: Any, params: Any, blocks: str | None, mesh: Mesh, held: Any = None) -> None:
        mv = self.moves = Moves.of(pl)
        self.use, self.params, self.grads, self.master = (list(s) for s in mv[:4])
        self.axis, self.reshard = mv.axis, pl.reshards
        # The master shards live in NVMe files (parameter offload): gathers read them through
        # the tier's checked I/O, not through their memory maps.
        self.params_in_files = getattr(pl.offload, "params", None) == "nvme"
        # The update runs on the host (the optimizer state in a tier; not ZenFlow's, whose hot
        # rows are updated on the device): gradients reduced in backward go to the host then.
        off = pl.offload
        self.grads_to_host = off is not None and off.active and off.zenflow is None
        self.pin = off.pin_memory if off is not None else True
        # ZeRO-3 under a pipeline: the blocks gathered per micro-batch (reshard_after_forward
        # given as True), not each stage once per step.
        self.regather_blocks = pl.reshard_after_forward is True
        self.blocks = blocks
        self.block_mask = block_mask(params, blocks)
        self.paths = _tree.tree_flatten_with_paths(params)[0]
        self.mesh = mesh
        self.trainable = list(pl.trainable) if pl.trainable is not None else None  # None: all
        self.frozen = [not t for t in self.trainable] if self.trainable is not None else None
        # Per-stage storage (``_held.Holding``, or None): this process updates the trained
        # leaves it holds, ``updated`` (None: every trained leaf), and the moments of those.
        self.holding = held
        here = held.here if held is not None else None
        if here is None or all(here):
            self.updated = self.trainable
        else:
            self.updated = [h and (self.trainable is None or t) for h, t in
                            zip(here, self.trainable or [True] * len(here))]
        # The held leaves among the trained ones (what the optimizer state's moments cover).
        self.held_trained = None if self.updated is self.trainable else T.pick(here, self.trainable)
        self.t_use, self.t_params, self.t_grads, self.t_master = (
            T.pick(x, self.updated) for x in (self.use, self.params, self.grads, self.master))
        self.t_paths = T.pick(self.paths, self.updated)


def block_mask(params: Any, path: str | None) -> list[bool] | None:
    """Which leaves live under the block list at ``path`` (a list of per-block subtrees)."""
    if path is None:
        return None
    try:
        node = _tree.get_path(params, path)
    except KeyError as e:
        raise ValueError(f"train_step(blocks={path!r}): {e.args[0]}") from None
    if not isinstance(node, (list, tuple)) or not node:
        raise ValueError(
            f"train_step(blocks={path!r}): the parameters there are a {type(node).__name__}, "
            f"not a non-empty list of per-block subtrees"
        )
    return [p.startswith(path + ".") for p in _tree.tree_flatten_with_paths(params)[0]]
