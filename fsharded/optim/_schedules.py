"""Learning-rate schedules: DeepSpeed's (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``,
``OneCycle``) and two plain ones (``constant``, ``linear``).

Each schedule is a frozen, validated dataclass; calling it with the optimizer step returns
the learning rate, a 0-d float64 tensor. It is written with torch ops only (``where``,
``clamp``, ``floor``: no Python ``if`` on the step, no ``.item()``) because it runs inside
the optimizer update, under ``torch.func.vmap`` on the virtual mesh.

Step indexing. ``step`` is the optimizer's update count: 0 for the first update, as in
optax. DeepSpeed's engine calls ``optimizer.step()`` and *then* ``lr_scheduler.step()``,
so the first update runs with the rate the scheduler set at construction
(``last_batch_iteration = -1``) and update ``k`` runs with its ``get_lr()`` at
``last_batch_iteration = k - 1``. The DeepSpeed-named schedules here return exactly that:
``schedule(k)`` is the rate DeepSpeed applies on update ``k``, so a run with the same
config follows the same learning rates step for step. (DeepSpeed also skips the scheduler
step when an fp16 step overflows; a caller that skips updates should not advance ``k``.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "constant",
    "linear",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
]

_F64 = torch.float64


def _step(step: Any) -> torch.Tensor:
    """The step as a tensor (ints accepted, so ``sched(3)`` works outside the update)."""
    if isinstance(step, torch.Tensor):
        if step.dtype.is_floating_point or step.dtype.is_complex or step.dtype == torch.bool:
            raise TypeError(f"a schedule's step must be an integer tensor, got {step.dtype}")
        return step
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"a schedule's step must be an int or an integer tensor, got {step!r}")
    return torch.tensor(step, dtype=torch.int64)


def _full(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full((), value, dtype=_F64, device=like.device)


# -- validation: a schedule that can return nan, inf or a negative rate is refused when it
# is made, naming the parameter (a nan rate would otherwise turn every parameter into nan
# at the first update while the loss of that step still looks fine).


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_rate(who: str, name: str, value: Any, *, what: str = "a learning rate") -> None:
    """``value`` must be a finite real number >= 0."""
    if not (_is_real(value) and math.isfinite(value) and value >= 0):
        why = ("a negative rate moves the parameters up the gradient" if _is_real(value) and value < 0
               else "a nan or inf rate turns every parameter into nan at the first update")
        raise ValueError(f"{who}: {name} must be a finite number >= 0 ({what}), got {value!r}: {why}; "
                         f"pass a finite float >= 0")


def _check_count(who: str, name: str, value: Any, *, low: int) -> None:
    """``value`` must be an int >= ``low`` (a whole number of updates)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        want = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{who}: {name} must be {want} (a number of updates), got {value!r}")


@dataclass(frozen=True)
class _Constant:
    value: float

    def __post_init__(self) -> None:
        _check_rate("constant", "lr", self.value)

    def __call__(self, step: Any) -> torch.Tensor:
        # full_like: a vector of steps (for plotting) gives a vector of rates, as elsewhere.
        return torch.full_like(_step(step), self.value, dtype=_F64)


@dataclass(frozen=True)
class _Linear:
    init: float
    end: float
    steps: int

    def __post_init__(self) -> None:
        _check_rate("linear", "init", self.init)
        _check_rate("linear", "end", self.end)
        _check_count("linear", "steps", self.steps, low=1)

    def __call__(self, step: Any) -> torch.Tensor:
        frac = (_step(step).to(_F64) / self.steps).clamp(0.0, 1.0)
        return self.init + (self.end - self.init) * frac


def constant(lr: float) -> _Constant:
    """The same rate at every step.

    >>> constant(0.1)(7)
    tensor(0.1000, dtype=torch.float64)
    """
    _check_rate("constant", "lr", lr)
    return _Constant(float(lr))


def linear(init: float, end: float, steps: int) -> _Linear:
    """``init`` at step 0, moving linearly to ``end`` at ``steps``, then held (optax's
    ``linear_schedule``).

    >>> float(linear(1.0, 0.0, 4)(1))
    0.75
    """
    _check_rate("linear", "init", init)
    _check_rate("linear", "end", end)
    return _Linear(float(init), float(end), steps)


# -- DeepSpeed's schedules ----------------------------------------------------------------

_WARMUP_TYPES = ("log", "linear")


def _check_warmup(name: str, warmup_num_steps: Any, warmup_type: str) -> None:
    _check_count(name, "warmup_num_steps", warmup_num_steps, low=1)
    if warmup_type not in _WARMUP_TYPES:
        # DeepSpeed falls back to "log" with a warning; a typo here should not change the run.
        raise ValueError(f"{name}: warmup_type must be 'log' or 'linear', got {warmup_type!r}")


def _check_total(name: str, total: Any) -> None:
    _check_count(name, "total_num_steps", total, low=1)


def _warmup_gamma(lbi: torch.Tensor, warmup_steps: int, warmup_type: str) -> torch.Tensor:
    """DeepSpeed's warmup fraction at ``last_batch_iteration = lbi >= 0`` (valid for
    ``lbi < warmup_steps``; callers select it with ``where``)."""
    t = lbi.to(_F64).clamp(min=0.0)  # the clamp keeps log() finite where lbi = -1
    if warmup_type == "log":
        return torch.log(t + 1.0) / math.log(warmup_steps)
    return t / warmup_steps


@dataclass(frozen=True)
class WarmupLR:
    """DeepSpeed's ``WarmupLR``: from ``warmup_min_lr`` up to ``warmup_max_lr`` over
    ``warmup_num_steps`` updates (``"log"`` or ``"linear"`` in the step), then constant.

    >>> s = WarmupLR(warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    >>> [float(s(k)) for k in range(6)]
    [0.0, 0.0, 0.25, 0.5, 0.75, 1.0]
    """

    warmup_min_lr: float = 0.0
    """Rate on the first update(s)."""
    warmup_max_lr: float = 0.001
    """Rate after warmup."""
    warmup_num_steps: int = 1000
    """Warmup length; DeepSpeed uses ``max(2, warmup_num_steps)``, and so does this."""
    warmup_type: str = "log"
    """``"log"``: ``log(i + 1) / log(n)``; ``"linear"``: ``i / n``."""

    def __post_init__(self) -> None:
        _check_rate(type(self).__name__, "warmup_min_lr", self.warmup_min_lr)
        _check_rate(type(self).__name__, "warmup_max_lr", self.warmup_max_lr)
        _check_warmup(type(self).__name__, self.warmup_num_steps, self.warmup_type)

    def __call__(self, step: Any) -> torch.Tensor:
        lbi = _step(step) - 1  # DeepSpeed's last_batch_iteration for this update
        n = max(2, self.warmup_num_steps)
        gamma = torch.where(lbi < n, _warmup_gamma(lbi, n, self.warmup_type), _full(1.0, lbi))
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma
        return torch.where(lbi < 0, _full(self.warmup_min_lr, lbi), lr)


@dataclass(frozen=True)
class WarmupDecayLR:
    """DeepSpeed's ``WarmupDecayLR``: ``WarmupLR``'s warmup, then linear decay to 0 at
    ``total_num_steps``.

    >>> s = WarmupDecayLR(10, warmup_max_lr=1.0, warmup_num_steps=2, warmup_type="linear")
    >>> [round(float(s(k)), 3) for k in (0, 2, 3, 6, 11, 20)]
    [0.0, 0.5, 1.0, 0.625, 0.0, 0.0]
    """

    total_num_steps: int
    """Update count at which the rate reaches 0."""
    warmup_min_lr: float = 0.0
    """Rate on the first update(s)."""
    warmup_max_lr: float = 0.001
    """Rate at the end of warmup."""
    warmup_num_steps: int = 1000
    """Warmup length (``max(2, .)``, as in DeepSpeed)."""
    warmup_type: str = "log"
    """``"log"`` or ``"linear"``, as in ``WarmupLR``."""

    def __post_init__(self) -> None:
        _check_rate("WarmupDecayLR", "warmup_min_lr", self.warmup_min_lr)
        _check_rate("WarmupDecayLR", "warmup_max_lr", self.warmup_max_lr)
        _check_warmup("WarmupDecayLR", self.warmup_num_steps, self.warmup_type)
        _check_total("WarmupDecayLR", self.total_num_steps)

    def __call__(self, step: Any) -> torch.Tensor:
        lbi = _step(step) - 1
        n = max(2, self.warmup_num_steps)
        warm = _warmup_gamma(lbi, n, self.warmup_type)
        decay = (self.total_num_steps - lbi.to(_F64)) / float(max(1, self.total_num_steps - n))
        gamma = torch.where(lbi < n, warm, decay.clamp(min=0.0))
        lr = self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * gamma
        return torch.where(lbi < 0, _full(self.warmup_min_lr, lbi), lr)


@dataclass(frozen=True)
class WarmupCosineLR:
    """DeepSpeed's ``WarmupCosineLR``: a ratio of the base ``lr`` that warms up from
    ``warmup_min_ratio`` to 1, then follows a half cosine down to ``cos_min_ratio`` at
    ``total_num_steps`` and stays there.

    DeepSpeed scales the optimizer's own lr; here that base rate is the ``lr`` argument.
    As in DeepSpeed the first update runs at rate 0 (the scheduler's value before its
    first ``step()``).

    >>> s = WarmupCosineLR(12, warmup_num_steps=2, warmup_type="linear", cos_min_ratio=0.0, lr=1.0)
    >>> [round(float(s(k)), 3) for k in (0, 1, 2, 3, 7, 12, 99)]
    [0.0, 0.0, 0.5, 0.976, 0.5, 0.0, 0.0]
    """

    total_num_steps: int
    """Update count at which the cosine reaches ``cos_min_ratio``."""
    warmup_min_ratio: float = 0.0
    """Ratio at the start of warmup."""
    warmup_num_steps: int = 1000
    """Warmup length (``max(2, .)``, as in DeepSpeed)."""
    cos_min_ratio: float = 0.0001
    """Ratio at the end of the cosine."""
    warmup_type: str = "log"
    """``"log"`` or ``"linear"``, as in ``WarmupLR``."""
    lr: float = field(default=None, kw_only=True)  # type: ignore[assignment]
    """The base rate the ratio multiplies (DeepSpeed takes it from the optimizer); required."""

    def __post_init__(self) -> None:
        _check_warmup("WarmupCosineLR", self.warmup_num_steps, self.warmup_type)
        if self.lr is None or isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)):
            raise ValueError(
                "WarmupCosineLR: pass the base learning rate as lr=... (DeepSpeed scales the "
                f"optimizer's lr by this schedule's ratio), got lr={self.lr!r}"
            )
        _check_rate("WarmupCosineLR", "lr", self.lr, what="the base learning rate")
        _check_rate("WarmupCosineLR", "warmup_min_ratio", self.warmup_min_ratio, what="a ratio of lr")
        _check_rate("WarmupCosineLR", "cos_min_ratio", self.cos_min_ratio, what="a ratio of lr")
        _check_total("WarmupCosineLR", self.total_num_steps)

    def ratio(self, step: Any) -> torch.Tensor:
        """The ratio of ``lr`` applied on update ``step`` (DeepSpeed's ``get_lr_ratio``)."""
        lbi = _step(step) - 1
        n = max(2, self.warmup_num_steps)
        warm = _warmup_gamma(lbi, n, self.warmup_type)
        warm = self.warmup_min_ratio + warm * (1.0 - self.warmup_min_ratio)
        progress = (lbi - n + 1).to(_F64) / max(1, self.total_num_steps - n)
        cos = (1.0 + torch.cos(math.pi * progress.clamp(0.0, 1.0))) / 2.0
        cos = (self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cos).clamp(min=0.0)
        r = torch.where(lbi < n, warm, cos)
        return torch.where(lbi < 0, _full(0.0, lbi), r)

    def __call__(self, step: Any) -> torch.Tensor:
        return self.lr * self.ratio(step)


@dataclass(frozen=True)
class OneCycle:
    """DeepSpeed's ``OneCycle`` (learning rate only): up from ``cycle_min_lr`` to
    ``cycle_max_lr`` over ``cycle_first_step_size`` updates, back down over
    ``cycle_second_step_size``, optionally in stairs, then (with ``decay_step_size`` and
    ``decay_lr_rate`` non-zero) ``cycle_min_lr / (1 + decay_lr_rate * i / decay_step_size)``
    ``i`` updates after the cycle. Momentum cycling is not modelled.

    >>> s = OneCycle(0.0, 1.0, cycle_first_step_size=4)
    >>> [float(s(k)) for k in (0, 2, 4, 6, 8, 9)]
    [0.0, 0.5, 1.0, 0.5, 0.0, 0.0]
    """

    cycle_min_lr: float
    """Rate at the start and end of the cycle."""
    cycle_max_lr: float
    """Rate at the peak."""
    decay_lr_rate: float = 0.0
    """Post-cycle decay rate (0: hold ``cycle_min_lr``)."""
    cycle_first_step_size: int = 2000
    """Updates from min to max."""
    cycle_second_step_size: int | None = None
    """Updates from max back to min (default: ``cycle_first_step_size``)."""
    cycle_first_stair_count: int = 0
    """Stairs in the first half (0: continuous)."""
    cycle_second_stair_count: int | None = None
    """Stairs in the second half (default: ``cycle_first_stair_count``)."""
    decay_step_size: int = 0
    """Updates per decay interval after the cycle (0: no decay)."""

    def __post_init__(self) -> None:
        _check_rate("OneCycle", "cycle_min_lr", self.cycle_min_lr)
        _check_rate("OneCycle", "cycle_max_lr", self.cycle_max_lr)
        _check_rate("OneCycle", "decay_lr_rate", self.decay_lr_rate, what="a decay rate")
        _check_count("OneCycle", "cycle_first_step_size", self.cycle_first_step_size, low=1)
        if self.cycle_second_step_size is not None:
            _check_count("OneCycle", "cycle_second_step_size", self.cycle_second_step_size, low=0)
        _check_count("OneCycle", "cycle_first_stair_count", self.cycle_first_stair_count, low=0)
        if self.cycle_second_stair_count is not None:
            _check_count("OneCycle", "cycle_second_stair_count", self.cycle_second_stair_count, low=0)
        _check_count("OneCycle", "decay_step_size", self.decay_step_size, low=0)

    def __call__(self, step: Any) -> torch.Tensor:
        first = float(self.cycle_first_step_size)
        second = first if self.cycle_second_step_size is None else float(self.cycle_second_step_size)
        total = first + second
        ratio = first / total
        s1 = self.cycle_first_stair_count
        s2 = s1 if self.cycle_second_stair_count is None else self.cycle_second_stair_count

        step = _step(step)
        bi = step.to(_F64)  # DeepSpeed's batch_iteration = last_batch_iteration + 1 = step
        # Position in the cycle, in [0, 1): floor(1 + bi/total) is the cycle number.
        x = 1.0 + bi / total - torch.floor(1.0 + bi / total)
        rising = x <= ratio
        # (ratio - 1) is 0 only when second == 0, where ``rising`` always holds.
        scale = torch.where(rising, x / ratio, (x - 1.0) / (ratio - 1.0 if ratio != 1.0 else 1.0))
        if s1 > 0 or s2 > 0:
            # DeepSpeed quantises from the integer offset in the cycle, not from ``scale``.
            stairs = torch.where(rising, _full(float(s1), bi), _full(float(s2), bi))
            ci = torch.remainder(bi, total)
            pos = torch.where(
                ci <= first, ci * stairs / first, (total - ci) * stairs / (second if second else 1.0)
            )
            stepped = torch.floor(pos) / stairs.clamp(min=1.0)
            scale = torch.where(stairs > 0, stepped, scale)
        cycle_lr = self.cycle_min_lr + (self.cycle_max_lr - self.cycle_min_lr) * scale

        if math.isclose(self.decay_step_size, 0) or math.isclose(self.decay_lr_rate, 0):
            decay_lr = _full(self.cycle_min_lr, bi)
        else:
            interval = (bi - total) / self.decay_step_size
            decay_lr = self.cycle_min_lr / (1.0 + self.decay_lr_rate * interval)
        # DeepSpeed: cycle while last_batch_iteration < total, i.e. step - 1 < total.
        return torch.where(bi - 1.0 < total, cycle_lr, decay_lr)
