"""In-place optimizer steps on CPU in C++ (AdamW / Adam, Lion, Adagrad), with references.

What CPU offload needs from an optimizer: update fp32 master weights and their states in
one multi-threaded, vectorised pass (AVX-512 / AVX2 / portable, picked at run time from the
CPU's flags), optionally writing a bf16/fp16 copy of the updated weights in the same pass,
unscaling the gradients by ``inv_scale`` on the fly, and (with ``check_finite=True``, the
default) doing *nothing* when a gradient is inf/nan (the returned ``found_inf`` says so).
Gradients may be fp32, bf16 or fp16.

Every function takes lists of tensors (a flat buffer is a 1-element list), updates them in
place and returns a 0-d bool tensor ``found_inf``. The arithmetic is torch.optim's:

- ``adamw_``: ``torch.optim.AdamW`` (``decoupled=True``) or ``torch.optim.Adam`` with L2
  ``weight_decay`` (``decoupled=False``); ``step`` is the 1-based step being taken;
- ``adagrad_``: ``torch.optim.Adagrad`` (``lr / (1 + (step - 1) * lr_decay)``);
- ``lion_``: ``c = b1 m + (1 - b1) g; w <- w (1 - lr wd) - lr sign(c); m <- b2 m + (1 - b2) g``.

With ``check_finite=True`` every gradient is checked before anything is written, so the
gradients are read twice: on a memory-bound machine that costs ~4 of the 32 bytes per
parameter an AdamW step moves (~2 of 30 with bf16 gradients). Only fp16 loss scaling needs
that. ``check_finite=False`` is the single pass torch.optim and DeepSpeedCPUAdam make: no
check, ``found_inf`` always False, and an inf/nan gradient propagates into the parameters and
states as it does in torch.optim. Elements are split into chunks that threads take in turn,
across tensor boundaries; results do not depend on the thread count or on ``check_finite``.

``*_reference_`` are the same steps in plain torch (any device; the fallback when the
extension cannot be built). The C++ functions release the GIL and use
``torch.get_num_threads()`` threads; they are optimizer steps outside autograd, not custom
ops, and do not bump autograd version counters (``fused_optim`` does, around them).
``load()`` builds the extension on first use (~15 s on 2 cores; once per install, cached
under ``TORCH_EXTENSIONS_DIR`` or ``~/.cache/torch_extensions`` by a hash of its sources and
flags, see ``fsharded._cext``); ``FSHARDED_CPU_OPTIM_ISA``
(``avx512``, ``avx2``, ``scalar``) forces an instruction set, for tests.

>>> p, g = [torch.ones(5)], [torch.full((5,), 0.5)]
>>> m, v = [torch.zeros(5)], [torch.zeros(5)]
>>> found_inf = adamw_reference_(p, g, m, v, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-8,
...                              weight_decay=0.0, step=1)
>>> bool(found_inf), round(p[0][0].item(), 4)
(False, 0.9)

``load_cuda()`` / ``adamw_cuda_`` are the multi-tensor fused Adam for CUDA tensors
(``csrc/cuda``), with the same signature and semantics.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
from collections.abc import Sequence
from types import ModuleType

import torch

from fsharded import _cext

__all__ = [
    "load",
    "load_cuda",
    "isa",
    "adamw_",
    "lion_",
    "adagrad_",
    "adamw_cuda_",
    "adamw_reference_",
    "lion_reference_",
    "adagrad_reference_",
]

CSRC = _cext.CSRC  # a module attribute: tests point it at other sources
_SOURCES = ("cpu_optim.cpp", "cpu_optim_avx512.cpp", "cpu_optim_avx2.cpp", "cpu_optim_scalar.cpp")
_CUDA_SOURCES = ("cuda/multi_tensor_adam.cpp", "cuda/multi_tensor_adam.cu")
ISA_ENV = "FSHARDED_CPU_OPTIM_ISA"
_WHAT_TO_DO = (
    "Use the pure-torch reference instead (impl='reference', or FSHARDED_KERNELS=reference), "
    "or fix the cause and start a new process (the result of load() is cached per process)."
)

TensorList = Sequence[torch.Tensor]


# -- building ------------------------------------------------------------------------------


def _compile(name: str, sources: tuple[str, ...], *, what: str = "", took: str = "",
             **kwargs) -> tuple[ModuleType | None, str]:
    """Build (once per install, see ``fsharded._cext``) or load the extension
    ``name`` from ``sources`` under ``CSRC``: ``(module, "")`` or ``(None, why)``."""
    return _cext.build(name, sources, root=CSRC, what=what, took=took, **kwargs)


@functools.cache
def _build_cpu() -> tuple[ModuleType | None, str]:
    return _compile(
        "fsharded_cpu_optim",
        _SOURCES,
        what="the C++ CPU optimizer",
        took="~15 s",
        # -ffp-contract=off: only the explicit FMAs are fused, identically in every code path.
        extra_cflags=[
            "-O3",
            "-fopenmp",
            "-fno-math-errno",
            "-ffp-contract=off",
            "-Wno-ignored-attributes",
        ],
        extra_ldflags=["-fopenmp"],
    )


def load(required: bool = False) -> ModuleType | None:
    """The compiled extension, built on first use; ``None`` when it cannot be built, or
    with ``required=True`` a ``RuntimeError`` carrying the build error and what to do.
    Success and failure are both cached for the life of the process."""
    mod, why = _build_cpu()
    if mod is None and required:
        raise RuntimeError(f"fsharded C++ CPU optimizer unavailable: {why}\n{_WHAT_TO_DO}")
    return mod


def isa() -> str | None:
    """The instruction set the C++ kernels use on this CPU (``"avx512"``, ``"avx2"``,
    ``"scalar"``), or ``None`` when the extension is not available."""
    mod = load()
    return None if mod is None else mod.auto_isa()


@functools.cache
def _build_cuda() -> tuple[ModuleType | None, str]:
    if torch.version.cuda is None:
        return None, f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return None, "torch.cuda.is_available() is False (no GPU or driver)"
    return _compile(
        "fsharded_cuda_adam",
        _CUDA_SOURCES,
        what="the CUDA multi-tensor Adam",
        took="a few minutes",
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "-lineinfo"],
    )


def load_cuda(required: bool = True) -> ModuleType | None:
    """The multi-tensor fused Adam CUDA extension (``csrc/cuda``), built on first use.
    Without CUDA, or when the build fails: ``RuntimeError`` saying why (``required=True``)
    or ``None``."""
    mod, why = _build_cuda()
    if mod is None and required:
        raise RuntimeError(f"fsharded CUDA multi-tensor Adam unavailable: {why}\n{_WHAT_TO_DO}")
    return mod


# -- argument checks (shared with the references) ------------------------------------------


def _as_list(who: str, name: str, xs) -> list[torch.Tensor]:
    if isinstance(xs, torch.Tensor) or not isinstance(xs, (list, tuple)):
        raise TypeError(
            f"{who}: {name} must be a list of tensors (a single flat buffer is a "
            f"1-element list), got {type(xs).__name__}"
        )
    return list(xs)


def _check_scalars(who: str, **kw: float) -> None:
    """Hyperparameters: finite numbers, betas in [0, 1), lr/eps/decays >= 0, inv_scale > 0,
    step an integer >= 1. Lists every bad one."""
    bad = []
    for k, v in kw.items():
        number = type(v) in (float, int) or (isinstance(v, numbers.Real) and type(v) is not bool)
        if not number or not math.isfinite(v):
            bad.append(f"{k}={v!r} (a finite number is needed)")
        elif k in ("beta1", "beta2") and not 0.0 <= v < 1.0:
            bad.append(f"{k}={v!r} (must be in [0, 1))")
        elif k in ("lr", "eps", "weight_decay", "lr_decay") and v < 0:
            bad.append(f"{k}={v!r} (must be >= 0)")
        elif k == "inv_scale" and v <= 0:
            bad.append(f"{k}={v!r} (must be > 0)")
        elif k == "step" and (int(v) != v or v < 1):
            bad.append(f"{k}={v!r} (the 1-based step being taken: an integer >= 1)")
    if bad:
        raise ValueError(f"{who}: " + "; ".join(bad))


def _scalar(v):
    """Python number of a 0-d tensor (a step counter kept as a tensor), else ``v``."""
    return v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v


_HALF = (torch.bfloat16, torch.float16)
_GRAD = (torch.float32, torch.bfloat16, torch.float16)


def _validate(who: str, params, grads, states: dict, half_params, *, cpu: bool) -> tuple:
    """The checks the C++ extension makes, naming the argument and index the same way
    (``cpu=False``: any one device, for the references)."""
    params = _as_list(who, "params", params)
    grads = _as_list(who, "grads", grads)
    states = {k: _as_list(who, k, v) for k, v in states.items()}
    half = [] if half_params is None else _as_list(who, "half_params", half_params)
    lists = [("grads", grads, _GRAD), *((k, v, (torch.float32,)) for k, v in states.items())]
    if half_params is not None:
        lists.append(("half_params", half, _HALF))
    devices = {t.device for t in params if isinstance(t, torch.Tensor)}
    for name, xs, _ in lists:
        if len(xs) != len(params):
            raise ValueError(f"{who}: {name} has {len(xs)} tensors but params has {len(params)}")
    for name, xs, dtypes in [("params", params, (torch.float32,)), *lists]:
        for i, t in enumerate(xs):
            where = f"{who}: {name}[{i}]"
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where} must be a tensor, got {type(t).__name__}")
            if cpu and (t.device.type != "cpu" or not t.is_contiguous()):
                raise ValueError(
                    f"{where} must be a contiguous CPU tensor, got "
                    f"device={t.device}, contiguous={t.is_contiguous()} "
                    "(move it to the CPU / call .contiguous())"
                )
            if not cpu and len(devices | {t.device}) > 1:
                raise ValueError(
                    f"{where} is on {t.device} but params are on "
                    f"{sorted(map(str, devices))}: all tensors on one device"
                )
            if t.dtype not in dtypes:
                names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise TypeError(f"{where} must have dtype {names}, got {t.dtype}")
            if name != "params" and t.numel() != params[i].numel():
                raise ValueError(
                    f"{where} has {t.numel()} elements but params[{i}] has {params[i].numel()}"
                )
    return params, grads, states, half


def _half(who: str, half_params, params) -> list[torch.Tensor]:
    """``half_params`` as the list the extension takes (empty: no copy). An empty list for
    non-empty ``params`` is a length mismatch, as it is for the reference."""
    if half_params is None:
        return []
    half = _as_list(who, "half_params", half_params)
    if not half and params:
        raise ValueError(f"{who}: half_params has 0 tensors but params has {len(params)}")
    return half


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _isa_override() -> str:
    return os.environ.get(ISA_ENV, "auto").strip().lower() or "auto"


_FOUND = (torch.tensor(False), torch.tensor(True))  # never handed out: copies are


def _flag(found: bool) -> torch.Tensor:
    return _FOUND[bool(found)].clone()


# -- C++ steps ------------------------------------------------------------------------------


def adamw_(
    params: TensorList,
    grads: TensorList,
    exp_avg: TensorList,
    exp_avg_sq: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """One AdamW step (Adam with L2 decay when ``decoupled=False``) in C++, in place.
    Returns ``found_inf`` (True: a gradient was inf/nan and nothing was modified).
    ``check_finite=False`` skips that check (one pass over the gradients instead of two):
    ``found_inf`` is then False and non-finite gradients reach the parameters, as in
    ``torch.optim``."""
    mod = load(required=True)
    who = "adamw_"
    step = _scalar(step)
    _check_scalars(
        who,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        inv_scale=inv_scale,
    )
    return _flag(
        mod.adam(
            _as_list(who, "params", params),
            _as_list(who, "grads", grads),
            _as_list(who, "exp_avg", exp_avg),
            _as_list(who, "exp_avg_sq", exp_avg_sq),
            _half(who, half_params, params),
            float(lr),
            float(beta1),
            float(beta2),
            float(eps),
            float(weight_decay),
            int(step),
            bool(decoupled),
            float(inv_scale),
            bool(check_finite),
            _threads(),
            _isa_override(),
        )
    )


def lion_(
    params: TensorList,
    grads: TensorList,
    exp_avg: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """One Lion step in C++, in place; returns ``found_inf`` (``check_finite`` as for
    ``adamw_``)."""
    mod = load(required=True)
    who = "lion_"
    _check_scalars(
        who, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, inv_scale=inv_scale
    )
    return _flag(
        mod.lion(
            _as_list(who, "params", params),
            _as_list(who, "grads", grads),
            _as_list(who, "exp_avg", exp_avg),
            _half(who, half_params, params),
            float(lr),
            float(beta1),
            float(beta2),
            float(weight_decay),
            float(inv_scale),
            bool(check_finite),
            _threads(),
            _isa_override(),
        )
    )


def adagrad_(
    params: TensorList,
    grads: TensorList,
    state_sum: TensorList,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    step: int = 1,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """One Adagrad step in C++, in place; returns ``found_inf`` (``check_finite`` as for
    ``adamw_``)."""
    mod = load(required=True)
    who = "adagrad_"
    step = _scalar(step)
    _check_scalars(
        who,
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        step=step,
        inv_scale=inv_scale,
    )
    return _flag(
        mod.adagrad(
            _as_list(who, "params", params),
            _as_list(who, "grads", grads),
            _as_list(who, "state_sum", state_sum),
            _half(who, half_params, params),
            float(lr),
            float(eps),
            float(weight_decay),
            float(lr_decay),
            int(step),
            float(inv_scale),
            bool(check_finite),
            _threads(),
            _isa_override(),
        )
    )


def adamw_cuda_(
    params: TensorList,
    grads: TensorList,
    exp_avg: TensorList,
    exp_avg_sq: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``adamw_`` for CUDA tensors: the multi-tensor fused kernel of ``csrc/cuda``. No host
    synchronisation: ``found_inf`` is a 0-d bool tensor on the GPU, and the update kernel
    reads it there and skips when it is set. ``check_finite=False`` launches no check kernel
    (``found_inf`` stays False)."""
    mod = load_cuda(required=True)
    who = "adamw_cuda_"
    step = _scalar(step)
    _check_scalars(
        who,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        inv_scale=inv_scale,
    )
    return mod.adam(
        _as_list(who, "params", params),
        _as_list(who, "grads", grads),
        _as_list(who, "exp_avg", exp_avg),
        _as_list(who, "exp_avg_sq", exp_avg_sq),
        _half(who, half_params, params),
        float(lr),
        float(beta1),
        float(beta2),
        float(eps),
        float(weight_decay),
        int(step),
        bool(decoupled),
        float(inv_scale),
        bool(check_finite),
    )


# -- references -----------------------------------------------------------------------------


def _unscaled(
    grads: list[torch.Tensor], inv_scale: float, check: bool = True
) -> tuple[list, torch.Tensor]:
    """fp32 gradients times ``inv_scale`` (new tensors unless that is a no-op) and whether
    any is inf/nan (always False without ``check``)."""
    gs = [g.float() if inv_scale == 1.0 else g.float() * inv_scale for g in grads]
    if not gs or not check:
        return gs, torch.tensor(False)
    finite = torch.stack([torch.isfinite(g).all() for g in gs]).all()
    return gs, torch.logical_not(finite).cpu()


def _copy_half(params, half) -> None:
    for p, h in zip(params, half):
        h.copy_(p)


@torch.no_grad()
def adamw_reference_(
    params: TensorList,
    grads: TensorList,
    exp_avg: TensorList,
    exp_avg_sq: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
    decoupled: bool = True,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``adamw_`` in torch ops, as ``torch.optim.AdamW`` / ``Adam`` (single-tensor) does it
    (``check_finite=False``: no check, as there)."""
    who = "adamw_"
    step = _scalar(step)
    _check_scalars(
        who,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        step=step,
        inv_scale=inv_scale,
    )
    params, grads, st, half = _validate(
        who, params, grads, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}, half_params, cpu=False
    )
    gs, found = _unscaled(grads, inv_scale, check_finite)
    if found:
        return found
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = math.sqrt(1 - beta2**step)
    for p, g, m, v in zip(params, gs, st["exp_avg"], st["exp_avg_sq"]):
        if decoupled:
            p.mul_(1 - lr * weight_decay)
        elif weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        p.addcdiv_(m, (v.sqrt() / bc2_sqrt).add_(eps), value=-step_size)
    _copy_half(params, half)
    return found


@torch.no_grad()
def lion_reference_(
    params: TensorList,
    grads: TensorList,
    exp_avg: TensorList,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``lion_`` in torch ops."""
    who = "lion_"
    _check_scalars(
        who, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, inv_scale=inv_scale
    )
    params, grads, st, half = _validate(
        who, params, grads, {"exp_avg": exp_avg}, half_params, cpu=False
    )
    gs, found = _unscaled(grads, inv_scale, check_finite)
    if found:
        return found
    for p, g, m in zip(params, gs, st["exp_avg"]):
        c = m.mul(beta1).add_(g, alpha=1 - beta1)
        p.mul_(1 - lr * weight_decay).add_(torch.sign(c), alpha=-lr)
        m.mul_(beta2).add_(g, alpha=1 - beta2)
    _copy_half(params, half)
    return found


@torch.no_grad()
def adagrad_reference_(
    params: TensorList,
    grads: TensorList,
    state_sum: TensorList,
    *,
    lr: float,
    eps: float,
    weight_decay: float,
    lr_decay: float = 0.0,
    step: int = 1,
    inv_scale: float = 1.0,
    half_params: TensorList | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``adagrad_`` in torch ops, as ``torch.optim.Adagrad`` (single-tensor) does it."""
    who = "adagrad_"
    step = _scalar(step)
    _check_scalars(
        who,
        lr=lr,
        eps=eps,
        weight_decay=weight_decay,
        lr_decay=lr_decay,
        step=step,
        inv_scale=inv_scale,
    )
    params, grads, st, half = _validate(
        who, params, grads, {"state_sum": state_sum}, half_params, cpu=False
    )
    gs, found = _unscaled(grads, inv_scale, check_finite)
    if found:
        return found
    clr = lr / (1 + (step - 1) * lr_decay)
    for p, g, s in zip(params, gs, st["state_sum"]):
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        s.addcmul_(g, g, value=1)
        p.addcdiv_(g, s.sqrt().add_(eps), value=-clr)
    _copy_half(params, half)
    return found
