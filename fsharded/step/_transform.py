"""The gradient transformation a step runs between its gradients and its update, composed
once when the plan is built (``GradientTransform``, made by ``TrainStep._plan``):

    unscale (the loss scale's: ``_scaling``) -> the parameters' dtypes
    -> the mesh-aware global norm -> the clipping factor -> the finite verdict (fp16)

The transformation does not multiply the gradients by the clipping factor: it hands the
factor to the update (``_update``), which applies it where it touches the gradients anyway
(the fused kernels as they load them, ``inv_scale``; the functional form in one multiply per
leaf before the optimizer). ``optim.clip_by_global_norm`` as a link of the optimizer's chain
would cost a pass over the gradients the fused kernels do not need, and a second norm: the
step's norm is the one ``metrics["grad_norm"]`` reports, computed once, one reduction per
set of mesh axes the leaves are sharded over (``optim.global_norm``).

>>> import torch
>>> from fsharded import P
>>> from fsharded.step._scaling import NoScaling
>>> tx = GradientTransform(NoScaling(), ClipByGlobalNorm(1.0), specs=[P()], axes=())
>>> out = tx([torch.tensor([3.0, 4.0])], [torch.zeros(2)], None)
>>> float(out.norm), round(float(out.factor), 4), out.finite
(5.0, 0.2, None)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import optree
import torch

from fsharded import optim
from fsharded.spmd.collectives import psum

__all__ = ["Transformed", "NoClip", "ClipByGlobalNorm", "GradientTransform"]


class Transformed(NamedTuple):
    """What the transformation hands the update and the metrics."""

    grads: Any  # unscaled, each in its parameter's dtype (not yet multiplied by ``factor``)
    norm: torch.Tensor  # 0-d: their global norm (the same on every shard)
    factor: torch.Tensor | None  # 0-d clipping factor (<= 1) for the update; None: no clipping
    finite: torch.Tensor | None  # fp16: every shard's verdict on the gradients; else None


class NoClip:
    """No clipping: the update takes the gradients as they are."""

    def factor(self, norm: torch.Tensor) -> None:
        return None


class ClipByGlobalNorm:
    """Clip to ``max_norm`` of the global norm (``optim.clip_factor``, as
    ``torch.nn.utils.clip_grad_norm_`` and DeepSpeed's ``gradient_clipping``)."""

    def __init__(self, max_norm: float) -> None:
        if not max_norm > 0:
            raise ValueError(f"train_step: clip must be a positive max norm or None, got {max_norm!r}")
        self.max_norm = max_norm

    def factor(self, norm: torch.Tensor) -> torch.Tensor:
        return optim.clip_factor(norm, self.max_norm)


class GradientTransform:
    """``(grads, params, loss_scale) -> Transformed`` on one shard: the pieces chosen for a
    state layout (``scaling``: ``_scaling.NoScaling`` or ``DynamicScaling``; ``clip``:
    ``NoClip`` or ``ClipByGlobalNorm``). ``specs``: one spec per gradient leaf (their
    master placement), so the norm counts every element once; ``axes``: the mesh axes fp16's
    finite verdict is agreed over. ``partial``: None, or ``(axis, counted)`` where each
    process holds some of the leaves along ``axis`` (per-stage storage, ``_held``): its
    part of the squared norm (the leaves ``counted`` marks) is summed over that axis."""

    def __init__(self, scaling: Any, clip: NoClip | ClipByGlobalNorm, specs: list, axes: tuple[str, ...],
                 partial: tuple[str, list[bool]] | None = None) -> None:
        self.scaling, self.clip, self.specs, self.axes = scaling, clip, specs, axes
        self.partial = partial

    def __call__(self, grads: Any, params: Any, loss_scale: Any) -> Transformed:
        grads = self.scaling.unscale(grads, loss_scale)
        grads = optree.tree_map(lambda g, p: g if g.dtype == p.dtype else g.to(p.dtype), grads, params)
        if self.partial is None:
            norm = optim.global_norm(grads, flat_specs=self.specs)
        else:
            axis, counted = self.partial
            mine = [g for g, c in zip(optree.tree_leaves(grads), counted) if c]
            sq = optim.global_sq_norm(mine, flat_specs=[s for s, c in zip(self.specs, counted) if c])
            norm = torch.sqrt(psum(sq, axis))
        return Transformed(grads, norm, self.clip.factor(norm), self.scaling.finite(grads, self.axes))

