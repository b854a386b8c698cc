"""The core: ``GradientTransformation``, ``chain``, ``apply_updates``, learning rates.

A transformation is a pure ``(init, update)`` pair over pytrees of tensors. Its state is
data (NamedTuples of tensors and of pytrees of tensors) and every ``update`` is made of
elementwise torch ops, ``torch.where`` and reductions, so it runs unchanged on one device,
on a shard inside ``shard_map`` and under ``torch.func.vmap``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import optree
import torch

from fsharded.mesh import PartitionSpec
from fsharded.optim._schedules import constant

# Whether a tree holds only ordinary tensors (not vmap-batched or grad-tracked): where the
# foreach and in-place forms apply. An optimizer runs inside a step (either backend) and on
# its own, under a caller's vmap: the values answer (spmd._wrappers, which asks torch.func).
from fsharded.spmd._wrappers import plain

__all__ = [
    "GradientTransformation",
    "Optimizer",
    "EmptyState",
    "ScaleByScheduleState",
    "Schedule",
    "ScalarOrSchedule",
    "chain",
    "identity",
    "apply_updates",
    "scale",
    "scale_by_learning_rate",
    "as_schedule",
    "get_lr",
    "scheduled_lrs",
    "state_specs",
]

Params = Any
Updates = Any
State = Any
# A schedule maps the optimizer step (a 0-d integer tensor, or an int) to a 0-d float tensor.
Schedule = Callable[[Any], torch.Tensor]
ScalarOrSchedule = float | Schedule


class GradientTransformation(NamedTuple):
    """A pure gradient transformation: ``init(params) -> state`` and
    ``update(updates, state, params=None) -> (updates, state)``.

    >>> tx = chain(scale(-0.1))
    >>> params = {"w": torch.ones(2)}
    >>> state = tx.init(params)
    >>> updates, state = tx.update({"w": torch.ones(2)}, state, params)
    >>> apply_updates(params, updates)
    {'w': tensor([0.9000, 0.9000])}
    """

    init: Callable[[Params], State]
    update: Callable[..., tuple[Updates, State]]


class Optimizer(GradientTransformation):
    """A ``GradientTransformation`` that also carries its learning-rate schedule as ``.lr``.

    Still the 2-tuple ``(init, update)``, so code written against ``GradientTransformation``
    takes it unchanged; ``get_lr(opt, step)`` reads ``.lr``. Every optimizer in this package
    returns one, and ``chain`` / ``MultiSteps`` keep the ``.lr`` of the optimizer inside them.
    """

    # No ``__slots__ = ()``: the instance dict holds ``lr`` beside the two tuple fields.

    def __new__(cls, init: Callable, update: Callable, lr: Schedule | None = None) -> Optimizer:
        self = super().__new__(cls, init, update)
        self.lr = lr
        return self

    def __getnewargs__(self) -> tuple:
        return (self.init, self.update, self.lr)

    def __repr__(self) -> str:
        return f"Optimizer(lr={self.lr!r})"


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


class ScaleByScheduleState(NamedTuple):
    """``count``: the number of updates applied so far (0-d int64), the schedule's step."""

    count: torch.Tensor


def _count0() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


def _lr_of(tx: Any) -> Schedule | None:
    return getattr(tx, "lr", None)


def _wrap(init: Callable, update: Callable, lr: Schedule | None) -> GradientTransformation:
    return Optimizer(init, update, lr) if lr is not None else GradientTransformation(init, update)


def identity() -> GradientTransformation:
    """Pass updates through unchanged."""
    return GradientTransformation(lambda params: EmptyState(), lambda u, s, params=None: (u, s))


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply ``transforms`` in order; the state is the tuple of their states.

    If exactly one of them carries a learning rate (an ``Optimizer``), so does the chain:

    >>> from fsharded.optim import adamw, clip_by_global_norm
    >>> tx = chain(clip_by_global_norm(1.0), adamw(1e-3))
    >>> float(get_lr(tx, 0))
    0.001
    """
    transforms = tuple(transforms)
    lrs = [lr for lr in map(_lr_of, transforms) if lr is not None]

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if len(state) != len(transforms):
            raise ValueError(
                f"chain: the state has {len(state)} entries but the chain has "
                f"{len(transforms)} transforms; was it made by this chain's init?"
            )
        new_state = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    update.lrs = lambda state: [x for t, s in zip(transforms, state) for x in scheduled_lrs(t, s)]
    return _wrap(init, update, lrs[0] if len(lrs) == 1 else None)


def apply_updates(params: Params, updates: Updates) -> Params:
    """``params + updates`` leafwise, keeping each parameter's dtype.

    Updates may come out in a wider dtype (an fp32 update for a bf16 parameter); the sum
    is cast back so the parameter tree's dtypes never drift.
    """
    if _foreach_ok(params) and plain(updates):  # (updates can be batched where params are not)
        p, tdef = optree.tree_flatten(params)
        u = optree.tree_leaves(updates)
        if all(x.dtype == y.dtype for x, y in zip(p, u)):
            if is_donating():
                torch._foreach_add_(p, u)
                return optree.tree_unflatten(tdef, p)
            return optree.tree_unflatten(tdef, torch._foreach_add(p, u))
    return optree.tree_map(lambda p, u: (p + u).to(p.dtype), params, updates)


_DONATE: contextvars.ContextVar[bool] = contextvars.ContextVar("fsharded_donate", default=False)


@contextlib.contextmanager
def donating() -> Iterator[None]:
    """Within this block optimizers may overwrite their state and the parameters in place
    (on plain tensors, see ``plain``): the state passed to ``update``/``apply_updates`` is
    consumed, like JAX's donated buffers. Saves a copy of the parameters and optimizer
    state at the update. ``train_step(..., donate=True)`` uses it."""
    tok = _DONATE.set(True)
    try:
        yield
    finally:
        _DONATE.reset(tok)


def is_donating() -> bool:
    """Inside ``donating()``. The in-place forms run only on plain tensors (``plain``)."""
    return _DONATE.get()


def _foreach_ok(tree: Any) -> bool:
    """Multi-tensor (foreach) kernels apply: plain tensors (``plain``), none on meta.

    On vmap-batched values (the virtual mesh) the per-leaf form is used: its ops have
    batching rules. The arithmetic is the same either way.
    """
    leaves = optree.tree_leaves(tree)
    if not plain(leaves):
        return False
    return bool(leaves) and all(isinstance(x, torch.Tensor) and x.device.type != "meta" for x in leaves)


def scale(factor: float) -> GradientTransformation:
    """Multiply every update by a constant."""

    def update(updates, state, params=None):
        return optree.tree_map(lambda u: u * factor, updates), state

    return GradientTransformation(lambda params: EmptyState(), update)


# -- learning rates --------------------------------------------------------------------


def check_hyper(who: str, name: str, value: Any, *, low: float = 0.0, high: float | None = None,
                closed_high: bool = False) -> None:
    """A hyper-parameter must be a finite real number in [low, high) (``closed_high``:
    [low, high]); raises naming the function and the argument (torch.optim's ranges)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and value >= low and (high is None or (value <= high if closed_high else value < high))
    if not ok:
        rng = f"[{low:g}, {high:g}{']' if closed_high else ')'}" if high is not None else f">= {low:g}"
        raise ValueError(f"{who}: {name} must be a finite number {'in ' if high is not None else ''}"
                         f"{rng}, got {value!r}")


def as_schedule(lr: ScalarOrSchedule, *, who: str = "optimizer") -> Schedule:
    """A float becomes a constant schedule (finite and >= 0, or a ``ValueError`` naming
    ``who``); a callable is returned as is (``train_step`` checks the rates it returns
    before applying them, see ``scheduled_lrs``)."""
    if callable(lr):
        return _tensor_valued(lr)
    if isinstance(lr, torch.Tensor):
        raise TypeError(
            f"{who}: lr must be a Python float or a schedule (step -> lr tensor), not a tensor: a "
            "tensor captured here would be frozen into the optimizer. Use fsharded.optim.constant(x)."
        )
    if not isinstance(lr, (int, float)) or isinstance(lr, bool):
        raise TypeError(f"{who}: lr must be a float or a schedule callable, got {type(lr).__name__}")
    check_hyper(who, "lr", lr)
    return constant(lr)


def _tensor_valued(fn: Callable[[Any], Any]) -> Schedule:
    """A schedule callable whose values may be Python numbers (``lambda step: 1e-3``):
    theirs as float64 tensors, as the package's schedules give (tensors pass through)."""
    if getattr(fn, "_tensor_valued", False):
        return fn

    @functools.wraps(fn)
    def sched(count: Any) -> torch.Tensor:
        v = fn(count)
        return v if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64)

    sched._tensor_valued = True
    return sched


def get_lr_schedule(tx: Any) -> Callable[[Any], torch.Tensor] | None:
    """The schedule an optimizer from this package applies, or None if it carries none."""
    if isinstance(tx, GradientTransformation):
        return _lr_of(tx)
    return None


def get_lr(tx_or_lr: Any, step: Any) -> torch.Tensor:
    """The learning rate applied by update number ``step`` (0 for the first update).

    ``tx_or_lr``: an optimizer from this package (or a ``chain`` / ``MultiSteps`` holding
    one), a schedule, or a float. Returns a 0-d float64 tensor.

    >>> from fsharded.optim import sgd, WarmupLR
    >>> opt = sgd(WarmupLR(warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear"))
    >>> [round(float(get_lr(opt, s)), 3) for s in (0, 1, 5, 10, 11)]
    [0.0, 0.0, 0.04, 0.09, 0.1]
    """
    if isinstance(tx_or_lr, GradientTransformation):
        lr = _lr_of(tx_or_lr)
        if lr is None:
            raise ValueError(
                "get_lr: this transformation carries no learning rate (it is not an optimizer "
                "from fsharded.optim, or a chain holding several of them); pass the schedule."
            )
        return lr(step)
    return as_schedule(tx_or_lr)(step)


def scheduled_lrs(tx: Any, state: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The learning rates the next ``tx.update(updates, state, params)`` multiplies by,
    read from ``state``'s counters without running the update: one ``(count, lr)`` pair
    (the schedule's step and its value) per ``scale_by_learning_rate`` inside ``tx``
    (through ``chain`` and ``MultiSteps``); none for a transformation built otherwise.
    ``train_step`` checks them before a step, so a rate that is nan, inf or negative is
    refused instead of turning every parameter into nan.

    >>> from fsharded.optim import adamw
    >>> opt = adamw(lambda step: 0.1 / (step + 1.0))
    >>> [(int(c), round(float(lr), 6)) for c, lr in scheduled_lrs(opt, opt.init({"w": torch.ones(2)}))]
    [(0, 0.1)]
    """
    probe = getattr(getattr(tx, "update", None), "lrs", None)
    return list(probe(state)) if probe is not None else []


class Rate(tuple):
    """One ``(count, lr)`` pair of ``scheduled_lrs``, with the ``scale_by_learning_rate``
    it belongs to (``token``: see ``given_rates``)."""

    token: object

    def __new__(cls, count: Any, lr: torch.Tensor, token: object) -> Rate:
        self = super().__new__(cls, (count, lr))
        self.token = token
        return self


# The rates computed before a step, by ``scale_by_learning_rate`` token (``given_rates``).
_GIVEN: contextvars.ContextVar[dict | None] = contextvars.ContextVar("fsharded_given_rates", default=None)


@contextlib.contextmanager
def given_rates(rates: dict) -> Iterator[None]:
    """Inside, each ``scale_by_learning_rate`` whose token (``Rate.token``) is in ``rates``
    multiplies by the value given there instead of computing its schedule. A step captured
    as one graph passes the rates it computed before running (``scheduled_lrs``, from the
    same counters) as inputs of the graph, so the graph holds no schedule: one graph for
    every schedule and run length. (A transformation reached by ``scheduled_lrs`` must
    not also run elsewhere in the same update on another counter: it would be given the
    reached one's rate.)"""
    tok = _GIVEN.set(rates)
    try:
        yield
    finally:
        _GIVEN.reset(tok)


def scale_by_learning_rate(lr: ScalarOrSchedule, *, flip_sign: bool = True, who: str = "optimizer") -> Optimizer:
    """Multiply updates by ``-lr(count)`` (``+lr`` with ``flip_sign=False``).

    ``count`` starts at 0 and counts the updates applied, so ``lr(0)`` scales the first one.
    ``who`` names the optimizer in the error for a float ``lr`` that is nan, inf or negative.
    """
    sched = as_schedule(lr, who=who)
    sign = -1.0 if flip_sign else 1.0
    token = object()  # (this transformation's own: a rate given for it, see given_rates)

    def rate(count: torch.Tensor) -> torch.Tensor:
        given = _GIVEN.get()
        return given[token] if given is not None and token in given else sched(count)

    def init(params):
        return ScaleByScheduleState(_count0())

    def update(updates, state, params=None):
        step_lr = rate(state.count) * sign
        if _foreach_ok(updates):
            u, tdef = optree.tree_flatten(updates)
            if len({x.dtype for x in u}) == 1:
                return (optree.tree_unflatten(tdef, torch._foreach_mul(u, step_lr.to(u[0].dtype))),
                        ScaleByScheduleState(state.count + 1))
        new = optree.tree_map(lambda u: u * step_lr.to(u.dtype), updates)
        return new, ScaleByScheduleState(state.count + 1)

    update.lrs = lambda state: [Rate(state.count, rate(state.count), token)]
    return Optimizer(init, update, sched)


# -- sharding of optimizer states --------------------------------------------------------


def state_specs(state: State, params: Params, param_specs: Any) -> Any:
    """A spec tree for an optimizer ``state``, for ``shard_map`` in/out specs.

    Every subtree of ``state`` with the structure and shapes of ``params`` (moments,
    accumulators) gets ``param_specs``; every other leaf (step counters, norms) is
    replicated, ``P()``. Shapes may be global or per-shard, as long as ``state`` and
    ``params`` agree.

    >>> from fsharded import P
    >>> from fsharded.optim import adam
    >>> params = {"w": torch.zeros(4, 2)}
    >>> state_specs(adam(0.1).init(params), params, {"w": P("data")})
    (EmptyState(), ScaleByAdamState(count=PartitionSpec(), mu={'w': PartitionSpec('data')}, nu={'w': PartitionSpec('data')}), ScaleByScheduleState(count=PartitionSpec()))
    """
    return moments_like(state, params, param_specs, PartitionSpec())


def moments_like(state: State, params: Params, moments: Any, other: Any) -> Any:
    """``state`` with every subtree shaped like ``params`` (the same structure and shapes:
    moments, accumulators) replaced by ``moments`` and every other leaf by ``other``."""
    ptree = optree.tree_structure(params)
    pshapes = [tuple(x.shape) for x in optree.tree_leaves(params)]

    def like_params(node: Any) -> bool:
        if optree.tree_structure(node) != ptree:
            return False
        shapes = [tuple(getattr(x, "shape", ())) for x in optree.tree_leaves(node)]
        return shapes == pshapes

    def walk(node: Any) -> Any:
        if like_params(node):
            return moments
        if optree.treespec_is_leaf(optree.tree_structure(node)):
            return other
        children, meta, _, unflatten = optree.tree_flatten_one_level(node)
        return unflatten(meta, [walk(c) for c in children])

    return walk(state)
