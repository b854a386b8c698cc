"""Loss scaling as a piece of the step: ``NoScaling`` (fp32 / bf16) or ``DynamicScaling``
(fp16: unscale, the finite check every shard agrees on, skip-or-apply)."""

from __future__ import annotations

from typing import Any

import torch

from fsharded.precision import all_finite, tree_where, unscale
from fsharded.spmd.collectives import is_bound

__all__ = ["NoScaling", "DynamicScaling"]


class NoScaling:
    """fp32 / bf16: the loss is differentiated as is and every step is applied."""

    def scale(self, loss: torch.Tensor, state: Any) -> torch.Tensor:
        return loss

    def unscale(self, grads: Any, state: Any) -> Any:
        return grads

    def finite(self, grads: Any, axes: tuple[str, ...]) -> Any:
        return None

    def select(self, finite: Any, new: tuple, old: tuple, state: Any) -> tuple[tuple, Any, dict]:
        return new, None, {"loss_scale": torch.ones(()), "skipped": torch.zeros((), dtype=torch.int64)}

    def applied(self, step: torch.Tensor, state: Any) -> torch.Tensor:
        return step


class DynamicScaling:
    """fp16: the loss is multiplied by the scale, gradients divided by it; a step whose
    gradients overflowed on any shard is skipped by every shard (the old parameters and
    optimizer state are kept, as in DeepSpeed), and the scale adapts (``scaler.update``)."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def scale(self, loss: torch.Tensor, state: Any) -> torch.Tensor:
        return loss * state.scale

    def unscale(self, grads: Any, state: Any) -> Any:
        return unscale(grads, state, dtype=None)

    def finite(self, grads: Any, axes: tuple[str, ...]) -> torch.Tensor:
        bound = tuple(a for a in axes if is_bound(a))  # none outside shard_map: this process's verdict
        return all_finite(grads, axis=bound or None)

    def select(self, finite: torch.Tensor, new: tuple, old: tuple, state: Any) -> tuple[tuple, Any, dict]:
        kept = tuple(tree_where(finite, n, o) for n, o in zip(new, old))
        new_state = self.scaler.update(state, finite)
        return kept, new_state, {"loss_scale": state.scale, "skipped": new_state.skipped}

    def applied(self, step: torch.Tensor, state: Any) -> torch.Tensor:
        # Skipped (overflowed) steps do not advance the schedule, as in DeepSpeed.
        return step - state.skipped
