"""Continuous batching: requests join and leave the running batch between steps, prompt
chunks are mixed with decodes in one forward (Dynamic SplitFuse), and a paged cache holds
the live tokens.

Each ``Engine.step()`` builds one batch of at most ``max_batch_tokens`` tokens: first one
token for every running request that is decoding, then chunks of the prompts waiting to
be prefilled, in arrival order, a prompt split across steps where the budget ends inside
it. The batch runs as one forward over all its tokens (the projections and MLPs on every
token at once; each chunk attends over its own sequence's pages). A prompt's last chunk
gives its first new token, each decode token the next. A request ends at one of its
``stop_tokens`` (kept) or after ``max_new_tokens``, and its pages are freed at once.

Pages are taken when tokens are written. A request is admitted where the free pages hold
its context and ``reserve`` (default 0.5) of the new tokens it may still produce, over
what the running requests still need by the same count: ``reserve=1`` admits only what can
run to its end, ``reserve=0`` admits as soon as its first prompt chunk fits, as vLLM does. Where a
decode finds no free page, the request admitted last is preempted: its pages are freed and it waits at the head of the queue to
be prefilled again from its prompt and the tokens it has produced (which it keeps), as
vLLM's recompute preemption does. A request that could never fit the cache is refused
when it is added.

With ``mesh`` (a ``tensor`` axis) each step runs inside a ``shard_map``: the heads and
hidden units split over it (the GPT's training plan, or fsharded's tensor-parallel plan
for a Hugging Face Llama or GPT-2), each device's pages holding its heads; the batch and
the scheduling are the same on every device, and so are the tokens.

Each request samples with its own key, ``fold_in(key, n)`` for its ``n``-th token (greedy
without a key): the draws ``generate`` makes for that prompt alone.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsharded import random as R
from fsharded.inference._gpt import _attention, forward
from fsharded.inference._hf import HFDecoder
from fsharded.inference._paged import PagedKVCache
from fsharded.inference._sample import check_sampling, sample
from fsharded.inference._sharded import GPTOnMesh, HFOnMesh
from fsharded.inference._stream import block_meta
from fsharded.mesh import Mesh
from fsharded.models._gpt_config import MoEConfig
from fsharded.step._estimate import available_memory

__all__ = ["Engine", "Request", "Event"]


@dataclass
class Request:
    """A request's settings and progress: ``tokens`` the new tokens so far, ``finished``
    (and ``stopped``: on a stop token), ``prefilled`` how many of ``context`` are in the
    cache."""

    id: int
    prompt: list[int]
    max_new_tokens: int
    key: torch.Tensor | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    stop_tokens: frozenset[int] = frozenset()
    tokens: list[int] = field(default_factory=list)
    prefilled: int = 0
    finished: bool = False
    stopped: bool = False
    added_s: float = 0.0
    first_token_s: float | None = None
    finished_s: float | None = None

    @property
    def context(self) -> list[int]:
        """The tokens the cache must hold before the next one is drawn: the prompt and
        every token produced (the last one is fed by the next decode)."""
        return self.prompt + self.tokens


@dataclass(frozen=True)
class Event:
    """A token produced by ``step``: request ``id``, the ``token``, and whether it ended
    the request."""

    id: int
    token: int
    finished: bool


class Engine:
    """Continuous batching over a paged cache for the bundled GPT's ``params``, or a
    Hugging Face causal LM (as ``generate`` takes one).

    ``max_batch_tokens``: the tokens one step runs (decodes and prompt chunks together);
    ``max_seqs``: the requests running at once; ``pages`` of ``page_size`` slots: the cache
    (default: room for ``max_seqs`` sequences of the model's learned positions, or of
    2,048 tokens with rotary positions, within half the memory available: ``cache_note``
    says where that cut it); ``reserve``: the share of each request's remaining
    new tokens its admission counts on (see the module docstring)."""

    def __init__(self, params: Any, *, max_batch_tokens: int = 256, max_seqs: int = 32, page_size: int = 16,
                 pages: int | None = None, moe: MoEConfig | None = None, model_state: Any = None,
                 cache_dtype: torch.dtype | None = None, mesh: Mesh | None = None, reserve: float = 0.5) -> None:
        if max_batch_tokens < 1 or max_seqs < 1 or page_size < 1 or (pages is not None and pages < 1):
            raise ValueError(f"Engine: max_batch_tokens ({max_batch_tokens}), max_seqs ({max_seqs}), page_size "
                             f"({page_size}) and pages ({pages}) must be >= 1")
        self.params, self.moe, self.model_state = params, moe, model_state
        self.max_batch_tokens, self.max_seqs = int(max_batch_tokens), int(max_seqs)
        if not 0.0 <= reserve <= 1.0:
            raise ValueError(f"Engine: reserve must be in [0, 1], got {reserve}")
        self.reserve = float(reserve)
        self.hf = None if isinstance(params, dict) else HFDecoder(params)
        if self.hf is not None:
            if moe is not None or model_state is not None:
                raise NotImplementedError("Engine: a Hugging Face model takes no moe= or model_state=")
            self.context, self.vocab, self.device = self.hf.positions, self.hf.vocab, self.hf.device
        else:
            self.context = params["pos"].shape[0] if "pos" in params else None
            self.vocab, self.device = params["emb"].shape[0], params["emb"].device
        self.on_mesh = None
        if mesh is not None and mesh.size > 1:  # the heads over the tensor axis; one copy of the batch
            self.on_mesh = (HFOnMesh(self.hf, mesh) if self.hf is not None else
                            GPTOnMesh(params, mesh, moe=moe, model_state=model_state))
            layers, kv, dh, dtype = self.on_mesh.cache_shape()
        elif self.hf is not None:
            layers, kv, dh, dtype = self.hf.layers, self.hf.kv_heads, self.hf.head_dim, self.hf.dtype
        else:
            meta = block_meta(params)
            wk = meta[0]["attn"]["wk"]  # (D, KV, Dh)
            layers, kv, dh, dtype = len(meta), wk.shape[1], wk.shape[2], params["emb"].dtype
        dtype = cache_dtype or dtype
        self.cache_note = None
        if pages is None:  # room for max_seqs sequences of the context, in at most half the free memory
            pages = max_seqs * -(-(self.context or 2048) // page_size)
            per_page = 2 * layers * kv * dh * page_size * torch.empty((), dtype=dtype).element_size()
            free, source = available_memory("cuda" if self.device.type == "cuda" else "cpu")
            if pages * per_page > free // 2:
                pages = max(1, free // 2 // per_page)
                self.cache_note = (f"the default cache ({max_seqs} sequences of {self.context or 2048} tokens) "
                                   f"would take more than half the memory available ({source}): {pages} pages "
                                   f"of {page_size} instead; give pages= to choose")
        self.cache = PagedKVCache(layers, kv, dh, pages, page_size, dtype=dtype, device=self.device)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted (holding pages), in admission order
        self.requests: dict[int, Request] = {}
        self._ids = itertools.count()
        self.steps = 0
        self.preemptions = 0

    def add_request(self, prompt: Sequence[int], max_new_tokens: int, *, key: torch.Tensor | None = None,
                    temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                    stop_tokens: Sequence[int] = ()) -> int:
        """Queue a request; returns its id. Bad input is an error here, before it runs."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("Engine.add_request: the prompt is empty; give at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"Engine.add_request: max_new_tokens must be >= 1, got {max_new_tokens}")
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        if bad:
            raise ValueError(f"Engine.add_request: the prompt holds token {bad[0]}, outside the vocabulary of "
                             f"{self.vocab}")
        need = len(prompt) + max_new_tokens - 1  # (the last new token is never fed back)
        if self.context is not None and need > self.context:
            raise ValueError(f"Engine.add_request: {len(prompt)} prompt tokens and {max_new_tokens} new ones need "
                             f"{need} positions, beyond the model's context of {self.context} learned positions")
        cap = self.cache.pages * self.cache.page_size
        if need > cap:
            raise ValueError(f"Engine.add_request: {need} tokens can never fit the cache's {cap} slots "
                             f"({self.cache.pages} pages of {self.cache.page_size}); give the Engine more pages")
        check_sampling(temperature, top_k, top_p, "Engine.add_request")
        r = Request(next(self._ids), prompt, int(max_new_tokens), key, temperature, top_k, top_p,
                    frozenset(int(t) for t in stop_tokens), added_s=time.perf_counter())
        self.requests[r.id] = r
        self.waiting.append(r)
        return r.id

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -----------------------------------------------------------------------

    def _to_take(self, r: Request) -> int:
        """Pages ``r`` will still take: for its whole context, and for ``reserve`` of the new
        tokens it may still produce."""
        more = r.max_new_tokens - len(r.tokens) - 1  # (the last new token is never fed back)
        want = len(r.context) + math.ceil(self.reserve * max(0, more))
        return max(0, -(-want // self.cache.page_size) - len(self.cache.table.get(r.id, ())))

    def _preempt(self) -> bool:
        """Free the pages of the request admitted last; False where none is running."""
        if not self.running:
            return False
        r = self.running.pop()
        self.cache.release(r.id)
        r.prefilled = 0
        self.waiting.appendleft(r)
        self.preemptions += 1
        return True

    def _schedule(self) -> list[tuple[Request, int, int]]:
        """This step's chunks: ``(request, first token of its context, tokens)``."""
        budget, chunks = self.max_batch_tokens, []
        for r in list(self.running):  # decodes: one token each, oldest first
            if len(r.context) - r.prefilled != 1 or not r.tokens or r not in self.running:
                continue
            while not self.cache.reserve(r.id, 1):
                if not self._preempt() or r not in self.running:
                    break
            if r in self.running and budget > 0:
                chunks.append((r, r.prefilled, 1))
                budget -= 1
        chunks = [c for c in chunks if c[0] in self.running]
        decoding = {id(c[0]) for c in chunks}
        queue = [r for r in self.running if id(r) not in decoding and r.prefilled < len(r.context)]
        queue += list(self.waiting)
        for r in queue:  # prompt chunks: a started prefill first, then arrivals in order
            if budget <= 0:
                break
            n = min(len(r.context) - r.prefilled, budget)
            if r not in self.running:
                if len(self.running) >= self.max_seqs:
                    break
                if self.reserve and sum(map(self._to_take, self.running)) + self._to_take(r) > len(self.cache.free):
                    break
                if not self.cache.reserve(r.id, n):
                    break
                self.waiting.remove(r)
                self.running.append(r)
            elif not self.cache.reserve(r.id, n):
                break
            chunks.append((r, r.prefilled, n))
            budget -= n
        return chunks

    # -- one step -------------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Run one batch; the tokens it produced."""
        chunks = self._schedule()
        while not chunks and self.running:  # (every running request waits for pages: free the last one's)
            self._preempt()
            chunks = self._schedule()
        if not chunks:
            if self.waiting:
                raise RuntimeError("Engine.step: no request can be admitted (the cache has no free page)")
            return []
        cache, dev = self.cache, self.device
        tokens, pos, writes, offsets = [], [], [], []
        singles, groups = [], []  # one-token chunks (attended together), longer ones (each alone)
        off = 0
        for r, start, n in chunks:
            tokens += r.context[start:start + n]
            pos += range(start, start + n)
            writes.append(cache.rows(r.id, start, start + n))
            offsets.append((off, n))
            if n == 1:
                singles.append((off, cache.rows(r.id, 0, start + 1)))
            else:
                j = torch.arange(start + n)
                groups.append((off, n, cache.rows(r.id, 0, start + n).to(dev),
                               (j[None, :] <= torch.arange(start, start + n)[:, None])[None].to(dev)))
            off += n
        write = torch.cat(writes).to(dev)
        if singles:  # one padded gather for every one-token chunk: (n1, S) rows, padding masked
            single_at = torch.tensor([o for o, _ in singles], device=dev)
            S = max(len(rows) for _, rows in singles)
            idx = torch.zeros(len(singles), S, dtype=torch.int64)
            seen = torch.zeros(len(singles), 1, S, dtype=torch.bool)
            for b, (_, rows) in enumerate(singles):
                idx[b, :len(rows)] = rows
                seen[b, 0, :len(rows)] = True
            idx, seen = idx.to(dev), seen.to(dev)
            flat = idx.view(-1)

        def attending(kc: list[torch.Tensor], vc: list[torch.Tensor]) -> Any:
            def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                kc[i][write] = k[0].to(kc[i].dtype)
                vc[i][write] = v[0].to(vc[i].dtype)
                out = torch.empty_like(q)
                if singles:
                    ks = kc[i].index_select(0, flat).view(*idx.shape, *kc[i].shape[1:]).to(q.dtype)
                    vs = vc[i].index_select(0, flat).view(*idx.shape, *vc[i].shape[1:]).to(q.dtype)  # (n1, S, KV, Dh)
                    out[0, single_at] = _attention(q[0, single_at][:, None], ks, vs, seen)[:, 0]
                for o, n, rows, mask in groups:
                    ks, vs = kc[i].index_select(0, rows).to(q.dtype)[None], vc[i].index_select(0, rows).to(q.dtype)[None]
                    out[:, o:o + n] = _attention(q[:, o:o + n], ks, vs, mask)
                return out
            return attend

        # The chunks that end their request's context draw its next token: only their last
        # token's logits are computed (row j of the step's logits).
        ends = [(r, o + n - 1) for (r, start, n), (o, _) in zip(chunks, offsets) if start + n == len(r.context)]
        done = [(r, j) for j, (r, _) in enumerate(ends)]
        with torch.no_grad():
            ids, at = torch.tensor([tokens], device=dev), torch.tensor([pos], device=dev)
            keep = torch.tensor([o for _, o in ends], dtype=torch.int64, device=dev)
            if self.on_mesh is not None:
                logits = self.on_mesh.paged_step(ids, at, cache, attending, keep)[0]
            elif self.hf is not None:
                logits = self.hf.run(ids, at, attending(cache.k, cache.v), keep=keep)[0]
            else:
                logits = forward(self.params, ids, at, attending(cache.k, cache.v), moe=self.moe,
                                 model_state=self.model_state, keep=keep)[0]
        self.steps += 1
        for r, start, n in chunks:
            r.prefilled = start + n
            cache.length[r.id] = r.prefilled
        greedy = [(r, at) for r, at in done if r.key is None or r.temperature == 0]
        picked = {}
        if greedy:  # one argmax for every greedy row
            best = logits[torch.tensor([at for _, at in greedy], device=dev)].argmax(-1).tolist()
            picked = {id(r): t for (r, _), t in zip(greedy, best)}
        events, now = [], time.perf_counter()
        for r, at in done:
            tok = picked.get(id(r))
            if tok is None:
                tok = int(sample(logits[at:at + 1], R.fold_in(r.key, len(r.tokens)), temperature=r.temperature,
                                 top_k=r.top_k, top_p=r.top_p)[0])
            r.tokens.append(tok)
            r.first_token_s = now if r.first_token_s is None else r.first_token_s
            r.stopped = tok in r.stop_tokens
            r.finished = r.stopped or len(r.tokens) >= r.max_new_tokens
            events.append(Event(r.id, tok, r.finished))
            if r.finished:
                r.finished_s = now
                self.running.remove(r)
                cache.release(r.id)
        return events

    def run(self) -> list[Event]:
        """Step until every request has finished; every event."""
        out = []
        while self.busy:
            out += self.step()
        return out

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kw: Any) -> list[list[int]]:
        """Add ``prompts`` (each with ``max_new_tokens`` and ``kw``), run them to the end
        and return their new tokens in order."""
        ids = [self.add_request(p, max_new_tokens, **kw) for p in prompts]
        self.run()
        return [self.requests[i].tokens for i in ids]
