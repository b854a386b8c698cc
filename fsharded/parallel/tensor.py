"""Megatron tensor parallelism for any ``nn.Module``: a plan from parameter paths to roles.

A plan names, by glob over parameter paths (``module.named_parameters()`` names), the
Megatron role of each ``nn.Linear`` / ``nn.Embedding``; it gives the spec tree for
``train_step`` and, while applied, runs those layers in per-shard form with the
collectives where the roles meet. Torch layout: a Linear's weight is ``[out, in]``.

==========  ===================  =============  =========  ===================================
role        module               weight spec    bias spec  forward, per shard
==========  ===================  =============  =========  ===================================
colwise     Linear               P(axis, None)  P(axis)    input ``pvary``'d once (Megatron's f:
                                                           its gradient is summed over axis);
                                                           output features split
rowwise     Linear               P(None, axis)  P()        input must be split; partial output
                                                           ``psum``'ed (Megatron's g), bias
                                                           added once, after the psum
vocab       Embedding ``[V, D]``  P(axis, None)  --         lookup of this shard's vocab rows,
                                                           zeros elsewhere, ``psum``
vocab       Linear ``[V, D]``     P(axis, None)  P(axis)    colwise, then the logits gathered
            (an output head)                               (``all_gather_invariant``)
replicated  any                  P()            P()        unchanged
==========  ===================  =============  =========  ===================================

HF GPT-2's ``Conv1D`` (a Linear stored ``[in, out]``, ``x @ weight + bias``) takes the
``colwise`` and ``rowwise`` roles with the weight specs transposed: ``P(None, axis)`` and
``P(axis, None)``.

A Linear tied to a ``vocab`` Embedding (nanoGPT's ``lm_head``) is a ``vocab`` Linear, and
the other way round. The layers act on what their weights are: outside ``shard_map``, or
on a mesh where the weight is replicated, they are the plain layers, so keeping a plan
applied changes nothing there.

>>> import torch, fsharded as fs
>>> mlp = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
>>> tp = fs.parallel.tensor.plan(mlp, {"0.*": "colwise", "2.weight": "rowwise"}, axis="tensor")
>>> tp.specs["0.weight"], tp.specs["2.weight"], tp.specs["2.bias"]
(PartitionSpec('tensor', None), PartitionSpec(None, 'tensor'), PartitionSpec())
>>> f = fs.shard_map(tp.apply, mesh=fs.Mesh({"tensor": 2}), in_specs=(tp.specs, fs.P()),
...                  out_specs=fs.P())
>>> x = torch.randn(3, 4)
>>> torch.allclose(f(tp.params, x), mlp(x), atol=1e-6)
True

Attention with split heads needs a module that reads its local head count from the
tensors (HF Llama/Mistral/Qwen2 reshape with ``-1`` heads: ``LLAMA``). nanoGPT's attention
reads the full width from its input (``C = x.size(-1)``) and fuses q, k, v in ``c_attn``:
no per-layer rule splits it, so ``NANOGPT`` parallelizes the MLP (and the tied vocabulary)
and marking ``c_attn`` ``colwise`` is an error. The bundled GPT does its own collectives: its
plan is ``fsharded.models.gpt_plans`` (``gpt.tensor_parallel_specs``).
"""

from __future__ import annotations

import contextlib
import functools
import re
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fsharded._tree import tree_flatten_with_paths, tree_map_with_path
from fsharded.mesh import P
from fsharded.mesh._tree import rules
from fsharded.parallel.blocks import active as run_blocks_active
from fsharded.spmd.collectives import (
    all_gather_invariant,
    axis_index,
    is_bound,
    psum,
    pvary,
    varying_axes,
)

__all__ = ["plan", "TensorPlan", "ROLES", "LLAMA", "NANOGPT", "GPT2"]

ROLES = ("colwise", "rowwise", "vocab", "replicated")

LLAMA: dict[str, str] = {
    "*.self_attn.q_proj.weight": "colwise",
    "*.self_attn.k_proj.weight": "colwise",
    "*.self_attn.v_proj.weight": "colwise",
    "*.self_attn.o_proj.weight": "rowwise",
    "*.mlp.gate_proj.weight": "colwise",
    "*.mlp.up_proj.weight": "colwise",
    "*.mlp.down_proj.weight": "rowwise",
}
"""HF Llama / Mistral / Qwen2 names: heads and MLP width split (biases follow their
weights). ``num_attention_heads`` and ``num_key_value_heads`` must divide by the axis
size. Add ``{"*embed_tokens.weight": "vocab", "lm_head.weight": "vocab"}`` to split the
vocabulary too."""

NANOGPT: dict[str, str] = {
    "transformer.h.*.mlp.c_fc.weight": "colwise",
    "transformer.h.*.mlp.c_proj.weight": "rowwise",
    "transformer.wte.weight": "vocab",
}
"""karpathy/nanoGPT names: the MLP width and the (tied) vocabulary split; attention stays
replicated (its fused ``c_attn`` and ``C = x.size(-1)`` reshapes cannot be split by a
per-layer rule)."""

GPT2: dict[str, str] = {
    "transformer.h.*.mlp.c_fc.weight": "colwise",
    "transformer.h.*.mlp.c_proj.weight": "rowwise",
    "transformer.wte.weight": "vocab",
}
"""HF ``GPT2LMHeadModel`` names (``Conv1D`` layers): the MLP width and the tied vocabulary
split; attention stays replicated (its fused ``c_attn`` is split by ``split_size``, the full
width)."""

_FUSED_NAMES = {"c_attn", "qkv", "qkv_proj", "Wqkv", "query_key_value", "W_pack"}
_UNSET = object()  # "no pattern matched this leaf": its module's role decides


def plan(model: Any, table: Mapping[str, str], *, axis: str, params: Any = None,
         allow_unmatched: bool = False) -> TensorPlan:
    """A tensor-parallel plan for ``model`` from ``{parameter path glob: role}``.

    ``model``: an ``nn.Module``, or an ``fs.nn.functional`` object (anything with
    ``.module`` and ``.params``). ``params``: the parameter tree the specs are built for;
    by default the object's ``.params``, or for a module ``{name: tensor}`` of its
    ``named_parameters()`` (the form ``torch.func.functional_call`` takes; tied weights
    once). Patterns are ``fsharded.rules`` patterns, first match wins; a pattern that
    matches no parameter is an error unless ``allow_unmatched``. A role on a weight or
    a bias applies to its module, whose other parameter follows (see the module table).
    ``axis``: the mesh axis to split over.
    """
    if isinstance(model, nn.Module):
        module, fm = model, None
    elif isinstance(getattr(model, "module", None), nn.Module) and hasattr(model, "params"):
        module, fm = model.module, model
    else:
        raise TypeError(
            f"tensor.plan: model must be an nn.Module or an fs.nn.functional object (with "
            f".module and .params), got {type(model).__name__}"
        )
    if not isinstance(axis, str) or not axis:
        raise TypeError(f"tensor.plan: axis must be a mesh axis name, got {axis!r}")
    if not isinstance(table, Mapping):
        raise TypeError(f"tensor.plan: table must map path patterns to roles, got {type(table).__name__}")
    bad = [f"  {pat!r}: {role!r}" for pat, role in table.items() if role not in ROLES]
    if bad:
        raise ValueError(
            "tensor.plan: unknown role(s):\n" + "\n".join(bad)
            + f"\nThe roles are {', '.join(ROLES)}"
        )
    if params is None:
        params = fm.params if fm is not None else {
            n: p.detach() for n, p in module.named_parameters()}
    return TensorPlan(module, fm, params, dict(table), axis, allow_unmatched)


class TensorPlan:
    """What ``plan`` returns: ``.specs``, ``.params``, ``.applied()``, ``.apply``, ``.wrap``.

    ``applied()`` is a context manager that swaps the forward of the planned layers for
    their per-shard form (instance ``forward`` overrides, restored on exit; nestable);
    ``apply`` and ``wrap`` open it for one call. A ZeRO-3 step with ``blocks=`` re-runs
    each block's forward in backward, after the loss function has returned: there the
    plan must be open around the step calls (``with plan.applied(): for batch in ...``),
    and opening it inside the loss is an error rather than a silently different model.

    >>> tp = plan(torch.nn.Linear(4, 8), {"weight": "colwise"}, axis="tp")
    >>> tp
    TensorPlan(axis='tp', 1 layers:
      <root>  colwise Linear)
    """

    def __init__(self, module: nn.Module, fm: Any, params: Any, table: dict[str, str],
                 axis: str, allow_unmatched: bool) -> None:
        self.module, self.params, self.axis = module, params, axis
        self._fm = fm
        self._layers = _resolve(module, params, table, allow_unmatched)  # id -> _Layer
        names = {n: layer for layer in self._layers.values() for n in layer.names}

        def spec(path: str, _leaf: Any) -> P:
            prefix, _, pname = path.rpartition(".")
            layer = names.get(prefix)
            return P() if layer is None else _spec(layer.role, pname, axis, layer.kind)

        self.specs = tree_map_with_path(spec, params)
        self._depth = 0  # open scopes
        self._saved: dict[int, Any] = {}
        self._last: tuple[weakref.ref, torch.Tensor] | None = None

    # -- use --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def applied(self) -> Iterator[TensorPlan]:
        """Run the planned layers in their per-shard form inside the ``with`` body."""
        with self._scope():
            yield self

    @contextlib.contextmanager
    def _scope(self) -> Iterator[TensorPlan]:
        if self._depth == 0:
            if run_blocks_active():
                # Opened inside a per-block ZeRO-3 step's loss: it closes when the loss
                # returns, before the step re-runs each block's forward in backward, and
                # the re-run would be the plain layers on split weights (silently wrong).
                raise RuntimeError(
                    "tensor plan: applied inside the loss of a step that re-runs its blocks "
                    "in backward (ZeRO-3 with blocks=), where the plan is no longer applied; "
                    "open it around the step calls instead: `with plan.applied(): for batch "
                    "in ...: state, m = step(state, batch)`"
                )
            self._install()
        self._depth += 1
        try:
            yield self
        finally:
            self._depth -= 1
            if self._depth == 0:
                self._uninstall()

    def apply(self, params: Any, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on ``params`` (a tree shaped like ``.params``), applied:
        ``fm.apply`` for an ``fs.nn`` object, else ``torch.func.functional_call``."""
        with self._scope():
            if self._fm is not None:
                return self._fm.apply(params, *args, **kwargs)
            paths, leaves, _ = tree_flatten_with_paths(params)
            return torch.func.functional_call(self.module, dict(zip(paths, leaves)), args, kwargs)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run under ``applied()`` (e.g. a loss for ``train_step``)."""

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with self._scope():
                return fn(*args, **kwargs)

        return run

    def __repr__(self) -> str:
        groups: dict[tuple[str, str, str], int] = {}
        for layer in self._layers.values():
            key = (re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", layer.label), layer.role,
                   type(layer.module).__name__)
            groups[key] = groups.get(key, 0) + 1
        rows = [f"  {n}  {role} {kind}" + (f" x{c}" if c > 1 else "")
                for (n, role, kind), c in groups.items()]
        return f"TensorPlan(axis={self.axis!r}, {len(self._layers)} layers:\n" + "\n".join(rows) + ")"

    # -- the per-shard layers ---------------------------------------------------------------

    def _install(self) -> None:
        for key, layer in self._layers.items():
            mod = layer.module
            current = mod.__dict__.get("forward", _UNSET)
            if getattr(current, "_fsharded_tensor_plan", None) is not None:
                self._uninstall()
                raise RuntimeError(
                    f"tensor.plan: {layer.label} is already run by another applied plan; "
                    f"apply one plan per module at a time"
                )
            self._saved[key] = current
            fn = functools.partial(_FORWARDS[(layer.role, layer.kind)], self, layer)
            fn._fsharded_tensor_plan = self  # type: ignore[attr-defined]
            mod.forward = fn
        self._last = None

    def _uninstall(self) -> None:
        for key, saved in self._saved.items():
            mod = self._layers[key].module
            if saved is _UNSET:
                mod.__dict__.pop("forward", None)
            else:
                mod.forward = saved
        self._saved.clear()
        self._last = None

    def _split(self, w: torch.Tensor) -> bool:
        """Whether ``w`` is split over the axis here (else the layer runs as it is)."""
        return is_bound(self.axis) and self.axis in varying_axes(w)

    def _enter(self, x: torch.Tensor) -> torch.Tensor:
        """Megatron's f on a colwise layer's input, once per input: q/k/v (gate/up) read
        the same tensor, so one pvary (one psum in backward) serves them all, where the
        implicit pvary would add one per layer."""
        if self.axis in varying_axes(x):
            return x
        last = self._last
        if last is not None and last[0]() is x:
            return last[1]
        y = pvary(x, self.axis)
        self._last = (weakref.ref(x), y)  # dropped at the next rowwise/vocab layer
        return y

    def _done(self) -> None:
        """A group of colwise layers has ended (a rowwise or vocab layer runs): drop the
        shared input, so the slot does not hold this forward's graph after it."""
        self._last = None


class _Layer:
    """One planned module: its names (several when shared or tied), role and kind."""

    __slots__ = ("module", "names", "role", "kind", "head_dim", "label")

    def __init__(self, module: nn.Module, names: list[str], role: str, head_dim: int | None):
        self.module, self.names, self.role = module, names, role
        self.kind = "embedding" if isinstance(module, nn.Embedding) else \
            "conv1d" if _is_conv1d(module) else "linear"
        self.head_dim = head_dim
        self.label = names[0] or "<root>"


def _is_conv1d(mod: nn.Module) -> bool:
    """HF transformers' ``Conv1D`` (GPT-2's layers), recognised without importing it."""
    w = mod._parameters.get("weight")
    return (type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "nf", None), int)
            and w is not None and w.dim() == 2 and w.shape[1] == mod.nf)


def _spec(role: str, pname: str, axis: str, kind: str = "linear") -> P:
    if kind == "conv1d" and pname == "weight" and role in ("colwise", "rowwise"):
        return P(None, axis) if role == "colwise" else P(axis, None)
    if role == "rowwise":
        return P(None, axis) if pname == "weight" else P()
    if role in ("colwise", "vocab"):
        return P(axis, None) if pname == "weight" else P(axis)
    return P()


def _resolve(module: nn.Module, params: Any, table: dict[str, str],
             allow_unmatched: bool) -> dict[int, _Layer]:
    """The planned modules, by id: each matched leaf's module and role, checked, with
    the modules tied to them."""
    role_tree = rules(params, table, default=_UNSET, allow_unmatched=allow_unmatched)
    paths, roles, _ = tree_flatten_with_paths(role_tree)
    all_names: dict[int, list[str]] = {}
    for name, m in module.named_modules(remove_duplicate=False):
        all_names.setdefault(id(m), []).append(name)
    errors: list[str] = []
    chosen: dict[int, tuple[nn.Module, str, str]] = {}  # id -> (module, role, first path)
    for path, role in zip(paths, roles):
        if role is _UNSET:
            continue
        prefix, _, pname = path.rpartition(".")
        try:
            mod = module.get_submodule(prefix)
        except AttributeError:
            errors.append(f"  {path}: no submodule {prefix!r} in {type(module).__name__} (the "
                          f"params tree must be named like module.named_parameters())")
            continue
        if pname not in mod._parameters:
            errors.append(f"  {path}: {pname!r} is not a parameter of {prefix} "
                          f"({type(mod).__name__}); plan roles apply to parameters")
            continue
        msg = _check_role(mod, prefix, role) if role != "replicated" else None
        if msg:
            errors.append(f"  {path}: {msg}")
            continue
        had = chosen.get(id(mod))
        if had is not None and had[1] != role:
            errors.append(f"  {path}: role {role!r}, but {had[2]} of the same module has {had[1]!r}")
            continue
        chosen.setdefault(id(mod), (mod, role, path))
    # Tied weights: every module holding a planned weight runs with it in that layout.
    holders: dict[int, list[nn.Module]] = {}
    for m in module.modules():
        w = m._parameters.get("weight")
        if w is not None:
            holders.setdefault(id(w), []).append(m)
    for mod, role, path in list(chosen.values()):
        if role == "replicated" or mod._parameters.get("weight") is None:
            continue
        for other in holders[id(mod._parameters["weight"])]:
            if other is mod:
                continue
            tie = f"{all_names[id(other)][0]} (tied to {path})"
            ok = role == "vocab" and isinstance(other, (nn.Linear, nn.Embedding)) or (
                type(other) is type(mod) and isinstance(other, nn.Linear))
            if not ok:
                errors.append(f"  {tie}: a {type(other).__name__} holding a {role!r} weight is "
                              f"not supported; untie it or keep the weight replicated")
            elif id(other) in chosen and chosen[id(other)][1] != role:
                errors.append(f"  {tie}: has role {chosen[id(other)][1]!r}, its tied weight "
                              f"{role!r}; give both one role")
            else:
                chosen.setdefault(id(other), (other, role, path))
    if errors:
        raise ValueError("tensor.plan: the table does not fit the model:\n" + "\n".join(errors))
    layers = {}
    for key, (mod, role, _) in chosen.items():
        if role == "replicated":
            continue
        names = all_names[key]
        parent = module.get_submodule(names[0].rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None) if role == "colwise" else None
        layers[key] = _Layer(mod, names, role, head_dim if isinstance(head_dim, int) else None)
    return layers


def _check_role(mod: nn.Module, name: str, role: str) -> str | None:
    """Why ``role`` does not fit ``mod``, or None."""
    kind = type(mod).__name__
    conv1d = _is_conv1d(mod)
    if role in ("colwise", "rowwise") and not (isinstance(mod, nn.Linear) or conv1d):
        extra = (" (an Embedding's vocabulary rows are split by role 'vocab')"
                 if isinstance(mod, nn.Embedding) else "")
        return f"role {role!r} needs an nn.Linear (or HF's Conv1D), {name} is a {kind}{extra}"
    if role == "vocab" and not isinstance(mod, (nn.Linear, nn.Embedding)):
        return f"role 'vocab' needs an nn.Embedding or an nn.Linear output head, {name} is a {kind}"
    if role == "colwise":
        out, inp = mod.weight.shape if not conv1d else reversed(mod.weight.shape)
        parent_name = name.rpartition(".")[0]
        last = name.rpartition(".")[2]
        if last in _FUSED_NAMES or (out == 3 * inp and "attn" in name.lower()):
            return (
                f"{name} looks like a fused q,k,v projection ([{out}, {inp}]): split colwise, "
                f"shard 0 would get all of q and part of k, not its own heads of each. Keep it "
                f"replicated (leave it out of the table, as NANOGPT does: attention then runs "
                f"whole and the MLP split), or use a model with separate q/k/v projections "
                f"(LLAMA), or the bundled GPT (gpt.tensor_parallel_specs)"
            ) + (f"; the attention module is {parent_name}" if parent_name else "")
    if isinstance(mod, nn.Embedding) and (mod.max_norm is not None or mod.scale_grad_by_freq
                                          or mod.sparse):
        return (f"{name}: an Embedding with max_norm, scale_grad_by_freq or sparse=True cannot "
                f"be vocab-split (each shard sees part of the rows); keep it replicated")
    return None


# -- per-shard forwards, one per (role, kind) --------------------------------------------------


def _colwise(tp: TensorPlan, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    w = mod.weight
    if not tp._split(w):
        return F.linear(x, w, mod.bias)
    if layer.head_dim and w.shape[0] % layer.head_dim:
        parent = layer.names[0].rpartition(".")[0]
        raise ValueError(
            f"tensor plan: {layer.label} has {w.shape[0]} output features per shard over "
            f"axis {tp.axis!r}, not a whole number of heads of head_dim {layer.head_dim} "
            f"({parent}.head_dim): its number of heads must be divisible by the size of "
            f"{tp.axis!r}; use a smaller tensor-parallel size or keep {layer.label} replicated"
        )
    return F.linear(tp._enter(x), w, mod.bias)  # (..., out/tp)


def _rowwise(tp: TensorPlan, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    w = mod.weight
    if not tp._split(w):
        return F.linear(x, w, mod.bias)
    if x.shape[-1] != w.shape[-1]:
        raise ValueError(
            f"tensor plan: rowwise {layer.label} expects its input split over axis "
            f"{tp.axis!r} ({w.shape[-1]} features per shard) but got {x.shape[-1]}: the layer "
            f"feeding it must be colwise (with the heads or hidden units it produces split), "
            f"or mark {layer.label} replicated too"
        )
    tp._done()
    y = psum(F.linear(x, w), tp.axis)  # (..., out): the sum of the shards' partial products
    return y if mod.bias is None else y + mod.bias  # once, after the sum


def _vocab_linear(tp: TensorPlan, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    w = mod.weight
    if not tp._split(w):
        return F.linear(x, w, mod.bias)
    logits = F.linear(tp._enter(x), w, mod.bias)  # (..., V/tp)
    tp._done()
    return all_gather_invariant(logits, tp.axis, dim=-1)  # (..., V), the same on every shard


def _vocab_embedding(tp: TensorPlan, layer: _Layer, ids: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    w = mod.weight
    if not tp._split(w):
        return F.embedding(ids, w, mod.padding_idx, mod.max_norm, mod.norm_type,
                           mod.scale_grad_by_freq, mod.sparse)
    tp._done()
    rows = w.shape[0]  # this shard's vocabulary: [index * rows, (index + 1) * rows)
    local = ids - axis_index(tp.axis) * rows
    inside = (local >= 0) & (local < rows)
    out = F.embedding(torch.where(inside, local, 0), w)  # (..., D)
    if mod.padding_idx is not None:  # the padding row gets no gradient, as in F.embedding
        out = torch.where((ids == mod.padding_idx).unsqueeze(-1), out.detach(), out)
    out = torch.where(inside.unsqueeze(-1), out, 0.0)
    return psum(out, tp.axis)  # each id's row from the one shard that holds it


def _conv1d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """HF Conv1D's arithmetic: ``addmm(bias, x, weight)`` over the flattened rows."""
    x2 = x.reshape(-1, x.shape[-1])
    y = torch.addmm(b, x2, w) if b is not None else x2 @ w
    return y.view(*x.shape[:-1], w.shape[1])


def _colwise_conv1d(tp: TensorPlan, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    if not tp._split(mod.weight):
        return _conv1d(x, mod.weight, mod.bias)
    return _conv1d(tp._enter(x), mod.weight, mod.bias)  # (..., out/tp)


def _rowwise_conv1d(tp: TensorPlan, layer: _Layer, x: torch.Tensor) -> torch.Tensor:
    mod = layer.module
    w = mod.weight
    if not tp._split(w):
        return _conv1d(x, w, mod.bias)
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"tensor plan: rowwise {layer.label} expects its input split over axis "
            f"{tp.axis!r} ({w.shape[0]} features per shard) but got {x.shape[-1]}: the layer "
            f"feeding it must be colwise, or mark {layer.label} replicated too"
        )
    tp._done()
    y = psum(_conv1d(x, w, None), tp.axis)  # the sum of the shards' partial products
    return y if mod.bias is None else y + mod.bias


_FORWARDS = {
    ("colwise", "linear"): _colwise,
    ("rowwise", "linear"): _rowwise,
    ("colwise", "conv1d"): _colwise_conv1d,
    ("rowwise", "conv1d"): _rowwise_conv1d,
    ("vocab", "linear"): _vocab_linear,
    ("vocab", "embedding"): _vocab_embedding,
}
