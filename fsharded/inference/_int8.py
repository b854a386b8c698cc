"""Int8 weight-only generation: the GPT's projections stored as int8 with fp32 scales and
multiplied by ``kernels.int8_matmul`` (the weights dequantized inside the product).

``quantize(params, group_size=None, dtype=None)`` returns the tree with every
projection of the blocks (attention ``wq``, ``wk``, ``wv``, ``wo``; the dense MLP's
``w_in``/``w_out`` or ``w_gate``/``w_up``/``w_down``) and the output head as an
``Int8Weight``; the embedding, norms, biases and a mixture of experts' weights stay
floating (cast to ``dtype`` where given). A tied head gets an int8 copy of the embedding
as ``params["head"]``, so decoding reads int8 for the logits too. ``w.matmul(x)`` (and
``x @ w``) is the int8 product.

``quantize(model)`` of a module (a Hugging Face causal LM) returns a copy whose linear
layers (``nn.Linear``, and transformers' ``Conv1D`` of GPT-2) are ``Int8Linear``: int8
weights and fp32 scales as buffers, the same product in ``forward``; its embeddings and
norms stay floating. ``generate``, the ``Engine`` and transformers' own ``generate`` run
it as they run the model.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import optree
import torch
from torch import nn

from fsharded.kernels import weight_int8
from fsharded.kernels.weight_int8 import dequantize_weight, int8_matmul, quantize_weight

__all__ = ["Int8Weight", "Int8Linear", "quantize"]

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


class Int8Linear(nn.Module):
    """A linear layer with int8 weights: ``y = x @ dequantize(q, scales) + bias`` through
    ``int8_matmul`` (``q`` ``(out, in)`` int8, ``scales`` ``(out, in // group_size)``
    fp32, as buffers; ``bias`` in the model's dtype). For inference: no gradient."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("q", q)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        weight_int8.prepare(q)

    @classmethod
    def of(cls, layer: nn.Module, group_size: int | None = None) -> Int8Linear:
        """From an ``nn.Linear`` (weight ``(out, in)``) or a transformers ``Conv1D``
        (weight ``(in, out)``)."""
        w = layer.weight.detach()
        q, scales = quantize_weight((w.T if isinstance(layer, nn.Linear) else w).float(), group_size)
        return cls(q, scales, layer.bias)

    @property
    def group_size(self) -> int:
        return self.in_features // self.scales.shape[1]

    def _apply(self, fn: Any, recurse: bool = True) -> Int8Linear:
        # A cast of the model (.to(torch.bfloat16), .half()) casts the bias; the scales stay
        # fp32, as the product takes them (a device move still moves them).
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float32:
            self.scales = self.scales.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = int8_matmul(x, self.q, self.scales)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


def _linear(m: nn.Module) -> bool:
    if isinstance(m, nn.Linear):
        return True
    return type(m).__name__ == "Conv1D" and type(m).__module__.startswith("transformers.") and m.weight.dim() == 2


def _quantize_module(model: nn.Module, group_size: int | None, dtype: torch.dtype | None, inplace: bool) -> nn.Module:
    out = model if inplace else copy.deepcopy(model)
    found = []
    for name, m in list(out.named_modules()):
        for child_name, child in list(m.named_children()):
            if _linear(child):
                path = f"{name}.{child_name}" if name else child_name
                K = child.weight.shape[1] if isinstance(child, nn.Linear) else child.weight.shape[0]
                if group_size is not None and K % group_size:
                    raise ValueError(f"quantize: group_size {group_size} does not divide the {K} input features of "
                                     f"{path}; give a group size that divides every layer's inputs")
                setattr(m, child_name, Int8Linear.of(child, group_size))
                found.append(path)
    if not found:
        raise ValueError(f"quantize: {type(model).__name__} has no nn.Linear (or transformers Conv1D) layer to "
                         f"quantize")
    if dtype is not None:  # (after quantizing: the int8 weights come from the weights as given)
        out = out.to(dtype)
    return out.requires_grad_(False).eval()


def quantize(params: Any, group_size: int | None = None, dtype: torch.dtype | None = None, *,
             tensor: int = 1, inplace: bool = False) -> Any:
    """``params`` (a GPT's tree) with its projections and head as ``Int8Weight`` (a scale
    per output channel, or per ``group_size`` input features), the rest cast to ``dtype``.

    ``params`` may instead be a module (a Hugging Face causal LM): a copy of it (the model
    itself with ``inplace=True``) with every ``nn.Linear`` and transformers ``Conv1D`` an
    ``Int8Linear`` quantized from the weights as given, the output head included (an int8
    copy of a tied embedding), then the rest cast to ``dtype``; for inference (nothing
    requires grad), on one device.

    ``tensor``: the tensor-parallel size the tree will be decoded on. The row-parallel
    projections (``wo``, ``w_out``, ``w_down``: their input features split over it) then
    take a scale per output channel per shard (groups of ``K / tensor`` inputs) where
    ``group_size`` is None, and a ``group_size`` must divide ``K / tensor``: each shard's
    weights and scales are then its slice of the whole, and quantizing each rank's shard
    alone (``tensor=1`` on it) gives the same numbers."""
    if tensor < 1:
        raise ValueError(f"quantize: tensor must be >= 1, got {tensor}")
    if isinstance(params, nn.Module):
        if tensor != 1:
            raise NotImplementedError("quantize: int8 layers of a module decode on one device; tensor= is for the "
                                      "bundled GPT's tree")
        return _quantize_module(params, group_size, dtype, inplace)

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
