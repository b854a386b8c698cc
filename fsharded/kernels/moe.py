"""Mixture-of-experts kernels: the sort-based token dispatch (``permute`` / ``unpermute``)
and the grouped expert matmul (``grouped_matmul``), with Triton kernels and torch references.

- ``permute(x, indices)``: ``out[n] = x[indices[n]]``, (T, d) -> (N, d); dual ``unpermute``.
- ``unpermute(y, indices, weights, T)``: ``out[t] = sum over n with indices[n] == t of
  weights[n] * y[n]``, (N, d) -> (T, d); dual ``permute``.
- ``grouped_matmul(x, w, offsets)``: ``out[n] = x[n] @ w[e]`` for the group ``e`` with
  ``offsets[e] <= n < offsets[e + 1]``, (N, d_in) -> (N, d_out).

``permute``'s backward is ``unpermute`` with unit weights (an ``index_add``) and
``unpermute``'s is ``permute`` scaled by the weights, plus ``dw[n] = <dout[indices[n]],
y[n]>``. ``grouped_matmul``'s: ``dx_g = dy_g @ w_e^T``, ``dw_e = x_g^T @ dy_g``. In an MoE
layer (:mod:`fsharded.parallel.moe`, sorted form), ``indices = order % T`` gathers the
tokens in expert order, ``offsets = [0, *cumsum(counts)]`` bounds the experts' groups and
``unpermute`` with the routing weights (sorted the same way) combines the outputs.

Arithmetic is fp32 (fp64 for fp64 inputs) whatever the input dtype; outputs come back in the
input's dtype (``y``'s for ``unpermute``) and grads in their input's dtype.

Implementations (``impl=``, see :mod:`fsharded.kernels._dispatch`):

- ``"reference"``: ``permute_reference`` (``index_select``), ``unpermute_reference``
  (``index_add``) and ``grouped_matmul_reference`` (a loop over the experts' row slices
  when ``offsets`` holds values; under ``vmap`` over per-sample offsets, or tracing, a loop
  of full matmuls masked to each group's rows: static shapes at ``E`` times the work).
  Plain torch ops, so autograd, ``torch.func`` (``grad``, ``vmap``) and double backward see
  through them. The default on CPU.
- ``"triton"``: the custom ops ``fsharded::moe_permute``, ``moe_unpermute``,
  ``moe_unpermute_backward``, ``grouped_matmul`` and ``grouped_matmul_backward``
  (``_triton_moe`` has the kernels), with fake, autograd and vmap rules. ``unpermute`` is a
  gather and weighted sum through the inverse mapping (``indices`` sorted once by
  ``torch.sort``), not a scatter with atomics: deterministic, any float dtype, and summed in
  ``index_add``'s order. ``grouped_matmul`` takes groups of any size, unaligned to its row
  tiles: a tile straddling groups masks its rows per group (no padding asked of the
  caller); float16 / bfloat16 / float32 only (fp32 follows
  ``torch.get_float32_matmul_precision()``: ``"highest"`` exact, otherwise TF32). The
  vmap rules fold the vmapped dim into the rows (indices shifted per sample, offsets
  concatenated), so the kernels also run under the virtual mesh's ``vmap``; per-sample
  weights ``w`` work too. Double backward through Triton ``unpermute`` with weights and
  through ``grouped_matmul`` raises ``NotImplementedError`` (the reference has it);
  ``permute`` / unweighted ``unpermute`` are each other's backward, to any order.

Checks: shapes, dtypes and devices raise ``ValueError`` naming the argument and the fix.
Value checks (indices in range, offsets non-decreasing from 0 to ``N``) read the values, a
device sync on CUDA: they run when ``check=True`` (default) and the values are at hand, and
are skipped under ``vmap`` over batched indices/offsets, ``make_fx`` and ``torch.compile``.
Unchecked out-of-range indices never read or write outside the buffers in the Triton
kernels (a gathered row reads zero, a scattered one is dropped); the reference raises
torch's index error.

>>> x = torch.randn(4, 8)
>>> idx = torch.tensor([2, 0, 2, 1])
>>> y = permute(x, idx, impl="reference")
>>> out = unpermute(y, idx, torch.full((4,), 0.5), 4, impl="reference")
>>> torch.allclose(out[2], x[2]) and bool((out[3] == 0).all())
True
"""

from __future__ import annotations

import torch
from torch import Tensor

from fsharded.spmd._wrappers import readable_beneath_grad

from ._dispatch import choose, forced

__all__ = [
    "permute",
    "unpermute",
    "grouped_matmul",
    "permute_reference",
    "unpermute_reference",
    "grouped_matmul_reference",
]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_MM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the Triton grouped matmul's


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------
# checks


def _tensor(
    problems: list,
    arg: str,
    t,
    *,
    floating: bool | None = None,
    dim: int | None = None,
    what: str = "",
) -> bool:
    """Append what is wrong with ``t`` as argument ``arg``; True when it is a usable tensor."""
    if not isinstance(t, torch.Tensor):
        problems.append(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
        return False
    ok = True
    if floating is True and t.dtype not in _FLOATS:
        problems.append(
            f"{arg} has dtype {t.dtype}; pass a float16, bfloat16, float32 or "
            f"float64 tensor (e.g. {arg}.float())"
        )
        ok = False
    if floating is False and t.dtype != torch.int64:
        problems.append(f"{arg} has dtype {t.dtype}; pass int64 {what or 'indices'} ({arg}.long())")
        ok = False
    if dim is not None and t.dim() != dim:
        problems.append(
            f"{arg} must be {dim}-D{' ' + what if what else ''}, got shape {tuple(t.shape)}"
        )
        ok = False
    return ok


def _raise(name: str, problems: list) -> None:
    if problems:
        raise ValueError(f"{name}: " + "; ".join(problems))


def _same_device(problems: list, **tensors) -> None:
    devices = {k: t.device for k, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        problems.append(
            "all tensors must be on one device, got "
            + ", ".join(f"{k} on {d}" for k, d in devices.items())
        )


def _check_permute(name: str, x, indices) -> None:
    p: list[str] = []
    _tensor(p, "x", x, floating=True, dim=2, what="(tokens, features)")
    _tensor(p, "indices", indices, floating=False, dim=1, what="(N,) row indices")
    _same_device(p, x=x, indices=indices)
    _raise(name, p)


def _check_unpermute(name: str, y, indices, weights, num_tokens) -> None:
    p: list[str] = []
    y_ok = _tensor(p, "y", y, floating=True, dim=2, what="(N, features)")
    i_ok = _tensor(p, "indices", indices, floating=False, dim=1, what="(N,) token indices")
    if y_ok and i_ok and indices.shape[0] != y.shape[0]:
        p.append(
            f"indices has {indices.shape[0]} entries but y {tuple(y.shape)} has "
            f"{y.shape[0]} rows; pass one token index per row of y"
        )
    if weights is not None and _tensor(p, "weights", weights, floating=True):
        n = y.shape[0] if y_ok else "N"
        if tuple(weights.shape) != (n,):
            p.append(
                f"weights has shape {tuple(weights.shape)}; pass one weight per row of "
                f"y, shape ({n},) (or weights=None for unit weights)"
            )
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        p.append(f"num_tokens must be an int >= 0 (the rows of the output), got {num_tokens!r}")
    _same_device(p, y=y, indices=indices, weights=weights)
    _raise(name, p)


def _check_grouped_matmul(name: str, x, w, offsets) -> None:
    p: list[str] = []
    x_ok = _tensor(p, "x", x, floating=True, dim=2, what="(N, d_in)")
    w_ok = _tensor(p, "w", w, floating=True, dim=3, what="(experts, d_in, d_out)")
    o_ok = _tensor(
        p, "offsets", offsets, floating=False, dim=1, what="(experts + 1,) group boundaries"
    )
    if x_ok and w_ok:
        if w.dtype != x.dtype:
            p.append(f"w has dtype {w.dtype} but x {x.dtype}; cast one to the other")
        if w.shape[1] != x.shape[1]:
            p.append(
                f"w {tuple(w.shape)} takes d_in={w.shape[1]} features but x "
                f"{tuple(x.shape)} has {x.shape[1]}"
            )
    if w_ok and o_ok and offsets.shape[0] != w.shape[0] + 1:
        p.append(
            f"offsets has {offsets.shape[0]} entries but w has {w.shape[0]} experts; "
            f"pass the {w.shape[0] + 1} boundaries [0, end of expert 0, ..., N]"
        )
    _same_device(p, x=x, w=w, offsets=offsets)
    _raise(name, p)


def _concrete(*tensors: Tensor) -> bool:
    """Whether the values of ``tensors`` can be read here: not under ``vmap`` over them,
    ``make_fx`` or ``torch.compile``, and not fake."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    if torch.compiler.is_compiling() or get_proxy_mode() is not None:
        return False
    for t in tensors:
        t = readable_beneath_grad(t)  # None under vmap (the virtual mesh)
        if t is None or isinstance(t, FakeTensor) or t.is_meta:
            return False
    return True


def _check_indices(name: str, indices: Tensor, size: int, what: str) -> None:
    if indices.numel() == 0:
        return
    lo, hi = (int(v) for v in torch.stack(indices.aminmax()).tolist())
    if lo >= 0 and hi < size:
        return
    bad = int(((indices < 0) | (indices >= size)).nonzero()[0, 0])
    raise ValueError(
        f"{name}: indices must lie in [0, {size}) ({what}), got indices[{bad}]="
        f"{int(indices[bad])} (min {lo}, max {hi}); drop or remap the out-of-range entries"
    )


def _check_offsets(name: str, offsets: Tensor, n: int) -> None:
    vals = offsets.tolist()
    why = None
    if vals[0] != 0:
        why = f"offsets[0]={vals[0]}, expected 0"
    elif vals[-1] != n:
        why = f"offsets[-1]={vals[-1]}, expected N={n} (the rows of x)"
    else:
        for i in range(1, len(vals)):
            if vals[i] < vals[i - 1]:
                why = f"offsets[{i}]={vals[i]} < offsets[{i - 1}]={vals[i - 1]}"
                break
    if why is not None:
        shown = vals if len(vals) <= 12 else [*vals[:5], "...", *vals[-5:]]
        raise ValueError(
            f"{name}: offsets must be non-decreasing group boundaries from 0 to N={n}, group "
            f"e being rows offsets[e]:offsets[e + 1]; {why} in {shown}. For group sizes "
            "`counts` pass torch.cat([counts.new_zeros(1), counts.cumsum(0)])"
        )


# ---------------------------------------------------------------------------------------
# references (pure torch; ground truth in tests)


def _permute_ref(x: Tensor, indices: Tensor) -> Tensor:
    return x.index_select(0, indices)  # (N, d)


def _unpermute_ref(y: Tensor, indices: Tensor, weights: Tensor | None, num_tokens: int) -> Tensor:
    acc = _acc(y.dtype)
    src = y.to(acc)  # (N, d)
    if weights is not None:
        src = src * weights.to(acc).unsqueeze(-1)
    out = src.new_zeros((num_tokens, y.shape[-1]))  # (T, d)
    return out.index_add(0, indices, src).to(y.dtype)


def _grouped_matmul_ref(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    acc = _acc(x.dtype)
    xf, wf = x.to(acc), w.to(acc)  # (N, d_in), (E, d_in, d_out)
    E, n = w.shape[0], x.shape[0]
    if E == 0:
        return (xf @ wf.sum(0)).to(x.dtype)  # N == 0 here; keeps both in the graph
    if _concrete(offsets):
        b = offsets.tolist()
        return torch.cat([xf[b[e] : b[e + 1]] @ wf[e] for e in range(E)]).to(x.dtype)
    # Offsets without values at hand (per-sample under vmap, traced): static shapes.
    rows = torch.arange(n, device=x.device)
    group = (rows.unsqueeze(-1) >= offsets[1:]).sum(-1)  # (N,) group of each row
    out = xf.new_zeros((n, w.shape[2]))
    for e in range(E):
        out = out + (group == e).unsqueeze(-1) * (xf @ wf[e])
    return out.to(x.dtype)


def permute_reference(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` by ``index_select``: ``x`` (T, d), ``indices`` (N,) int64 -> (N, d)."""
    _check_permute("permute_reference", x, indices)
    return _permute_ref(x, indices)


def unpermute_reference(
    y: Tensor, indices: Tensor, weights: Tensor | None, num_tokens: int
) -> Tensor:
    """``out[t] = sum_{n: indices[n] = t} weights[n] * y[n]`` by ``index_add`` in fp32 (fp64
    for fp64), (T, d) in y's dtype; ``weights=None`` means 1."""
    _check_unpermute("unpermute_reference", y, indices, weights, num_tokens)
    return _unpermute_ref(y, indices, weights, num_tokens)


def grouped_matmul_reference(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``x[g] @ w[e]`` per group ``g = offsets[e]:offsets[e + 1]`` in fp32 (fp64 for fp64),
    (N, d_out) in x's dtype (module doc: the two loops)."""
    _check_grouped_matmul("grouped_matmul_reference", x, w, offsets)
    return _grouped_matmul_ref(x, w, offsets)


# ---------------------------------------------------------------------------------------
# the Triton kernels as custom ops


def _kernels(name: str, *tensors: Tensor):
    choose(name, *tensors, impl="triton")  # a clear error where Triton cannot run
    from . import _triton_moe

    return _triton_moe


def _c(t: Tensor | None) -> Tensor | None:
    return t.contiguous() if t is not None else None


@torch.library.custom_op("fsharded::moe_permute", mutates_args=())
def _permute_op(x: Tensor, indices: Tensor) -> Tensor:
    """``x[indices]`` (Triton; ``permute`` dispatches here). Dual: ``fsharded::moe_unpermute``."""
    K = _kernels("fsharded::moe_permute", x, indices)
    return K.gather(x.contiguous(), indices.contiguous())[0]


@torch.library.custom_op("fsharded::moe_unpermute", mutates_args=())
def _unpermute_op(y: Tensor, indices: Tensor, weights: Tensor | None, num_tokens: int) -> Tensor:
    """``out[t] = sum_{n: indices[n] = t} weights[n] y[n]`` (Triton, gather through the
    inverse mapping). Dual: ``fsharded::moe_permute``."""
    K = _kernels("fsharded::moe_unpermute", y, indices)
    return K.segment_sum(y.contiguous(), indices.contiguous(), _c(weights), num_tokens)


@torch.library.custom_op("fsharded::moe_unpermute_backward", mutates_args=())
def _unpermute_backward_op(
    dout: Tensor, y: Tensor, indices: Tensor, weights: Tensor, need_dw: bool
) -> tuple[Tensor, Tensor]:
    """``(dy = weights[:, None] * dout[indices], dweights[n] = <dout[indices[n]], y[n]>)`` of
    ``fsharded::moe_unpermute``, dweights in fp32 (fp64 for fp64), ``(0,)`` unless asked."""
    K = _kernels("fsharded::moe_unpermute_backward", dout, y, indices)
    dy, dw = K.gather(
        dout.contiguous(),
        indices.contiguous(),
        weights.contiguous(),
        y.contiguous() if need_dw else None,
    )
    return dy, dw if dw is not None else dout.new_empty((0,), dtype=_acc(dout.dtype))


def _check_groups(name: str, w: Tensor, offsets: Tensor) -> None:
    groups = offsets.shape[0] - 1
    if w.shape[0] == 0 or groups % w.shape[0]:
        raise ValueError(
            f"{name}: the {groups} groups of offsets must be a multiple of the "
            f"{w.shape[0]} weights of w (group g multiplies by w[g % {w.shape[0]}])"
        )


@torch.library.custom_op("fsharded::grouped_matmul", mutates_args=())
def _gmm_op(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Rows ``offsets[g]:offsets[g + 1]`` of ``x`` times ``w[g % W]`` (Triton). ``G`` groups may
    be a multiple of the ``W`` weights (the vmap rule's folded samples share ``w``)."""
    _check_groups("fsharded::grouped_matmul", w, offsets)
    K = _kernels("fsharded::grouped_matmul", x, w, offsets)
    return K.grouped_matmul(x.contiguous(), w.contiguous(), offsets.contiguous())


@torch.library.custom_op("fsharded::grouped_matmul_backward", mutates_args=())
def _gmm_backward_op(
    dy: Tensor, x: Tensor, w: Tensor, offsets: Tensor, need_dx: bool, need_dw: bool
) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` of ``fsharded::grouped_matmul``: ``dx_g = dy_g @ w[g % W]^T`` and
    ``dw`` per group, ``(G, d_in, d_out)`` in w's dtype; ``(0,)`` for the one not asked."""
    _check_groups("fsharded::grouped_matmul_backward", w, offsets)
    K = _kernels("fsharded::grouped_matmul_backward", dy, x, w, offsets)
    dy, offsets = dy.contiguous(), offsets.contiguous()
    dx = K.grouped_matmul(dy, w.contiguous(), offsets, transpose_w=True) if need_dx else None
    dw = K.grouped_matmul_dw(x.contiguous(), dy, offsets, w.dtype) if need_dw else None
    return (
        dx if dx is not None else dy.new_empty((0,)),
        dw if dw is not None else w.new_empty((0,)),
    )


@_permute_op.register_fake
def _(x, indices):
    return x.new_empty((indices.shape[0], x.shape[1]))


@_unpermute_op.register_fake
def _(y, indices, weights, num_tokens):
    return y.new_empty((num_tokens, y.shape[1]))


@_unpermute_backward_op.register_fake
def _(dout, y, indices, weights, need_dw):
    dw_shape = y.shape[:1] if need_dw else (0,)
    return dout.new_empty(y.shape), dout.new_empty(dw_shape, dtype=_acc(dout.dtype))


@_gmm_op.register_fake
def _(x, w, offsets):
    return x.new_empty((x.shape[0], w.shape[2]))


@_gmm_backward_op.register_fake
def _(dy, x, w, offsets, need_dx, need_dw):
    dw_shape = (offsets.shape[0] - 1, *w.shape[1:]) if need_dw else (0,)
    return dy.new_empty(x.shape if need_dx else (0,)), w.new_empty(dw_shape)


# autograd rules
#
# As in norm.py: torch.func rejects the autograd.Function that register_autograd generates,
# so the public functions enter through Functions with setup_context (vmap rules generated
# from the ops' own). permute and unweighted unpermute are each other's backward, so those
# differentiate to any order; the two fused backward ops go through Functions whose own
# backward raises instead of silently returning zeros.


def _no_double_backward(what: str):
    def backward(ctx, *grads):
        raise NotImplementedError(
            f"double backward through the Triton {what} is not implemented; use "
            "impl='reference' for higher-order derivatives"
        )

    return staticmethod(backward)


class _PermuteFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, indices):
        return torch.ops.fsharded.moe_permute(x, indices)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[1])
        ctx.num_tokens = inputs[0].shape[0]

    @staticmethod
    def backward(ctx, dy):
        (indices,) = ctx.saved_tensors
        return _UnpermuteFn.apply(dy, indices, None, ctx.num_tokens), None


class _UnpermuteBackwardFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(dout, y, indices, weights, need_dw):
        return torch.ops.fsharded.moe_unpermute_backward(dout, y, indices, weights, need_dw)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = _no_double_backward("unpermute with weights")


class _UnpermuteFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(y, indices, weights, num_tokens):
        return torch.ops.fsharded.moe_unpermute(y, indices, weights, num_tokens)

    @staticmethod
    def setup_context(ctx, inputs, output):
        y, indices, weights, _ = inputs
        ctx.save_for_backward(y if weights is not None else None, indices, weights)

    @staticmethod
    def backward(ctx, dout):
        y, indices, weights = ctx.saved_tensors
        if weights is None:
            return _PermuteFn.apply(dout, indices), None, None, None
        need_dy, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
        dy, dw = _UnpermuteBackwardFn.apply(dout, y, indices, weights, need_dw)
        return (dy if need_dy else None, None, dw.to(weights.dtype) if need_dw else None, None)


class _GroupedMatmulBackwardFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(dy, x, w, offsets, need_dx, need_dw):
        return torch.ops.fsharded.grouped_matmul_backward(dy, x, w, offsets, need_dx, need_dw)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = _no_double_backward("grouped_matmul")


def _gmm_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gmm_grad(ctx, dy):
    x, w, offsets = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dx, dw = _GroupedMatmulBackwardFn.apply(dy, x, w, offsets, need_dx, need_dw)
    if need_dw and dw.shape[0] != w.shape[0]:  # groups g and g + W share w[g % W]
        dw = dw.view(-1, *w.shape).sum(0)
    return dx if need_dx else None, dw if need_dw else None, None


def _unpermute_setup(ctx, inputs, output):
    _UnpermuteFn.setup_context(ctx, inputs, output)


def _permute_setup(ctx, inputs, output):
    _PermuteFn.setup_context(ctx, inputs, output)


_permute_op.register_autograd(_PermuteFn.backward, setup_context=_permute_setup)
_unpermute_op.register_autograd(_UnpermuteFn.backward, setup_context=_unpermute_setup)
_gmm_op.register_autograd(_gmm_grad, setup_context=_gmm_setup)


class _GroupedMatmulFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w, offsets):
        return torch.ops.fsharded.grouped_matmul(x, w, offsets)

    setup_context = staticmethod(_gmm_setup)
    backward = staticmethod(_gmm_grad)


# vmap rules: the vmapped dim folded into the rows
#
# Sample b's rows sit at b * rows in the folded tensors: indices shift by b * T (out-of-range
# ones become -1, so they stay out of range instead of reaching the next sample), offsets by
# b * N (concatenated: B * G groups), and a shared w serves every sample through the ops'
# ``g % W``.


def _front(t: Tensor, dim: int | None, size: int) -> Tensor:
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


def _rows(t: Tensor, dim: int | None, size: int) -> Tensor:
    """``(size, R, ...)`` per-sample rows as ``(size * R, ...)``."""
    t = _front(t, dim, size)
    return t.reshape(size * t.shape[1], *t.shape[2:])


def _fold_indices(indices: Tensor, dim: int | None, size: int, rows: int) -> Tensor:
    idx = _front(indices, dim, size)  # (B, N)
    base = torch.arange(size, device=idx.device, dtype=idx.dtype).unsqueeze(1) * rows
    return torch.where((idx >= 0) & (idx < rows), idx + base, -1).reshape(-1)


def _fold_offsets(offsets: Tensor, dim: int | None, size: int, rows: int) -> Tensor:
    o = _front(offsets, dim, size)  # (B, G + 1)
    base = torch.arange(size, device=o.device, dtype=o.dtype).unsqueeze(1) * rows
    return torch.cat([(o[:, :-1] + base).reshape(-1), o.new_full((1,), size * rows)])


@_permute_op.register_vmap
def _(info, in_dims, x, indices):
    x_dim, i_dim = in_dims
    size = info.batch_size
    if x_dim is None:  # shared rows, per-sample indices
        out = torch.ops.fsharded.moe_permute(x, _front(indices, i_dim, size).reshape(-1))
    else:
        x = _rows(x, x_dim, size)
        out = torch.ops.fsharded.moe_permute(
            x, _fold_indices(indices, i_dim, size, x.shape[0] // size)
        )
    return out.view(size, -1, out.shape[-1]), 0


@_unpermute_op.register_vmap
def _(info, in_dims, y, indices, weights, num_tokens):
    y_dim, i_dim, w_dim = in_dims[:3]
    size = info.batch_size
    ws = _rows(weights, w_dim, size) if weights is not None else None
    out = torch.ops.fsharded.moe_unpermute(
        _rows(y, y_dim, size),
        _fold_indices(indices, i_dim, size, num_tokens),
        ws,
        size * num_tokens,
    )
    return out.view(size, num_tokens, out.shape[-1]), 0


@_unpermute_backward_op.register_vmap
def _(info, in_dims, dout, y, indices, weights, need_dw):
    d_dim, y_dim, i_dim, w_dim = in_dims[:4]
    size = info.batch_size
    dout = _rows(dout, d_dim, size)
    tokens = dout.shape[0] // size
    dy, dw = torch.ops.fsharded.moe_unpermute_backward(
        dout,
        _rows(y, y_dim, size),
        _fold_indices(indices, i_dim, size, tokens),
        _rows(weights, w_dim, size),
        need_dw,
    )
    dy = dy.view(size, -1, dy.shape[-1])
    return (dy, dw.view(size, -1) if need_dw else dw), (0, 0 if need_dw else None)


def _fold_gmm(info, x_dim, w_dim, o_dim, x, w, offsets):
    size = info.batch_size
    x = _rows(x, x_dim, size)
    offsets = _fold_offsets(offsets, o_dim, size, x.shape[0] // size)
    if w_dim is not None:
        w = _front(w, w_dim, size)  # (B, W, d_in, d_out)
        groups = offsets.shape[0] - 1
        if groups != size * w.shape[1]:  # nested vmap: expand to one weight per group
            w = w.repeat(1, groups // (size * w.shape[1]), 1, 1)
        w = w.reshape(-1, *w.shape[2:])
    return size, x, w, offsets


@_gmm_op.register_vmap
def _(info, in_dims, x, w, offsets):
    size, x, w, offsets = _fold_gmm(info, *in_dims, x, w, offsets)
    y = torch.ops.fsharded.grouped_matmul(x, w, offsets)
    return y.view(size, -1, y.shape[-1]), 0


@_gmm_backward_op.register_vmap
def _(info, in_dims, dy, x, w, offsets, need_dx, need_dw):
    size = info.batch_size
    dy = _rows(dy, in_dims[0], size)
    size, x, w, offsets = _fold_gmm(info, *in_dims[1:4], x, w, offsets)
    dx, dw = torch.ops.fsharded.grouped_matmul_backward(dy, x, w, offsets, need_dx, need_dw)
    dx = dx.view(size, -1, dx.shape[-1]) if need_dx else dx
    dw = dw.view(size, -1, *dw.shape[1:]) if need_dw else dw  # per-sample (B, G, d_in, d_out)
    return (dx, dw), (0 if need_dx else None, 0 if need_dw else None)


# ---------------------------------------------------------------------------------------
# public


def permute(x: Tensor, indices: Tensor, *, impl: str | None = None, check: bool = True) -> Tensor:
    """Rows ``x[indices]``: ``x`` (T, d), ``indices`` (N,) int64 in ``[0, T)`` -> (N, d), the
    sort-based MoE dispatch (``indices = order % T``). Backward: ``dx = index_add`` of the
    cotangent rows (``unpermute`` with unit weights). Module doc: implementations, checks.

    >>> permute(torch.eye(3), torch.tensor([2, 2, 0]), impl="reference")[:, 2].tolist()
    [1.0, 1.0, 0.0]
    """
    _check_permute("permute", x, indices)
    if check and _concrete(indices):
        _check_indices("permute", indices, x.shape[0], f"the {x.shape[0]} rows of x")
    if choose("moe_permute", x, indices, impl=impl) == "reference":
        return _permute_ref(x, indices)
    return _PermuteFn.apply(x, indices)


def unpermute(
    y: Tensor,
    indices: Tensor,
    weights: Tensor | None,
    num_tokens: int,
    *,
    impl: str | None = None,
    check: bool = True,
) -> Tensor:
    """``out[t] = sum over n with indices[n] == t of weights[n] * y[n]``: ``y`` (N, d),
    ``indices`` (N,) int64 in ``[0, num_tokens)``, ``weights`` (N,) or None (unit) ->
    ``(num_tokens, d)`` in y's dtype (fp32 sums); tokens no row maps to are 0. The MoE
    combine; differentiable in ``y`` and ``weights``. Module doc: implementations, checks.

    >>> y = torch.ones(3, 2)
    >>> unpermute(y, torch.tensor([1, 1, 0]), torch.tensor([0.25, 0.5, 1.0]), 2, impl="reference")
    tensor([[1.0000, 1.0000],
            [0.7500, 0.7500]])
    """
    _check_unpermute("unpermute", y, indices, weights, num_tokens)
    if check and _concrete(indices):
        _check_indices("unpermute", indices, num_tokens, f"num_tokens={num_tokens}")
    if (
        choose("moe_permute", y, indices, *([weights] if weights is not None else []), impl=impl)
        == "reference"
    ):
        return _unpermute_ref(y, indices, weights, num_tokens)
    return _UnpermuteFn.apply(y, indices, weights, num_tokens)


def grouped_matmul(
    x: Tensor, w: Tensor, offsets: Tensor, *, impl: str | None = None, check: bool = True
) -> Tensor:
    """Each expert's rows times its weight: ``x`` (N, d_in) sorted by expert, ``w`` (E, d_in,
    d_out), ``offsets`` (E + 1,) int64 with group ``e`` the rows ``offsets[e]:offsets[e + 1]``
    (non-decreasing, from 0 to N; empty groups allowed) -> (N, d_out) in x's dtype, fp32
    accumulation. Differentiable in ``x`` and ``w``. Module doc: implementations, checks.

    >>> x, w = torch.ones(3, 2), torch.stack([torch.eye(2), 2 * torch.eye(2)])
    >>> grouped_matmul(x, w, torch.tensor([0, 1, 3]), impl="reference")[:, 0].tolist()
    [1.0, 2.0, 2.0]
    """
    _check_grouped_matmul("grouped_matmul", x, w, offsets)
    if check and _concrete(offsets):
        _check_offsets("grouped_matmul", offsets, x.shape[0])
    which = choose("grouped_matmul", x, w, offsets, impl=impl)
    if which == "triton" and x.dtype not in _MM_DTYPES:
        if (forced() if (impl or "auto").lower() == "auto" else impl.lower()) == "triton":
            raise ValueError(
                f"grouped_matmul: the Triton kernel takes float16, bfloat16 or float32, got "
                f"{x.dtype}; pass impl='reference' (impl=None falls back to it by itself)"
            )
        which = "reference"
    if which == "reference":
        return _grouped_matmul_ref(x, w, offsets)
    return _GroupedMatmulFn.apply(x, w, offsets)
