"""Typed, validated training configs (``TrainConfig``), TOML/JSON/CLI overrides, and
DeepSpeed JSON configs read with DeepSpeed's own rules (``from_deepspeed``)."""

from fsharded.config._deepspeed import from_deepspeed
from fsharded.config._train import *  # noqa: F403
from fsharded.config._train import __all__ as _train_all

__all__ = [*_train_all, "from_deepspeed"]
