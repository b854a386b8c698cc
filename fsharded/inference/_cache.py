"""A static key/value cache for the bundled GPT: one preallocated buffer per layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsharded.inference._stream import block_meta

__all__ = ["KVCache"]


@dataclass
class KVCache:
    """Keys and values of every layer, ``k[i]`` and ``v[i]`` of shape ``(B, S, KV, Dh)``
    (``S`` slots per row), of which the first ``length`` are filled. Prompts of different
    lengths sit right-aligned (left-padded): row ``b``'s own tokens start at slot
    ``start[b]``; the slots before it are padding, never attended to. The token in slot
    ``j`` of row ``b`` is at position ``j - start[b]`` of its sequence."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    start: torch.Tensor
    length: int = 0

    @classmethod
    def empty(cls, params: dict, batch: int, slots: int, *, start: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache for ``params`` (a GPT's tree) holding ``slots`` tokens per row of
        ``batch``, in ``dtype`` (default: the embedding's)."""
        k, v = [], []
        emb = params["emb"]  # the activations' dtype (the projections may be int8)
        for p in block_meta(params):
            wk = p["attn"]["wk"]  # (D, KV, Dh)
            shape = (batch, slots, wk.shape[1], wk.shape[2])
            k.append(torch.zeros(shape, dtype=dtype or emb.dtype, device=emb.device))
            v.append(torch.zeros(shape, dtype=dtype or emb.dtype, device=emb.device))
        start = torch.zeros(batch, dtype=torch.int64) if start is None else start.to(torch.int64)
        return cls(k, v, start, 0)

    @property
    def slots(self) -> int:
        return self.k[0].shape[1] if self.k else 0

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))
