"""Mixture of experts: top-k routing with fixed capacity, balancing losses, static-shape
dispatch and combine, and expert parallelism over a mesh axis.

A token's router logits ``(T, E)`` give softmax probabilities; its ``top_k`` experts are
the highest (plus an optional selection bias), its combine weights their probabilities
(Switch, top-1) or those renormalised to sum to 1 (GShard, top-2 and up). Each expert
takes at most ``capacity`` assignments per shard; the rest are dropped, first choices
served before second choices, each in token order (GShard). ``capacity_factor=None`` is
dropless: capacity = tokens, so no expert can overflow.

Shapes are static everywhere (no ``nonzero``, no ``.item()``), so the layer runs under
``vmap`` (the virtual mesh), ``torch.func.grad`` and ``make_fx``:

- capacity form: assignment ``(t, j)`` of token ``t`` to expert ``e`` at slot ``c`` is
  scattered into row ``(e, c)`` of an ``(E, C, d)`` buffer; combine gathers the rows back
  and sums them weighted;
- sorted form (dropless): the ``T * k`` assignments sorted by expert id (stable) are
  contiguous groups, one per expert; a gather by sorted index lays group ``e`` out as row
  ``e`` of an ``(E, T, d)`` buffer (zero past the group's end) and combine undoes the sort.
  Both forms fill the same slots with the same tokens.

Expert parallelism (inside ``shard_map`` with ``w1``/``w2`` split over ``axis`` on dim 0
and the tokens split over it too): each shard routes its own tokens with its own capacity,
one ``all_to_all`` sends every shard the slots of its ``E/n`` experts, ``(E, C, d) ->
(E/n, n*C, d)``, and one brings the outputs back. Per direction a shard sends
``(n - 1)/n`` of its ``E * C * d`` buffer. Each shard's result is exactly the
single-device layer on that shard's tokens.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from fsharded.kernels import moe as K
from fsharded.kernels._dispatch import choose
from fsharded.mesh import P
from fsharded.spmd._schedule import stands_for
from fsharded.spmd._wrappers import transforms_active
from fsharded.spmd.collectives import (
    all_to_all,
    axis_size,
    is_bound,
    psum,
    pvary_to_union,
    varying_axes,
)

__all__ = [
    "Routing",
    "capacity",
    "route",
    "load_balancing_loss",
    "z_loss",
    "update_bias",
    "dispatch",
    "combine",
    "sort_by_expert",
    "sorted_dispatch",
    "sorted_combine",
    "expert_mlp",
    "moe_layer",
    "init",
    "expert_parallel_specs",
]

Params = dict[str, torch.Tensor]


class Routing(NamedTuple):
    """Where each of ``T`` tokens goes: its ``k`` choices, each with an expert, a weight and
    a slot in that expert's buffer."""

    experts: torch.Tensor  # (T, k) int64: chosen expert ids, best first
    weights: torch.Tensor  # (T, k) combine weights (normalised before drops; a dropped choice adds nothing)
    slots: torch.Tensor  # (T, k) int64: position in the expert's buffer (>= capacity where dropped)
    kept: torch.Tensor  # (T, k) bool: the choice fits its expert's capacity
    probs: torch.Tensor  # (T, E) router softmax probabilities
    load: torch.Tensor  # (E,) float32: assignments routed to each expert, before drops
    drop_fraction: torch.Tensor  # () float32: dropped assignments / (T * k)
    capacity: int  # slots per expert (C)


def capacity(tokens: int, experts: int, *, top_k: int = 1, capacity_factor: float | None = 1.0,
             min_capacity: int = 4) -> int:
    """Slots per expert for ``tokens`` tokens on one shard:
    ``min(tokens, max(min_capacity, ceil(top_k * tokens * capacity_factor / experts)))``;
    ``capacity_factor=None`` (dropless) gives ``tokens``. An expert never gets more than
    ``tokens`` assignments (a token picks distinct experts), hence the cap.

    >>> capacity(32, 4, top_k=2, capacity_factor=1.25)
    20
    """
    if capacity_factor is None:
        return tokens
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor!r}")
    if min_capacity < 0:
        raise ValueError(f"min_capacity must be >= 0, got {min_capacity!r}")
    c = math.ceil(top_k * tokens * capacity_factor / experts)
    return min(tokens, max(min_capacity, c))


def _check_top_k(top_k: int, experts: int, where: str) -> None:
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"{where}: top_k must be a positive int, got {top_k!r}")
    if top_k > experts:
        raise ValueError(f"{where}: top_k={top_k} but the router scores only {experts} experts: "
                         f"use top_k <= {experts}, or more experts")


def route(logits: torch.Tensor, *, top_k: int = 1, capacity_factor: float | None = 1.0,
          min_capacity: int = 4, normalize: bool | None = None,
          selection_bias: torch.Tensor | None = None) -> Routing:
    """Top-``k`` routing of router ``logits`` ``(T, E)`` with ``capacity(T, E, ...)`` slots
    per expert.

    ``probs = softmax(logits)``; the chosen experts are the ``top_k`` largest of ``probs +
    selection_bias`` (DeepSeek-V3's balancing bias, ``(E,)``, which affects the choice only);
    the weights are the chosen ``probs``, divided by their sum when ``normalize`` (default:
    ``top_k > 1``, so Switch for top-1 and GShard for top-2). Slots are handed out in choice
    order, then token order: every first choice is served before any second choice, so the
    ``j``-th choice of token ``t`` is dropped when its expert already has ``capacity``
    assignments from choices ``< j`` or from tokens ``< t`` at choice ``j``.

    >>> r = route(torch.tensor([[2.0, 0.0], [1.0, 0.0], [3.0, 0.0]]), min_capacity=1, capacity_factor=1.0)
    >>> r.capacity, r.kept[:, 0].tolist(), r.load.tolist()
    (2, [True, True, False], [3.0, 0.0])
    """
    if logits.dim() != 2:
        raise ValueError(f"route: logits must be (tokens, experts), got shape {tuple(logits.shape)}")
    T, E = logits.shape
    _check_top_k(top_k, E, "route")
    if normalize is None:
        normalize = top_k > 1
    C = capacity(T, E, top_k=top_k, capacity_factor=capacity_factor, min_capacity=min_capacity)
    probs = torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # (T, E)
    scores = probs.detach() if selection_bias is None else probs.detach() + selection_bias.to(probs.dtype)
    experts = torch.topk(scores, top_k, dim=-1).indices  # (T, k)
    weights = probs.gather(1, experts)  # (T, k)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Slot of each assignment: how many earlier assignments (choice-major, then token order)
    # went to the same expert.
    onehot = (experts.t().unsqueeze(-1) == torch.arange(E, device=logits.device)).to(torch.int64)  # (k, T, E)
    flat = onehot.reshape(top_k * T, E)
    before = (torch.cumsum(flat, dim=0) - flat).reshape(top_k, T, E)
    slots = (before * onehot).sum(-1).t()  # (T, k)
    kept = slots < C
    load = flat.sum(0).to(torch.float32)  # (E,)
    drop_fraction = 1.0 - kept.sum().to(torch.float32) / (T * top_k)
    return Routing(experts, weights, slots, kept, probs, load, drop_fraction, C)


def load_balancing_loss(probs: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e``: ``f_e`` the fraction of tokens
    whose first choice ``top1`` ``(T,)`` is ``e`` (no gradient), ``P_e`` the mean of
    ``probs`` ``(T, E)`` over tokens. 1 at uniform routing, ``E`` when every token and all
    the probability go to one expert.

    >>> load_balancing_loss(torch.tensor([[0.75, 0.25], [0.5, 0.5]]), torch.tensor([0, 0]))
    tensor(1.2500)
    """
    E = probs.shape[-1]
    f = (top1.unsqueeze(-1) == torch.arange(E, device=probs.device)).to(probs.dtype).mean(0)  # (E,)
    return E * (f * probs.mean(0)).sum()


def z_loss(logits: torch.Tensor) -> torch.Tensor:
    """Router z-loss (ST-MoE): the mean over tokens of ``logsumexp(logits)**2``; logits
    ``(T, E)``, computed in at least float32."""
    lse = torch.logsumexp(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return (lse**2).mean()


def update_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's aux-loss-free balancing step: ``bias + rate * sign(mean(load) - load)``
    for a per-expert selection bias and load ``(E,)``, outside the gradient. Under data or
    expert parallelism pass the load summed over the token axes, so every shard takes the
    same step.

    >>> update_bias(torch.zeros(3), torch.tensor([4.0, 1.0, 1.0]), 0.1)
    tensor([-0.1000,  0.1000,  0.1000])
    """
    with torch.no_grad():
        load = load.to(bias.dtype)
        return bias.detach() + rate * torch.sign(load.mean() - load)


def _flat_slot(r: Routing) -> torch.Tensor:
    """Row of each assignment in the flattened ``(E * C)`` buffer; ``E * C`` where dropped."""
    E, C = r.probs.shape[-1], r.capacity
    return torch.where(r.kept, r.experts * C + r.slots, E * C)  # (T, k)


def dispatch(x: torch.Tensor, r: Routing) -> torch.Tensor:
    """Tokens ``x`` ``(T, d)`` into the capacity buffer ``(E, C, d)``: row ``(e, c)`` holds
    the token whose kept assignment to ``e`` has slot ``c``, zero where no token does."""
    (T, d), E, C, k = x.shape, r.probs.shape[-1], r.capacity, r.experts.shape[1]
    idx = _flat_slot(r).reshape(T * k)
    src = x.unsqueeze(1).expand(T, k, d).reshape(T * k, d)
    buf = x.new_zeros(E * C + 1, d).index_add(0, idx, src)  # the last row takes the dropped
    return buf[: E * C].reshape(E, C, d)


def combine(y: torch.Tensor, r: Routing) -> torch.Tensor:
    """Expert outputs ``y`` ``(E, C, d)`` back to tokens ``(T, d)``: each token's kept
    assignments' rows, weighted by the routing weights and summed."""
    E, C, d = y.shape
    idx = _flat_slot(r).clamp(max=E * C - 1)  # (T, k); dropped rows get weight 0
    w = (r.weights * r.kept).to(y.dtype)
    # (T, 1, k) @ (T, k, d): the weighted sum without a (T, k, d) product beside the rows
    return torch.bmm(w.unsqueeze(1), y.reshape(E * C, d)[idx]).squeeze(1)


def sort_by_expert(r: Routing) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``N = k * T`` assignments in choice-major order (``n = j * T + t``), sorted
    stably by expert id: ``order`` ``(N,)`` (assignment at each sorted position),
    ``counts`` ``(E,)`` (group sizes) and ``offsets`` ``(E,)`` (where each expert's
    contiguous group starts). Within a group the order is the capacity form's slot order."""
    E = r.probs.shape[-1]
    ids = r.experts.t().reshape(-1)  # (N,)
    order = torch.argsort(ids, stable=True)
    counts = (ids.unsqueeze(-1) == torch.arange(E, device=ids.device)).sum(0)  # (E,)
    return order, counts, torch.cumsum(counts, 0) - counts


def _check_dropless(r: Routing, T: int, where: str) -> None:
    if r.capacity != T:
        raise ValueError(f"{where}: the sorted form is dropless; route with capacity_factor=None "
                         f"(capacity {r.capacity} != {T} tokens)")


def sorted_dispatch(x: torch.Tensor, r: Routing) -> torch.Tensor:
    """Dropless dispatch through a sort: tokens ``x`` ``(T, d)`` gathered in sorted
    assignment order (contiguous groups, ``(k * T, d)``), then group ``e`` laid out as row
    ``e`` of ``(E, T, d)``, zero past its end. Equals ``dispatch`` for a dropless routing."""
    T, d = x.shape
    _check_dropless(r, T, "sorted_dispatch")
    N = r.experts.numel()
    order, counts, offsets = sort_by_expert(r)
    xs = x[order % T]  # (N, d): assignment n = j * T + t is token t
    c = torch.arange(T, device=x.device)
    src = (offsets.unsqueeze(1) + c).clamp(max=N - 1)  # (E, T)
    inside = (c < counts.unsqueeze(1)).to(x.dtype)
    return xs[src] * inside.unsqueeze(-1)


def sorted_combine(y: torch.Tensor, r: Routing) -> torch.Tensor:
    """Inverse of ``sorted_dispatch``: expert outputs ``y`` ``(E, T, d)`` read back in
    sorted order, unsorted to ``(T, k, d)``, weighted and summed to ``(T, d)``."""
    E, T, d = y.shape
    _check_dropless(r, T, "sorted_combine")
    k = r.experts.shape[1]
    order, _, offsets = sort_by_expert(r)
    e = r.experts.t().reshape(-1)[order]  # (N,) expert of each sorted position
    pos = torch.arange(k * T, device=y.device)
    ys = y[e, pos - offsets[e]]  # (N, d)
    back = ys[torch.argsort(order)].reshape(k, T, d).transpose(0, 1)  # (T, k, d)
    return torch.bmm(r.weights.to(y.dtype).unsqueeze(1), back).squeeze(1)


def expert_mlp(params: Params, h: torch.Tensor) -> torch.Tensor:
    """The experts' GELU MLPs on their buffers: ``h`` ``(E_l, C, d)`` with ``w1`` ``(E_l, d,
    f)``, ``w2`` ``(E_l, f, d)`` and optional ``b1`` ``(E_l, f)``, ``b2`` ``(E_l, d)``;
    returns ``(E_l, C, d)``. On CPU one matmul per expert (torch's bmm there runs 5-8%
    slower than the same products as separate mm calls at 4 x (1280..2560, 256) x 1024,
    forward + backward, and backward then frees each expert's activations as it finishes
    it); elsewhere one batched matmul per projection for all the experts."""
    return _experts_looped(params, h) if _per_row(h) else _experts_batched(params, h)


def _per_row(buf: torch.Tensor) -> bool:
    """Whether the experts run one matmul per buffer row (CPU), so that expert parallelism
    keeps the all-to-all's shard-major rows, rather than one batched matmul for all of
    them, the rows regrouped by expert. Meta tensors (a dry run's stand-ins, e.g.
    ``estimate_memory``'s) take the form of the device they stand for (the two keep
    different activations)."""
    dev = buf.device.type
    if dev == "meta":
        dev = stands_for()
    return dev == "cpu"


def _experts_batched(params: Params, h: torch.Tensor) -> torch.Tensor:
    b1, b2 = params.get("b1"), params.get("b2")
    a = torch.baddbmm(b1.unsqueeze(1), h, params["w1"]) if b1 is not None else torch.bmm(h, params["w1"])
    g = F.gelu(a)
    return torch.baddbmm(b2.unsqueeze(1), g, params["w2"]) if b2 is not None else torch.bmm(g, params["w2"])


class _LoopedMLP(torch.autograd.Function):
    """``_experts_looped`` in eager autograd, lighter than the same ops recorded one by one:
    the forward keeps each row's pre-activation only (its GELU is recomputed in backward),
    the backward frees each row's as it finishes it and writes every expert's weight and
    bias gradients straight into one tensor per leaf (an ``mm``, then ``addmm``, into its
    slice), where autograd would hold the experts' separate gradients and then stack them;
    the outputs are written into their rows as well."""

    @staticmethod
    def forward(ctx, h, w1, w2, b1, b2):
        E = w1.shape[0]
        pre = []
        out = h.new_empty(h.shape[0], h.shape[1], w2.shape[2])
        for i in range(h.shape[0]):
            e = i % E
            a = torch.addmm(b1[e], h[i], w1[e]) if b1 is not None else torch.mm(h[i], w1[e])
            g = F.gelu(a)
            if b2 is not None:
                torch.addmm(b2[e], g, w2[e], out=out[i])
            else:
                torch.mm(g, w2[e], out=out[i])
            pre.append(a)
        ctx.save_for_backward(h, w1, w2)
        ctx.pre = pre  # internal, never handed out: freed row by row in backward
        ctx.biases = (b1 is not None, b2 is not None)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        h, w1, w2 = ctx.saved_tensors
        pre, ctx.pre = ctx.pre, None
        has_b1, has_b2 = ctx.biases
        E = w1.shape[0]
        # Every expert has a row (h.shape[0] is a multiple of E): its first row writes
        # the gradients, the later ones add to them, so nothing is zeroed first.
        dw1, dw2 = torch.empty_like(w1), torch.empty_like(w2)
        db1 = w1.new_empty(w1.shape[0], w1.shape[2]) if has_b1 else None
        db2 = w2.new_empty(w2.shape[0], w2.shape[2]) if has_b2 else None
        # The tokens' gradient row by row, stacked at the end when the pre-activations (f/d
        # times its size) are freed: allocated up front it would sit beside all of them.
        dh = [] if ctx.needs_input_grad[0] else None
        for i in range(h.shape[0]):
            e, a = i % E, pre[i]
            pre[i] = None
            first = i < E
            # mm/addmm with out=, not addmm_: FLOP counters see them
            if first:
                torch.mm(F.gelu(a).T, dy[i], out=dw2[e])
            else:
                torch.addmm(dw2[e], F.gelu(a).T, dy[i], out=dw2[e])
            if db2 is not None and first:
                torch.sum(dy[i], 0, out=db2[e])
            elif db2 is not None:
                db2[e] += dy[i].sum(0)
            da = torch.ops.aten.gelu_backward(dy[i] @ w2[e].T, a)
            del a
            if first:
                torch.mm(h[i].T, da, out=dw1[e])
            else:
                torch.addmm(dw1[e], h[i].T, da, out=dw1[e])
            if db1 is not None and first:
                torch.sum(da, 0, out=db1[e])
            elif db1 is not None:
                db1[e] += da.sum(0)
            if dh is not None:
                dh.append(da @ w1[e].T)
        return (torch.stack(dh) if dh is not None else None), dw1, dw2, db1, db2


def _function_applies(h: torch.Tensor, leaves: tuple) -> bool:
    """Whether ``_LoopedMLP`` can run here: no torch.func transform, one dtype, no autocast."""
    device = h.device.type
    if device == "meta":  # a dry run's stand-in: autocast as on the device it stands for
        device = stands_for()
    return (not transforms_active() and len({t.dtype for t in leaves if t is not None}) == 1
            and not torch.is_autocast_enabled(device))


def _experts_looped(params: Params, h: torch.Tensor) -> torch.Tensor:
    """``h`` ``(G * E_l, C, d)``: row ``i`` through expert ``i % E_l``'s MLP, one matmul
    per row and projection (``G`` groups of rows, e.g. one per source shard)."""
    E = params["w1"].shape[0]
    if h.shape[0] % E or not h.shape[0]:
        raise ValueError(f"expert_mlp: {h.shape[0]} buffer rows for {E} experts (give a positive multiple)")
    leaves = (h, params["w1"], params["w2"], params.get("b1"), params.get("b2"))
    # The Function where autograd records (it keeps less for backward); with no gradient
    # (inference, remat's forward) the plain loop below, the same products (and one that
    # torch.compile traces: a decode step).
    if torch.is_grad_enabled() and _function_applies(h, leaves):
        # The typing sees the Function's insides, not its application: the implicit pvary
        # of an input invariant over an axis another varies over (the tokens under expert
        # tensor parallelism: their gradient sums over it) is made here.
        return _LoopedMLP.apply(*pvary_to_union(*leaves))
    # Under torch.func (the virtual mesh): unbind, not h[e]: its backward stacks the
    # experts' gradients once, where indexing would give each expert a zero gradient of
    # the whole tensor to add up.
    w1, w2, hs = params["w1"].unbind(0), params["w2"].unbind(0), h.unbind(0)
    b1 = params["b1"].unbind(0) if "b1" in params else None
    b2 = params["b2"].unbind(0) if "b2" in params else None
    outs = []
    for i, x in enumerate(hs):
        e = i % E
        a = torch.addmm(b1[e], x, w1[e]) if b1 is not None else torch.mm(x, w1[e])
        g = F.gelu(a)
        outs.append(torch.addmm(b2[e], g, w2[e]) if b2 is not None else torch.mm(g, w2[e]))
    return torch.stack(outs)


_EXPERT_LEAVES = ("w1", "w2", "b1", "b2")


def moe_layer(params: Params, x: torch.Tensor, *, top_k: int = 1, capacity_factor: float | None = 1.0,
              min_capacity: int = 4, normalize: bool | None = None,
              selection_bias: torch.Tensor | None = None, axis: str | None = "expert",
              method: str = "capacity", impl: str | None = None,
              tensor_axis: str | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A mixture-of-experts GELU MLP on tokens ``x`` ``(..., d)`` (leading dims flattened
    in row-major order into ``T`` tokens); returns ``y`` of ``x``'s shape and ``aux``:
    ``aux_loss`` (``load_balancing_loss``), ``z_loss``, ``drop_fraction`` and ``load``
    ``(E,)``, all for this shard's tokens (routing in at least float32).

    ``params``: ``router`` ``(d, E)``, ``w1`` ``(E, d, f)``, ``w2`` ``(E, f, d)``, optional
    ``b1`` ``(E, f)``, ``b2`` ``(E, d)``. Routing options are ``route``'s. ``method``:
    ``"capacity"`` (``dispatch``/``combine``) or ``"sorted"`` (``sorted_dispatch`` /
    ``sorted_combine``, dropless only).

    The sorted form without an expert axis runs on ``fsharded.kernels.moe`` where its
    Triton kernels run (CUDA; ``impl``: ``"auto"``, ``"triton"``, ``"reference"``): the
    assignments gathered in expert order, one grouped matmul per expert projection over
    exactly the rows each expert got (no padding to ``T`` rows per expert), and a weighted
    scatter back; elsewhere the padded ``(E, T, d)`` buffer.

    With ``axis`` bound by an enclosing ``shard_map`` (size ``n > 1``), the expert leaves
    are this shard's ``E/n`` experts (``expert_parallel_specs``) and the buffers go through
    ``all_to_all`` over ``axis``; unbound (or ``None``), every expert runs here.

    Expert tensor parallelism: with ``tensor_axis`` bound (size ``t > 1``), each expert's
    hidden dim is split over it (``expert_parallel_specs(..., tensor_axis=...)``: ``w1``
    ``(E_l, d, f/t)``, ``w2`` ``(E_l, f/t, d)``, ``b1`` ``(E_l, f/t)``, ``b2`` whole), the
    tokens are the same on every tensor shard (so is the routing), each shard computes its
    part of the second projection, and one ``psum`` over ``tensor_axis`` of the experts'
    output buffer adds them up before ``b2``.

    >>> p = init(8, 16, 4, seed=0)
    >>> y, aux = moe_layer(p, torch.randn(10, 8), top_k=2)
    >>> y.shape, sorted(aux)
    (torch.Size([10, 8]), ['aux_loss', 'drop_fraction', 'load', 'z_loss'])
    """
    if method not in ("capacity", "sorted"):
        raise ValueError(f"moe_layer: method must be 'capacity' or 'sorted', got {method!r}")
    if method == "sorted" and capacity_factor is not None:
        raise ValueError("moe_layer: method='sorted' is dropless; pass capacity_factor=None, "
                         "or use method='capacity' to drop over capacity")
    d, E = params["router"].shape
    if x.shape[-1] != d:
        raise ValueError(f"moe_layer: x has {x.shape[-1]} features but the router "
                         f"{tuple(params['router'].shape)} expects {d}")
    _check_top_k(top_k, E, "moe_layer")
    w1, w2 = params["w1"], params["w2"]
    split = tensor_axis is not None and is_bound(tensor_axis)  # a partial split is named below
    if not split and (w1.dim() != 3 or w2.dim() != 3 or w1.shape[1] != d or w2.shape[2] != d
                      or w2.shape[:2] != (w1.shape[0], w1.shape[2])):
        raise ValueError(f"moe_layer: w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)} do not fit the router "
                         f"{tuple(params['router'].shape)}: give w1 (experts, {d}, f) and w2 (experts, f, {d}) "
                         f"with the same experts and f (moe.init makes them)")
    n = axis_size(axis) if axis is not None and is_bound(axis) else 1
    local = w1.shape[0]
    if n > 1 and E % n:
        raise ValueError(f"moe_layer: the {E} experts do not divide over axis {axis!r} of size {n}: "
                         f"use a number of experts divisible by {n}, or a smaller {axis!r} axis")
    if local * n != E:
        where = f"on each of the {n} shards of axis {axis!r}" if n > 1 else "with no expert axis bound"
        raise ValueError(f"moe_layer: w1 holds {local} experts {where}, but the router scores {E}: "
                         + (f"shard w1, w2 (and b1, b2) as P({axis!r}) on dim 0 (expert_parallel_specs)"
                            if n > 1 else "pass all the experts' weights"))
    shape = x.shape
    x2 = x.reshape(-1, d)  # (T, d)
    ct = torch.promote_types(x2.dtype, torch.float32)  # routing in at least float32
    logits = x2.to(ct) @ params["router"].to(ct)  # (T, E)
    r = route(logits, top_k=top_k, capacity_factor=capacity_factor, min_capacity=min_capacity,
              normalize=normalize, selection_bias=selection_bias)
    aux = {"aux_loss": load_balancing_loss(r.probs, r.experts[:, 0]), "z_loss": z_loss(logits),
           "drop_fraction": r.drop_fraction, "load": r.load}
    if method == "sorted" and n == 1 and _grouped_kernels(x2, impl):
        return _grouped_experts(params, x2, r, impl).reshape(shape), aux
    buf = sorted_dispatch(x2, r) if method == "sorted" else dispatch(x2, r)  # (E, C, d)
    experts = {k: params[k] for k in _EXPERT_LEAVES if k in params}
    t = _expert_tensor_degree(experts, tensor_axis)
    if t > 1:
        b2 = experts.pop("b2", None)  # added once, to the sum of the partial products
        mlp, looped = _tensor_parallel(expert_mlp, tensor_axis, b2), _tensor_parallel(_experts_looped, tensor_axis, b2)
    else:
        mlp, looped = expert_mlp, _experts_looped
    if n > 1 and _per_row(buf):
        # Shard-major, as the all-to-all lays it out: row s * E/n + e holds shard s's slots
        # for my expert e, each row its own matmul (no relayout copies either way).
        buf = all_to_all(buf, axis, split_dim=0, concat_dim=0)  # (n * E/n, C, d)
        out = looped(experts, buf)
        out = all_to_all(out, axis, split_dim=0, concat_dim=0)  # (E, C, d): my slots, every expert
    elif n > 1:
        buf = all_to_all(buf, axis, split_dim=0, concat_dim=1)  # (E/n, n*C, d): my experts, every shard's slots
        out = all_to_all(mlp(experts, buf), axis, split_dim=1, concat_dim=0)  # (E, C, d)
    else:
        out = mlp(experts, buf)
    y = sorted_combine(out, r) if method == "sorted" else combine(out, r)
    return y.reshape(shape), aux


def _expert_tensor_degree(experts: Params, tensor_axis: str | None) -> int:
    """How many shards of ``tensor_axis`` split the experts' hidden dim here: its size when
    it is bound and ``w1``, ``w2`` (and ``b1``) vary over it (sharded by their specs), 1 when
    none of them does (replicated weights: every tensor shard computes the whole MLP)."""
    if tensor_axis is None or not is_bound(tensor_axis) or axis_size(tensor_axis) == 1:
        return 1
    split = {k: tensor_axis in varying_axes(experts[k]) for k in ("w1", "w2", "b1") if k in experts}
    if not any(split.values()):
        return 1
    if not all(split.values()):
        raise ValueError(f"moe_layer: expert tensor parallelism over {tensor_axis!r} splits every expert's "
                         f"hidden dim, but only {sorted(k for k, v in split.items() if v)} vary over it (not "
                         f"{sorted(k for k, v in split.items() if not v)}): shard w1 on dim 2, w2 and b1 on dim 1 "
                         f"(expert_parallel_specs(..., tensor_axis={tensor_axis!r}))")
    return axis_size(tensor_axis)


def _tensor_parallel(run, tensor_axis: str, b2: torch.Tensor | None):
    """``run`` (the experts' MLP on a buffer whose rows cycle through the local experts)
    with each expert's hidden dim split over ``tensor_axis``: the partial products summed
    over it, then ``b2`` added once per row's expert."""

    def mlp(experts: Params, buf: torch.Tensor) -> torch.Tensor:
        out = psum(run(experts, buf), tensor_axis)
        if b2 is None:
            return out
        return out + b2.repeat(buf.shape[0] // b2.shape[0], 1).unsqueeze(1)  # row i: expert i % E_l

    return mlp


def _grouped_kernels(x: torch.Tensor, impl: str | None) -> bool:
    return choose("grouped_matmul", x, impl=impl) == "triton"


def _grouped_experts(params: Params, x: torch.Tensor, r: Routing, impl: str | None) -> torch.Tensor:
    """The dropless experts on the sorted assignments: ``permute`` -> grouped matmul ->
    GELU -> grouped matmul -> weighted ``unpermute`` (``fsharded.kernels.moe``)."""
    T = x.shape[0]
    order, counts, offsets = sort_by_expert(r)
    tokens = order % T  # assignment n = j * T + t is token t
    bounds = torch.cat([offsets, (offsets[-1:] + counts[-1:])])  # (E + 1,)
    experts = r.experts.t().reshape(-1)[order]  # (N,) expert of each sorted row
    h = K.grouped_matmul(K.permute(x, tokens, impl=impl), params["w1"], bounds, impl=impl)
    if "b1" in params:
        h = h + params["b1"][experts]
    y = K.grouped_matmul(F.gelu(h), params["w2"], bounds, impl=impl)
    if "b2" in params:
        y = y + params["b2"][experts]
    weights = r.weights.t().reshape(-1)[order].to(y.dtype)
    return K.unpermute(y, tokens, weights, T, impl=impl)


def init(d_model: int, d_ff: int, experts: int, *, seed: int = 0, bias: bool = False, std: float = 0.02,
         dtype: torch.dtype = torch.float32) -> Params:
    """Fresh MoE parameters: ``router`` ``(d, E)``, ``w1`` ``(E, d, f)``, ``w2`` ``(E, f,
    d)`` normal with ``std`` (drawn in float32, then cast), and zero ``b1`` ``(E, f)``,
    ``b2`` ``(E, d)`` when ``bias``. Deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(int(seed))

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    p = {"router": normal(d_model, experts), "w1": normal(experts, d_model, d_ff),
         "w2": normal(experts, d_ff, d_model)}
    if bias:
        p.update(b1=torch.zeros(experts, d_ff, dtype=dtype), b2=torch.zeros(experts, d_model, dtype=dtype))
    return p


def expert_parallel_specs(params: Params, *, axis: str | None = "expert", axis_size: int | None = None,
                          tensor_axis: str | None = None) -> dict:
    """Specs for expert parallelism: the expert leaves split over ``axis`` on dim 0, the
    router replicated. With ``axis_size``, checks that the experts divide over it. With
    ``tensor_axis`` (expert tensor parallelism), each expert's hidden dim is split over it
    too: ``w1`` on dim 2, ``w2`` and ``b1`` on dim 1, ``b2`` only over ``axis``."""
    E = params["w1"].shape[0]
    if axis_size is not None and E % axis_size:
        raise ValueError(f"expert_parallel_specs: the {E} experts (w1 {tuple(params['w1'].shape)}) do not "
                         f"divide over axis {axis!r} of size {axis_size}: use a number of experts "
                         f"divisible by {axis_size}, or a smaller {axis!r} axis")
    hidden = {"w1": P(axis, None, tensor_axis), "w2": P(axis, tensor_axis), "b1": P(axis, tensor_axis)}
    return {k: ((hidden.get(k, P(axis)) if tensor_axis is not None else P(axis)) if k in _EXPERT_LEAVES else P())
            for k in params}
