"""LayerNorm and RMSNorm over the last dim, with Triton forward and backward kernels.

``layer_norm(x, weight, bias)`` = ``(x - mean) / sqrt(var + eps) * weight + bias`` and
``rms_norm(x, weight)`` = ``x / sqrt(mean(x²) + eps) * weight``, both over ``x``'s last dim
(the hidden size ``N``). ``weight`` / ``bias`` are optional ``(N,)`` tensors of any float dtype.
Statistics and arithmetic are fp32 for fp16/bf16/fp32 inputs (fp64 for fp64); the output
has ``x``'s dtype, and the parameter grads their parameter's dtype.

Implementations (``fsharded.kernels._dispatch.choose``):

- ``"reference"``: ``layer_norm_reference`` (``torch.nn.functional.layer_norm`` in fp32) and
  ``rms_norm_reference`` (fp32 math): plain torch ops, so autograd / vmap / compile see them
  natively;
- ``"triton"``: the custom ops ``fsharded::layer_norm`` / ``fsharded::rms_norm`` (forward
  kernel) with ``fsharded::layer_norm_backward`` / ``fsharded::rms_norm_backward`` (``dx``
  plus per-row-block partial ``dweight`` / ``dbias``, summed after), fake kernels, autograd
  and vmap rules. vmap folds the vmapped dim into the rows; per-sample ``weight`` / ``bias``
  (vmapped parameters) run the reference instead, under the same vmap.

Limits: the kernels hold a row in registers, so ``N <= MAX_HIDDEN`` (16384). Above it the
auto choice runs the reference; an explicit ``impl="triton"`` (or ``FSHARDED_KERNELS=triton``)
raises ``ValueError``. Non-contiguous inputs are copied. Double backward (a derivative of
the backward) through the Triton path raises ``NotImplementedError``; the reference has it.
The public functions reach the ops through small ``autograd.Function``s so that
``torch.func.grad`` / ``vjp`` work too (see the note above ``_NormBackwardFn``).

>>> x = torch.randn(2, 3, 8)
>>> y = layer_norm(x, torch.ones(8), torch.zeros(8), impl="reference")
>>> torch.allclose(y, torch.nn.functional.layer_norm(x, (8,)), atol=1e-6)
True
"""

import torch
import torch.nn.functional as F

from ._dispatch import choose, forced

__all__ = ["MAX_HIDDEN", "layer_norm", "rms_norm", "layer_norm_reference", "rms_norm_reference"]

MAX_HIDDEN = 16384
"""Largest last dim the Triton kernels take (a whole row lives in registers)."""

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(name: str, x, weight=None, bias=None) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a tensor, got {type(x).__name__}")
    if x.dtype not in _FLOATS:
        raise TypeError(
            f"{name}: x has dtype {x.dtype}; expected float16, bfloat16, float32 or float64 "
            "(cast integer inputs with .float())"
        )
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{name}: x has shape {tuple(x.shape)}; normalising needs a last dim >= 1")
    n = x.shape[-1]
    for arg, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOATS:
            what = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name}: {arg} must be a floating tensor, got {what}")
        if tuple(t.shape) != (n,):
            raise ValueError(
                f"{name}: {arg} has shape {tuple(t.shape)} but x {tuple(x.shape)} has last dim "
                f"{n}; {arg} must have shape ({n},)"
            )
        if t.device != x.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, x on {x.device}")


def _which(name: str, x, params, impl: str | None) -> str:
    which = choose(name, x, *[p for p in params if p is not None], impl=impl)
    if which == "triton" and x.shape[-1] > MAX_HIDDEN:
        want = (impl or "auto").lower()
        if (forced() if want == "auto" else want) == "triton":
            raise ValueError(
                f"{name}: hidden size {x.shape[-1]} exceeds the Triton kernel's maximum "
                f"MAX_HIDDEN={MAX_HIDDEN}; use impl='reference' (or impl=None, which falls "
                "back to it)"
            )
        return "reference"
    return which


# ---------------------------------------------------------------------------------------
# references (pure torch; ground truth in tests)


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` over the last dim computed in fp32 (fp64 for fp64), cast to x's dtype."""
    acc = _acc(x.dtype)
    w = weight.to(acc) if weight is not None else None
    b = bias.to(acc) if bias is not None else None
    return F.layer_norm(x.to(acc), (x.shape[-1],), w, b, eps).to(x.dtype)


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> torch.Tensor:
    """``x * rsqrt(mean(x², -1) + eps) * weight`` in fp32 (fp64 for fp64), cast to x's dtype."""
    return _reference_math(x, weight, None, eps, rms=True)


def _reference_math(x, weight, bias, eps: float, rms: bool):
    """The forward in torch ops with ``weight`` / ``bias`` broadcast against ``x`` (per-sample
    parameters in the vmap rules come as ``(B, 1, .., N)``)."""
    xf = x.to(_acc(x.dtype))
    if rms:
        y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(xf, (x.shape[-1],), None, None, eps)
    if weight is not None:
        y = y * weight.to(xf.dtype)
    if bias is not None:
        y = y + bias.to(xf.dtype)
    return y.to(x.dtype)


def _backward_reference(dy, x, weight, *, eps: float, rms: bool, need_db: bool, groups: int):
    """The backward ops' contract in torch ops: ``(dx, dw, db)`` with ``dw``/``db`` summed per
    group of rows, shape ``(*lead, groups, N)`` in the accumulation dtype (``(0,)`` when
    absent), where ``lead`` is ``weight.shape[:-1]``: per-sample weights ``(B, N)`` in the
    vmap rules (``x`` and ``dy`` then lead with ``B`` too)."""
    n, acc = x.shape[-1], _acc(x.dtype)
    lead = tuple(weight.shape[:-1]) if weight is not None else ()
    xf = x.reshape(*lead, groups, -1, n).to(acc)  # (*lead, G, R, N)
    dyf = dy.reshape(*lead, groups, -1, n).to(acc)
    if not rms:
        xf = xf - xf.mean(-1, keepdim=True)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    wdy = dyf * weight.to(acc).reshape(*lead, 1, 1, n) if weight is not None else dyf
    dx = wdy - xhat * (xhat * wdy).mean(-1, keepdim=True)
    if not rms:
        dx = dx - wdy.mean(-1, keepdim=True)
    dx = (dx * rstd).reshape(x.shape).to(x.dtype)
    dw = (dyf * xhat).sum(-2) if weight is not None else x.new_empty((0,), dtype=acc)
    db = dyf.sum(-2) if need_db else x.new_empty((0,), dtype=acc)
    return dx, dw, db


# ---------------------------------------------------------------------------------------
# the Triton kernels as custom ops


def _contig(t):
    return t.contiguous() if t is not None else None


def _forward_impl(name, x, weight, bias, eps, rms):
    _check(name, x, weight, bias)
    n = x.shape[-1]
    if n > MAX_HIDDEN:
        raise ValueError(f"{name}: hidden size {n} > MAX_HIDDEN={MAX_HIDDEN}")
    choose(name, x, impl="triton")  # a clear error where Triton cannot run on x's device
    from . import _triton_norm as K

    y = K.forward(x.reshape(-1, n).contiguous(), _contig(weight), _contig(bias), eps, rms)
    return y.view(x.shape)


def _backward_impl(name, dy, x, weight, eps, rms, need_db, groups):
    _check(name, x, weight)
    n = x.shape[-1]
    if dy.shape != x.shape:
        raise ValueError(f"{name}: dy has shape {tuple(dy.shape)}, x {tuple(x.shape)}")
    if groups < 1 or (x.numel() // n) % groups:
        raise ValueError(f"{name}: groups={groups} must divide the {x.numel() // n} rows")
    choose(name, x, impl="triton")
    from . import _triton_norm as K

    dx, dw, db = K.backward(
        dy.reshape(-1, n).contiguous(),
        x.reshape(-1, n).contiguous(),
        _contig(weight),
        eps,
        rms,
        need_db,
        groups,
    )

    def absent():  # a fresh (0,) each: op outputs must not alias one another
        return x.new_empty((0,), dtype=_acc(x.dtype))

    return dx.view(x.shape), dw if dw is not None else absent(), db if db is not None else absent()


def _backward_fake(x, weight, need_db, groups):
    n, acc = x.shape[-1], _acc(x.dtype)
    dw = x.new_empty((groups, n) if weight is not None else (0,), dtype=acc)
    db = x.new_empty((groups, n) if need_db else (0,), dtype=acc)
    return x.new_empty(x.shape), dw, db


def _to_front(t, dim, size):
    return t.expand(size, *t.shape) if dim is None else t.movedim(dim, 0)


def _per_sample(t, size, groups):
    """A ``(size * groups, N)`` grad as ``(size, groups, N)`` with out dim 0; an absent
    ``(0,)`` grad stays unbatched."""
    if t.dim() == 1:
        return t, None
    return t.view(size, groups, t.shape[-1]), 0


@torch.library.custom_op("fsharded::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Triton LayerNorm forward over the last dim (``layer_norm`` dispatches here)."""
    return _forward_impl("fsharded::layer_norm", x, weight, bias, eps, rms=False)


@torch.library.custom_op("fsharded::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    need_db: bool,
    groups: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dx, dweight (groups, N) or (0,), dbias (groups, N) or (0,))`` of
    ``fsharded::layer_norm``; the parameter grads are summed per group of rows."""
    name = "fsharded::layer_norm_backward"
    return _backward_impl(name, dy, x, weight, eps, False, need_db, groups)


@torch.library.custom_op("fsharded::rms_norm", mutates_args=())
def _rms_norm_op(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Triton RMSNorm forward over the last dim (``rms_norm`` dispatches here)."""
    return _forward_impl("fsharded::rms_norm", x, weight, None, eps, rms=True)


@torch.library.custom_op("fsharded::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, eps: float, groups: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dx, dweight (groups, N) or (0,))`` of ``fsharded::rms_norm``."""
    name = "fsharded::rms_norm_backward"
    dx, dw, _ = _backward_impl(name, dy, x, weight, eps, True, False, groups)
    return dx, dw


# fake (shape) rules


@_layer_norm_op.register_fake
def _(x, weight, bias, eps):
    return x.new_empty(x.shape)


@_rms_norm_op.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape)


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, eps, need_db, groups):
    return _backward_fake(x, weight, need_db, groups)


@_rms_norm_backward_op.register_fake
def _(dy, x, weight, eps, groups):
    return _backward_fake(x, weight, False, groups)[:2]


# autograd rules
#
# torch.func.grad / vjp / jacrev refuse the autograd.Function that ``register_autograd``
# generates (it has no setup_context; pytorch/pytorch#168393) and, for the same reason, any
# custom op called on inputs that require grad at a functorch level. So the public functions
# enter through autograd.Functions that do have one (``_LayerNormFn``, ``_RMSNormFn``), and
# the backward ops are called through ``_NormBackwardFn`` whose own backward (double
# backward) raises instead of silently returning zeros. ``register_autograd`` on the forward
# ops uses the same formulas, for direct op calls and torch.compile. Under vmap, the ops'
# own vmap rules run (``generate_vmap_rule``).


def _double_backward(*_):
    raise NotImplementedError(
        "double backward through the Triton layer_norm / rms_norm is not implemented; "
        "use impl='reference' for higher-order derivatives"
    )


class _NormBackwardFn(torch.autograd.Function):
    """``(dx, dw, db)`` of either norm through its backward op (``rms`` picks which)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(dy, x, weight, eps, rms, need_db):
        if rms:
            dx, dw = torch.ops.fsharded.rms_norm_backward(dy, x, weight, eps, 1)
            return dx, dw, dw.new_empty((0,))
        return torch.ops.fsharded.layer_norm_backward(dy, x, weight, eps, need_db, 1)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    backward = staticmethod(_double_backward)


def _setup(ctx, inputs, output):
    x, weight = inputs[0], inputs[1]
    ctx.save_for_backward(x, weight)
    ctx.eps = inputs[-1]
    bias = inputs[2] if len(inputs) == 4 else None
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _grads(ctx, dy, rms):
    x, weight = ctx.saved_tensors
    need_db = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
    dx, dw, db = _NormBackwardFn.apply(dy, x, weight, ctx.eps, rms, need_db)
    dw = dw[0].to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
    return dx, dw, db[0].to(ctx.bias_dtype) if need_db else None


def _layer_norm_grad(ctx, dy):
    return (*_grads(ctx, dy, rms=False), None)


def _rms_norm_grad(ctx, dy):
    dx, dw, _ = _grads(ctx, dy, rms=True)
    return dx, dw, None


_layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_setup)
_rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_setup)


class _LayerNormFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias, eps):
        return torch.ops.fsharded.layer_norm(x, weight, bias, eps)

    setup_context = staticmethod(_setup)
    backward = staticmethod(_layer_norm_grad)


class _RMSNormFn(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, eps):
        return torch.ops.fsharded.rms_norm(x, weight, eps)

    setup_context = staticmethod(_setup)
    backward = staticmethod(_rms_norm_grad)


# vmap rules: fold the vmapped dim into the rows; vmapped parameters → the reference


def _affine_to_front(t, dim, size, ndim):
    """A per-sample parameter ``(N,)`` vmapped at ``dim`` as ``(B, 1, .., 1, N)``."""
    if t is None:
        return None
    t = _to_front(t, dim, size)
    return t.reshape(size, *([1] * (ndim - 2)), t.shape[-1])


@_layer_norm_op.register_vmap
def _(info, in_dims, x, weight, bias, eps):
    x_dim, w_dim, b_dim = in_dims[:3]
    if w_dim is None and b_dim is None:
        return torch.ops.fsharded.layer_norm(x.movedim(x_dim, 0), weight, bias, eps), 0
    # Per-sample parameters (rare: ensembles): the reference, broadcast over the samples.
    x = _to_front(x, x_dim, info.batch_size)
    w = _affine_to_front(weight, w_dim, info.batch_size, x.dim())
    b = _affine_to_front(bias, b_dim, info.batch_size, x.dim())
    return _reference_math(x, w, b, eps, rms=False), 0


@_rms_norm_op.register_vmap
def _(info, in_dims, x, weight, eps):
    x_dim, w_dim = in_dims[:2]
    if w_dim is None:
        return torch.ops.fsharded.rms_norm(x.movedim(x_dim, 0), weight, eps), 0
    x = _to_front(x, x_dim, info.batch_size)
    w = _affine_to_front(weight, w_dim, info.batch_size, x.dim())
    return _reference_math(x, w, None, eps, rms=True), 0


def _backward_vmap(info, in_dims, dy, x, weight, eps, rms, need_db, groups):
    """Both backward ops' vmap rule; returns ``((dx, dw, db), out_dims)``."""
    dy_dim, x_dim, w_dim = in_dims[:3]
    size = info.batch_size
    dy, x = _to_front(dy, dy_dim, size), _to_front(x, x_dim, size)
    if w_dim is None:  # per-sample parameter grads = one group of rows per sample
        if rms:
            dx, dw = torch.ops.fsharded.rms_norm_backward(dy, x, weight, eps, groups * size)
            db = x.new_empty((0,), dtype=dw.dtype)
        else:
            op = torch.ops.fsharded.layer_norm_backward
            dx, dw, db = op(dy, x, weight, eps, need_db, groups * size)
        (dw, dw_dim), (db, db_dim) = _per_sample(dw, size, groups), _per_sample(db, size, groups)
        return (dx, dw, db), (0, dw_dim, db_dim)
    # Per-sample weights: the reference formulas, with the samples as a leading dim.
    weight = _to_front(weight, w_dim, size)
    dx, dw, db = _backward_reference(
        dy, x, weight, eps=eps, rms=rms, need_db=need_db, groups=groups
    )
    return (dx, dw, db), (0, 0, 0 if need_db else None)


@_layer_norm_backward_op.register_vmap
def _(info, in_dims, dy, x, weight, eps, need_db, groups):
    return _backward_vmap(info, in_dims, dy, x, weight, eps, False, need_db, groups)


@_rms_norm_backward_op.register_vmap
def _(info, in_dims, dy, x, weight, eps, groups):
    (dx, dw, _), (dx_dim, dw_dim, _) = _backward_vmap(
        info, in_dims, dy, x, weight, eps, True, False, groups
    )
    return (dx, dw), (dx_dim, dw_dim)


# ---------------------------------------------------------------------------------------
# public


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    impl: str | None = None,
) -> torch.Tensor:
    """LayerNorm of ``x`` over its last dim ``N``: ``(x - mean) * rsqrt(var + eps) * weight +
    bias`` (biased variance, as ``torch.nn.LayerNorm``), fp32 statistics, output in x's dtype.

    ``weight`` / ``bias``: optional ``(N,)``. Differentiable in all three, under vmap and
    make_fx. Module doc: implementations and limits.
    """
    _check("layer_norm", x, weight, bias)
    if _which("layer_norm", x, (weight, bias), impl) == "reference":
        return layer_norm_reference(x, weight, bias, eps)
    return _LayerNormFn.apply(x, weight, bias, float(eps))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    impl: str | None = None,
) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dim: ``x * rsqrt(mean(x²) + eps) * weight``, fp32
    statistics, output in x's dtype. ``weight``: optional ``(N,)``. Module doc: the rest."""
    _check("rms_norm", x, weight)
    if _which("rms_norm", x, (weight,), impl) == "reference":
        return rms_norm_reference(x, weight, eps)
    return _RMSNormFn.apply(x, weight, float(eps))
