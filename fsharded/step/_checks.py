"""What ``train_step`` checks of what a loss function gives it: the form of its result
(a scalar, ``(loss, metrics)``, or ``(loss, metrics, stats)`` with a model state), the
loss's varying axes, and the reduced gradients' types; and of the optimizer, the learning
rates its next update applies."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from fsharded import _tree, optim
from fsharded.mesh._mesh import Mesh
from fsharded.spmd.collectives import varying_axes


def _check_grad_types(grads: list, specs: list, mesh: Mesh, paths: list[str]) -> None:
    """Each reduced gradient may vary only over the axes its parameter is sharded on."""
    bad = [f"  params.{p}: varies over {extra}, its spec is {s!r}"
           for p, g, s in zip(paths, grads, specs)
           if (extra := [a for a in varying_axes(g) if a not in s.axes and mesh.shape[a] > 1])]
    if bad:
        raise ValueError("train_step: gradients left unreduced over mesh axes their parameters "
                         "are not sharded on:\n" + "\n".join(bad[:8]))


_RESERVED = ("loss", "grad_norm", "lr", "loss_scale", "skipped", "tokens_per_s")


def _check_loss(batch_axes: tuple[str, ...], mesh: Mesh, out: Any, *, with_stats: bool = False) -> tuple:
    """``loss_fn``'s result -> (the scalar loss, (its metrics, its stats)): a scalar, or
    ``(loss, metrics)`` with ``metrics`` a dict of scalar tensors reported beside the loss
    (not differentiated; averaged over the batch shards and micro-batches); with a model
    state (``with_stats``), ``(loss, metrics, stats)``, ``stats`` a pytree of tensors."""
    stats: Any = {}  # none (an empty tree: torch.func's aux takes no None)
    if with_stats:
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError(
                "train_step(update_model_state=...): loss_fn(params, batch, model_state) must return "
                f"(loss, metrics, stats), got {type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple) else "")
                + "; metrics a dict of 0-d tensors (may be empty), stats the tensors update_model_state reads")
        loss, extra, stats = out
        s_paths, s_leaves, _ = _tree.tree_flatten_with_paths(stats)
        bad = [f"stats.{p}" for p, x in zip(s_paths, s_leaves) if not isinstance(x, torch.Tensor)]
        if bad:
            raise ValueError(f"train_step: loss_fn's stats must be a pytree of tensors; {bad[:4]} are not")
        stats = optree.tree_map(torch.Tensor.detach, stats)
    else:
        loss, extra = out if isinstance(out, tuple) and len(out) == 2 else (out, {})
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(
            f"train_step: loss_fn must return a scalar tensor, or (loss, metrics) with metrics a "
            f"dict of scalar tensors; got {type(loss).__name__} of shape {tuple(getattr(loss, 'shape', ()))}"
        )
    _check_loss_dtype(loss)
    bad = [k for k, v in extra.items() if not (isinstance(v, torch.Tensor) and v.dim() == 0)] \
        if isinstance(extra, dict) else None
    if bad is None or bad:
        what = type(extra).__name__ if bad is None else f"entries {bad} that are not scalar tensors"
        raise ValueError(f"train_step: loss_fn returned (loss, metrics) with metrics {what}: give a dict "
                         f"of 0-d tensors (e.g. {{'aux_loss': aux}})")
    taken = [k for k in extra if k in _RESERVED]
    if taken:
        raise ValueError(f"train_step: loss_fn's metrics {taken} collide with the step's own; rename them")
    _check_loss_type(loss, batch_axes, mesh)
    return loss, ({k: v.detach().float() for k, v in extra.items()}, stats)


def _check_loss_type(loss: torch.Tensor, batch_axes: tuple[str, ...], mesh: Mesh) -> None:
    """A shard's loss may vary over the batch axes only: one that still varies over
    another axis is each shard's partial piece of a different model (its parameters are
    sharded over the axis and the model does not reduce over it)."""
    extra = [a for a in varying_axes(loss) if a not in batch_axes and mesh.shape[a] > 1]
    if extra:
        raise ValueError(
            f"train_step: the loss varies over mesh axis {extra[0]!r}"
            + (f" (and {extra[1:]})" if len(extra) > 1 else "")
            + f" after loss_fn, but only the batch axes {list(batch_axes)} may differ between "
            f"shards: parameters are sharded over {extra[0]!r} and the model does not reduce "
            f"over it (a missing psum). Tell the model the axis name (the bundled GPT: "
            f"functools.partial(gpt.loss, tensor_axis={extra[0]!r}); an nn.Module under "
            f"fs.parallel.tensor.plan: call the model through the plan, tp.apply(params, ...) "
            f"or tp.wrap(loss_fn)), add the psum, or keep the parameters replicated over {extra[0]!r}"
        )


def _check_loss_dtype(loss: torch.Tensor) -> None:
    """The loss is a real floating-point number: a complex one has no order to minimise
    (its real part would be taken silently), an integer one no gradient."""
    if not loss.is_floating_point():
        raise TypeError(
            f"train_step: loss_fn returned a loss of dtype {loss.dtype}; it must be a real floating-point "
            f"scalar (minimised, differentiated)"
            + ("; take the quantity to minimise: its .abs(), .real or a squared magnitude"
               if loss.is_complex() else "; compute it in floating point (e.g. .float())"))


def _check_rates(optimizer: Any, opt_state: Any, n: int, kept: Callable[[], str]) -> None:
    """Refuse step ``n + 1`` before it runs when the update would multiply by a learning
    rate that is nan, inf or negative (a schedule given as a callable can return one at any
    step): it would turn every parameter into nan while that step's loss and gradients still
    look finite. The rates come from the optimizer state's counters (``optim.scheduled_lrs``):
    a few scalar ops on the host per step, nothing read from the parameters. ``kept``: what
    the caller is left with, for the message."""
    rates = optim.scheduled_lrs(optimizer, opt_state)
    if not rates:
        return
    vals = [torch.as_tensor(lr).detach().to("cpu", torch.float64).reshape(-1) for _, lr in rates]
    bad = [(c, v) for (c, _), v in zip(rates, vals) if not bool((torch.isfinite(v) & (v >= 0)).all())]
    if not bad:
        return
    what = " and ".join(
        f"{_fmt(v)}{' (negative)' if bool(torch.isfinite(v).all()) else ''} (its schedule's value at update "
        f"{_fmt(torch.as_tensor(c).reshape(-1))}, counted from 0)" for c, v in bad)
    raise FloatingPointError(
        f"train_step: step {n + 1}: the optimizer's learning rate is {what}. The step was not run: "
        f"{kept()}. A learning rate must be a finite number >= 0: fix the schedule passed "
        f"as the optimizer's lr (a callable is checked only here, step by step; fsharded.optim's "
        f"schedules check their arguments when made). on_nonfinite='skip' does not skip this: later "
        f"steps would read the same schedule")


def _fmt(v: torch.Tensor) -> str:
    vals = v.tolist()
    return str(vals[0]) if len(vals) == 1 else str(vals)


def _shown(paths: list[str]) -> str:
    return ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")


def _nonfinite_state(params: Any, opt_state: Any) -> list[str]:
    """Paths of the floating-point leaves of (this rank's part of) a state holding inf or
    nan: the parameters and the optimizer state (a refused step's diagnosis only)."""
    out = []
    for name, tree in (("params", params), ("opt_state", opt_state)):
        paths, leaves, _ = _tree.tree_flatten_with_paths(tree)
        out += [f"{name}.{p}" for p, x in zip(paths, leaves)
                if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type != "meta"
                and not bool(torch.isfinite(x).all())]
    return out


def _check_optimizer(optimizer: Any) -> None:
    """An optimizer is a pure ``(init, update)`` pair (``fsharded.optim``), not a
    ``torch.optim`` class or instance, which keeps its state inside itself."""
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    is_class = isinstance(optimizer, type)
    is_torch = isinstance(optimizer, torch.optim.Optimizer) or \
        (is_class and issubclass(optimizer, torch.optim.Optimizer))
    if is_class:
        what = f"the class {optimizer.__module__}.{optimizer.__name__}"
    elif is_torch:
        what = f"a {type(optimizer).__module__}.{type(optimizer).__name__} instance"
    else:
        what = f"{type(optimizer).__name__} " + " ".join(repr(optimizer).split())[:60]
    hint = ("; torch.optim's optimizers keep their state inside themselves: use fsharded.optim's pure "
            "(init, update) pairs (fs.optim.adamw, adam, sgd, lion, adagrad, lamb)" if is_torch else "")
    raise TypeError(f"train_step: optimizer must be a gradient transformation with init(params) and "
                    f"update(grads, state, params), e.g. fs.optim.adamw(3e-4) or fs.optim.chain(...); got "
                    f"{what}{hint}")


def _check_param_leaves(params: Any, *, meta_ok: bool = False) -> None:
    """Every leaf of the parameter tree is a tensor with values (differentiated, updated and
    sharded): not a Python number, None or a meta tensor (``meta_ok``: a template, whose
    values come from a checkpoint). Lists every leaf that is not."""
    paths, leaves = optree.tree_flatten_with_path(params, none_is_leaf=True)[:2]
    if not leaves:
        raise ValueError("train_step.init: the parameter tree has no tensors: pass a dict (or other "
                         "pytree) of the model's parameter tensors")
    not_tensors, meta = [], []
    for path, x in zip(map(_tree.path_str, paths), leaves):
        if not isinstance(x, torch.Tensor):
            not_tensors.append(f"  params.{path}: {type(x).__name__} {x!r:.40}")
        elif x.device.type == "meta" and not meta_ok:
            meta.append(f"  params.{path}: a meta tensor {tuple(x.shape)} {x.dtype} (a shape, no values)")
    if not_tensors:
        raise TypeError("train_step.init: every leaf of the parameter tree must be a tensor; these are "
                        "not:\n" + "\n".join(not_tensors[:8]) + ("\n  ..." if len(not_tensors) > 8 else "")
                        + "\nMake a number a tensor (torch.tensor(1.5)) if it is trained; keep constants and "
                          "None out of the parameter tree (close over them in the loss)")
    if meta:
        raise ValueError("train_step.init: parameters on the meta device have no values to train:\n"
                         + "\n".join(meta[:8]) + ("\n  ..." if len(meta) > 8 else "")
                         + "\nInitialise them first (module.to_empty(device='cpu') then reset_parameters(), "
                           "or load weights); meta tensors are for estimate_memory")


def _check_batch_sizes(batch: Any) -> None:
    """A batch leaf with a dim of size 0 (an empty last batch) has no loss to take: its mean
    is nan. Refused naming the leaves instead of reported as a diverged step."""
    paths, leaves, _ = _tree.tree_flatten_with_paths(batch)
    bad = [f"  batch.{p}: shape {tuple(x.shape)}" for p, x in zip(paths, leaves)
           if isinstance(x, torch.Tensor) and 0 in x.shape]
    if bad:
        raise ValueError("train_step: the batch has leaves with a dim of size 0 (nothing to train on; the "
                         "loss's mean would be nan):\n" + "\n".join(bad[:8])
                         + "\nGive every leaf at least one row (an empty last batch: drop it, drop_last=True)")


def _check_scale(scale: Any, n: int) -> None:
    """fp16: a step that overflowed with the scale already at its minimum has diverged."""
    if int(scale.overflows_at_min.max()):
        raise FloatingPointError(
            f"train_step: step {n + 1}: the gradients overflow with the loss scale at its "
            f"minimum ({float(scale.scale.min())}), after {int(scale.skipped.max())} skipped "
            f"step(s) in all: the run has diverged (DeepSpeed stops here too). The state passed "
            f"in (after {n} step{'' if n == 1 else 's'}) is unchanged. Lower the learning rate, check the data for "
            f"inf/nan, or use bf16")


def _check_local_shapes(params: Any, expect: list | None, placement: Callable[[], str]) -> None:
    """On real ranks, a state laid out for another placement (another ZeRO stage or mesh)
    has other shard shapes than ``expect`` (this step's, per leaf; None: the state was not
    made by this step's init, nothing to compare with): say so, naming ``placement()``,
    instead of computing garbage."""
    if expect is None:
        return
    paths, leaves, _ = _tree.tree_flatten_with_paths(params)
    bad = [f"  params.{p}: local shape {tuple(x.shape)}, this step's placement expects {e}"
           for p, x, e in zip(paths, leaves, expect) if tuple(x.shape) != e]
    if bad:
        raise ValueError(
            f"train_step: the state is laid out for another placement than this step's ({placement()}):\n"
            + "\n".join(bad[:8]) + ("\n  ..." if len(bad) > 8 else "")
            + "\nReshard it: full = old_step.params(state); state = step.init(full) "
              "(optimizer moments are not carried over that way)"
        )
