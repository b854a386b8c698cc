"""ZeRO-3 gathered per block: the local loss for a model whose blocks run through
``fsharded.parallel.run_block`` (``train_step(blocks=...)``). The leaves gathered inside
the loss (``Moves.gather_in_loss``) that live outside the block list are gathered up
front; a block's stay sharded until its ``run_block``, where the handler
(``parallel.zero3.block_handler``) gathers them, frees them after the block's forward
and gathers them again in backward, reduce-scattering their gradients there. On real
ranks the next block's gather is prefetched and backward's reduce-scatters overlap the
rest of backward (``backward_ctx``).

It is a ``LocalLoss``: the plain and accumulated strategies differentiate it as they do
the loss that gathers every leaf up front.

>>> loss = BlockLoss(layout, loss_fn, policy=policy, scaling=NoScaling(), check_loss=check,
...                  cap=cap, distributed=False)
>>> grads = Plain(Inputs(layout, cap), loss, Reduction(layout, ...), differentiator(eager=False),
...               dtype=torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import optree

from fsharded import _tree
from fsharded.parallel import zero3
from fsharded.parallel.blocks import handling
from fsharded.spmd import _manifest
from fsharded.step._differentiate import LocalLoss
from fsharded.step._layout import Layout

__all__ = ["BlockLoss", "gathers_blocks"]


def gathers_blocks(layout: Layout) -> bool:
    """Whether some leaf of the layout's block list is gathered inside the loss (so the
    loss runs its blocks through this module's handler)."""
    mask = layout.block_mask or ()
    return any(b and g for b, g in zip(mask, layout.moves.gather_in_loss))


class BlockLoss(LocalLoss):
    """The local loss with the block list's leaves gathered at their ``run_block``.
    ``distributed``: real ranks with plain autograd (prefetch, overlapped reduce-scatters;
    not on the schedule check's dry run)."""

    def __init__(self, layout: Layout, loss_fn: Callable, *, distributed: bool, **kw: Any) -> None:
        mask = layout.block_mask
        # The block list's leaves stay in their params layout until their run_block.
        super().__init__(layout, loss_fn, to=[p if b else u for p, u, b in zip(layout.params, layout.use, mask)],
                         **kw)
        self.layout, self.cap, self.distributed = layout, kw["cap"], distributed
        self.specs = [(p, u) if b else None for p, u, b in zip(layout.params, layout.use, mask)]
        # The block leaves reach their run_block in the master dtype: the gather casts them
        # to the compute dtype before they travel, and its transpose reduce-scatters their
        # gradients in the policy's reduce dtype (fp32 under bf16: as the other stages do).
        self.uncast = [b and g for b, g in zip(mask, layout.moves.gather_in_loss)]
        self.cold = list(layout.frozen or [False] * len(mask))
        self._prefetch = None  # this call's (real ranks)

    def running(self, p: Any) -> Any:
        handler, remats = self._handler(p)
        if self.remat is not None:  # the policy's choice, inside ZeRO-3's gathers (not twice)
            handler = self.remat.handler(handler, done=remats)
        return handling(handler)

    def drain(self) -> None:
        """Wait for the gathers a stopped forward left in flight (every rank stopped at the
        same collective, so every rank waits for the same ones)."""
        pf, self._prefetch = self._prefetch, None
        if pf is not None:
            for g in (*pf.pending.values(), *pf.backward.values()):
                g.wait()
            pf.drain_reads()

    def backward_ctx(self) -> Any:
        """Real ranks: the block's reduce-scatters are issued without waiting in backward
        and all complete when it ends."""
        if self.distributed and not _manifest.dry():
            return zero3.overlapped_backward()
        return contextlib.nullcontext()

    def _handler(self, p: Any) -> tuple[Callable, Callable[[Any], bool]]:
        """The run_block handler for this call's leaves (identified by their ids), and
        whether it recomputes a block (params) in backward itself (a remat of the block:
        under torch.func, re-gathering after the forward)."""
        lay = self.layout
        leaves = optree.tree_leaves(p)
        specs_of = {id(x): s for x, s in zip(leaves, self.specs) if s is not None}
        frozen = {id(x) for x, c in zip(leaves, self.cold) if c}
        blocks = _tree.get_path(p, lay.blocks)
        dtype, reduce_dtype = self.policy.compute_dtype, self.policy.reduce_dtype
        prefetch = zero3.Prefetch(blocks, specs_of, lay.axis, lay.mesh, dtype=dtype) \
            if self.distributed and not _manifest.dry() else None
        self._prefetch = prefetch
        # The last block's backward follows its forward at once: keep its weights.
        kept = {id(t) for t in optree.tree_leaves(blocks[-1])}

        def remats(params: Any) -> bool:
            first = optree.tree_leaves(params)
            return lay.reshard and prefetch is None and bool(first) and id(first[0]) not in kept

        return zero3.block_handler(specs_of, lay.axis, lay.mesh, self.cap, prefetch, lay.reshard, kept,
                                   frozen=frozen, dtype=dtype, reduce_dtype=reduce_dtype), remats
