"""Fused in-place steps: ``adamw``, ``adam`` and ``lion`` on the kernels of
``fsharded.kernels`` (Triton on CUDA, the C++ optimizer on CPU, the reference elsewhere).

The transformations of this package are pure; a fused step is their in-place twin, for
plain tensors, not torch.func wrappers (one device, or a real rank's shards):

>>> opt = adamw(1e-3)
>>> state = opt.init(params)
>>> state, found_inf = fused_update_(opt, grads, state, params)   # params updated in place

It reads and writes the same state pytree as ``opt.update`` (moments in place, counters
advanced), so the two can be mixed, checkpointed and resharded alike, and gives the same
numbers (to float rounding: the kernels evaluate the same formulas in another order).
``inv_scale`` multiplies the gradients on load (loss-scale unscaling, a clipping factor);
when any gradient is inf or nan nothing is modified, the counters do not advance and
``found_inf`` is true (unless ``check_finite=False``, which skips that check).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded.kernels import fused_optim
from fsharded.optim._base import ScaleByScheduleState, get_lr_schedule, plain
from fsharded.optim._weight_decay import resolve_mask

__all__ = ["FusedForm", "FusedStep", "has_fused", "fused_update_", "decay_flags"]


class FusedForm(NamedTuple):
    """What a fused step needs to know about an optimizer built by this package.

    ``kind``: ``"adamw"`` (decoupled decay), ``"adam"`` (L2) or ``"lion"``; ``hyper``: its
    betas, eps and weight decay; ``moments``: the index of the moment state in the
    optimizer's chain state; the learning-rate schedule's state is the last entry;
    ``mask``: which leaves the weight decay applies to (``add_decayed_weights``' mask; None:
    all)."""

    kind: str
    hyper: dict
    moments: int
    mask: Any = None


def has_fused(optimizer: Any) -> bool:
    """Whether ``fused_update_`` can run ``optimizer`` (``adamw``, ``adam`` or ``lion`` as
    built by this package, with or without a decay mask, not wrapped in another chain)."""
    return isinstance(getattr(optimizer, "fused", None), FusedForm)


def _check(name: str, leaves: list, ref: list[torch.Tensor]) -> None:
    if len(leaves) != len(ref):
        raise ValueError(f"fused_update_: {name} has {len(leaves)} leaves, params {len(ref)}")


def decay_flags(optimizer: Any, params: Any) -> list[bool] | None:
    """Per leaf of ``params``, whether ``optimizer``'s fused form decays it (its mask read
    on these parameters, as its ``update`` reads it); None: every leaf."""
    form = getattr(optimizer, "fused", None)
    if not isinstance(form, FusedForm) or form.mask is None:
        return None
    return resolve_mask(form.mask, params, f"{form.kind} (fused)")


def fused_update_(optimizer: Any, grads: Any, state: Any, params: Any, *,
                  inv_scale: float | torch.Tensor = 1.0, check_finite: bool = True,
                  impl: str | None = None, decay: list[bool] | None = None) -> tuple[Any, torch.Tensor]:
    """One in-place step of ``optimizer`` on ``params`` (see the module doc).

    Returns ``(new_state, found_inf)``; ``params`` and the moments inside ``state`` are
    updated in place (the old state is consumed, as with ``donating()``).
    ``check_finite=False`` skips the inf/nan check (one read of the gradients less, what
    pays off when nothing needs it, i.e. without fp16 loss scaling): ``found_inf`` is then
    always false and a non-finite gradient propagates into the parameters and moments, as
    with ``optimizer.update`` or ``torch.optim``. ``decay``: per leaf, whether the weight
    decay applies (``decay_flags`` of the parameters as the optimizer's mask sees them,
    for a caller whose ``params`` are another view of them); by default the mask is read
    on ``params``. The decayed and the other leaves run as two groups of the kernel.
    """
    if not plain((grads, state, params)):
        raise RuntimeError(
            "fused_update_ updates tensors in place and cannot take torch.func-wrapped values "
            "(vmap-batched on the virtual mesh, or differentiated); use optimizer.update and "
            "apply_updates there"
        )
    fs = FusedStep(optimizer, state, inv_scale=inv_scale, impl=impl)
    p = optree.tree_leaves(params)
    g = optree.tree_leaves(grads)
    _check("grads", g, p)
    moments = fs.moment_leaves()
    for name, ms in zip(("the first moments", "the second moments"), moments):
        _check(name, ms, p)
    if decay is None:
        decay = decay_flags(optimizer, params)
    if decay is not None and len(decay) != len(p):
        raise ValueError(f"fused_update_: {len(decay)} decay flags, params {len(p)}")
    mixed = decay is not None and not all(decay) and any(decay)
    if check_finite and mixed:  # nothing modified when any gradient is inf or nan
        bad = not bool(torch.stack([torch.isfinite(x).all() for x in g]).all())
        if bad:
            return tuple(state), torch.ones((), dtype=torch.bool, device=fs.device)
        check_finite = False
    found = fs.run(p, g, moments, decay, check_finite=check_finite)
    return fs.finish(found), found


class FusedStep:
    """One fused step taken in parts: ``run`` the kernel on any split of the leaves (their
    contiguous pieces, one bucket at a time, in any buffers: the update is elementwise),
    then ``finish`` with the counters advanced once. ``moment_leaves()``: the state's
    moment tensors, one list per moment (``mu``, and ``nu`` for adam/adamw), in the
    parameters' leaf order. What ``fused_update_`` runs in one piece."""

    def __init__(self, optimizer: Any, state: Any, *, inv_scale: float | torch.Tensor = 1.0,
                 impl: str | None = None) -> None:
        form = getattr(optimizer, "fused", None)
        if not isinstance(form, FusedForm):
            raise ValueError(
                "fused_update_: this optimizer has no fused form (adamw, adam and lion have one); "
                "use optimizer.update and apply_updates"
            )
        sched = state[-1]
        if not isinstance(sched, ScaleByScheduleState):
            raise ValueError("fused_update_: the state was not made by this optimizer's init")
        self.form, self.state, self.impl = form, state, impl
        self.inv_scale = float(inv_scale) if isinstance(inv_scale, torch.Tensor) else inv_scale
        self.lr = float(get_lr_schedule(optimizer)(sched.count))
        self.device = sched.count.device
        moments = state[form.moments]
        self.count = moments.count + 1 if form.kind in ("adamw", "adam") else None

    def moment_leaves(self) -> list[list[torch.Tensor]]:
        moments = self.state[self.form.moments]
        if self.form.kind in ("adamw", "adam"):
            return [optree.tree_leaves(moments.mu), optree.tree_leaves(moments.nu)]
        return [optree.tree_leaves(moments.mu)]

    def run(self, p: list[torch.Tensor], g: list[torch.Tensor], moments: list[list[torch.Tensor]],
            decay: list[bool] | None = None, *, check_finite: bool = False) -> torch.Tensor:
        """The kernel on these leaves (pieces), in place; ``decay``: per piece, whether the
        weight decay applies (None: all). Returns found_inf (with ``check_finite``)."""
        h, form = self.form.hyper, self.form
        groups = [(list(range(len(p))), h["weight_decay"])] if decay is None or all(decay) else \
            [(idx, wd) for idx, wd in (([i for i, d in enumerate(decay) if d], h["weight_decay"]),
                                       ([i for i, d in enumerate(decay) if not d], 0.0)) if idx]
        found = None
        for idx, wd in groups:
            ps, gs = [p[k] for k in idx], [g[k] for k in idx]
            ms = [[xs[k] for k in idx] for xs in moments]
            if form.kind in ("adamw", "adam"):
                f = _in_groups(gs, check_finite, lambda i, j, gg, ps=ps, ms=ms, wd=wd: fused_optim.fused_adamw_(
                    ps[i:j], gg, ms[0][i:j], ms[1][i:j], lr=self.lr, beta1=h["b1"], beta2=h["b2"], eps=h["eps"],
                    weight_decay=wd, step=int(self.count), decoupled=form.kind == "adamw",
                    inv_scale=self.inv_scale, check_finite=check_finite, impl=self.impl))
            elif form.kind == "lion":
                f = _in_groups(gs, check_finite, lambda i, j, gg, ps=ps, ms=ms, wd=wd: fused_optim.fused_lion_(
                    ps[i:j], gg, ms[0][i:j], lr=self.lr, beta1=h["b1"], beta2=h["b2"], weight_decay=wd,
                    inv_scale=self.inv_scale, check_finite=check_finite, impl=self.impl))
            else:  # pragma: no cover - FusedForm is only built below
                raise NotImplementedError(form.kind)
            found = f if found is None else found | f
        if found is None:
            return torch.zeros((), dtype=torch.bool, device=self.device)
        return found.to(self.device)

    def finish(self, found: torch.Tensor | None = None) -> tuple:
        """The new state: the moments as they are (updated in place), the counters
        advanced unless ``found`` (found_inf) is true."""
        found = torch.zeros((), dtype=torch.bool, device=self.device) if found is None else found.to(self.device)
        out = list(self.state)
        moments = out[self.form.moments]
        if self.count is not None:
            out[self.form.moments] = type(moments)(torch.where(found, moments.count, self.count), *moments[1:])
        sched = out[-1]
        out[-1] = ScaleByScheduleState(torch.where(found, sched.count, sched.count + 1))
        return tuple(out)


def _in_groups(grads: list[torch.Tensor], check_finite: bool, run: Any) -> torch.Tensor:
    """``run(i, j, contiguous grads[i:j])`` over all leaves; its found-inf flags or'ed.

    Gradients are temporaries: a strided one (an einsum's transpose, a slice of a
    virtual-mesh bucket) is copied, not rejected. Without the finite check (nothing to
    leave untouched when one is inf) the leaves go in groups, so that the copies of one
    group at a time are alive (a quarter of the gradients, or the largest) rather than a
    copy of every gradient."""
    if check_finite or all(x.is_contiguous() for x in grads):
        return run(0, len(grads), [x.contiguous() for x in grads])
    # Elements copied per group: a quarter of the gradients, at least the largest leaf.
    budget = max(max(x.numel() for x in grads), sum(x.numel() for x in grads) // 4)
    found, i = None, 0
    while i < len(grads):
        j, copied = i, 0
        while j < len(grads) and (j == i or copied + (0 if grads[j].is_contiguous()
                                                        else grads[j].numel()) <= budget):
            copied += 0 if grads[j].is_contiguous() else grads[j].numel()
            j += 1
        f = run(i, j, [x.contiguous() for x in grads[i:j]])
        found = f if found is None else found | f
        i = j
    return found
