"""Optimizers as pure, composable gradient transformations (optax-style) on torch tensors.

A ``GradientTransformation`` is a pair ``init(params) -> state`` and
``update(updates, state, params=None) -> (updates, state)``; states are NamedTuples of
tensors (and of pytrees of tensors), pure data with no Python counters, so they can be
sharded by spec trees (``state_specs``), checkpointed and carried through ``vmap``.
Updates are computed with out-of-place elementwise ops, ``torch.where`` and reductions
only: they run on one device, on each shard inside ``shard_map`` and under
``torch.func.vmap`` (the virtual mesh). The few operations that need whole-tensor norms
(``global_norm``, ``clip_by_global_norm``, ``lamb``) take the ``specs`` the trees are
sharded by and ``psum`` over exactly those mesh axes.

>>> import torch
>>> from fsharded import optim
>>> opt = optim.chain(optim.clip_by_global_norm(1.0),
...                   optim.adamw(optim.WarmupCosineLR(1000, warmup_num_steps=100, lr=3e-4),
...                               mask=optim.decay_mask))
>>> params = {"fc": {"w": torch.ones(4, 4), "b": torch.zeros(4)}}
>>> state = opt.init(params)
>>> grads = {"fc": {"w": torch.ones(4, 4), "b": torch.ones(4)}}
>>> updates, state = opt.update(grads, state, params)
>>> params = optim.apply_updates(params, updates)
>>> round(float(optim.get_lr(opt, 150)), 7)   # the rate update 150 (from 0) runs at
0.0002977

Learning rates. ``lr`` is a float or a schedule: a callable from the update count (an int
or a 0-d integer tensor; 0 for the first update) to a 0-d float64 tensor. Each optimizer
returns an ``Optimizer``, a ``GradientTransformation`` subclass (still the 2-tuple
``(init, update)``) whose ``.lr`` attribute holds its schedule; ``chain`` and
``MultiSteps`` keep it when they hold exactly one optimizer. ``get_lr(opt, step)`` returns
the rate update ``step`` runs at (for Adagrad, including its ``lr_decay``).

DeepSpeed's schedules (``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle``)
reproduce the rates DeepSpeed's engine applies, update for update: DeepSpeed steps its
scheduler after the optimizer, so update ``k`` runs at the scheduler's ``get_lr()`` for
``last_batch_iteration = k - 1`` (the constructor's value for ``k = 0``).

Fused steps. ``fused_update_(opt, grads, state, params)`` runs ``adamw``, ``adam`` or
``lion`` (a decay mask makes two groups of leaves) as one in-place multi-tensor kernel: Triton on CUDA, the C++
optimizer on CPU (``fsharded.kernels``); same state, same numbers to float rounding.
``train_step(..., donate=True)`` uses it where it applies.

Weight decay. ``adamw``, ``lion`` and ``lamb`` decay decoupled (``w -= lr * wd * w``),
``adam``, ``sgd`` and ``adagrad`` as L2 on the gradient, like ``torch.optim``. ``mask`` is
``None`` (decay every leaf, as torch), a bool pytree (or prefix), or a callable
``params -> bool pytree`` such as ``decay_mask`` (no decay for biases, norms, scalars).
"""

from fsharded.optim._accumulate import MultiSteps, MultiStepsState, accumulate
from fsharded.optim._adam import ScaleByAdamState, adam, adamw, scale_by_adam
from fsharded.optim._base import (
    EmptyState,
    GradientTransformation,
    Optimizer,
    ScalarOrSchedule,
    ScaleByScheduleState,
    Schedule,
    apply_updates,
    as_schedule,
    chain,
    donating,
    get_lr,
    get_lr_schedule,
    identity,
    moments_like,
    scale,
    scale_by_learning_rate,
    scheduled_lrs,
    state_specs,
)
from fsharded.optim._clip import (
    ClipByGlobalNormState,
    clip_by_global_norm,
    clip_factor,
    global_norm,
    global_sq_norm,
    leaf_sq_norms,
)
from fsharded.optim._fused import FusedForm, FusedStep, decay_flags, fused_update_, has_fused
from fsharded.optim._lamb import lamb, scale_by_trust_ratio
from fsharded.optim._lion import ScaleByLionState, lion, scale_by_lion
from fsharded.optim._schedules import (
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    constant,
    linear,
)
from fsharded.optim._sgd import (
    ScaleByAdagradState,
    TraceState,
    adagrad,
    scale_by_adagrad,
    sgd,
    trace,
)
from fsharded.optim._weight_decay import add_decayed_weights, decay_mask

__all__ = [
    # core
    "GradientTransformation",
    "Optimizer",
    "Schedule",
    "ScalarOrSchedule",
    "chain",
    "donating",
    "identity",
    "apply_updates",
    "get_lr",
    "get_lr_schedule",
    "as_schedule",
    "scheduled_lrs",
    "state_specs",
    "moments_like",
    # fused in-place steps (fsharded.kernels)
    "fused_update_",
    "has_fused",
    "decay_flags",
    "FusedForm",
    "FusedStep",
    # optimizers
    "adamw",
    "adam",
    "sgd",
    "lion",
    "adagrad",
    "lamb",
    # building blocks
    "scale",
    "scale_by_learning_rate",
    "scale_by_adam",
    "scale_by_lion",
    "scale_by_adagrad",
    "scale_by_trust_ratio",
    "trace",
    "add_decayed_weights",
    "decay_mask",
    # norms and clipping
    "global_norm",
    "global_sq_norm",
    "leaf_sq_norms",
    "clip_by_global_norm",
    "clip_factor",
    # accumulation
    "MultiSteps",
    "accumulate",
    # schedules
    "constant",
    "linear",
    "WarmupLR",
    "WarmupDecayLR",
    "WarmupCosineLR",
    "OneCycle",
    # states
    "EmptyState",
    "ScaleByScheduleState",
    "ScaleByAdamState",
    "ScaleByLionState",
    "ScaleByAdagradState",
    "TraceState",
    "ClipByGlobalNormState",
    "MultiStepsState",
]
