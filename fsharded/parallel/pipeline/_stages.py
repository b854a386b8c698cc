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
from typing import Any

import optree
import torch

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
    ``last_keys``: the top-level parameter keys ``first`` and ``last`` read; ``blocks``:
    the key of the block list; ``ranges[s]``: the blocks of stage ``s``."""

    first: Callable[[Any, Any], torch.Tensor]
    block: Callable[..., torch.Tensor]
    last: Callable[[Any, torch.Tensor, Any], torch.Tensor]
    first_keys: tuple[str, ...]
    last_keys: tuple[str, ...]
    ranges: tuple[range, ...]
    blocks: str = "blocks"

    @property
    def n(self) -> int:
        return len(self.ranges)

    def check(self, params: Any) -> None:
        """That ``params`` is the tree these stages were cut for."""
        if not isinstance(params, dict) or self.blocks not in params:
            raise ValueError(f"pipeline: the parameters have no block list {self.blocks!r} to cut into stages "
                             f"(top-level keys: {sorted(params) if isinstance(params, dict) else type(params).__name__}); "
                             f"a pipe axis needs a model that runs its blocks from a list")
        have = len(params[self.blocks])
        if self.ranges[-1].stop != have:
            raise ValueError(f"pipeline: the stages were cut for {self.ranges[-1].stop} blocks, the parameters "
                             f"have {have}")
        missing = [k for k in (*self.first_keys, *self.last_keys) if k not in params]
        if missing:
            raise ValueError(f"pipeline: the parameters have no {missing} (the first / last stage's)")

    def keys(self, s: int) -> tuple[str, ...]:
        """The top-level keys stage ``s`` holds besides its blocks."""
        ks = (self.first_keys if s == 0 else ()) + (self.last_keys if s == self.n - 1 else ())
        return tuple(dict.fromkeys(ks))

    def params_of(self, params: dict, s: int) -> dict:
        """Stage ``s``'s part of ``params``: its keys and its run of blocks."""
        out = {k: params[k] for k in self.keys(s)}
        out[self.blocks] = [params[self.blocks][i] for i in self.ranges[s]]
        return out

    def merge(self, parts: dict[int, dict], like: dict) -> dict:
        """The whole tree (``like``'s keys) from the stages' parts: blocks in order, a key
        held by two stages (tied embeddings) summed, and zeros (shaped as in ``like``) for
        what no part holds (the stages of other ranks)."""
        out: dict = {}
        blocks: list = [None] * len(like[self.blocks])
        for s, part in sorted(parts.items()):
            for i, b in zip(self.ranges[s], part[self.blocks]):
                blocks[i] = b
            for k in self.keys(s):
                out[k] = part[k] if k not in out else _add(out[k], part[k])
        zeros = lambda t: optree.tree_map(torch.zeros_like, t)  # noqa: E731
        out[self.blocks] = [zeros(like[self.blocks][i]) if b is None else b for i, b in enumerate(blocks)]
        return {k: out[k] if k in out else zeros(like[k]) for k in like}

    def forward(self, s: int, params: dict, x: Any, batch: Any) -> torch.Tensor:
        """Stage ``s`` on its part of the parameters: from the batch (the first stage) or
        the previous stage's activation ``x``, to the next stage's activation or (the last
        stage) the loss."""
        if s == 0:
            x = self.first(params, batch)
        for p in params[self.blocks]:
            x = run_block(self.block, p, x)
        if s == self.n - 1:
            return self.last(params, x, batch)
        return x


def _add(a: Any, b: Any) -> Any:
    return optree.tree_map(lambda u, v: u + v, a, b)
