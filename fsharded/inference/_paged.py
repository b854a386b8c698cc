"""A paged key/value cache: fixed-size pages of token slots shared by all sequences, a
page table per sequence, so memory follows the live tokens.

``PagedKVCache(layers, kv_heads, head_dim, pages, page_size)`` (``for_model(params, ...)``
for the GPT's) holds, per layer, ``k[i]`` and ``v[i]`` of shape ``(pages * page_size, KV, Dh)``: slot ``s`` of page ``p`` is row ``p * page_size + s``. A
sequence (``seq``) owns a list of pages (``table[seq]``) and a length; its token ``j`` is
in row ``table[seq][j // page_size] * page_size + j % page_size``. ``reserve(seq, n)``
takes pages from the free list so that ``n`` more tokens fit (or says it cannot),
``release(seq)`` gives them back.
"""

from __future__ import annotations

import torch

from fsharded.inference._stream import block_meta

__all__ = ["PagedKVCache"]


class PagedKVCache:
    """Pages of key/value slots for every layer; see the module docstring."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, pages: int, page_size: int = 16, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        if pages < 1 or page_size < 1:
            raise ValueError(f"PagedKVCache: pages ({pages}) and page_size ({page_size}) must be >= 1")
        self.page_size, self.pages = int(page_size), int(pages)
        shape = (self.pages * self.page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.free: list[int] = list(range(self.pages - 1, -1, -1))  # popped from the end: page 0 first
        self.table: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}
        self._rows: dict[int, torch.Tensor] = {}  # each sequence's rows, slot by slot, for its pages
        self._offsets = torch.arange(self.page_size)

    @classmethod
    def for_model(cls, params: dict, pages: int, page_size: int = 16, *,
                  dtype: torch.dtype | None = None) -> PagedKVCache:
        """A cache for the bundled GPT's ``params`` (its layers and key/value heads), in
        ``dtype`` (default: the embedding's)."""
        meta = block_meta(params)
        wk = meta[0]["attn"]["wk"]  # (D, KV, Dh)
        emb = params["emb"]
        return cls(len(meta), wk.shape[1], wk.shape[2], pages, page_size, dtype=dtype or emb.dtype, device=emb.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def pages_used(self) -> int:
        return self.pages - len(self.free)

    def pages_for(self, seq: int, n: int) -> int:
        """Pages ``seq`` needs beyond its own for ``n`` more tokens."""
        have = len(self.table.get(seq, ()))
        need = -(-(self.length.get(seq, 0) + n) // self.page_size)
        return max(0, need - have)

    def reserve(self, seq: int, n: int) -> bool:
        """Make room for ``n`` more tokens of ``seq`` (a new one starts empty); False, taking
        nothing, where the free pages do not suffice."""
        more = self.pages_for(seq, n)
        if more > len(self.free):
            return False
        self.table.setdefault(seq, [])
        self.length.setdefault(seq, 0)
        new = [self.free.pop() for _ in range(more)]
        self.table[seq].extend(new)
        if new or seq not in self._rows:
            added = (torch.tensor(new, dtype=torch.int64)[:, None] * self.page_size + self._offsets).reshape(-1)
            self._rows[seq] = torch.cat([self._rows[seq], added]) if seq in self._rows else added
        return True

    def release(self, seq: int) -> None:
        """``seq``'s pages back to the free list."""
        self.free.extend(reversed(self.table.pop(seq, [])))
        self.length.pop(seq, None)
        self._rows.pop(seq, None)

    def rows(self, seq: int, start: int, stop: int) -> torch.Tensor:
        """The cache rows of tokens ``start..stop-1`` of ``seq``."""
        if stop > len(self._rows.get(seq, ())):
            raise IndexError(f"PagedKVCache: sequence {seq} holds {len(self._rows.get(seq, ()))} slots, not {stop}")
        return self._rows[seq][start:stop]
