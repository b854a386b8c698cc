"""DeepSpeed features fsharded does not have yet, as a table read by ``from_deepspeed``.

A config that turns one on (``zero_optimization.zero_quantized_weights: true``,
``flops_profiler.enabled: true``...) is refused unless ``allow_ignored=True``
(``fsharded train --allow-ignored``): the run would otherwise go on without what was asked
for, and an offload that never happened is found out only when memory runs short. At
their off values (DeepSpeed's defaults: ``"device": "none"``, ``false``, ``null``) these
keys are read without a word. Pure performance knobs are not here: ``_DS_QUIET`` in
``_deepspeed.py`` reads them quietly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

__all__: list[str] = []


class _Feature(NamedTuple):
    """One key that switches a DeepSpeed feature on, and the keys read along with it."""

    key: str
    """The switch's dotted path."""
    tp: Any
    """Its type (a wrong one is a type error, as for every key read)."""
    off: Callable[[Any], bool]
    """True for the values that leave the feature off (an absent key is off)."""
    what: str
    """What DeepSpeed does with it on, and what fsharded does (or offers) instead."""
    with_it: tuple[str, ...] = ()
    """Keys of the same block read with the switch (quiet whatever their value: they
    mean nothing while it is off, and it is named when on); ``("*",)``: the whole block."""


def _false(v: Any) -> bool:
    return v is None or v is False


_ZERO = "zero_optimization."
_ZPP_WHAT = ("ZeRO++ quantized communication: fsharded gathers and reduces at full precision "
             "(communication_data_type sets the reduction's dtype)")

FEATURES: tuple[_Feature, ...] = (
    *(_Feature(_ZERO + k, bool, _false, _ZPP_WHAT) for k in (
        "zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")),
    _Feature("flops_profiler.enabled", bool, _false,
             "DeepSpeed's per-module FLOPs and latency profile at profile_step: fsharded train's "
             "summary gives the model FLOPs per step, TFLOP/s and MFU (--peak-tflops); "
             "fsharded.flops.measure_flops counts any step",
             ("profile_step", "module_depth", "top_modules", "detailed", "output_file",
              "recompute_fwd_factor")),
    _Feature("amp.enabled", bool, _false,
             "NVIDIA Apex mixed precision: use \"bf16\" or \"fp16\": {\"enabled\": true}", ("*",)),
    _Feature("torch_autocast.enabled", bool, _false,
             "the forward under torch.autocast: use \"bf16\" or \"fp16\": {\"enabled\": true}", ("*",)),
    _Feature("elasticity.enabled", bool, _false,
             "batch sizes chosen from the GPUs available (elastic training): fsharded uses the "
             "batch sizes given", ("*",)),
    _Feature("quantize_training.enabled", bool, _false,
             "weights quantized during training (MoQ): fsharded trains at full precision", ("*",)),
    _Feature("curriculum_learning.enabled", bool, _false,
             "a sequence-length curriculum: fsharded trains at the full --seq-len from step 1", ("*",)),
    _Feature("data_efficiency.enabled", bool, _false,
             "curriculum data sampling and random layer-token drop: fsharded samples uniformly and "
             "runs every token through every layer", ("*",)),
    _Feature("progressive_layer_drop.enabled", bool, _false,
             "layers dropped at random, more as training goes on: fsharded runs every layer", ("*",)),
)
"""Each key with real effect that fsharded cannot honour, switched on by any value but its
off ones."""

CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {}

HOW_TO_RUN = (
    "To train without them, set them off (\"device\": \"none\", \"enabled\": false, or remove the "
    "keys), or pass allow_ignored=True (fsharded train --allow-ignored) to have them ignored with a "
    "warning naming them."
)
