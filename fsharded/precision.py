"""Mixed precision: a dtype ``Policy`` and DeepSpeed's dynamic loss scaling as pure state.

A ``Policy`` says which dtype each role uses: parameters on the step, compute, gradient
reduction and the optimizer's master weights. Loss scaling is an optax-style pair: a
frozen config (``DynamicLossScale`` or ``StaticLossScale``) with ``init()`` and
``update(state, finite)``, and a ``LossScaleState`` of 0-d tensors. Nothing here calls
``.item()`` or branches in Python on tensor values, so every function runs unchanged
inside ``torch.func.vmap`` (the virtual mesh) and ``torch.func.grad``.

One fp16 step, per shard::

    ls = DynamicLossScale()                    # DeepSpeed's defaults
    state = ls.init()
    grads = torch.func.grad(lambda p: scale_loss(loss_fn(p, batch), state))(params)
    # ... reduce grads over the data axis ...
    finite = all_finite(grads, axis=("data",))  # one verdict for every shard
    grads = unscale(grads, state)               # fp32, divided by the scale
    new_params, new_opt = optimizer(grads, opt_state, params)
    params, opt_state = tree_where(finite, (new_params, new_opt), (params, opt_state))
    state = ls.update(state, finite)           # skip count, hysteresis, shrink / grow

>>> ls = DynamicLossScale(hysteresis=1)
>>> s = ls.update(ls.init(), torch.tensor(False))   # an overflow: skip and halve
>>> s.scale.item(), s.skipped.item()
(32768.0, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import optree
import torch

from fsharded._tree import tree_map_with_path
from fsharded.spmd.collectives import pmax

__all__ = [
    "Policy",
    "as_policy",
    "cast_tree",
    "LossScaleState",
    "DynamicLossScale",
    "StaticLossScale",
    "loss_scale_init",
    "all_finite",
    "scale_loss",
    "unscale",
    "tree_where",
    "check_loss_scale",
]

_DTYPE_NAMES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float64: "fp64",
}


def _dtype_name(d: torch.dtype) -> str:
    return _DTYPE_NAMES.get(d, str(d).removeprefix("torch."))


def cast_tree(tree: Any, dtype: torch.dtype | None) -> Any:
    """Cast every floating-point tensor leaf of ``tree`` to ``dtype``.

    Integer, boolean and complex tensors and non-tensor leaves pass through unchanged, so
    a parameter tree holding step counters or token ids can be cast as a whole. ``None``
    as ``dtype`` returns ``tree`` as is. The cast is differentiable.

    >>> cast_tree({"w": torch.ones(2), "step": torch.tensor(3)}, torch.bfloat16)
    {'w': tensor([1., 1.], dtype=torch.bfloat16), 'step': tensor(3)}
    """
    if dtype is None:
        return tree

    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return optree.tree_map(cast, tree)


@dataclass(frozen=True)
class Policy:
    """Which dtype each role uses in a mixed-precision step.

    ``Policy.bf16()`` is the usual choice on hardware with bfloat16; ``Policy.fp16()``
    adds dynamic loss scaling because fp16 gradients underflow without it. Master
    weights (the optimizer's copy that accumulates updates) stay fp32 in both, and
    gradients are reduced in fp32 by default — more accurate than DeepSpeed, whose
    default ``communication_data_type`` is the low-precision dtype; pass
    ``reduce_dtype=torch.bfloat16`` to halve the bytes on the wire instead.

    >>> Policy.from_name("bf16")
    Policy(param=bf16, compute=bf16, reduce=fp32, master=fp32, loss_scaling=False)
    >>> Policy.bf16(reduce_dtype=torch.bfloat16).reduce_dtype
    torch.bfloat16
    """

    param_dtype: torch.dtype = torch.float32
    """Dtype of the parameters the step's forward and backward see (cast from master)."""
    compute_dtype: torch.dtype = torch.float32
    """Dtype activations and matmuls run in."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype gradients are cast to before the data-parallel reduction."""
    master_dtype: torch.dtype = torch.float32
    """Dtype of the optimizer's master weights and of the gradients it consumes."""
    loss_scaling: bool = False
    """Whether the step scales the loss (needed for fp16; see ``DynamicLossScale``)."""
    loss_scale: DynamicLossScale | StaticLossScale | None = None
    """The scaler to use when ``loss_scaling``; ``None`` means ``DynamicLossScale()``
    (DeepSpeed's defaults)."""

    def __post_init__(self) -> None:
        errors = []
        for name in ("param_dtype", "compute_dtype", "reduce_dtype", "master_dtype"):
            v = getattr(self, name)
            if not isinstance(v, torch.dtype) or not v.is_floating_point:
                errors.append(f"  {name}: expected a floating torch.dtype, got {v!r}")
        if not isinstance(self.loss_scaling, bool):
            errors.append(f"  loss_scaling: expected bool, got {self.loss_scaling!r}")
        if self.loss_scale is not None:
            if not isinstance(self.loss_scale, DynamicLossScale | StaticLossScale):
                errors.append(
                    f"  loss_scale: expected a DynamicLossScale or StaticLossScale, got {self.loss_scale!r}"
                )
            elif self.loss_scaling is False:
                errors.append("  loss_scale: given, but loss_scaling is False (set it True)")
        if errors:
            raise ValueError("invalid Policy:\n" + "\n".join(errors))

    def __repr__(self) -> str:
        extra = "" if self.loss_scale is None else f", loss_scale={self.loss_scale!r}"
        return (
            f"Policy(param={_dtype_name(self.param_dtype)}, "
            f"compute={_dtype_name(self.compute_dtype)}, "
            f"reduce={_dtype_name(self.reduce_dtype)}, "
            f"master={_dtype_name(self.master_dtype)}, loss_scaling={self.loss_scaling}{extra})"
        )

    def loss_scaler(self) -> DynamicLossScale | StaticLossScale | None:
        """The loss-scaling config the step should use, or ``None`` without loss scaling.

        >>> Policy.fp16().loss_scaler() == DynamicLossScale()
        True
        """
        if not self.loss_scaling:
            return None
        return self.loss_scale if self.loss_scale is not None else DynamicLossScale()

    @classmethod
    def fp32(cls, **overrides: Any) -> Policy:
        """Everything in fp32, no loss scaling."""
        return cls(**overrides)

    @classmethod
    def bf16(cls, **overrides: Any) -> Policy:
        """bf16 parameters and compute; fp32 reduction and master weights; no scaling."""
        kw = dict(param_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
        return cls(**{**kw, **overrides})

    @classmethod
    def fp16(cls, **overrides: Any) -> Policy:
        """fp16 parameters and compute; fp32 reduction and master weights; loss scaling
        (``loss_scale=StaticLossScale(...)`` or a configured ``DynamicLossScale``)."""
        kw = dict(param_dtype=torch.float16, compute_dtype=torch.float16, loss_scaling=True)
        return cls(**{**kw, **overrides})

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Policy:
        """``"fp32" | "bf16" | "fp16"`` (also ``float32``, ``bfloat16``, ``float16``, ``half``)."""
        key = name.lower() if isinstance(name, str) else name
        ctor = _POLICY_NAMES.get(key)
        if ctor is None:
            raise ValueError(
                f"unknown precision {name!r}: expected one of 'fp32', 'bf16', 'fp16' "
                "(aliases: 'float32', 'float', 'bfloat16', 'float16', 'half')"
            )
        return getattr(cls, ctor)(**overrides)

    def cast_to_param(self, tree: Any) -> Any:
        """Cast floating leaves to ``param_dtype`` (master weights -> step parameters)."""
        return cast_tree(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        """Cast floating leaves to ``compute_dtype`` (parameters or inputs for the forward)."""
        return cast_tree(tree, self.compute_dtype)

    def cast_to_reduce(self, tree: Any) -> Any:
        """Cast floating leaves to ``reduce_dtype`` (gradients before the reduction)."""
        return cast_tree(tree, self.reduce_dtype)

    def cast_to_master(self, tree: Any) -> Any:
        """Cast floating leaves to ``master_dtype`` (params or gradients for the optimizer)."""
        return cast_tree(tree, self.master_dtype)


_POLICY_NAMES = {
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
}


def as_policy(precision: Policy | str | None) -> Policy:
    """A ``Policy`` from a policy, a name (``"bf16"``) or ``None`` (fp32)."""
    if precision is None:
        return Policy.fp32()
    if isinstance(precision, Policy):
        return precision
    if isinstance(precision, str):
        return Policy.from_name(precision)
    raise TypeError(f"precision: expected a Policy or a name like 'bf16', got {precision!r}")


# -- loss scaling ---------------------------------------------------------------------------


class LossScaleState(NamedTuple):
    """Loss-scaling state: 0-d tensors only, so it is a pytree that vmap and shard_map carry.

    ``good_steps`` is DeepSpeed's ``cur_iter - last_overflow_iter - 1`` at the next update:
    the number of overflow-free updates since the last overflow.
    """

    scale: torch.Tensor
    """Current loss scale (fp32)."""
    hysteresis: torch.Tensor
    """Overflows still tolerated before the scale shrinks (DeepSpeed's ``cur_hysteresis``)."""
    good_steps: torch.Tensor
    """Overflow-free updates since the last overflow (int64)."""
    skipped: torch.Tensor
    """Total steps skipped because of non-finite gradients (int64)."""
    overflows_at_min: torch.Tensor
    """Overflows that wanted to shrink a scale already at ``min_loss_scale`` (int64).

    DeepSpeed's ``DynamicLossScaler`` raises at this point; a pure step cannot, so it
    counts and the driver checks (``check_loss_scale``)."""


def _state(scale: float, hysteresis: int) -> LossScaleState:
    i64 = dict(dtype=torch.int64)
    return LossScaleState(
        scale=torch.tensor(float(scale), dtype=torch.float32),
        hysteresis=torch.tensor(hysteresis, **i64),
        good_steps=torch.tensor(0, **i64),
        skipped=torch.tensor(0, **i64),
        overflows_at_min=torch.tensor(0, **i64),
    )


def _as_bool(finite: torch.Tensor | bool) -> torch.Tensor:
    return torch.as_tensor(finite, dtype=torch.bool)


def _positive_int(name: str, v: Any) -> str | None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return f"  {name}: expected an int >= 1, got {v!r}"
    return None


@dataclass(frozen=True)
class DynamicLossScale:
    """DeepSpeed's dynamic loss scaler (``fp16.loss_scale = 0``) as a pure ``init``/``update``.

    The semantics are those of ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``:

    - Start at ``2**initial_scale_power``.
    - On an overflow (non-finite gradients) the step is skipped. If the hysteresis
      counter is above 1 it is decremented and the scale is kept; otherwise the scale
      becomes ``max(scale / 2, min_loss_scale)``. The counter is *not* refilled by the
      shrink, so further overflows shrink at once until it is refilled.
    - On an overflow-free update that follows ``k * loss_scale_window`` (k >= 1)
      overflow-free updates since the last overflow, the scale doubles and the counter
      is refilled to ``hysteresis``. With ``consecutive_hysteresis`` the counter is
      refilled on every overflow-free update instead, so only *consecutive* overflows
      use it up.

    >>> ls = DynamicLossScale(loss_scale_window=2, initial_scale_power=4)
    >>> s = ls.init()
    >>> for _ in range(3):
    ...     s = ls.update(s, torch.tensor(True))
    >>> s.scale.item()   # doubled on the update after 2 good ones, as DeepSpeed does
    32.0
    """

    initial_scale_power: int = 16
    """The first scale is ``2**initial_scale_power``."""
    loss_scale_window: int = 1000
    """Overflow-free updates before the scale doubles."""
    hysteresis: int = 2
    """Overflows tolerated before the scale shrinks (DeepSpeed's ``delayed_shift``)."""
    min_loss_scale: float = 1.0
    """The scale never shrinks below this."""
    consecutive_hysteresis: bool = False
    """Refill the hysteresis counter on every overflow-free update."""
    scale_factor: float = 2.0
    """Shrink/grow factor (fixed at 2 in DeepSpeed)."""

    def __post_init__(self) -> None:
        errors = [
            _positive_int("loss_scale_window", self.loss_scale_window),
            _positive_int("hysteresis", self.hysteresis),
        ]
        p = self.initial_scale_power
        if isinstance(p, bool) or not isinstance(p, int) or not -126 <= p <= 127:
            errors.append(f"  initial_scale_power: expected an int in [-126, 127], got {p!r}")
        for name in ("min_loss_scale", "scale_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                errors.append(f"  {name}: expected a finite number > 0, got {v!r}")
        if not isinstance(self.consecutive_hysteresis, bool):
            errors.append(f"  consecutive_hysteresis: expected bool, got {self.consecutive_hysteresis!r}")
        errors = [e for e in errors if e]
        if errors:
            raise ValueError("invalid DynamicLossScale:\n" + "\n".join(errors))

    def init(self) -> LossScaleState:
        """The state before the first step."""
        return _state(2.0**self.initial_scale_power, self.hysteresis)

    def update(self, state: LossScaleState, finite: torch.Tensor | bool) -> LossScaleState:
        """The state after a step whose gradients were ``finite`` (a 0-d bool tensor)."""
        finite = _as_bool(finite)
        overflow = ~finite
        scale, hyst = state.scale, state.hysteresis
        refill = torch.full_like(hyst, self.hysteresis)

        # Overflow: spend one unit of hysteresis, or shrink once it is down to 1.
        shrink = overflow & (hyst <= 1)
        at_min = shrink & (scale == self.min_loss_scale)
        shrunk = torch.clamp(scale / self.scale_factor, min=self.min_loss_scale)
        scale_over = torch.where(shrink, shrunk, scale)
        hyst_over = torch.where(shrink, hyst, hyst - 1)

        # No overflow: grow at every multiple of the window of overflow-free updates.
        stable = state.good_steps
        grow = (stable > 0) & (stable % self.loss_scale_window == 0)
        scale_good = torch.where(grow, scale * self.scale_factor, scale)
        hyst_good = refill if self.consecutive_hysteresis else torch.where(grow, refill, hyst)

        return LossScaleState(
            scale=torch.where(overflow, scale_over, scale_good),
            hysteresis=torch.where(overflow, hyst_over, hyst_good),
            good_steps=torch.where(overflow, torch.zeros_like(stable), stable + 1),
            skipped=state.skipped + overflow.to(state.skipped.dtype),
            overflows_at_min=state.overflows_at_min + at_min.to(state.overflows_at_min.dtype),
        )


@dataclass(frozen=True)
class StaticLossScale:
    """A fixed loss scale (DeepSpeed's ``fp16.loss_scale > 0``), same API as the dynamic one.

    Steps with non-finite gradients are still skipped and counted, as DeepSpeed's fp16
    optimizer does with a static scale; the scale itself never changes.
    ``StaticLossScale(1.0)`` is "no scaling" with overflow skipping.

    >>> ls = StaticLossScale(128.0)
    >>> ls.update(ls.init(), torch.tensor(False)).scale.item()
    128.0
    """

    scale: float = 1.0
    """The loss scale."""

    def __post_init__(self) -> None:
        v = self.scale
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"invalid StaticLossScale:\n  scale: expected a finite number > 0, got {v!r}")

    def init(self) -> LossScaleState:
        """The state before the first step."""
        return _state(self.scale, 1)

    def update(self, state: LossScaleState, finite: torch.Tensor | bool) -> LossScaleState:
        """Count a skipped step when ``finite`` is false; the scale stays."""
        finite = _as_bool(finite)
        overflow = ~finite
        return state._replace(
            good_steps=torch.where(overflow, torch.zeros_like(state.good_steps), state.good_steps + 1),
            skipped=state.skipped + overflow.to(state.skipped.dtype),
        )


def loss_scale_init(
    initial_scale_power: int = 16,
    loss_scale_window: int = 1000,
    hysteresis: int = 2,
    min_loss_scale: float = 1.0,
    consecutive_hysteresis: bool = False,
) -> LossScaleState:
    """Initial dynamic loss-scale state; shorthand for ``DynamicLossScale(...).init()``.

    Only the initial scale and hysteresis enter the state; pass the same settings to a
    ``DynamicLossScale`` for ``update``.
    """
    return DynamicLossScale(
        initial_scale_power=initial_scale_power,
        loss_scale_window=loss_scale_window,
        hysteresis=hysteresis,
        min_loss_scale=min_loss_scale,
        consecutive_hysteresis=consecutive_hysteresis,
    ).init()


def all_finite(tree: Any, *, axis: str | tuple[str, ...] | None = None) -> torch.Tensor:
    """0-d bool tensor: every floating leaf of ``tree`` is free of inf and nan.

    With ``axis`` (mesh axis names, inside ``shard_map``) the verdict is combined over
    those axes, so every shard skips or applies the step together: pass every axis the
    gradients are sharded or differ over (DeepSpeed all-reduces its overflow flag over
    data and model parallel groups the same way). An empty tree is finite.

    >>> all_finite({"a": torch.ones(2), "b": torch.tensor([1.0, float("inf")])})
    tensor(False)
    """
    flags = [
        torch.isfinite(x).all()
        for x in optree.tree_leaves(tree)
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    finite = torch.stack(flags).all() if flags else torch.tensor(True)
    if axis is not None:
        # Collectives carry floats; the max of "overflowed" flags is "any shard overflowed".
        overflow = pmax((~finite).to(torch.float32), axis)
        finite = overflow == 0
    return finite


def scale_loss(loss: torch.Tensor, state: LossScaleState) -> torch.Tensor:
    """``loss`` in fp32 times the current scale (differentiate this one).

    The product is fp32 (as DeepSpeed's ``loss.float() * cur_scale``), so the scaled
    loss itself cannot overflow; its gradient flows back into the fp16 graph scaled.
    """
    return loss.float() * state.scale


def unscale(
    grads: Any, state: LossScaleState, *, dtype: torch.dtype | None = torch.float32
) -> Any:
    """Divide floating gradient leaves by the scale, after casting them to ``dtype``.

    The cast comes first because unscaled fp16 gradients are exactly the small values
    that underflow in fp16; ``dtype=None`` keeps each leaf's dtype. Scales are powers
    of two, so multiplying by the reciprocal is exact.
    """
    inv = 1.0 / state.scale

    def f(g: Any) -> Any:
        if not (isinstance(g, torch.Tensor) and g.is_floating_point()):
            return g
        g = g if dtype is None else g.to(dtype)
        return g * inv.to(g.dtype)

    return optree.tree_map(f, grads)


def tree_where(cond: torch.Tensor | bool, new: Any, old: Any) -> Any:
    """Per leaf ``torch.where(cond, new, old)``: take ``new`` where ``cond`` holds.

    The vmap-safe way to skip a step: compute the update unconditionally, then keep the
    old parameters and optimizer state when the gradients overflowed. ``new`` and
    ``old`` must have the same structure; non-tensor leaves must be equal (they cannot
    depend on ``cond``). Each result keeps the dtype of its ``old`` leaf.

    >>> tree_where(torch.tensor(False), {"w": torch.zeros(2)}, {"w": torch.ones(2)})
    {'w': tensor([1., 1.])}
    """
    cond = _as_bool(cond)

    def pick(path: str, n: Any, o: Any) -> Any:
        if isinstance(n, torch.Tensor) or isinstance(o, torch.Tensor):
            if not (isinstance(n, torch.Tensor) and isinstance(o, torch.Tensor)):
                raise TypeError(
                    f"tree_where: leaf {path} is a tensor on one side only "
                    f"(new: {type(n).__name__}, old: {type(o).__name__})"
                )
            if n is o:  # passed through (a frozen leaf, one a pipe rank does not hold): as it is
                return o
            return torch.where(cond, n, o).to(o.dtype)
        if n is not o and n != o:
            raise TypeError(
                f"tree_where: non-tensor leaf {path} differs ({n!r} vs {o!r}); "
                "keep step-dependent values in tensors"
            )
        return o

    try:
        return tree_map_with_path(pick, new, old)
    except ValueError as e:
        raise ValueError(f"tree_where: new and old have different structures: {e}") from None


def check_loss_scale(state: LossScaleState) -> None:
    """Raise where DeepSpeed would: an overflow with the scale already at its minimum.

    Call it on the host, outside ``shard_map``/``vmap`` (it reads a value). Training at
    the minimum scale that still overflows has diverged; DeepSpeed stops the run.
    """
    n = int(state.overflows_at_min.max())
    if n:
        raise FloatingPointError(
            f"loss scale at its minimum ({float(state.scale.min())}) and gradients still "
            f"overflow ({n} time(s)); DeepSpeed stops here. Lower the learning rate, check "
            "the data for inf/nan, or use bf16."
        )
