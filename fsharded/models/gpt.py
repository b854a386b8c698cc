"""The reference GPT as pure functions over a parameter pytree, written once in per-shard form.

The same ``loss(params, batch)`` runs on one device, data-parallel, or Megatron
tensor-parallel inside ``shard_map``: attention heads and the MLP hidden width may be
sharded over a mesh axis (``tensor_axis``, ``"tensor"`` by default). The model reduces over
it exactly where its values are split (their varying axes, ``fsharded.varying_axes``): with
replicated weights nothing is reduced, and a mesh that names the axis otherwise leaves a
loss that still varies over it, which ``train_step`` reports. Local head counts and widths
come from the local tensor shapes.

>>> import torch
>>> cfg = GPTConfig.tiny()
>>> params = init(cfg, seed=0)
>>> tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1))
>>> apply(params, tokens[:, :-1]).shape
torch.Size([2, 16, 64])
>>> bool(abs(loss(params, {"tokens": tokens}) - math.log(cfg.vocab_size)) < 0.1)
True

Parameter tree (the architecture is read back from it; ``[tp]`` marks dims sharded by
``tensor_parallel_specs``)::

    emb          (V, D)             token embedding
    pos          (T, D)             learned positions only (absent with rotary)
    blocks       list, one dict per layer:
      norm1      {w (D,), b (D,)}   LayerNorm; RMSNorm has only w
      attn       wq (D, H[tp], Dh)  wk, wv (D, KV[tp], Dh)  wo (H[tp], Dh, D)
                 with bias: bq (H[tp], Dh)  bk, bv (KV[tp], Dh)  bo (D,)
      norm2      like norm1
      mlp        GELU:   w_in (D, F[tp])  w_out (F[tp], D)   [+ b_in (F[tp],), b_out (D,)]
                 SwiGLU: w_gate, w_up (D, F[tp])  w_down (F[tp], D)
                         [+ b_gate, b_up (F[tp],), b_down (D,)]
    final_norm   like norm1
    head         (D, V)             untied only; tied models use emb.T

Fixed choices (not in the tree): norm eps 1e-5, exact (erf) GELU, rotary theta 10000 in
the half-split layout, causal attention scaled by 1/sqrt(Dh).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import optree
import torch
import torch.nn.functional as F

from fsharded import kernels
from fsharded.kernels import attention as kernels_attention
from fsharded.kernels import losses as kernels_losses
from fsharded.kernels import norm as kernels_norm
from fsharded.models._gpt_config import EXPERT, TENSOR, GPTConfig, MoEConfig
from fsharded.parallel import moe as M
from fsharded.parallel import sequence
from fsharded.parallel.blocks import run_block
from fsharded.parallel.ring import ring_attention
from fsharded.parallel.ulysses import ulysses_attention
from fsharded.spmd.collectives import (
    all_gather,
    axis_size,
    is_bound,
    pmean,
    psum,
    psum_scatter,
    pvary,
    varying_axes,
)

__all__ = [
    "GPTConfig",
    "MoEConfig",
    "init",
    "init_model_state",
    "update_model_state",
    "model_state_updater",
    "apply",
    "loss",
    "embed",
    "block",
    "unembed",
    "token_loss",
    "shift",
    "IGNORE",
    "SEQ_PARALLEL",
    "param_count",
]

NORM_EPS = 1e-5
ROPE_THETA = 10000.0

Params = dict[str, Any]


# ------------------------------------------------------------------------------------------
# init
# ------------------------------------------------------------------------------------------


def init(config: GPTConfig, seed: int = 0, *, dtype: torch.dtype = torch.float32) -> Params:
    """Fresh parameters for ``config``: a dict pytree of tensors (see the module docstring).

    Deterministic in ``seed``. Values are drawn in float32 and then cast, so
    ``init(c, s, dtype=torch.float64)`` is exactly the float32 init, widened.

    >>> params = init(GPTConfig.tiny(), seed=0)
    >>> len(params["blocks"]), tuple(params["blocks"][0]["attn"]["wq"].shape)
    (2, (16, 4, 4))
    """
    if not isinstance(config, GPTConfig):
        raise TypeError(f"init: config must be a GPTConfig, got {type(config).__name__}")
    c = config
    gen = torch.Generator().manual_seed(int(seed))
    D, H, KV, Dh, Fh, V = c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.vocab_size
    std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.n_layers)

    def normal(*shape: int, s: float = std) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * s).to(dtype)

    def zeros(*shape: int) -> torch.Tensor:
        return torch.zeros(*shape, dtype=dtype)

    def norm() -> Params:
        p = {"w": torch.ones(D, dtype=dtype)}
        if c.norm == "layernorm":
            p["b"] = zeros(D)
        return p

    params: Params = {"emb": normal(V, D)}
    if c.positions == "learned":
        params["pos"] = normal(c.seq_len, D)
    blocks = []
    moe_layers = set(c.moe.layers(c.n_layers)) if c.moe is not None else set()
    for i in range(c.n_layers):
        attn = {"wq": normal(D, H, Dh), "wk": normal(D, KV, Dh), "wv": normal(D, KV, Dh),
                "wo": normal(H, Dh, D, s=out_std)}
        if i in moe_layers:
            E, Fe = c.moe.experts, c.moe.d_ff or Fh
            mlp = {"router": normal(D, E), "w1": normal(E, D, Fe), "w2": normal(E, Fe, D, s=out_std)}
            if c.bias:
                attn.update(bq=zeros(H, Dh), bk=zeros(KV, Dh), bv=zeros(KV, Dh), bo=zeros(D))
                mlp.update(b1=zeros(E, Fe), b2=zeros(E, D))
            blocks.append({"norm1": norm(), "attn": attn, "norm2": norm(), "mlp": mlp})
            continue
        if c.activation == "gelu":
            mlp = {"w_in": normal(D, Fh), "w_out": normal(Fh, D, s=out_std)}
        else:
            mlp = {"w_gate": normal(D, Fh), "w_up": normal(D, Fh),
                   "w_down": normal(Fh, D, s=out_std)}
        if c.bias:
            attn.update(bq=zeros(H, Dh), bk=zeros(KV, Dh), bv=zeros(KV, Dh), bo=zeros(D))
            if c.activation == "gelu":
                mlp.update(b_in=zeros(Fh), b_out=zeros(D))
            else:
                mlp.update(b_gate=zeros(Fh), b_up=zeros(Fh), b_down=zeros(D))
        blocks.append({"norm1": norm(), "attn": attn, "norm2": norm(), "mlp": mlp})
    params["blocks"] = blocks
    params["final_norm"] = norm()
    if not c.tied_embeddings:
        params["head"] = normal(D, V)
    return params


def param_count(params: Any) -> int:
    """Total number of elements over every tensor leaf (global shapes if given global params).

    >>> param_count(init(GPTConfig.tiny()))
    7872
    """
    return sum(x.numel() for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor))


# ------------------------------------------------------------------------------------------
# forward, per shard
# ------------------------------------------------------------------------------------------


def _split(axis: str | None, w: torch.Tensor) -> bool:
    """Whether the weight ``w`` is split over the mesh axis ``axis`` in this shard_map."""
    return axis is not None and is_bound(axis) and axis in varying_axes(w)


def _enter_tp(x: torch.Tensor, axis: str | None, w: torch.Tensor, sp: bool = False) -> torch.Tensor:
    """Megatron's f: identity forward, all-reduce of the gradient over ``axis`` backward,
    so replicated inputs of column-parallel layers (weight ``w``) get their full gradient;
    one all-reduce for the layer (an implicit pvary would add one per weight it meets).
    ``sp`` (Megatron-SP: ``x`` is this rank's sequence chunk): all-gather of the sequence
    forward, reduce-scatter of the gradient backward."""
    if sp:
        if not _split(axis, w):
            raise ValueError(f"seq_parallel='megatron' shards the sequence over the tensor axis {axis!r} "
                             f"between tensor-parallel layers, but this block's weights are not split over "
                             f"it: lay them out with tensor_parallel_specs")
        return all_gather(x, axis, dim=1)
    return pvary(x, axis) if _split(axis, w) else x


def _exit_tp(x: torch.Tensor, axis: str | None, sp: bool = False) -> torch.Tensor:
    """Megatron's g: sum the partial outputs of row-parallel layers over ``axis``, where
    they are partial (vary over it); outputs of replicated weights are already whole.
    ``sp``: a reduce-scatter to this rank's sequence chunk instead (all-gather backward)."""
    if sp:
        return psum_scatter(x, axis, dim=1)
    return psum(x, axis) if axis is not None and is_bound(axis) and axis in varying_axes(x) else x


def _triton(x: torch.Tensor, kind: str) -> bool:
    """Whether ``fsharded.kernels`` would run its Triton kernel for ``kind`` on ``x`` (CUDA,
    or ``FSHARDED_KERNELS=triton`` under the interpreter); elsewhere the model keeps plain
    torch ops, which are the kernels' references."""
    return kernels.choose(kind, x) == "triton"


def _norm(p: Params, x: torch.Tensor) -> torch.Tensor:
    if "b" in p:
        if _triton(x, "layer_norm"):
            return kernels_norm.layer_norm(x, p["w"], p["b"], eps=NORM_EPS)
        return F.layer_norm(x, x.shape[-1:], p["w"], p["b"], eps=NORM_EPS)
    if _triton(x, "rms_norm"):
        return kernels_norm.rms_norm(x, p["w"], eps=NORM_EPS)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * p["w"]


def _rotary(x: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE in the half-split layout: dim ``i`` pairs with ``i + Dh/2``. x: (B, T, h, Dh);
    ``pos``: the tokens' global positions (T,) (a sequence shard's), default 0..T-1."""
    T, Dh = x.shape[1], x.shape[3]
    # Angles in at least float32: bf16 positions would collide past a few hundred tokens.
    dt = torch.promote_types(x.dtype, torch.float32)
    inv_freq = ROPE_THETA ** (-torch.arange(0, Dh, 2, dtype=dt, device=x.device) / Dh)
    pos = torch.arange(T, device=x.device) if pos is None else pos
    ang = pos.to(dt)[:, None] * inv_freq  # (T, Dh/2)
    cos = ang.cos().repeat(1, 2)[:, None, :].to(x.dtype)  # (T, 1, Dh)
    sin = ang.sin().repeat(1, 2)[:, None, :].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Explicit einsum attention: fast under vmap, where CPU SDPA loops per sample.

    q: (B, T, h, Dh), k/v: (B, T, kv, Dh) with h a multiple of kv. Query head ``i`` reads
    key/value head ``i // (h // kv)``, which holds on every tensor shard too because
    ``tensor_parallel_specs`` splits both head dims into contiguous chunks.
    """
    B, T, h, Dh = q.shape
    kv = k.shape[2]
    q = q.reshape(B, T, kv, h // kv, Dh)  # (B, T, kv, g, Dh)
    s = torch.einsum("btkgd,bskd->bkgts", q, k) * (Dh**-0.5)  # (B, kv, g, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~causal, float("-inf"))
    o = torch.einsum("bkgts,bskd->btkgd", s.softmax(dim=-1), v)
    return o.reshape(B, T, h, Dh)


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``scaled_dot_product_attention`` (fused kernels on GPU); same layout as above."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, Dh)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       enable_gqa=q.shape[1] != k.shape[1])
    return o.transpose(1, 2)


def _flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``fsharded.kernels.flash_attention`` (Triton on CUDA, torch's fused kernel on CPU)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, Dh)
    return kernels_attention.flash_attention(q, k, v, causal=True).transpose(1, 2)


# From this many tokens torch's fused CPU flash kernel beats the einsum form on CPU (GPT
# d=128, 4 heads, a train step on the virtual mesh: 0.96x at 128 tokens, 1.15x at 256,
# 1.8x at 512) and keeps no (T, T) scores; below it the einsum form is as fast.
CPU_FLASH_MIN_TOKENS = 256


def _auto_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Flash attention where a fused kernel runs it (Triton on CUDA; torch's CPU kernel from
    ``CPU_FLASH_MIN_TOKENS`` tokens), the einsum form elsewhere."""
    if _triton(q, "flash_attention"):
        return _flash_attention(q, k, v)
    if q.shape[1] >= CPU_FLASH_MIN_TOKENS:
        if kernels_attention.flash_backend(*(t.transpose(1, 2) for t in (q, k, v))) == "cpu":
            return _flash_attention(q, k, v)
    return _causal_attention(q, k, v)


_ATTENTION = {"auto": _auto_attention, "einsum": _causal_attention, "sdpa": _sdpa_attention,
              "flash": _flash_attention}


SEQ_PARALLEL = ("ulysses", "ring", "hybrid", "megatron")


def _seq(seq_axis: Any) -> bool:
    """Whether the sequence is sharded over ``seq_axis`` here (bound, more than one shard)."""
    if seq_axis is None:
        return False
    axes = (seq_axis,) if isinstance(seq_axis, str) else tuple(seq_axis)
    return all(is_bound(a) for a in axes) and axis_size(axes) > 1


def _attn(p: Params, x: torch.Tensor, rotary: bool, attention: str, axis: str | None,
          seq_axis: str | None = None, seq_parallel: str = "ulysses",
          seq_layout: str = "contiguous") -> torch.Tensor:
    sp = seq_parallel == "megatron" and _seq(seq_axis)  # x: a sequence chunk, gathered here
    x = _enter_tp(x, axis, p["wq"], sp)  # (B, T, D)
    q = torch.einsum("btd,dhe->bthe", x, p["wq"])  # (B, T, H/tp, Dh)
    k = torch.einsum("btd,dhe->bthe", x, p["wk"])  # (B, T, KV/tp, Dh)
    v = torch.einsum("btd,dhe->bthe", x, p["wv"])  # (B, T, KV/tp, Dh)
    if "bq" in p:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    sharded = _seq(seq_axis) and not sp
    if rotary:
        pos = sequence.positions(q.shape[1], seq_axis, seq_layout, device=q.device) if sharded else None
        q, k = _rotary(q, pos), _rotary(k, pos)
    if not sharded:
        o = _ATTENTION[attention](q, k, v)  # (B, T, H/tp, Dh)
    elif seq_parallel == "ulysses":  # whole sequences for H/(tp n) heads, then back
        o = ulysses_attention(_ATTENTION[attention], q, k, v, seq_axis)
    elif seq_parallel == "ring":  # the key/value blocks around the ring
        o = ring_attention(q, k, v, seq_axis, layout=seq_layout)
    else:  # hybrid: Ulysses over the minor axis, ring attention across the major one
        ring_axis, a2a_axis = seq_axis
        o = ulysses_attention(lambda q, k, v: ring_attention(q, k, v, ring_axis), q, k, v, a2a_axis)
    y = _exit_tp(torch.einsum("bthe,hed->btd", o, p["wo"]), axis, sp)  # (B, T, D), or (B, T/tp, D)
    return y + p["bo"] if "bo" in p else y


def _mlp(p: Params, x: torch.Tensor, axis: str | None, sp: bool = False) -> torch.Tensor:
    x = _enter_tp(x, axis, p["w_gate"] if "w_gate" in p else p["w_in"], sp)  # (B, T, D)
    if "w_gate" in p:
        gate, up = x @ p["w_gate"], x @ p["w_up"]  # (B, T, F/tp)
        if "b_gate" in p:
            gate, up = gate + p["b_gate"], up + p["b_up"]
        y = _exit_tp((F.silu(gate) * up) @ p["w_down"], axis, sp)  # (B, T, D)
        return y + p["b_down"] if "b_down" in p else y
    h = x @ p["w_in"]  # (B, T, F/tp)
    if "b_in" in p:
        h = h + p["b_in"]
    y = _exit_tp(F.gelu(h) @ p["w_out"], axis, sp)  # (B, T, D)
    return y + p["b_out"] if "b_out" in p else y


def block(p: Params, x: torch.Tensor, *, rotary: bool = False,
          attention: str = "auto", tensor_axis: str | None = TENSOR, seq_axis: str | None = None,
          seq_parallel: str = "ulysses", seq_layout: str = "contiguous", moe: MoEConfig | None = None,
          expert_axis: str | None = EXPERT, train: bool = True,
          selection_bias: torch.Tensor | None = None) -> Any:
    """One pre-norm transformer block, ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))``.

    ``p`` is one entry of ``params["blocks"]``; x: (B, T, D), replicated over
    ``tensor_axis`` (the mesh axis the heads and hidden width may be split over).
    Every tensor it reads is in ``p`` or ``x`` (nothing captured), so it can be wrapped by
    remat or a ZeRO-3 gather, or placed on a pipeline stage as is. ``seq_axis``: the mesh
    axis x's sequence dim may be sharded over (``seq_parallel`` "ulysses" or "ring",
    ``seq_layout`` "contiguous" or "zigzag": ``fsharded.parallel.sequence``).

    A block whose MLP is a mixture of experts (``p["mlp"]["router"]``) routes this shard's
    tokens by ``moe`` (``MoEConfig``; capacity ``moe.capacity_factor``, or
    ``eval_capacity_factor`` when not ``train``), with its experts split over
    ``expert_axis`` where that axis is bound, and returns ``(x, aux)``: ``aux`` the
    layer's ``aux_loss``, ``z_loss`` and ``drop_fraction`` (0-d tensors) and ``load``
    (tokens per expert, ``(E,)``). ``selection_bias`` ``(E,)``: added to the router's
    probabilities for the choice of experts only (aux-loss-free balancing).
    """
    x = x + _attn(p["attn"], _norm(p["norm1"], x), rotary, attention, tensor_axis,
                  seq_axis, seq_parallel, seq_layout)
    if _is_moe(p):
        return _moe_mlp(p["mlp"], _norm(p["norm2"], x), x, moe, expert_axis, train,
                        seq_parallel == "megatron" and _seq(seq_axis), selection_bias, tensor_axis)
    if selection_bias is not None:
        raise ValueError("block: selection_bias is for a mixture-of-experts block; this block's MLP is dense")
    return x + _mlp(p["mlp"], _norm(p["norm2"], x), tensor_axis, seq_parallel == "megatron" and _seq(seq_axis))


def _is_moe(p: Any) -> bool:
    """Whether the block ``p`` (a params subtree; a wrapper's block object passes as is)
    has a mixture-of-experts MLP."""
    return isinstance(p, dict) and isinstance(p.get("mlp"), dict) and "router" in p["mlp"]


def _moe_mlp(p: Params, h: torch.Tensor, x: torch.Tensor, cfg: MoEConfig | None, axis: str | None,
             train: bool, megatron: bool, bias: torch.Tensor | None = None,
             tensor_axis: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if cfg is None:
        raise ValueError("this GPT has mixture-of-experts blocks (params['blocks'][i]['mlp']['router']): pass "
                         "its routing config, gpt.loss(params, batch, moe=config.moe) (or to apply / block)")
    if megatron:
        raise NotImplementedError("seq_parallel='megatron' with mixture-of-experts blocks is not implemented")
    E = p["router"].shape[1]
    if E != cfg.experts:
        raise ValueError(f"moe.experts is {cfg.experts} but this block's router scores {E} experts "
                         f"(params mlp.router {tuple(p['router'].shape)}): pass the config the model was built with")
    cf = cfg.capacity_factor if train else cfg.eval_capacity_factor
    # Dropless through the sort (grouped kernels on CUDA without an expert axis)
    y, aux = M.moe_layer(p, h, top_k=cfg.top_k, capacity_factor=cf, min_capacity=cfg.min_capacity, axis=axis,
                         method="capacity" if cf is not None else "sorted", selection_bias=bias,
                         tensor_axis=tensor_axis)
    return x + y, {k: aux[k] for k in ("aux_loss", "z_loss", "drop_fraction", "load")}


def embed(params: Params, tokens: torch.Tensor, *, seq_axis: str | None = None,
          seq_layout: str = "contiguous") -> torch.Tensor:
    """Token (and learned position) embeddings: tokens (B, T) int -> (B, T, D); with the
    sequence sharded over ``seq_axis``, the learned positions of this shard's tokens."""
    if tokens.dim() != 2 or tokens.is_floating_point() or tokens.is_complex():
        raise ValueError(
            f"tokens must be an integer tensor of shape (B, T), got {tokens.dtype} "
            f"{tuple(tokens.shape)}"
        )
    x = params["emb"][tokens]  # (B, T, D)
    if "pos" in params:
        sharded = _seq(seq_axis)
        T, T_max = tokens.shape[1] * (axis_size(seq_axis) if sharded else 1), params["pos"].shape[0]
        if T > T_max:
            raise ValueError(
                f"sequence length {T} exceeds the {T_max} learned positions (params['pos'] "
                f"has shape {tuple(params['pos'].shape)}); pass at most {T_max} tokens (padding "
                f"included: with a sequence padded to divide over its shards, a table that long, "
                f"or rotary positions, which have no limit)"
            )
        if sharded:
            x = x + params["pos"][sequence.positions(tokens.shape[1], seq_axis, seq_layout,
                                                     device=tokens.device)]
        else:
            x = x + params["pos"][:T]
    return x


def unembed(params: Params, x: torch.Tensor) -> torch.Tensor:
    """Final norm and output projection: (B, T, D) -> logits (B, T, V)."""
    x = _norm(params["final_norm"], x)
    if "head" in params:
        return x @ params["head"]
    return x @ params["emb"].T


def apply(params: Params, tokens: torch.Tensor, *, attention: str = "auto",
          block_fn: Callable[..., torch.Tensor] | None = None,
          tensor_axis: str | None = TENSOR, seq_axis: str | None = None,
          seq_parallel: str = "ulysses", seq_layout: str = "contiguous", moe: MoEConfig | None = None,
          expert_axis: str | None = EXPERT, train: bool = True, model_state: Any = None) -> torch.Tensor:
    """Logits ``(B, T, V)`` for integer ``tokens`` ``(B, T)``.

    ``attention``: ``"auto"`` (default: ``"flash"`` where a fused kernel runs it, i.e. Triton
    on CUDA and torch's CPU flash kernel from ``CPU_FLASH_MIN_TOKENS`` = 256 tokens, else
    ``"einsum"``), ``"einsum"`` (explicit causal mask, fast on the virtual
    mesh), ``"flash"`` (``fsharded.kernels.flash_attention``) or ``"sdpa"``
    (``scaled_dot_product_attention``; a slow per-sample loop under vmap on CPU). ``block_fn(block, p, x, *, rotary, attention)``
    runs every layer instead of ``block(p, x, ...)``: a wrapper (remat, ZeRO-3 gathering)
    that receives the block function and calls it. ``tensor_axis``: the mesh axis the
    tensor-parallel weights are split over (``None``: no tensor parallelism).
    ``seq_axis``: the mesh axis ``tokens``' sequence dim is sharded over inside shard_map
    (``None`` or unbound: not sharded), with ``seq_parallel`` "ulysses" (all-to-all to
    whole sequences for a slice of the heads), "ring" (key/value blocks passed around) or
    "hybrid" (``seq_axis=(ring_axis, ulysses_axis)``, the sequence sharded over both as
    ``P(None, (ring_axis, ulysses_axis))``: Ulysses inside each ring position, ring across,
    so the degree is not capped by the heads), and ``seq_layout`` "contiguous" or "zigzag"
    (ring's causal balance; the batch put in that order by
    ``fsharded.parallel.sequence.zigzag``). Logits come back sharded alike. ``moe``,
    ``expert_axis``, ``train``: a model with mixture-of-experts blocks (see ``block``);
    ``model_state``: its routing biases (``init_model_state``), with
    ``moe.bias_update_rate``.
    """
    return _forward(params, tokens, attention=attention, block_fn=block_fn, tensor_axis=tensor_axis,
                    seq_axis=seq_axis, seq_parallel=seq_parallel, seq_layout=seq_layout, moe=moe,
                    expert_axis=expert_axis, train=train, model_state=model_state)[0]


def _forward(params: Params, tokens: torch.Tensor, *, attention: str, block_fn: Callable | None,
             tensor_axis: str | None, seq_axis: Any, seq_parallel: str, seq_layout: str,
             moe: MoEConfig | None, expert_axis: str | None, train: bool,
             model_state: Any = None) -> tuple[torch.Tensor, list[dict]]:
    """Logits and the auxiliary values of each mixture-of-experts block (see ``apply``)."""
    biases = _routing_biases(params, moe, model_state)
    if attention not in _ATTENTION:
        raise ValueError(f"attention must be one of {list(_ATTENTION)}, got {attention!r}")
    seq_axis = check_seq(seq_axis, seq_parallel, seq_layout)
    if seq_parallel == "megatron":
        seq_axis, tokens = _megatron_chunk(tokens, seq_axis, tensor_axis)
    fn = block if block_fn is None else functools.partial(block_fn, block)
    rotary = "pos" not in params
    x = embed(params, tokens, seq_axis=seq_axis, seq_layout=seq_layout)
    seq = {"seq_axis": seq_axis, "seq_parallel": seq_parallel, "seq_layout": seq_layout} \
        if seq_axis is not None else {}
    experts = {"moe": moe, "expert_axis": expert_axis, "train": train} if moe is not None else {}
    aux = []
    for p in params["blocks"]:  # each through the step's block hook (ZeRO-3 gathers here)
        kw = experts if _is_moe(p) else {}
        if kw and biases is not None:
            kw = {**kw, "selection_bias": biases[len(aux)]}
        x = run_block(fn, p, x, rotary=rotary, attention=attention, tensor_axis=tensor_axis, **seq, **kw)
        if isinstance(x, tuple):  # a mixture-of-experts block: (x, its auxiliary values)
            x, a = x
            aux.append(a)
    return unembed(params, x), aux


def check_seq(seq_axis: Any, seq_parallel: str, seq_layout: str) -> Any:
    """The sequence-parallel settings checked; the axis (a tuple of two for 'hybrid')."""
    if seq_parallel not in SEQ_PARALLEL:
        raise ValueError(f"seq_parallel must be one of {list(SEQ_PARALLEL)}, got {seq_parallel!r}")
    sequence.check_layout(seq_layout)
    if seq_layout == "zigzag" and seq_parallel != "ring" and _seq(seq_axis):
        raise ValueError(f"seq_layout='zigzag' is ring attention's causal balance; {seq_parallel} needs "
                         f"the contiguous layout")
    hybrid = seq_parallel == "hybrid" and seq_axis is not None
    if hybrid and (isinstance(seq_axis, str) or len(tuple(seq_axis)) != 2):
        raise ValueError(f"seq_parallel='hybrid' shards the sequence over two axes, seq_axis=(ring axis, "
                         f"Ulysses axis) as in the batch spec P(None, (ring, ulysses)); got {seq_axis!r}")
    if not hybrid and seq_axis is not None and not isinstance(seq_axis, str):
        raise ValueError(f"seq_axis={seq_axis!r}: one axis for {seq_parallel} (two only for 'hybrid')")
    return tuple(seq_axis) if hybrid else seq_axis


IGNORE = -100  # a target the loss skips (cross_entropy's ignore_index): padding


def shift(batch: dict[str, torch.Tensor], *, multiple: int = 1) -> dict[str, torch.Tensor]:
    """``{"tokens": (B, T + 1)}`` -> ``{"inputs": (B, T), "targets": (B, T)}``: the form a
    sequence-sharded batch takes (inputs and targets split alike). ``multiple``: pad the
    sequence at its end to a multiple of it (inputs with token 0, targets with ``IGNORE``):
    causal attention keeps the padding out of every real token's result and the loss
    skips it, so a length that does not divide over the shards trains as the unpadded one."""
    inputs, targets = _split_batch(batch)
    pad = -inputs.shape[1] % multiple
    if pad:
        inputs = F.pad(inputs, (0, pad), value=0)
        targets = F.pad(targets, (0, pad), value=IGNORE)
    return {"inputs": inputs, "targets": targets}


def _megatron_chunk(t: torch.Tensor, seq_axis: Any, tensor_axis: str | None) -> tuple[Any, torch.Tensor]:
    """Megatron-SP: the sequence is sharded over the tensor axis between the tensor-parallel
    layers. ``t`` (B, T), the same on every tensor rank, -> this rank's chunk (B, T/tp)
    (integers: nothing to differentiate, nothing to communicate), and the axis."""
    if seq_axis not in (None, tensor_axis):
        raise ValueError(f"seq_parallel='megatron' shards the sequence over the tensor axis ({tensor_axis!r}); "
                         f"leave seq_axis unset (got {seq_axis!r})")
    if tensor_axis is None or not _seq(tensor_axis):
        return None, t
    n = axis_size(tensor_axis)
    if t.shape[1] % n:
        raise ValueError(f"seq_parallel='megatron': the sequence length {t.shape[1]} does not divide over "
                         f"{tensor_axis}={n}; pad it (fsharded.models.gpt.shift(batch, multiple={n}))")
    return tensor_axis, t[:, sequence.positions(t.shape[1] // n, tensor_axis, device=t.device)]


def _split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict) and "tokens" in batch:
        tokens = batch["tokens"]
        if tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(
                f"batch['tokens'] must have shape (B, T + 1) with T >= 1, got "
                f"{tuple(tokens.shape)}"
            )
        return tokens[:, :-1], tokens[:, 1:]
    if isinstance(batch, dict) and "inputs" in batch and "targets" in batch:
        inputs, targets = batch["inputs"], batch["targets"]
        if inputs.shape != targets.shape:
            raise ValueError(
                f"batch['inputs'] {tuple(inputs.shape)} and batch['targets'] "
                f"{tuple(targets.shape)} must have the same shape (B, T)"
            )
        return inputs, targets
    got = list(batch) if isinstance(batch, dict) else type(batch).__name__
    raise ValueError(
        f"batch must be a dict with 'tokens' (B, T + 1) or with 'inputs' and 'targets' "
        f"(B, T); got {got}"
    )


def loss(params: Params, batch: dict[str, torch.Tensor], model_state: Any = None, *, attention: str = "auto",
         block_fn: Callable[..., torch.Tensor] | None = None,
         tensor_axis: str | None = TENSOR, seq_axis: str | None = None,
         seq_parallel: str = "ulysses", seq_layout: str = "contiguous", moe: MoEConfig | None = None,
         expert_axis: str | None = EXPERT, train: bool = True, metrics: bool = False) -> Any:
    """Mean next-token cross-entropy over this shard's batch (a 0-d tensor).

    ``batch["tokens"]`` (B, T + 1): inputs are ``tokens[:, :-1]``, targets
    ``tokens[:, 1:]``; or give ``batch["inputs"]`` and ``batch["targets"]`` (B, T).
    Inside ``shard_map`` with the batch sharded over ``"data"`` this is the local mean:
    ``pmean`` it over ``"data"`` for the global mean. ``tensor_axis``: the mesh axis of
    ``tensor_parallel_specs(params, axis=...)``, e.g. ``functools.partial(loss,
    tensor_axis="tp")`` on a mesh whose axis is named ``"tp"``. Sequence parallel
    (``seq_axis``, see ``apply``): give ``inputs`` and ``targets`` sharded over the axis
    (``batch_spec=P("data", "seq")``); the loss is this shard's mean, which ``train_step``
    averages over the batch axes like the data shards' (equal token counts per shard).

    Mixture of experts (``moe=config.moe``, see ``block``): the loss adds
    ``moe.aux_loss_weight`` times the load-balancing losses and ``moe.z_loss_weight`` times
    the router z-losses, summed over the MoE blocks. ``metrics=True`` returns ``(loss,
    metrics)`` with ``lm_loss`` and, for MoE, ``moe_aux_loss``, ``moe_z_loss``,
    ``moe_drop_fraction`` and ``moe_load_imbalance`` (the most assignments any expert got
    over the mean; 1 is uniform), each the mean over the MoE blocks: the form
    ``train_step`` reports.
    Aux-loss-free balancing (``moe.bias_update_rate``): pass the routing biases
    ``model_state`` (``init_model_state``; positional, as ``train_step`` passes it); the
    loss then returns ``(loss, metrics, stats)``, ``stats["moe_load"]`` each MoE block's tokens per expert, the form
    ``train_step(..., update_model_state=gpt.model_state_updater(moe))`` takes.
    """
    inputs, targets = _split_batch(batch)
    if _seq(seq_axis) and isinstance(batch, dict) and "tokens" in batch:
        raise ValueError(f"sequence parallel over {seq_axis!r}: batch['tokens'] (B, T + 1) cannot be "
                         f"split over the sequence (targets cross the shards); give batch['inputs'] and "
                         f"batch['targets'] (B, T), e.g. fsharded.models.gpt.shift(batch)")
    logits, aux = _forward(params, inputs, attention=attention, block_fn=block_fn, tensor_axis=tensor_axis,
                           seq_axis=seq_axis, seq_parallel=seq_parallel, seq_layout=seq_layout, moe=moe,
                           expert_axis=expert_axis, train=train, model_state=model_state)  # (B, T, V)
    out = shard_loss(logits, targets, seq_axis=seq_axis, seq_parallel=seq_parallel, tensor_axis=tensor_axis)
    if not aux:
        return (out, {"lm_loss": out.detach()}) if metrics else out
    balance, z = sum(a["aux_loss"] for a in aux), sum(a["z_loss"] for a in aux)
    total = out + moe.aux_loss_weight * balance.to(out.dtype) + moe.z_loss_weight * z.to(out.dtype)
    m = {"lm_loss": out.detach(), "moe_aux_loss": balance.detach(), "moe_z_loss": z.detach(),
         "moe_drop_fraction": sum(a["drop_fraction"] for a in aux).detach() / len(aux),
         "moe_load_imbalance": sum(a["load"].max() / a["load"].mean() for a in aux).detach() / len(aux)}
    if model_state is not None:
        return total, m, {"moe_load": [a["load"].detach() for a in aux]}
    return (total, m) if metrics else total


def shard_loss(logits: torch.Tensor, targets: torch.Tensor, *, seq_axis: Any = None, seq_parallel: str = "ulysses",
               tensor_axis: str | None = TENSOR) -> torch.Tensor:
    """The language-model loss of this shard's ``logits`` (B, T, V) against its ``targets``
    (B, T) (``loss``'s, without the mixture-of-experts terms); sequence parallel as ``loss``
    takes it."""
    megatron = seq_parallel == "megatron"
    if megatron:  # the logits are this tensor rank's sequence chunk: so are the targets
        seq_axis, targets = _megatron_chunk(targets, seq_axis, tensor_axis)
    sharded = _seq(seq_axis)
    # Sequence shards may hold different numbers of real tokens (padding, IGNORE targets):
    # each shard's sum over the mean real-token count of its sequence group, so that the
    # step's mean over the shards is the mean over the group's real tokens.
    out = token_loss(logits, targets, reduction="sum" if sharded else "mean")
    if sharded:
        count = (targets.reshape(-1) != IGNORE).sum().to(out.dtype)
        out = out / (psum(count, seq_axis) / axis_size(seq_axis))
        # Megatron-SP: the tensor axis is not a batch axis of the step: the mean over it here
        out = pmean(out, seq_axis) if megatron else out
    return out


def token_loss(logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T), the
    ``IGNORE`` targets skipped, with fp32 statistics (a chunked kernel where it runs)."""
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if _triton(flat, "cross_entropy"):
        # Chunked over the vocabulary with fp32 statistics: no fp32 copy of the logits.
        return kernels_losses.cross_entropy(flat, flat_targets, reduction=reduction)
    # Low-precision logits lose the small differences softmax cares about: upcast.
    return F.cross_entropy(flat.to(torch.promote_types(flat.dtype, torch.float32)), flat_targets,
                           reduction=reduction)


def init_model_state(params: Params) -> dict[str, list[torch.Tensor]]:
    """The state aux-loss-free balancing carries (``MoEConfig.bias_update_rate``):
    ``{"moe_bias": [zeros(E) per mixture-of-experts block, in block order]}`` (float32),
    for ``train_step(...).init(params, model_state=...)``.

    >>> cfg = GPTConfig.tiny(moe={"experts": 4, "bias_update_rate": 1e-3})
    >>> [b.shape for b in init_model_state(init(cfg))["moe_bias"]]
    [torch.Size([4])]
    """
    biases = [torch.zeros(p["mlp"]["router"].shape[1], dtype=torch.float32, device=p["mlp"]["router"].device)
              for p in params["blocks"] if _is_moe(p)]
    if not biases:
        raise ValueError("init_model_state: this GPT has no mixture-of-experts blocks (GPTConfig(moe=...))")
    return {"moe_bias": biases}


def update_model_state(model_state: dict, stats: dict, *, rate: float) -> dict:
    """DeepSeek-V3's bias step for every MoE block: ``bias + rate * sign(mean(load) -
    load)`` (``fsharded.parallel.moe.update_bias``) from the blocks' loads ``stats
    ["moe_load"]`` (in a step: averaged over the micro-batches and the batch shards)."""
    b, load = model_state["moe_bias"], stats["moe_load"]
    if len(b) != len(load):
        raise ValueError(f"update_model_state: {len(b)} routing biases but loads of {len(load)} MoE blocks")
    return {"moe_bias": [M.update_bias(x, n, rate) for x, n in zip(b, load)]}


def model_state_updater(moe: MoEConfig) -> Callable[[dict, dict], dict]:
    """``update_model_state`` at ``moe.bias_update_rate``, for ``train_step``."""
    if moe is None or moe.bias_update_rate is None:
        raise ValueError("model_state_updater: the MoE config has no bias_update_rate (no routing bias)")
    return functools.partial(update_model_state, rate=moe.bias_update_rate)


def _routing_biases(params: Params, moe: MoEConfig | None, model_state: Any) -> list | None:
    """The MoE blocks' routing biases from ``model_state``, checked against the blocks."""
    if model_state is None:
        if moe is not None and moe.bias_update_rate is not None and any(_is_moe(p) for p in params["blocks"]):
            raise ValueError("moe.bias_update_rate is set, so the experts are chosen with a routing bias: pass "
                             "model_state= (gpt.init_model_state(params), carried by train_step's "
                             "TrainState.model_state), or drop bias_update_rate")
        return None
    if moe is None or moe.bias_update_rate is None:
        raise ValueError("model_state= holds routing biases, but the MoE config has no bias_update_rate: pass "
                         "moe=config.moe of a config with bias_update_rate")
    biases = model_state.get("moe_bias") if isinstance(model_state, dict) else None
    n = sum(_is_moe(p) for p in params["blocks"])
    if not isinstance(biases, (list, tuple)) or len(biases) != n:
        raise ValueError(f"model_state must be {{'moe_bias': [one (E,) tensor per MoE block]}} for this GPT's "
                         f"{n} MoE blocks (gpt.init_model_state(params)); got {type(model_state).__name__}")
    return list(biases)


# The sharding plans live beside the model (``fsharded.models.gpt_plans``), which does not
# import them; their names stay reachable here: ``gpt.tensor_parallel_specs(params)``.
_PLANS = ("tensor_parallel_specs", "expert_parallel_specs", "TENSOR_PARALLEL_RULES")


def __getattr__(name: str) -> Any:
    if name in _PLANS:
        from fsharded.models import gpt_plans

        return getattr(gpt_plans, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_PLANS])
