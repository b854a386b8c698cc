"""The ``remat`` section of a training config: which blocks are recomputed in backward."""

from __future__ import annotations

from dataclasses import dataclass

from fsharded.parallel.remat import policy

__all__ = ["RematConfig"]


@dataclass(frozen=True)
class RematConfig:
    """Activation checkpointing of the model's blocks (``train_step(remat=...)``,
    ``fsharded.parallel.remat.Blocks``): the recomputed blocks keep only their inputs
    between forward and backward, and run again in backward, with the same numbers."""

    policy: str = "none"
    """``none``, ``blocks`` (every block) or ``blocks:K`` (every K-th block), either with
    ``,dots`` (selective: the matrix products' outputs kept, only the element-wise ops
    recomputed; ``selective`` is ``blocks,dots``) and/or ``,offload`` (the recomputed
    blocks' inputs kept in host memory), or ``budget:SIZE`` (the least recomputation that
    fits SIZE per device, e.g. ``budget:8GiB``)."""

    def __post_init__(self) -> None:
        try:
            if not isinstance(self.policy, str):
                raise ValueError(self.policy)
            policy(self.policy)
        except ValueError:
            raise ValueError(f"invalid RematConfig:\n  remat.policy: expected none, blocks or blocks:K (every K-th "
                             f"block), either with ,dots and/or ,offload, selective, or budget:SIZE, got {self.policy!r}") from None
