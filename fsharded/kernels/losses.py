"""Fused softmax cross-entropy over a (possibly vocabulary-sharded) last dim.

``cross_entropy(logits, targets)`` equals
``torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), targets.flatten())``
(reshaped back for ``reduction="none"``) without materialising an fp32 ``(N, V)`` matrix.
The Triton forward streams each row's vocabulary in chunks with an online max / sum-exp
and keeps only the row logsumexp (fp32, ``N`` values); the backward recomputes the softmax
chunk by chunk and writes ``dlogits = (softmax - onehot) * dloss`` directly in the logits'
dtype. It is "linear-free": the output projection producing the logits is not fused.

Peak memory, ``N`` rows (tokens) and vocabulary ``V``: the naive fp32 path keeps an fp32
copy of low-precision logits (``4NV`` bytes), the saved fp32 log-probs (``4NV``) and their
fp32 gradient (``4NV``) before the cast back, so about ``8NV``-``12NV`` bytes beyond the
logits. Here the only ``(N, V)`` buffer is ``dlogits`` in the input dtype (``2NV`` bytes for
bf16) plus ``O(N)`` fp32 row statistics. For ``N = 8192``, ``V = 128256`` in bf16 that is
2.1 GB instead of 8.4-12.6 GB.

Vocabulary parallelism (``axis="tensor"`` inside :func:`fsharded.shard_map`): ``logits``
is this shard's slice ``[i * V_local, (i + 1) * V_local)`` of the vocabulary, ``targets``
are global ids. The local kernel gives each shard's logsumexp and the target logit (0 on
shards that do not own the target); they are combined with ``pmax`` (a stop-gradient shift,
which changes no value or derivative), ``psum`` of the rescaled sum-exp, and ``psum`` of
the target logit, all differentiable through the collectives' transpose rules.

Targets equal to ``ignore_index`` contribute 0 to the loss and the gradient and are left
out of the mean's count (all ignored: the mean is nan, as in torch). A target outside
``[0, V)`` (global ``V``) that is not ``ignore_index`` makes its row's loss nan (and so a
"mean"/"sum" nan) instead of raising: the check needs no device sync and works under
vmap / tracing. Gradients of such rows are 0. Differentiable once (no double backward).

>>> logits = torch.randn(4, 10)
>>> targets = torch.tensor([1, 9, -100, 0])
>>> loss = cross_entropy(logits, targets)
>>> torch.allclose(loss, torch.nn.functional.cross_entropy(logits, targets))
True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fsharded.kernels import _dispatch
from fsharded.spmd import collectives as C

__all__ = ["cross_entropy", "cross_entropy_reference"]

_KIND = "cross_entropy"
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPES = (*_TRITON_DTYPES, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------
# The local kernel pieces as custom ops: row statistics (forward) and dlogits (backward).
# --------------------------------------------------------------------------------------


@torch.library.custom_op("fsharded::cross_entropy_fwd", mutates_args=())
def _fwd_op(
    logits: torch.Tensor, targets: torch.Tensor, impl: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lse, target_logit)`` of ``logits`` (..., V): the row logsumexp and the logit at
    ``targets`` (0 where the id is outside ``[0, V)``), fp32 (fp64 for fp64 logits)."""
    if impl == "triton":
        from fsharded.kernels import _triton_cross_entropy

        return _triton_cross_entropy.forward(logits, targets)
    x = logits.to(_stat_dtype(logits.dtype))  # (..., V)
    V = x.shape[-1]
    own = (targets >= 0) & (targets < V)
    picked = x.gather(-1, torch.where(own, targets, 0).unsqueeze(-1)).squeeze(-1)
    return torch.logsumexp(x, -1), torch.where(own, picked, torch.zeros_like(picked))


@_fwd_op.register_fake
def _(logits, targets, impl):
    lead, dt = logits.shape[:-1], _stat_dtype(logits.dtype)
    return logits.new_empty(lead, dtype=dt), logits.new_empty(lead, dtype=dt)


@torch.library.custom_op("fsharded::cross_entropy_bwd", mutates_args=())
def _bwd_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    d_lse: torch.Tensor,
    d_target: torch.Tensor,
    impl: str,
) -> torch.Tensor:
    """``exp(logits - lse) * d_lse + onehot(targets) * d_target`` in the logits' dtype
    (ids outside ``[0, V)`` have no one-hot)."""
    if impl == "triton":
        from fsharded.kernels import _triton_cross_entropy

        return _triton_cross_entropy.backward(logits, targets, lse, d_lse, d_target)
    dt = _stat_dtype(logits.dtype)
    x = logits.to(dt)  # (..., V)
    g = torch.exp(x - lse.to(dt).unsqueeze(-1)) * d_lse.to(dt).unsqueeze(-1)
    V = x.shape[-1]
    hit = torch.arange(V, device=x.device) == targets.unsqueeze(-1)  # (..., V)
    g = g + hit.to(dt) * d_target.to(dt).unsqueeze(-1)
    return g.to(logits.dtype)


@_bwd_op.register_fake
def _(logits, targets, lse, d_lse, d_target, impl):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _op_setup(ctx, inputs, output):
    logits, targets, impl = inputs
    ctx.save_for_backward(logits, targets, output[0])
    ctx.impl = impl


def _op_backward(ctx, d_lse, d_target):
    logits, targets, lse = ctx.saved_tensors
    if d_lse is None:
        d_lse = torch.zeros_like(lse)
    if d_target is None:
        d_target = torch.zeros_like(lse)
    # No double backward: the backward op is not itself differentiable.
    with torch.no_grad():
        return _bwd_op(logits, targets, lse, d_lse, d_target, ctx.impl), None, None


_fwd_op.register_autograd(_op_backward, setup_context=_op_setup)


def _front(x: torch.Tensor, bdim: int | None, size: int) -> torch.Tensor:
    """The vmapped dim first; an unbatched input is broadcast (a stride-0 view)."""
    if bdim is None:
        return x.expand(size, *x.shape)
    return x.movedim(bdim, 0)


@_fwd_op.register_vmap
def _(info, in_dims, logits, targets, impl):
    # Rows are independent: the vmapped dim is just one more leading (row) dim.
    n = info.batch_size
    return _fwd_op(_front(logits, in_dims[0], n), _front(targets, in_dims[1], n), impl), (0, 0)


@_bwd_op.register_vmap
def _(info, in_dims, logits, targets, lse, d_lse, d_target, impl):
    n = info.batch_size
    args = [_front(v, d, n) for v, d in zip((logits, targets, lse, d_lse, d_target), in_dims)]
    return _bwd_op(*args, impl), 0


class _Stats(torch.autograd.Function):
    """The forward op with its backward, as an autograd.Function so ``torch.func.grad``
    works (a custom op's ``register_autograd`` does not support functorch transforms)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(logits, targets, impl):
        return _fwd_op(logits, targets, impl)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _op_setup(ctx, inputs, output)

    @staticmethod
    def backward(ctx, d_lse, d_target):
        return _op_backward(ctx, d_lse, d_target)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _check(logits, targets, ignore_index, reduction) -> None:
    if not isinstance(logits, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError(
            f"cross_entropy: logits and targets must be tensors, got "
            f"{type(logits).__name__} and {type(targets).__name__}"
        )
    if logits.dtype not in _DTYPES:
        raise TypeError(
            f"cross_entropy: logits must be float32, bfloat16, float16 or float64, got "
            f"{logits.dtype}"
        )
    if targets.dtype != torch.int64:
        raise TypeError(
            f"cross_entropy: targets must be int64 class ids, got {targets.dtype}; "
            f"use targets.long()"
        )
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"cross_entropy: logits must have a non-empty last (vocabulary) dim, got shape "
            f"{tuple(logits.shape)}"
        )
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"cross_entropy: targets of shape {tuple(targets.shape)} must have the shape of "
            f"logits {tuple(logits.shape)} without its last dim, {tuple(logits.shape[:-1])}"
        )
    if logits.device != targets.device:
        raise ValueError(
            f"cross_entropy: logits are on {logits.device} but targets on {targets.device}"
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"cross_entropy: reduction={reduction!r}, expected one of {', '.join(_REDUCTIONS)}"
        )
    if not isinstance(ignore_index, int):
        raise TypeError(f"cross_entropy: ignore_index must be an int, got {ignore_index!r}")


def _choose(logits: torch.Tensor, targets: torch.Tensor, impl: str | None) -> str:
    kind = _dispatch.choose(_KIND, logits, targets, impl=impl)
    if kind == "triton" and logits.dtype not in _TRITON_DTYPES:
        want = (impl or "auto").lower()
        if want == "triton" or (want == "auto" and _dispatch.forced() == "triton"):
            raise TypeError(
                f"cross_entropy: the Triton kernel takes float32/bfloat16/float16 logits, got "
                f"{logits.dtype}; use impl='reference' or cast the logits"
            )
        return "reference"  # documented fallback: float64 runs the reference
    return kind


def _reduce(loss: torch.Tensor, valid: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / valid.sum().to(loss.dtype)


def cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    axis: str | Sequence[str] | None = None,
    impl: str | None = None,
) -> torch.Tensor:
    """Softmax cross-entropy of ``logits`` (..., V) against int64 ``targets`` (...).

    Returns fp32 (fp64 for fp64 logits): per-row losses of shape (...) for
    ``reduction="none"``, else a scalar ("mean" over non-ignored targets, or "sum").
    ``axis``: the mesh axis (or tuple of axes) the vocabulary is sharded over, only
    inside ``shard_map``; ``logits`` is then the local slice of ``V / axis_size`` columns
    and ``targets`` are global ids. ``impl``: see :mod:`fsharded.kernels._dispatch`;
    float64 logits run the reference (Triton takes fp32/bf16/fp16). Input of any strides
    is accepted; a last dim of stride != 1 is copied contiguous for the Triton kernel.
    """
    _check(logits, targets, ignore_index, reduction)
    kind = _choose(logits, targets, impl)
    V = logits.shape[-1]
    local_targets = targets
    if axis is not None:
        if not C.is_bound(axis):
            raise ValueError(
                f"cross_entropy(axis={axis!r}): the vocabulary axis must be a mesh axis bound "
                f"by an enclosing shard_map; call it inside shard_map(f, mesh=..., ...) or "
                f"pass axis=None for unsharded logits"
            )
        local_targets = targets - C.axis_index(axis) * V
        V = V * C.axis_size(axis)

    lse, target_logit = _Stats.apply(logits, local_targets, kind)  # (...), (...)
    if axis is not None:
        # Shift by the global row max (no gradient: the shift cancels exactly), sum the
        # rescaled partial sum-exps, and take the target logit from the shard owning it.
        m = C.pmax(lse.detach(), axis)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        lse = m + torch.log(C.psum(torch.exp(lse - m), axis))
        target_logit = C.psum(target_logit, axis)

    valid = targets != ignore_index
    bad = valid & ((targets < 0) | (targets >= V))
    loss = torch.where(valid, lse - target_logit, torch.zeros_like(lse))
    loss = torch.where(bad, torch.full_like(loss, float("nan")), loss)
    return _reduce(loss, valid, reduction)


def cross_entropy_reference(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    axis: str | Sequence[str] | None = None,
) -> torch.Tensor:
    """Pure-torch ground truth for :func:`cross_entropy` (same arguments and semantics).

    Materialises the fp32 log-softmax; with ``axis`` it all-gathers the vocabulary shards
    first and computes the unsharded loss.
    """
    _check(logits, targets, ignore_index, reduction)
    if axis is not None:
        logits = C.all_gather_invariant(logits, axis, dim=-1)  # every shard: the whole row
    x = logits.to(_stat_dtype(logits.dtype))
    V = x.shape[-1]
    valid = targets != ignore_index
    own = (targets >= 0) & (targets < V)
    logp = torch.log_softmax(x, -1)
    picked = logp.gather(-1, torch.where(own, targets, 0).unsqueeze(-1)).squeeze(-1)
    loss = torch.where(valid, -picked, torch.zeros_like(picked))
    loss = torch.where(valid & ~own, torch.full_like(loss, float("nan")), loss)
    return _reduce(loss, valid, reduction)
