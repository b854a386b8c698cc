"""What a step does about non-finite numbers, chosen once when the step is built
(``choose_guard``): nothing (``Unguarded``, ``check_finite=False``), refuse the step
(``Refuse``, ``on_nonfinite="raise"``) or skip it (``Skip``, ``"skip"``). A guard acts at
three points of a call:

- ``before`` the step runs: the learning rates the update is about to apply must be finite
  and >= 0 (a schedule given as a callable can return anything), else the step is refused
  before anything runs (``"skip"`` does not skip it: every later step reads the same
  schedule);
- ``verdict``, inside the step: the finite verdict the in-place updates skip on, the same on
  every shard (the loss and the norm are reduced; fp16's check is agreed over every axis);
- ``after`` it ran, on the host: the state to go on from and the metrics. A step whose loss
  or gradient norm is inf or nan is not applied: ``FloatingPointError`` naming the step and
  the gradient leaves that were not finite (``Refuse``), or the state passed in with ``step``
  and ``skipped`` advanced (``Skip``). fp16's overflows are its loss scale's to skip (the
  step applies none and counts them in the loss scale's state); a step the loss scale
  applied but whose loss is not finite is refused or skipped as in fp32, and an overflow at
  the minimum scale is the end of the run (DeepSpeed's rule).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import optree
import torch
import torch.distributed as dist

from fsharded import _tree
from fsharded.mesh._spec import PartitionSpec
from fsharded.spmd import _env
from fsharded.spmd.collectives import pmax
from fsharded.spmd.shard_map import shard_map
from fsharded.step import _trainable as T
from fsharded.step._batch import local_batch
from fsharded.step._checks import _check_rates, _check_scale, _nonfinite_state, _shown
from fsharded.step._transform import Transformed

__all__ = ["Unguarded", "Refuse", "Skip", "choose_guard", "kept", "nonfinite_leaves"]


class Unguarded:
    """``check_finite=False``: every step the loss scale applies is applied."""

    def before(self, step: Any, state: Any) -> None:
        pass

    def verdict(self, loss: torch.Tensor, t: Transformed) -> torch.Tensor | None:
        """fp16's verdict, so an in-place update skips the overflow the loss scale drops."""
        return t.finite

    def graph_verdict(self, metrics: dict) -> torch.Tensor | None:
        """``verdict`` from the step's metrics (the loss averaged over the batch shards and
        the gradient norm), for a captured step writing its new state into the donated one."""
        return None

    def after(self, step: Any, state: Any, new: Any, metrics: dict, batch: Any) -> tuple[Any, dict]:
        return new, metrics


class Refuse(Unguarded):
    """``on_nonfinite="raise"``: a non-finite step raises, the state passed in unchanged."""

    def __init__(self) -> None:
        self.warned_zero_grads = False

    def before(self, step: Any, state: Any) -> None:
        """Refuse, before running it, a step whose update would apply a learning rate that is
        nan, inf or negative (``step._checks._check_rates``)."""
        _check_rates(step.optimizer, state.opt_state, int(state.step), lambda: kept(step, state))

    def verdict(self, loss: torch.Tensor, t: Transformed) -> torch.Tensor:
        # fp32 / bf16: the loss and the norm are the same on every shard, so is the verdict;
        # an in-place update is skipped on it (the pure one is dropped after).
        return t.finite if t.finite is not None else torch.isfinite(t.norm) & torch.isfinite(loss)

    def graph_verdict(self, metrics: dict) -> torch.Tensor:
        return torch.isfinite(metrics["grad_norm"]) & torch.isfinite(metrics["loss"])

    def after(self, step: Any, state: Any, new: Any, metrics: dict, batch: Any) -> tuple[Any, dict]:
        loss, gnorm = float(metrics["loss"]), float(metrics["grad_norm"])
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        if state.loss_scale is not None:
            _check_scale(new.loss_scale, int(state.step))
            # Overflowing gradients are the loss scale's to skip (and it did); a step it
            # applied must be finite as in fp32 / bf16: a nan loss whose gradients are finite
            # (a term that does not reach the parameters) is no overflow a smaller scale
            # could fix, so it is refused, not counted as one.
            applied = bool((new.loss_scale.skipped == state.loss_scale.skipped).all())
            finite = finite or not applied
        if not finite:
            return self.nonfinite(step, state, metrics, batch, loss, gnorm)
        if gnorm == 0.0 and math.isfinite(loss) and not self.warned_zero_grads:
            self.warned_zero_grads = True
            warnings.warn(
                f"train_step: every gradient is exactly zero at step {int(state.step) + 1}: the loss "
                f"probably does not depend on the parameters (detached, computed under "
                f"torch.no_grad, or from the batch alone), so nothing trains", stacklevel=3)
        return new, metrics

    def nonfinite(self, step: Any, state: Any, metrics: dict, batch: Any, loss: float,
                  gnorm: float) -> tuple[Any, dict]:
        n = int(state.step)
        where = ""
        if not math.isfinite(gnorm):
            bad = nonfinite_leaves(step, state, batch)
            where = f"; non-finite gradients in {_shown([f'params.{p}' for p in bad])}" if bad else ""
        raise FloatingPointError(
            f"train_step: step {n + 1} has loss {loss} and gradient norm {gnorm}{where}. It was "
            f"not applied: {kept(step, state)}. Lower the learning rate, "
            f"enable clipping, look for sqrt/log/division at 0 in the loss, or pass "
            f"on_nonfinite='skip' to skip such steps")


class Skip(Refuse):
    """``on_nonfinite="skip"``: a non-finite step is skipped, as DeepSpeed's bf16 optimizer
    skips: the state passed in, its ``step`` and ``skipped`` counters advanced."""

    def nonfinite(self, step: Any, state: Any, metrics: dict, batch: Any, loss: float,
                  gnorm: float) -> tuple[Any, dict]:
        skipped = state.skipped + 1
        # metrics["skipped"]: every step not applied so far, the loss scale's overflows too.
        metrics["skipped"] = (skipped + state.loss_scale.skipped.max()) if state.loss_scale is not None else skipped
        return state._replace(step=state.step + 1, skipped=skipped), metrics


def choose_guard(check_finite: bool, on_nonfinite: str) -> Unguarded:
    """The guard of a step built with these settings."""
    if on_nonfinite not in ("raise", "skip"):
        raise ValueError(f"train_step: on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    if not check_finite:
        return Unguarded()
    return Skip() if on_nonfinite == "skip" else Refuse()


def _slots(layout: Any) -> list[int]:
    """Per gradient leaf a layout's step computes (the trained leaves this process holds),
    its index among the trained leaves."""
    trained = [i for i in range(len(layout.paths)) if layout.trainable is None or layout.trainable[i]]
    return [k for k, i in enumerate(trained) if layout.updated is None or layout.updated[i]]


def kept(step: Any, state: Any) -> str:
    """What a refused step leaves the caller: the state passed in, unchanged — and, if that
    state already holds inf or nan (it did not come from a checked step: a checkpoint, a
    transformation whose rates the step cannot read), saying so, since it is no good state
    to go on from."""
    n = int(state.step)
    out = (f"the state passed in (after {n} step{'' if n == 1 else 's'}) is unchanged"
           f"{', donated buffers included' if step.donate else ''}")
    bad = _nonfinite_state(state.params, state.opt_state)
    if not bad:
        return out
    on = f" on rank {dist.get_rank()}" if step.distributed else ""
    return (f"{out}, but it already held non-finite values{on} in {_shown(bad)}, so it is no "
            f"good state either: go back to a checkpoint saved before they appeared")


def nonfinite_leaves(step: Any, state: Any, batch: Any) -> list[str]:
    """The paths of the parameters whose gradient has an inf or nan on any shard: the
    gradients of (the global) ``batch`` again, a stop's diagnosis, on every rank together."""
    mask = step._mask(state)
    key = ("nonfinite", optree.tree_structure(state), tuple(mask) if mask is not None else None)
    if key not in step._compiled:  # kept with the step's compiled functions (and cleared with them)
        plans = {eager: step._plan(state, eager) for eager in (False, True)}
        axes = tuple(a for a in step.mesh.axis_names if step.mesh.shape[a] > 1)

        def body(s: Any, b: Any) -> torch.Tensor:
            frame = _env.current()
            plan = plans[frame.backend == "distributed" or frame.mesh.size == 1]
            g_leaves, _, _ = step._gradients(plan, s, b)
            vma = _env.current().vma
            with vma.paused() if vma is not None else contextlib.nullcontext():
                # One flag per trained leaf (0 for those a pipe rank does not hold), so every
                # rank's vector names the same leaves.
                every = [torch.zeros((), dtype=torch.float32)] * len(T.pick(plan.layout.paths, plan.layout.trainable))
                for k, g in zip(_slots(plan.layout), g_leaves):
                    every[k] = (~torch.isfinite(g)).any().to(torch.float32)
                flags = torch.stack(every)
                return pmax(flags, axes) if axes else flags

        step._compiled[key] = shard_map(body, mesh=step.mesh, in_specs=(step.state_specs(state), step.batch_spec),
                                        out_specs=PartitionSpec(), backend=step.backend)
    sm = step._compiled[key]
    if step.distributed:
        batch = local_batch(sm, batch)
    with torch.no_grad():
        flags = sm.local(state, batch)
    paths = T.pick(_tree.tree_flatten_with_paths(state.params)[0], mask)
    return [p for p, f in zip(paths, flags.tolist()) if f]
