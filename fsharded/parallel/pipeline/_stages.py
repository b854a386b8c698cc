"""A model cut into pipeline stages.

A model that runs its blocks in a list (``params["blocks"]``, each through ``run_block``)
is three functions: ``first(params, batch) -> x`` (the embeddings), ``block(p, x) -> x``
and ``last(params, x, batch) -> loss`` (final norm, head and loss). ``Stages`` holds
them with the block list cut into contiguous runs, one per pipeline stage: the first
stage also runs ``first`` and holds its parameters, the last also runs ``last``. A
parameter both ends read (tied embeddings) is held by both; its gradient is the sum of
the two stages' (``Stages.merge``).

>>> cut([1, 1, 1, 1, 1, 1], 3)
(range(0, 2), range(2, 4), range(4, 6))
>>> cut([4, 1, 1, 1, 1], 2)                  # balanced by size
(range(0, 1), range(1, 5))
>>> cut([1, 1, 1, 1], 2, boundaries=[1])     # or where you say
(range(0, 1), range(1, 4))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import optree
import torch

from fsharded import _tree
from fsharded.parallel.blocks import run_block

__all__ = ["cut", "Stages"]


def cut(sizes: Sequence[int], stages: int, *, boundaries: Sequence[int] | None = None,
        first: int = 0, last: int = 0) -> tuple[range, ...]:
    """The blocks ``0 .. len(sizes) - 1`` in ``stages`` contiguous runs, each of at least
    one block: at ``boundaries`` (the first block of every stage but the first), or else
    the cut whose largest stage is smallest, a stage's size being its blocks' ``sizes``
    (parameter counts) plus ``first`` on the first stage and ``last`` on the last (the
    embeddings and the head they hold)."""
    n = len(sizes)
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"pipeline stages must be a positive int, got {stages!r}")
    if stages > n:
        raise ValueError(f"{stages} pipeline stages (pipe x virtual stages) but the model has {n} blocks: "
                         f"each stage needs at least one block; use at most {n} stages")
    if boundaries is not None:
        b = [int(x) for x in boundaries]
        if len(b) != stages - 1 or any(not 0 < x < n for x in b) or b != sorted(set(b)):
            raise ValueError(f"pipeline boundaries {list(boundaries)}: give {stages - 1} increasing block indices "
                             f"in 1 .. {n - 1}, the first block of each stage after the first")
        edges = [0, *b, n]
        return tuple(range(edges[i], edges[i + 1]) for i in range(stages))
    pre = [0]
    for s in sizes:
        pre.append(pre[-1] + int(s))

    def cost(i: int, j: int, k: int) -> int:  # blocks i..j-1 as stage k
        return pre[j] - pre[i] + (first if k == 0 else 0) + (last if k == stages - 1 else 0)

    # best[k][j]: the smallest largest stage when blocks 0..j-1 form stages 0..k.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages)]
    arg = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, j, 0)
    for k in range(1, stages):
        for j in range(k + 1, n + 1):
            for i in range(k, j):  # the last stage of these: blocks i..j-1
                c = max(best[k - 1][i], cost(i, j, k))
                if c < best[k][j]:
                    best[k][j], arg[k][j] = c, i
    edges = [n]
    for k in range(stages - 1, 0, -1):
        edges.append(arg[k][edges[-1]])
    edges.append(0)
    edges.reverse()
    return tuple(range(edges[i], edges[i + 1]) for i in range(stages))


@dataclass(frozen=True)
class Stages:
    """A model as pipeline stages (see the module's docstring). ``first_keys`` and
    ``last_keys``: the parameters ``first`` and ``last`` read, as dotted paths of subtrees
    or leaves (``"emb"``, ``"model.norm.weight"``); ``blocks``: the dotted path of the block
    list; ``ranges[s]``: the blocks of stage ``s``. A stage's part of the parameters
    (``params_of``) is a flat dict: ``{blocks: [its blocks], path: subtree, ...}``."""

    first: Callable[[Any, Any], torch.Tensor]
    block: Callable[..., torch.Tensor]
    last: Callable[[Any, torch.Tensor, Any], torch.Tensor]
    first_keys: tuple[str, ...]
    last_keys: tuple[str, ...]
    ranges: tuple[range, ...]
    blocks: str = "blocks"
    # The metrics the stages report beside the loss (train_step's (loss, metrics)): each a
    # sum over the stages of 0-d values per micro-batch, meant over the micro-batches.
    metrics: tuple[str, ...] = ()
    # A model state the blocks read (train_step's update_model_state: aux-loss-free routing
    # biases): ``block_state(model_state, i)`` the keyword arguments block ``i`` takes from
    # it; the blocks then report their stats among their metrics (names not in
    # ``metrics``), and ``stats(model_state, reported)`` makes the stats tree
    # ``update_model_state`` takes from them (zeros for what ``reported`` lacks: the
    # blocks of other pipe ranks).
    block_state: Callable[[Any, int], dict] | None = None
    stats: Callable[[Any, dict], Any] | None = None
    # Whether stage ``s``'s forward runs the model from its start (skipping the earlier
    # stages' blocks), so it makes the earlier stages' random draws again (``ModuleStages``);
    # else it makes its own only, and its draws follow where the stage before stopped.
    replays: ClassVar[bool] = False

    @property
    def n(self) -> int:
        return len(self.ranges)

    def keys(self, s: int) -> tuple[str, ...]:
        """The paths stage ``s`` holds besides its blocks."""
        ks = (self.first_keys if s == 0 else ()) + (self.last_keys if s == self.n - 1 else ())
        return tuple(dict.fromkeys(ks))

    def params_of(self, params: Any, s: int) -> dict:
        """Stage ``s``'s part of ``params``: its paths and its run of blocks."""
        out = {k: _tree.get_path(params, k) for k in self.keys(s)}
        blocks = _tree.get_path(params, self.blocks)
        out[self.blocks] = [blocks[i] for i in self.ranges[s]]
        return out

    def holders(self, paths: Sequence[str]) -> list[frozenset[int]]:
        """Per parameter leaf (by its dotted path), the stages that hold it: one for a
        block's leaf, the first and the last for a tied embedding, none for a leaf no stage
        reads."""
        out = []
        for p in paths:
            held = set()
            for s in range(self.n):
                if any(p.startswith(f"{self.blocks}.{i}.") for i in self.ranges[s]) or \
                        any(p == k or p.startswith(k + ".") for k in self.keys(s)):
                    held.add(s)
            out.append(frozenset(held))
        return out

    def merge(self, parts: dict[int, dict], like: Any) -> Any:
        """The whole tree (shaped as ``like``) from the stages' parts: blocks in order, a
        path held by two stages (tied embeddings) summed, and zeros for what no part holds
        (the stages of other ranks: a zero broadcast to the shape, which allocates nothing)."""
        got: dict[str, torch.Tensor] = {}
        for s, part in sorted(parts.items()):
            for i, b in zip(self.ranges[s], part[self.blocks]):
                _put(got, f"{self.blocks}.{i}", b)
            for k in self.keys(s):
                _put(got, k, part[k])
        paths, leaves, tdef = _tree.tree_flatten_with_paths(like)
        return optree.tree_unflatten(tdef, [got[p] if p in got else x.new_zeros(()).expand(x.shape)
                                            for p, x in zip(paths, leaves)])

    def forward(self, s: int, params: dict, x: Any, batch: Any, state: Any = None) -> Any:
        """Stage ``s`` on its part of the parameters: from the batch (the first stage) or
        the previous stage's activation ``x``, to the next stage's activation or (the last
        stage) the loss; or ``(that, extra, metrics)``. A block may return ``(x, extra)``
        or ``(x, extra, metrics)``: ``extra`` a 0-d term of the loss (a mixture-of-experts
        layer's weighted balancing losses), ``metrics`` a dict of 0-d values named in
        ``self.metrics`` (and, with a model ``state``, its stats); ``last`` may return
        ``(loss, metrics)``. The last stage adds its blocks' extra terms to the loss
        (``extra`` None), another stage returns their sum; ``metrics`` are summed over the
        stage's blocks and its ``last``. ``state``: the model state, each block given its
        part (``block_state``)."""
        if state is not None and self.block_state is None:
            raise ValueError("pipeline: a model state was given, but these Stages read none: give Stages("
                             "..., block_state=, stats=) (gpt_stages.pipeline_stages does for routing biases)")
        if s == 0:
            x = self.first(params, batch)
        extra, metrics = None, {}
        for i, p in zip(self.ranges[s], params[self.blocks]):
            kw = self.block_state(state, i) if state is not None else {}
            x = run_block(self.block, p, x, **kw)
            if isinstance(x, tuple):
                x, e, *m = x
                extra = e if extra is None else extra + e
                _add(metrics, m[0] if m else {})
        if s == self.n - 1:
            loss = self.last(params, x, batch)
            if isinstance(loss, tuple):
                loss, m = loss
                _add(metrics, m)
            loss = loss if extra is None else loss + extra.to(loss.dtype)
            return (loss, None, metrics) if metrics else loss
        return (x, extra, metrics) if extra is not None or metrics else x


def _add(into: dict, metrics: dict) -> None:
    for k, v in metrics.items():
        into[k] = v if k not in into else into[k] + v


def _put(got: dict, prefix: str, tree: Any) -> None:
    """Each leaf of ``tree`` under its dotted path below ``prefix`` (added where one is there)."""
    paths, leaves, _ = _tree.tree_flatten_with_paths(tree)
    for p, x in zip(paths, leaves):
        key = prefix if p == "<root>" else f"{prefix}.{p}"
        got[key] = x if key not in got else got[key] + x
