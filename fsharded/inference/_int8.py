"""Int8 weight-only generation: the GPT's projections stored as int8 with fp32 scales and
multiplied by ``kernels.int8_matmul`` (the weights dequantized inside the product).

``quantize(params, group_size=None, dtype=None)`` returns the tree with every
projection of the blocks (attention ``wq``, ``wk``, ``wv``, ``wo``; the dense MLP's
``w_in``/``w_out`` or ``w_gate``/``w_up``/``w_down``) and the output head as an
``Int8Weight``; the embedding, norms, biases and a mixture of experts' weights stay
floating (cast to ``dtype`` where given). A tied head gets an int8 copy of the embedding
as ``params["head"]``, so decoding reads int8 for the logits too. ``w.matmul(x)`` (and
``x @ w``) is the int8 product.
"""

from __future__ import annotations

import math
from typing import Any

import optree
import torch

from fsharded.kernels import weight_int8
from fsharded.kernels.weight_int8 import dequantize_weight, int8_matmul, quantize_weight

__all__ = ["Int8Weight", "quantize"]

_ATTN = ("wq", "wk", "wv", "wo")
_MLP = ("w_in", "w_out", "w_gate", "w_up", "w_down")


class Int8Weight:
    """A weight of shape ``shape`` whose first ``inputs`` dims are the input features:
    ``q`` ``(N, K)`` int8 and ``scales`` ``(N, K // group_size)`` fp32
    (``kernels.int8_matmul.quantize_weight`` of it viewed as ``(K, N)``). A leaf of the
    parameter tree (not a pytree node: a cast of the tree leaves it as it is)."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], inputs: int = 1) -> None:
        self.q, self.scales, self.shape, self.inputs = q, scales, tuple(shape), int(inputs)
        weight_int8.prepare(q)

    @classmethod
    def of(cls, w: torch.Tensor, inputs: int = 1, group_size: int | None = None) -> Int8Weight:
        K = math.prod(w.shape[:inputs])
        q, scales = quantize_weight(w.detach().reshape(K, -1).float(), group_size)
        return cls(q, scales, tuple(w.shape), inputs)

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scales.shape[1]

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.scales.numel() * 4

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ w``: ``x`` ``(..., *shape[:inputs])`` -> ``(..., *shape[inputs:])``."""
        lead = x.shape[:x.dim() - self.inputs]
        y = int8_matmul(x.reshape(*lead, self.q.shape[1]), self.q, self.scales)
        return y.view(*lead, *self.shape[self.inputs:])

    def __rmatmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_weight(self.q, self.scales, dtype).reshape(self.shape)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def __repr__(self) -> str:
        return f"Int8Weight(shape={self.shape}, group_size={self.group_size})"


def quantize(params: dict, group_size: int | None = None, dtype: torch.dtype | None = None, *,
             tensor: int = 1) -> dict:
    """``params`` (a GPT's tree) with its projections and head as ``Int8Weight`` (a scale
    per output channel, or per ``group_size`` input features), the rest cast to ``dtype``.

    ``tensor``: the tensor-parallel size the tree will be decoded on. The row-parallel
    projections (``wo``, ``w_out``, ``w_down``: their input features split over it) then
    take a scale per output channel per shard (groups of ``K / tensor`` inputs) where
    ``group_size`` is None, and a ``group_size`` must divide ``K / tensor``: each shard's
    weights and scales are then its slice of the whole, and quantizing each rank's shard
    alone (``tensor=1`` on it) gives the same numbers."""
    if tensor < 1:
        raise ValueError(f"quantize: tensor must be >= 1, got {tensor}")

    def cast(x: Any) -> Any:
        return x.to(dtype) if dtype is not None and isinstance(x, torch.Tensor) and x.is_floating_point() else x

    def of(w: torch.Tensor, inputs: int, path: str, row_parallel: bool) -> Int8Weight:
        g = group_size
        if row_parallel and tensor > 1:
            K = math.prod(w.shape[:inputs])
            if K % tensor:
                raise ValueError(f"quantize: {path} has {K} input features, which tensor={tensor} does not divide")
            if g is None:
                g = K // tensor
            elif (K // tensor) % g:
                raise ValueError(f"quantize: group_size {g} does not divide the {K // tensor} input features of "
                                 f"{path} on each of tensor={tensor} shards; give a group size that divides them")
        return Int8Weight.of(w, inputs, g)

    out = {k: optree.tree_map(cast, v) for k, v in params.items() if k != "blocks"}
    blocks = []
    for i, p in enumerate(params["blocks"]):
        a = dict(p["attn"])
        for k in _ATTN:
            a[k] = of(a[k], 2 if k == "wo" else 1, f"blocks.{i}.attn.{k}", k == "wo")
        mlp = dict(p["mlp"])
        if "router" not in mlp:  # the experts stay floating
            for k in _MLP:
                if k in mlp:
                    mlp[k] = of(mlp[k], 1, f"blocks.{i}.mlp.{k}", k in ("w_out", "w_down"))
        blocks.append(optree.tree_map(cast, {**p, "attn": a, "mlp": mlp}))
    out["blocks"] = blocks
    out["head"] = Int8Weight.of(params["head"] if "head" in params else params["emb"].T, 1, group_size)
    return out
