"""What every sequence-parallel strategy shares: which global positions a shard holds.

A sequence sharded over a mesh axis of size ``n`` is held in one of two layouts:

- ``"contiguous"``: shard ``i`` holds tokens ``[i * T/n, (i + 1) * T/n)`` (Ulysses, and
  ring attention without load balancing);
- ``"zigzag"``: the sequence is cut into ``2n`` chunks and shard ``i`` holds chunks ``i``
  and ``2n - 1 - i``, so every shard has as many early (cheap under a causal mask) as late
  (expensive) queries: ring attention's causal load balance. The batch is put in this
  order before it is sharded (``zigzag``), and model outputs back with ``unzigzag``; a
  mean loss over tokens needs no inverse (inputs and targets move together).

Positions are computed from ``axis_index`` inside ``shard_map`` (a value that varies over
the axis), so learned and rotary position embeddings get each shard's true offsets.
"""

from __future__ import annotations

import torch

from fsharded.spmd.collectives import axis_index, axis_size, is_bound

__all__ = ["LAYOUTS", "positions", "positions_of", "zigzag", "unzigzag", "check_layout"]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> None:
    """Refuse a layout that is not one of ``LAYOUTS``, naming them."""
    if layout not in LAYOUTS:
        raise ValueError(f"sequence layout must be one of {LAYOUTS}, got {layout!r}")


def positions(length: int, axis: str | None, layout: str = "contiguous", *,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions (int64, ``(length,)``) of the ``length`` tokens this shard
    holds along ``axis`` (unsharded, or outside shard_map: ``arange(length)``)."""
    check_layout(layout)
    local = torch.arange(length, device=device)
    if axis is None or not is_bound(axis) or axis_size(axis) == 1:
        return local
    return positions_of(length, axis_index(axis).to(local.device), axis_size(axis), layout)


def positions_of(length: int, index: torch.Tensor, n: int, layout: str = "contiguous") -> torch.Tensor:
    """The global positions of the ``length`` tokens shard ``index`` (an int64 scalar
    tensor, possibly varying over an axis) of ``n`` holds in ``layout``."""
    check_layout(layout)
    local = torch.arange(length, device=index.device)
    if layout == "contiguous":
        return index * length + local
    if length % 2:
        raise ValueError(f"zigzag layout: each shard holds two equal chunks, but its sequence "
                         f"length {length} is odd (the global length must divide by 2 x {n})")
    c = length // 2
    first = local[:c]
    return torch.cat([index * c + first, (2 * n - 1 - index) * c + first])


def _order(length: int, n: int) -> list[int]:
    if length % (2 * n):
        raise ValueError(f"zigzag over {n} shards cuts the sequence into {2 * n} chunks: its length "
                         f"{length} does not divide by {2 * n}")
    c = length // (2 * n)
    chunks = [j for i in range(n) for j in (i, 2 * n - 1 - i)]
    return [j * c + t for j in chunks for t in range(c)]


def zigzag(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """Reorder the (global, unsharded) sequence dim ``dim`` so that sharding it
    contiguously over ``n`` shards gives each shard chunks ``i`` and ``2n - 1 - i``."""
    if n == 1:
        return x
    return x.index_select(dim, torch.tensor(_order(x.shape[dim], n), device=x.device))


def unzigzag(x: torch.Tensor, n: int, dim: int = 1) -> torch.Tensor:
    """The inverse of ``zigzag``: the sequence back in order."""
    if n == 1:
        return x
    order = _order(x.shape[dim], n)
    inverse = [0] * len(order)
    for k, j in enumerate(order):
        inverse[j] = k
    return x.index_select(dim, torch.tensor(inverse, device=x.device))
