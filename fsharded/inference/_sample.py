"""Choosing the next token from logits: greedy, or drawn with an explicit key after
temperature, top-k and top-p (nucleus) filtering, as JAX samples: the Gumbel-max trick
on ``fsharded.random`` draws, so a key gives the same tokens on every backend."""

from __future__ import annotations

import math

import torch

from fsharded import random as R

__all__ = ["sample", "check_sampling"]


def check_sampling(temperature: float, top_k: int | None, top_p: float | None, op: str = "sample") -> None:
    """A clear error for settings ``sample`` cannot take."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{op}: temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{op}: top_k must be an integer >= 1, got {top_k!r}")
    if top_p is not None and (not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):  # (NaN fails too)
        raise ValueError(f"{op}: top_p must be in (0, 1], got {top_p!r}")


def sample(logits: torch.Tensor, key: torch.Tensor | None = None, *, temperature: float = 1.0,
           top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """The next token of each row of ``logits`` ``(B, V)``: the argmax where ``key`` is None
    or ``temperature`` is 0, else drawn from ``softmax(logits / temperature)`` restricted to
    the ``top_k`` most likely tokens and to the smallest set whose probability reaches
    ``top_p`` (at least one token kept)."""
    if logits.dim() != 2:
        raise ValueError(f"sample: logits must be (B, V), got {tuple(logits.shape)}")
    check_sampling(temperature, top_k, top_p)
    if key is None or temperature == 0:
        return logits.argmax(dim=-1)
    x = logits.float() / temperature
    if top_k is not None and top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        s, order = x.sort(dim=-1, descending=True)
        probs = s.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # the probability of the tokens ranked above
        drop = before >= top_p  # (the first token is always kept: nothing is above it)
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    u = R.uniform(key, tuple(x.shape), dtype=torch.float32)
    tiny = torch.finfo(torch.float32).tiny
    gumbel = -torch.log(-torch.log(u.clamp(tiny, 1.0 - 2 ** -24)))
    return (x + gumbel).argmax(dim=-1)
