"""``generate``: prompts in, new tokens out, through a ``KVCache``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fsharded import random as R
from fsharded.inference._cache import KVCache
from fsharded.inference._gpt import check_context, compiled_decode, extend
from fsharded.inference._hf import HFDecoder
from fsharded.inference._sample import sample
from fsharded.inference._sharded import HFOnMesh, MeshRunner
from fsharded.inference._stream import StreamedBlocks
from fsharded.kernels import weight_int8
from fsharded.mesh import Mesh
from fsharded.models._gpt_config import MoEConfig

__all__ = ["Generation", "generate"]


@dataclass
class Generation:
    """What ``generate`` returns: ``tokens[b]`` the new tokens of prompt ``b`` (up to and
    including a stop token, if one came), ``stopped[b]`` whether it ended on one, and the
    seconds and token counts of the prefill and of the decode steps (with ``compile``, the
    first decode step, which compiles, is ``compile_s`` and not counted in them)."""

    tokens: list[list[int]]
    stopped: list[bool]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cache: KVCache | None = field(default=None, repr=False)
    compile_s: float | None = None

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


def _prompts(prompts: Any) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.is_floating_point() or 0 in prompts.shape:
            raise ValueError(f"generate: a tensor of prompts must be integer (B, T), got {prompts.dtype} "
                             f"{tuple(prompts.shape)}")
        return [row.tolist() for row in prompts]
    out = [list(map(int, p)) for p in prompts]
    if not out or any(not p for p in out):
        raise ValueError("generate: give at least one prompt, each of at least one token")
    return out


def generate(params: dict, prompts: torch.Tensor | Sequence[Sequence[int]], max_new_tokens: int, *,
             key: torch.Tensor | None = None, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, stop_tokens: Sequence[int] = (), moe: MoEConfig | None = None,
             model_state: Any = None, cache_dtype: torch.dtype | None = None, mesh: Mesh | None = None,
             param_specs: Any = None, compile: bool = False) -> Generation:
    """Continue each prompt (a list of token lists of any lengths, or an integer ``(B, T)``
    tensor) by up to ``max_new_tokens`` tokens of the bundled GPT with ``params``.

    The prompts are prefilled together, left-padded to the longest, into a cache of
    ``longest + max_new_tokens`` slots per row; then one decode step per new token. Greedy
    where ``key`` is None (or ``temperature`` 0); else token ``n`` is drawn with
    ``fold_in(key, n)`` (``sample``: temperature, top-k, top-p), so a key gives the same
    tokens on every run and backend. A row stops at a token of ``stop_tokens`` (kept) or
    after ``max_new_tokens``; the others go on. ``moe``: the routing config of a model with
    mixture-of-experts blocks (routed dropless here), ``model_state`` its routing biases.

    ``compile``: decode through one ``torch.compile``d step of static shapes (the cache's
    slots rounded up to a multiple of 64, its attention over every slot with the rows'
    masks, the new keys written at a position given as a tensor), compiled once per batch
    size, slot count and dtype and reused by later calls; the prefill runs eagerly.
    ``Generation.compile_s`` is the time the first decode step took (the compile).

    ``params`` may instead be a Hugging Face causal LM (an ``nn.Module`` such as
    ``LlamaForCausalLM`` or ``GPT2LMHeadModel``, or ``fs.nn.functional`` of one): it runs
    with fsharded's cache in place of its ``past_key_values`` (``fsharded.inference._hf``).

    ``mesh``: decode on it (axes ``tensor``, ``expert``, ``data``): the heads and hidden
    units over ``tensor``, the experts over ``expert``, the prompts' rows over ``data`` and
    ``expert``, with ``params`` laid out by ``param_specs`` (default: the model's tensor- and
    expert-parallel plans). On real ranks ``params`` are this rank's shards and every rank
    gives the same prompts and gets the same tokens."""
    if max_new_tokens < 0:
        raise ValueError(f"generate: max_new_tokens must be >= 0, got {max_new_tokens}")
    rows = _prompts(prompts)
    hf = None if isinstance(params, dict) else HFDecoder(params)
    vocab = params["emb"].shape[0] if hf is None else hf.vocab
    bad = [(b, t) for b, p in enumerate(rows) for t in p if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"generate: prompt {bad[0][0]} holds token {bad[0][1]}, outside the vocabulary of {vocab}")
    B, longest = len(rows), max(map(len, rows))
    dev = params["emb"].device if hf is None else hf.device
    padded = torch.zeros(B, longest, dtype=torch.int64, device=dev)
    for b, p in enumerate(rows):
        padded[b, longest - len(p):] = torch.tensor(p, dtype=torch.int64)
    start = torch.tensor([longest - len(p) for p in rows], dtype=torch.int64)
    if hf is None and isinstance(params["blocks"], StreamedBlocks) and (compile or mesh is not None):
        raise NotImplementedError("generate: streamed weights (stream_weights) decode eagerly on one device; not "
                                  "with compile=True or a mesh")
    if compile and (hf is not None or mesh is not None):
        raise NotImplementedError("generate: compile=True decodes the bundled GPT (dense or a mixture of experts) on "
                                  "one device; not a Hugging Face model or a mesh")
    slots = longest + max_new_tokens
    if compile:
        slots = -(-slots // 64) * 64  # one compiled step for a range of lengths
        weight_int8.prepare(params["emb"])  # (the C++ row products loaded before the step is traced)
    if hf is not None:
        if moe is not None or model_state is not None or param_specs is not None:
            raise NotImplementedError("generate: a Hugging Face model takes no moe=, model_state= or param_specs= "
                                      "(on a mesh it is laid out by fsharded's tensor-parallel plan for it)")
        runner = HFOnMesh(hf, mesh) if mesh is not None and mesh.size > 1 else hf
        cache = runner.empty_cache(B, slots, start, cache_dtype)

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            return runner.extend(tokens, cache) if runner is not hf else hf.forward(tokens, cache)
    elif mesh is not None:
        runner = MeshRunner(params, mesh, param_specs, moe=moe, model_state=model_state)
        cache = runner.empty_cache(B, slots, start, cache_dtype)

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            return runner.extend(tokens, cache)
    else:
        cache = KVCache.empty(params, B, slots, start=start, dtype=cache_dtype)

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            if compile and tokens.shape[1] == 1:
                check_context(params, cache, 1)
                logits = compiled_decode()(params, tokens, cache.k, cache.v, torch.tensor(cache.length, device=dev),
                                           cache.start.to(dev), moe, model_state)
                cache.length += 1
                return logits[:, None]
            return extend(params, tokens, cache, moe=moe, model_state=model_state)
    out: list[list[int]] = [[] for _ in range(B)]
    stopped = [False] * B
    stops = set(int(t) for t in stop_tokens)
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = forward(padded)[:, -1]
        prefill_s = time.perf_counter() - t0
        decode_s, steps = 0.0, 0
        compile_s = None
        for n in range(max_new_tokens):
            tok = sample(logits, R.fold_in(key, n) if key is not None else None, temperature=temperature,
                         top_k=top_k, top_p=top_p)
            for b, t in enumerate(tok.tolist()):
                if not stopped[b]:
                    out[b].append(t)
                    stopped[b] = t in stops
            if all(stopped) or n == max_new_tokens - 1:
                break
            t0 = time.perf_counter()
            logits = forward(tok[:, None])[:, -1]
            if compile and compile_s is None:  # the first step compiles (or finds the compiled one)
                compile_s = time.perf_counter() - t0
                continue
            decode_s += time.perf_counter() - t0
            steps += 1
    return Generation(out, stopped, prefill_s, decode_s, int(sum(map(len, rows))), steps * B, cache, compile_s)
