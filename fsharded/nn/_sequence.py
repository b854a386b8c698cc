"""Sequence parallelism (Ulysses, ring, hybrid) for Hugging Face decoders through ``fs.nn``.

A Llama-, Mistral-, Qwen2- or GPT-2-style ``transformers`` model trains with its sequence dim
sharded over a mesh axis inside ``fs.train_step``, with the same losses and weights as the
unsharded model. Three pieces do it, each usable alone:

- an attention implementation registered with transformers' ``AttentionInterface``
  (``sequence_attention(strategy, axis=..., layout=...)`` returns its name): inside
  ``shard_map`` with ``axis`` bound it runs ``fsharded.parallel.ulysses.ulysses_attention``
  around causal attention over the whole sequence, ``fsharded.parallel.ring.ring_attention``,
  or both (hybrid); elsewhere plain causal attention, so the model still runs unsharded. Its
  mask function stands in for HF's: the causal mask that matters is the global one, which
  the strategies apply from global positions, so the locally built mask is never made, and
  a padding mask is refused (``NotImplementedError``) rather than dropped;
- global positions: each shard's ``position_ids`` from ``fsharded.parallel.sequence.positions``,
  passed to the model, so rotary and learned position embeddings see the true offsets;
- ``causal_lm_loss``: next-token cross-entropy on a sequence shard, ``sum / (psum(count) / n)``,
  so the step's mean over the shards is the mean over the real tokens of the whole sequence.

``sequence_parallel(model, ...)`` puts them together: it switches the model's attention to
the registered implementation (the model is changed in place, as
``model.set_attn_implementation`` does; outside ``shard_map`` it computes what eager or SDPA
attention computed, for causal training without a padding mask) and returns a
``SequenceParallel`` whose ``loss``, ``params``, ``blocks`` and ``batch_spec`` go to
``train_step``::

    model = transformers.LlamaForCausalLM(config)
    sp = fs.nn.sequence_parallel(model, axis="seq", strategy="ring", layout="zigzag")
    mesh = fs.Mesh({"data": 2, "seq": 4})
    step = fs.train_step(sp.loss, fs.optim.adamw(3e-4), mesh=mesh, batch_spec=sp.batch_spec("data"),
                         param_specs=fs.parallel.zero(3)(fs.P(), sp.params), blocks=sp.blocks)
    state = step.init(sp.params)
    for batch in loader:                                # {"tokens": (B, T + 1)}
        state, metrics = step(state, sp.prepare(batch, mesh))
    fs.nn.load_into(model, step.params(state))

``prepare`` shifts the tokens into inputs and targets (the targets of a shard's last token
live on the next shard), pads the sequence at its end to a multiple of the degree (targets
``IGNORE``: causal attention keeps the padding out of every real token) and, for the
zigzag layout, puts it in zigzag order. Not supported (a clear error, not a silent
difference): padding / custom attention masks, attention dropout, key/value caches while
sharded, cross-attention, ``head_mask``, attention weights as outputs, and sliding windows
shorter than the sequence under ring attention.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsharded.kernels.attention import flash_attention
from fsharded.mesh import Mesh, P
from fsharded.nn._functional import FunctionalModule, functional
from fsharded.nn._hf_attention import switch
from fsharded.parallel import sequence
from fsharded.parallel.ring import ring_attention
from fsharded.parallel.ulysses import ulysses_attention
from fsharded.spmd.collectives import axis_size, is_bound, psum

__all__ = ["STRATEGIES", "IGNORE", "SequenceParallel", "sequence_parallel", "sequence_attention",
           "causal_lm_loss"]

STRATEGIES = ("ulysses", "ring", "hybrid")
IGNORE = -100  # a target the loss skips (cross_entropy's ignore_index): padding

_MASK_ERROR = (
    "fs.nn sequence parallelism: got an attention mask ({what}). Only causal attention over "
    "whole sequences is supported: the mask that matters is the global causal mask, which the "
    "strategies apply from global positions; a padding mask cannot be split with the sequence "
    "here. Pass no attention_mask (an all-ones mask means the same) and pad at the end with "
    "IGNORE targets instead (SequenceParallel.prepare does), or pack sequences without padding"
)

# Whether the sharded attention ran during one SequenceParallel.apply: a dynamically scoped
# list (like the axis environment), so a model that bypasses its attention implementation
# is an error, not local attention over each shard.
_RAN: contextvars.ContextVar[list | None] = contextvars.ContextVar("fsharded_sequence_ran", default=None)


def _check(strategy: str, axis: Any, layout: str) -> tuple[str, Any, str]:
    if strategy not in STRATEGIES:
        raise ValueError(f"fs.nn sequence parallelism: strategy must be one of {STRATEGIES}, got {strategy!r}")
    sequence.check_layout(layout)
    if strategy == "hybrid":
        if not (isinstance(axis, (tuple, list)) and len(axis) == 2 and all(isinstance(a, str) for a in axis)):
            raise ValueError(f"strategy='hybrid' shards the sequence over two axes: axis=(ring_axis, "
                             f"ulysses_axis), as in the batch spec P(None, (ring_axis, ulysses_axis)); got "
                             f"axis={axis!r}")
        axis = tuple(axis)
    elif not isinstance(axis, str) or not axis:
        raise ValueError(f"strategy={strategy!r} shards the sequence over one mesh axis (a name), got "
                         f"axis={axis!r}")
    if layout == "zigzag" and strategy != "ring":
        raise ValueError(f"layout='zigzag' is ring attention's causal balance; strategy={strategy!r} needs "
                         f"the contiguous layout")
    return strategy, axis, layout


def _axes(axis: Any) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis)


def _sharded(axis: Any) -> bool:
    """Whether the sequence is sharded over ``axis`` here: bound by an enclosing shard_map
    with more than one shard. Some but not all of a hybrid's axes bound is an error."""
    if axis is None:
        return False
    axes = _axes(axis)
    bound = [a for a in axes if is_bound(a)]
    if bound and len(bound) != len(axes):
        raise ValueError(f"fs.nn sequence parallelism over {axes}: the mesh binds {bound} but not "
                         f"{[a for a in axes if a not in bound]}; give the mesh every axis or none")
    return bool(bound) and axis_size(axes) > 1


def _name(strategy: str, axis: Any, layout: str) -> str:
    # No "/" in it: transformers would take "a/b" for a kernel on the Hub.
    return f"fsharded_{strategy}_{layout}_{'+'.join(_axes(axis))}".replace("/", "_")


def sequence_attention(strategy: str = "ulysses", *, axis: Any = "seq", layout: str = "contiguous") -> str:
    """Register the sequence-parallel attention (and its mask function) with transformers
    and return its name, for ``attn_implementation=`` or ``model.set_attn_implementation``.

    ``strategy``: ``"ulysses"`` (all-to-all to whole sequences for a slice of the heads, the
    degree must divide the query heads), ``"ring"`` (key/value blocks passed around, no head
    cap; ``layout`` ``"contiguous"`` or ``"zigzag"``) or ``"hybrid"`` (``axis=(ring_axis,
    ulysses_axis)``: Ulysses inside each ring position, ring across). Registering the same
    configuration again is a no-op in effect (the name is a function of it)::

        name = fs.nn.sequence_attention("ring", axis="seq", layout="zigzag")
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(..., attn_implementation=name))
        # or: from_pretrained(path, attn_implementation=name), model.set_attn_implementation(name)
    """
    strategy, axis, layout = _check(strategy, axis, layout)
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = _name(strategy, axis, layout)
    AttentionInterface.register(name, _attention(strategy, axis, layout))
    AttentionMaskInterface.register(name, _no_mask)
    return name


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> None:
    """HF's mask function for the registered name: no mask (causality is the attention's),
    and a padding mask refused where HF would otherwise drop it silently for a custom
    implementation without a mask function."""
    if attention_mask is not None:
        raise NotImplementedError(_MASK_ERROR.format(what=f"a {attention_mask.dim()}-d attention_mask"))
    return None


def _refuse(module: nn.Module, attention_mask: Any, dropout: float, kwargs: Mapping[str, Any]) -> None:
    name = type(module).__name__
    if attention_mask is not None:
        raise NotImplementedError(_MASK_ERROR.format(what=f"a {tuple(attention_mask.shape)} mask reached {name}"))
    if getattr(module, "is_cross_attention", False) or getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"fs.nn sequence parallelism: {name} is not causal self-attention "
                                  f"(cross-attention or an encoder); only causal decoders are supported")
    if dropout:
        raise NotImplementedError(f"fs.nn sequence parallelism: attention dropout (p={dropout}) in {name}; set "
                                  f"the config's attention dropout to 0 (Llama attention_dropout, GPT-2 "
                                  f"attn_pdrop) or call model.eval()")
    if kwargs.get("head_mask") is not None:
        raise NotImplementedError(f"fs.nn sequence parallelism: head_mask in {name} is not supported")
    if kwargs.get("output_attentions"):
        raise NotImplementedError("fs.nn sequence parallelism: attention weights are never formed; "
                                  "pass output_attentions=False")
    for k in ("s_aux", "softcap"):
        if kwargs.get(k) is not None:
            raise NotImplementedError(f"fs.nn sequence parallelism: {name} passes {k}= to its attention "
                                      f"(attention sinks / logit soft-capping), which is not supported")


def _scale(module: nn.Module, head_dim: int, scaling: float | None) -> float:
    """``scaling`` as the model passes it (Llama), else GPT-2's eager rule: 1/sqrt(Dh) if
    ``scale_attn_weights``, divided by the layer number with ``scale_attn_by_inverse_layer_idx``."""
    if scaling is not None:
        return float(scaling)
    scale = head_dim**-0.5 if getattr(module, "scale_attn_weights", True) else 1.0
    if getattr(module, "scale_attn_by_inverse_layer_idx", False):
        scale /= float(module.layer_idx + 1)
    return scale


def _local(scale: float, window: int | None) -> Callable:
    """Causal attention on ``(B, T, h, Dh)`` q and ``(B, T, kv, Dh)`` k/v (the layout of
    ``ulysses_attention``), through ``fsharded.kernels.flash_attention``."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, Dh)
        return flash_attention(q, k, v, causal=True, window=window, scale=scale).transpose(1, 2)
    return attend


def _check_heads(module: nn.Module, heads: int, axis: str) -> None:
    n = axis_size(axis)
    if heads % n:
        raise ValueError(f"fs.nn sequence parallelism: Ulysses over {axis!r} (size {n}) splits the attention "
                         f"heads, but {type(module).__name__} has {heads} query heads, which do not divide by "
                         f"{n}: use a degree dividing the heads, strategy='ring' (no head cap) or "
                         f"strategy='hybrid'")


def _attention(strategy: str, axis: Any, layout: str) -> Callable:
    """The function registered with ``AttentionInterface`` for one configuration."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                  **kwargs: Any) -> tuple[torch.Tensor, None]:
        """q ``(B, H, T, Dh)``, k/v ``(B, KV, T, Dh)`` (HF's layout, GQA unrepeated) ->
        ``((B, T, H, Dh), None)``; ``T`` is this shard's when ``axis`` is bound."""
        _refuse(module, attention_mask, dropout, kwargs)
        scale = _scale(module, query.shape[-1], scaling)
        window = kwargs.get("sliding_window")
        if not _sharded(axis):  # the whole sequence here: plain causal (with a cache: the last keys)
            return flash_attention(query, key, value, causal=True, window=window, scale=scale).transpose(1, 2), None
        if key.shape[2] != query.shape[2]:
            raise NotImplementedError(f"fs.nn sequence parallelism: {key.shape[2]} keys for {query.shape[2]} "
                                      f"queries (a key/value cache) while the sequence is sharded; train "
                                      f"with use_cache=False")
        ran = _RAN.get()
        if ran is not None:
            ran.append(type(module).__name__)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, T/n, H or KV, Dh)
        if strategy == "ulysses":
            _check_heads(module, q.shape[2], axis)
            return ulysses_attention(_local(scale, window), q, k, v, axis), None
        if window is not None and window < q.shape[1] * axis_size(axis):
            raise NotImplementedError(f"fs.nn sequence parallelism: a sliding window of {window} tokens "
                                      f"under ring attention (the sequence is {q.shape[1] * axis_size(axis)}); "
                                      f"use strategy='ulysses'")
        if strategy == "ring":
            return ring_attention(q, k, v, axis, layout=layout, scale=scale), None
        ring_axis, a2a_axis = axis
        _check_heads(module, q.shape[2], a2a_axis)
        return ulysses_attention(lambda q, k, v: ring_attention(q, k, v, ring_axis, scale=scale),
                                 q, k, v, a2a_axis), None

    attention.__name__ = attention.__qualname__ = _name(strategy, axis, layout)
    return attention


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor, *, axis: Any = None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``logits`` (B, T, V) against ``targets`` (B, T),
    already shifted (``IGNORE`` skipped), computed in at least float32.

    With the sequence sharded over ``axis`` (bound, more than one shard): this shard's sum
    over the mean real-token count of the shards, ``sum / (psum(count, axis) / n)``, so that
    the mean over the shards (``train_step`` averages over the batch axes) is the mean over
    the real tokens of the whole sequence, however the padding is spread."""
    flat = logits.reshape(-1, logits.shape[-1])
    flat = flat.to(torch.promote_types(flat.dtype, torch.float32))
    flat_targets = targets.reshape(-1)
    if not _sharded(axis):
        return F.cross_entropy(flat, flat_targets, ignore_index=IGNORE)
    total = F.cross_entropy(flat, flat_targets, ignore_index=IGNORE, reduction="sum")
    count = (flat_targets != IGNORE).sum().to(total.dtype)
    return total / (psum(count, axis) / axis_size(axis))


def _logits(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if getattr(out, "logits", None) is not None:
        return out.logits
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"fs.nn sequence parallelism: the model returned a {type(out).__name__}; expected logits "
                    f"or an output with .logits")


class SequenceParallel:
    """A Hugging Face causal LM set up for sequence parallelism (``sequence_parallel``).

    ``loss(params, batch)``: ``train_step``'s loss function, ``batch`` ``{"inputs",
    "targets"}`` (B, T) sharded over ``axis`` (``batch_spec``), as ``prepare`` makes them.
    ``apply(params, input_ids, **kwargs)``: the model's output (logits (B, T/n, V)) with the
    shard's global ``position_ids``. ``params`` / ``blocks`` / ``functional``: those of
    ``fs.nn.functional(model)``. ``attn_implementation``: the registered name the model now
    uses.
    """

    def __init__(self, model: nn.Module | FunctionalModule, *, axis: Any = "seq", strategy: str = "ulysses",
                 layout: str = "contiguous", blocks: str | bool | None = None) -> None:
        self.strategy, self.axis, self.layout = _check(strategy, axis, layout)
        if isinstance(model, FunctionalModule):
            if blocks is not None:
                raise ValueError("fs.nn.sequence_parallel: blocks= is for an nn.Module; a FunctionalModule "
                                 "already has its blocks")
            self.functional = model
        elif isinstance(model, nn.Module):
            self.functional = functional(model, blocks=blocks)
        else:
            raise TypeError(f"fs.nn.sequence_parallel: expected a Hugging Face model (nn.Module) or "
                            f"fs.nn.functional(model), got {type(model).__name__}")
        self.module = self.functional.module
        self.attn_implementation = sequence_attention(self.strategy, axis=self.axis, layout=self.layout)
        switch(self.module, self.attn_implementation)

    @property
    def params(self) -> Any:
        return self.functional.params

    @property
    def blocks(self) -> str | None:
        return self.functional.blocks

    def batch_spec(self, data: str | tuple[str, ...] | None = None) -> P:
        """The spec of a (B, T) batch: rows over ``data`` (if any), the sequence over the axis."""
        return P(data, self.axis)

    def degree(self, mesh: Mesh | int | None) -> int:
        """How many shards the sequence is split into on ``mesh`` (1 where it lacks the axis)."""
        if mesh is None:
            return 1
        if isinstance(mesh, int):
            return mesh
        shape = mesh.shape
        n = 1
        for a in _axes(self.axis):
            n *= shape.get(a, 1)
        return n

    def positions(self, length: int, *, device: torch.device | str | None = None) -> torch.Tensor:
        """``position_ids`` (1, ``length``) of this shard's tokens: global, in the layout."""
        return sequence.positions(length, self.axis, self.layout, device=device)[None]

    def apply(self, params: Any, /, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        """``model(input_ids, position_ids=<global>, use_cache=False, **kwargs)`` on ``params``."""
        if kwargs.get("attention_mask") is not None:
            raise NotImplementedError(_MASK_ERROR.format(what="attention_mask= given to apply"))
        if "position_ids" in kwargs:
            raise ValueError("fs.nn sequence parallelism: position_ids are computed from each shard's offset "
                             "(SequenceParallel.positions); do not pass them")
        kwargs.setdefault("use_cache", False)
        pos = self.positions(input_ids.shape[1], device=input_ids.device)
        token = _RAN.set([])
        try:
            out = self.functional.apply(params, input_ids=input_ids, position_ids=pos, **kwargs)
            ran = _RAN.get()
        finally:
            _RAN.reset(token)
        if not ran and _sharded(self.axis):
            raise RuntimeError(
                f"fs.nn sequence parallelism: {type(self.module).__name__} ran without its attention "
                f"implementation {self.attn_implementation!r} (config._attn_implementation is "
                f"{getattr(self.module.config, '_attn_implementation', None)!r}): each shard would attend "
                f"within its own tokens only. Its attention must dispatch through transformers' "
                f"AttentionInterface")
        return out

    def loss(self, params: Any, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy over the real tokens (``causal_lm_loss``)."""
        if not (isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch):
            got = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(f"fs.nn sequence parallelism: the batch must be {{'inputs', 'targets'}} (B, T), "
                             f"already shifted (a shard's last target is the next shard's first token): "
                             f"use SequenceParallel.prepare(batch, mesh); got {got}")
        inputs, targets = batch["inputs"], batch["targets"]
        if inputs.shape != targets.shape:
            raise ValueError(f"batch['inputs'] {tuple(inputs.shape)} and batch['targets'] "
                             f"{tuple(targets.shape)} must have the same shape (B, T)")
        return causal_lm_loss(_logits(self.apply(params, inputs)), targets, axis=self.axis)

    def prepare(self, batch: Mapping[str, torch.Tensor], mesh: Mesh | int | None = None, *,
                pad_id: int = 0) -> dict[str, torch.Tensor]:
        """A global batch ``{"tokens": (B, T + 1)}`` (or ``{"inputs", "targets"}`` (B, T))
        -> ``{"inputs", "targets"}`` for ``mesh``: padded at the end to a multiple of the
        degree (twice it for zigzag; inputs ``pad_id``, targets ``IGNORE``) and, for the
        zigzag layout, in zigzag order."""
        if isinstance(batch, Mapping) and "tokens" in batch:
            tokens = batch["tokens"]
            if tokens.dim() != 2 or tokens.shape[1] < 2:
                raise ValueError(f"batch['tokens'] must have shape (B, T + 1) with T >= 1, got "
                                 f"{tuple(tokens.shape)}")
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
        elif isinstance(batch, Mapping) and "inputs" in batch and "targets" in batch:
            inputs, targets = batch["inputs"], batch["targets"]
        else:
            got = list(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise ValueError(f"batch must have 'tokens' (B, T + 1) or 'inputs' and 'targets' (B, T); got {got}")
        n = self.degree(mesh)
        multiple = n * (2 if self.layout == "zigzag" and n > 1 else 1)
        pad = -inputs.shape[1] % multiple
        if pad:
            inputs = F.pad(inputs, (0, pad), value=pad_id)
            targets = F.pad(targets, (0, pad), value=IGNORE)
        if self.layout == "zigzag":
            inputs, targets = sequence.zigzag(inputs, n), sequence.zigzag(targets, n)
        return {"inputs": inputs, "targets": targets.contiguous()}

    def restore(self, x: torch.Tensor, mesh: Mesh | int | None = None, *, dim: int = 1) -> torch.Tensor:
        """A global output (logits) of a prepared batch back in sequence order."""
        return sequence.unzigzag(x, self.degree(mesh), dim) if self.layout == "zigzag" else x

    def __repr__(self) -> str:
        return (f"SequenceParallel({type(self.module).__name__}: strategy={self.strategy!r}, axis={self.axis!r}, "
                f"layout={self.layout!r}, attn_implementation={self.attn_implementation!r}, "
                f"blocks={self.blocks!r})")


def sequence_parallel(model: nn.Module | FunctionalModule, *, axis: Any = "seq", strategy: str = "ulysses",
                      layout: str = "contiguous", blocks: str | bool | None = None) -> SequenceParallel:
    """``model`` (a Hugging Face causal LM, or ``fs.nn.functional`` of one) with its attention
    switched to ``sequence_attention(strategy, axis=axis, layout=layout)`` (in place), as a
    ``SequenceParallel``: ``.loss``, ``.params``, ``.blocks``, ``.batch_spec(data)`` for
    ``train_step``, ``.prepare(batch, mesh)`` for each batch (see the module docstring).
    ``blocks``: as for ``fs.nn.functional``."""
    return SequenceParallel(model, axis=axis, strategy=strategy, layout=layout, blocks=blocks)
