"""Fused in-place optimizer steps over lists of tensors: AdamW / Adam, Lion, Adagrad.

Each step takes lists (one tensor per parameter; a flat ZeRO buffer is a 1-element list)
and updates them in place in one pass per bucket:

- ``params`` and the optimizer states are fp32 (master weights);
- ``grads`` are fp32, bf16 or fp16, upcast and multiplied by ``inv_scale`` on load (loss-scale
  unscaling fused into the update);
- ``half_params`` (optional, bf16/fp16) receive the updated params cast down in the same pass;
- non-finite detection is fused: when any unscaled gradient is inf or nan, *nothing* is
  modified (params, states, half params) and the returned 0-d bool ``found_inf`` is True.
  That costs a second read of the gradients, needed only under fp16 loss scaling:
  ``check_finite=False`` skips it (no check kernel / pass; ``found_inf`` is always False), and
  non-finite gradients then propagate into the parameters and states as in ``torch.optim``.

Implementations (``fsharded.kernels._dispatch.choose``):

- ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``): one kernel launch for a whole
  list of tensors of different sizes (a device table of addresses and chunk offsets, see
  ``_triton_fused_optim``), preceded by one check launch writing a device flag that the
  update reads: ``found_inf`` comes back without a host synchronisation;
- ``"cpp"`` (CPU): ``fsharded.kernels.cpu_optim`` (imported only when chosen);
- ``"reference"``: the ``*_reference_`` functions below, which run ``cpu_optim``'s pure-torch
  steps (torch.optim's ops one for one, on any device; ``found_inf`` costs one host sync).

The Triton launch tables are cached on the tensors' addresses (exact keys: a hit is always
valid), so stepping the same buffers every iteration copies no table to the device.

These are not custom ops and do not take part in autograd (like ``torch._fused_adamw_``):
they run under ``torch.no_grad`` on plain tensors or ``nn.Parameter``s after backward, and
bump the autograd version counters of what they modify. All tensors must be contiguous and on
one device. Bias corrections use the 1-based ``step`` being taken, computed in float64 on the
host, so results match ``torch.optim.AdamW`` / ``Adam`` / ``Adagrad`` up to fp32 rounding.

>>> p, g = [torch.zeros(3)], [torch.ones(3)]
>>> m, v = [torch.zeros(3)], [torch.zeros(3)]
>>> fused_adamw_(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
...              step=1, impl="reference")
tensor(False)
>>> p[0]
tensor([-0.1000, -0.1000, -0.1000])
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._dispatch import choose

__all__ = [
    "fused_adamw_",
    "fused_adam_",
    "fused_lion_",
    "fused_adagrad_",
    "fused_adamw_reference_",
    "fused_lion_reference_",
    "fused_adagrad_reference_",
]

Tensors = Sequence[torch.Tensor]

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF_DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------
# validation


def _check_lists(
    name: str, params: Tensors, grads: Tensors, states: dict, half_params: Tensors | None
) -> None:
    """Raise one error listing every bad tensor (dtype → TypeError, else ValueError)."""
    lists = {"params": params, "grads": grads, **states}
    if half_params is not None:
        lists["half_params"] = half_params
    for arg, lst in lists.items():
        if not isinstance(lst, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in lst):
            raise TypeError(
                f"{name}: {arg} must be a list of tensors (wrap a single flat buffer as "
                f"[buffer]), got {type(lst).__name__}"
            )
    n = len(params)
    lengths = {arg: len(lst) for arg, lst in lists.items() if len(lst) != n}
    if lengths:
        raise ValueError(f"{name}: every list must have len(params)={n}, got {lengths}")
    device = params[0].device if n else None
    dtype_problems, problems = [], []
    for arg, lst in lists.items():
        allowed = {"grads": _GRAD_DTYPES, "half_params": _HALF_DTYPES}.get(arg, (torch.float32,))
        for i, t in enumerate(lst):
            where = f"{arg}[{i}]"
            if t.dtype not in allowed:
                want = " or ".join(str(d) for d in allowed)
                dtype_problems.append(f"{where} has dtype {t.dtype}, expected {want}")
            if t.shape != params[i].shape:
                problems.append(
                    f"{where} has shape {tuple(t.shape)}, params[{i}] has {tuple(params[i].shape)}"
                )
            if t.device != device:
                problems.append(f"{where} is on {t.device}, params[0] on {device}")
            if not t.is_contiguous():
                problems.append(f"{where} is not contiguous (call .contiguous() on it)")
    if dtype_problems or problems:
        cls = TypeError if dtype_problems else ValueError
        raise cls(f"{name}: " + "; ".join(dtype_problems + problems))


def _check_scalars(name: str, **values: float) -> None:
    bad = []
    for key, value in values.items():
        if key in ("beta1", "beta2"):
            ok = 0.0 <= value < 1.0
            want = "in [0, 1)"
        elif key == "step":
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            want = "an int >= 1 (the 1-based step being taken)"
        elif key == "inv_scale":
            ok = math.isfinite(value) and value > 0.0
            want = "finite and > 0"
        else:
            ok = math.isfinite(value) and value >= 0.0
            want = "finite and >= 0"
        if not ok:
            bad.append(f"{key}={value!r} (must be {want})")
    if bad:
        raise ValueError(f"{name}: " + ", ".join(bad))


def _empty_found(params: Tensors) -> torch.Tensor | None:
    """``found_inf`` for a list with nothing to update, else None."""
    if all(p.numel() == 0 for p in params):
        device = params[0].device if len(params) else "cpu"
        return torch.zeros((), dtype=torch.bool, device=device)
    return None


# ---------------------------------------------------------------------------------------
# host scalars (float64), shared by the reference and the kernel


def _adam_scalars(lr, beta1, beta2, eps, weight_decay, step, decoupled, inv_scale) -> dict:
    return dict(
        lr=lr,
        beta1=beta1,
        omb1=1.0 - beta1,
        beta2=beta2,
        omb2=1.0 - beta2,
        eps=eps,
        wd=weight_decay,
        decay=1.0 - lr * weight_decay if decoupled else 1.0,
        step_size=lr / (1.0 - beta1**step),
        bc2_sqrt=(1.0 - beta2**step) ** 0.5,
        inv_scale=inv_scale,
    )


def _lion_scalars(lr, beta1, beta2, weight_decay, inv_scale) -> dict:
    return dict(
        lr=lr,
        beta1=beta1,
        omb1=1.0 - beta1,
        beta2=beta2,
        omb2=1.0 - beta2,
        eps=0.0,
        wd=weight_decay,
        decay=1.0 - lr * weight_decay,
        step_size=0.0,
        bc2_sqrt=1.0,
        inv_scale=inv_scale,
    )


def _adagrad_scalars(lr, eps, weight_decay, lr_decay, step, inv_scale) -> dict:
    return dict(
        lr=lr,
        beta1=0.0,
        omb1=1.0,
        beta2=0.0,
        omb2=1.0,
        eps=eps,
        wd=weight_decay,
        decay=1.0,
        step_size=lr / (1.0 + (step - 1) * lr_decay),
        bc2_sqrt=1.0,
        inv_scale=inv_scale,
    )


# ---------------------------------------------------------------------------------------
# references: the pure-torch steps of ``cpu_optim`` (one copy of torch.optim's arithmetic,
# shared with the C++ path), with this module's argument checks and ``found_inf`` on the
# params' device


def _on_device(found: torch.Tensor, params: Tensors) -> torch.Tensor:
    return found.to(params[0].device) if len(params) else found


def fused_adamw_reference_(
    params: Tensors,
    grads: Tensors,
    exp_avg: Tensors,
    exp_avg_sq: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """Pure-torch :func:`fused_adamw_`: ``cpu_optim.adamw_reference_``, op for op as
    ``torch.optim.AdamW`` / ``Adam`` (single-tensor); one host sync for ``found_inf``."""
    from .cpu_optim import adamw_reference_

    _check_lists(
        "fused_adamw_reference_",
        params,
        grads,
        {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq},
        half_params,
    )
    found = adamw_reference_(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled=decoupled,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    return _on_device(found, params)


def fused_lion_reference_(
    params: Tensors,
    grads: Tensors,
    exp_avg: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """Pure-torch :func:`fused_lion_`: ``cpu_optim.lion_reference_``."""
    from .cpu_optim import lion_reference_

    _check_lists("fused_lion_reference_", params, grads, {"exp_avg": exp_avg}, half_params)
    found = lion_reference_(
        params,
        grads,
        exp_avg,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    return _on_device(found, params)


def fused_adagrad_reference_(
    params: Tensors,
    grads: Tensors,
    state_sum: Tensors,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    step: int = 1,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """Pure-torch :func:`fused_adagrad_`: ``cpu_optim.adagrad_reference_``, op for op as
    ``torch.optim.Adagrad`` (single-tensor)."""
    from .cpu_optim import adagrad_reference_

    _check_lists("fused_adagrad_reference_", params, grads, {"state_sum": state_sum}, half_params)
    found = adagrad_reference_(
        params,
        grads,
        state_sum,
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        step=step,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    return _on_device(found, params)


# ---------------------------------------------------------------------------------------
# public, dispatched


def _triton(kind: str, params, grads, s0, s1, half_params, scalars, check, decoupled=True):
    from . import _triton_fused_optim as K

    keep = [i for i, p in enumerate(params) if p.numel() > 0]

    def pick(lst):
        return None if lst is None else [lst[i] for i in keep]

    rows = dict(
        params=pick(params), grads=pick(grads), s0=pick(s0), s1=pick(s1), half=pick(half_params)
    )
    found = K.step(getattr(K, kind), rows, scalars, decoupled=decoupled, check=check)
    # The kernel wrote through raw pointers: tell autograd these tensors changed.
    modified = [t for lst in (params, s0, s1, half_params) if lst is not None for t in lst]
    torch.autograd.graph.increment_version(modified)
    return found


def fused_adamw_(
    params: Tensors,
    grads: Tensors,
    exp_avg: Tensors,
    exp_avg_sq: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
    impl: str | None = None,
) -> torch.Tensor:
    """One AdamW step in place (``decoupled=False``: Adam with L2 decay added to the grad).

    ``p *= 1 - lr*wd`` (decoupled); ``m = lerp(m, g, 1-beta1)``; ``v = beta2*v + (1-beta2)*g²``;
    ``p -= lr/(1-beta1^step) * m / (sqrt(v)/sqrt(1-beta2^step) + eps)``, with
    ``g = grad * inv_scale`` in fp32. Returns ``found_inf`` (0-d bool on the params' device);
    when True nothing was modified. ``check_finite=False`` skips the check: ``found_inf`` is
    False and an inf/nan gradient reaches the parameters, as in ``torch.optim``. ``step`` is
    the 1-based step being taken. Module doc: dtypes, devices, implementations.
    """
    name = "fused_adamw_" if decoupled else "fused_adam_"
    _check_lists(name, params, grads, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, half_params)
    _check_scalars(
        name,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        inv_scale=inv_scale,
    )
    if (empty := _empty_found(params)) is not None:
        return empty
    kw = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled=decoupled,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    which = choose("fused_adamw", *params, impl=impl, cpp=True)
    if which == "cpp":
        from . import cpu_optim

        return cpu_optim.adamw_(params, grads, exp_avg, exp_avg_sq, **kw)
    if which == "reference":
        return fused_adamw_reference_(params, grads, exp_avg, exp_avg_sq, **kw)
    scalars = _adam_scalars(lr, beta1, beta2, eps, weight_decay, step, decoupled, inv_scale)
    return _triton(
        "ADAM", params, grads, exp_avg, exp_avg_sq, half_params, scalars, check_finite, decoupled
    )


def fused_adam_(
    params: Tensors,
    grads: Tensors,
    exp_avg: Tensors,
    exp_avg_sq: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = False,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
    impl: str | None = None,
) -> torch.Tensor:
    """:func:`fused_adamw_` with ``decoupled=False`` by default (``torch.optim.Adam``: the
    weight decay is added to the gradient)."""
    return fused_adamw_(
        params,
        grads,
        exp_avg,
        exp_avg_sq,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        decoupled=decoupled,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
        impl=impl,
    )


def fused_lion_(
    params: Tensors,
    grads: Tensors,
    exp_avg: Tensors,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
    impl: str | None = None,
) -> torch.Tensor:
    """One Lion step in place (Chen et al. 2023): ``u = sign(beta1*m + (1-beta1)*g)``;
    ``p -= lr * (u + wd*p)``; ``m = beta2*m + (1-beta2)*g``, with ``g = grad * inv_scale``.
    Returns ``found_inf`` as :func:`fused_adamw_`."""
    name = "fused_lion_"
    _check_lists(name, params, grads, {"exp_avg": exp_avg}, half_params)
    _check_scalars(
        name, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, inv_scale=inv_scale
    )
    if (empty := _empty_found(params)) is not None:
        return empty
    kw = dict(
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    which = choose("fused_lion", *params, impl=impl, cpp=True)
    if which == "cpp":
        from . import cpu_optim

        return cpu_optim.lion_(params, grads, exp_avg, **kw)
    if which == "reference":
        return fused_lion_reference_(params, grads, exp_avg, **kw)
    scalars = _lion_scalars(lr, beta1, beta2, weight_decay, inv_scale)
    return _triton("LION", params, grads, exp_avg, None, half_params, scalars, check_finite)


def fused_adagrad_(
    params: Tensors,
    grads: Tensors,
    state_sum: Tensors,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    step: int = 1,
    inv_scale: float = 1.0,
    half_params: Tensors | None = None,
    check_finite: bool = True,
    impl: str | None = None,
) -> torch.Tensor:
    """One Adagrad step in place (``torch.optim.Adagrad``): ``g += wd*p``; ``s += g²``;
    ``p -= lr/(1+(step-1)*lr_decay) * g / (sqrt(s) + eps)``, with ``g = grad * inv_scale``.

    The Triton path is the same multi-tensor kernel as Adam/Lion (an Adagrad branch), so it
    also reports ``found_inf`` without a host sync. Returns ``found_inf`` as
    :func:`fused_adamw_`.
    """
    name = "fused_adagrad_"
    _check_lists(name, params, grads, {"state_sum": state_sum}, half_params)
    _check_scalars(
        name,
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        step=step,
        inv_scale=inv_scale,
    )
    if (empty := _empty_found(params)) is not None:
        return empty
    kw = dict(
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        step=step,
        inv_scale=inv_scale,
        half_params=half_params,
        check_finite=check_finite,
    )
    which = choose("fused_adagrad", *params, impl=impl, cpp=True)
    if which == "cpp":
        from . import cpu_optim

        return cpu_optim.adagrad_(params, grads, state_sum, **kw)
    if which == "reference":
        return fused_adagrad_reference_(params, grads, state_sum, **kw)
    scalars = _adagrad_scalars(lr, eps, weight_decay, lr_decay, step, inv_scale)
    return _triton("ADAGRAD", params, grads, state_sum, None, half_params, scalars, check_finite)
