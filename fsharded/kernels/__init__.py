"""Triton and C++/CUDA kernels, each with a pure-torch reference beside it.

=====================  ==========================================  =====================
kernel                 functions                                   implementations
=====================  ==========================================  =====================
fused optimizers       ``fused_adamw_``, ``fused_adam_``,           Triton (CUDA), C++
                       ``fused_lion_``, ``fused_adagrad_``          (CPU), reference
norms                  ``layer_norm``, ``rms_norm``                 Triton, reference
cross-entropy          ``cross_entropy`` (vocab-parallel with       Triton, reference
                       ``axis=``)
flash attention        ``flash_attention``,                         Triton, reference
                       ``flash_attention_with_lse``,
                       ``merge_attention``
int8 quantisation      ``quantize_int8``, ``dequantize_int8``,      Triton, reference
                       ``quantized_all_gather``,
                       ``quantized_psum_scatter``
int8 weight-only       ``int8_matmul``, ``quantize_weight``,        Triton, CPU packed
                       ``dequantize_weight``                        (ATen), reference
=====================  ==========================================  =====================

Every function takes ``impl=`` (``"auto"``, ``"triton"``, ``"cpp"``, ``"reference"``);
``FSHARDED_KERNELS=reference`` forces the references everywhere (see ``_dispatch``). By
default Triton runs on CUDA tensors, the C++ optimizer on CPU tensors (built on first use;
the reference when no compiler is present) and the reference elsewhere. The Triton
kernels are PyTorch custom ops (``torch.ops.fsharded.*``) with fake, autograd and vmap
rules, so they work under ``torch.func.grad``, the virtual mesh's ``vmap`` and
``make_fx``.

Importing this package never imports Triton or builds anything.
"""

from __future__ import annotations

import importlib
from typing import Any

from fsharded.kernels._dispatch import choose, forced, triton_available

_EXPORTS = {
    "fused_adamw_": "fused_optim",
    "fused_adam_": "fused_optim",
    "fused_lion_": "fused_optim",
    "fused_adagrad_": "fused_optim",
    "layer_norm": "norm",
    "rms_norm": "norm",
    "cross_entropy": "losses",
    "flash_attention": "attention",
    "flash_attention_with_lse": "attention",
    "merge_attention": "attention",
    "quantize_int8": "quant",
    "dequantize_int8": "quant",
    "quantized_all_gather": "quant",
    "quantized_psum_scatter": "quant",
    "int8_matmul": "weight_int8",
    "quantize_weight": "weight_int8",
    "dequantize_weight": "weight_int8",
}

__all__ = ["choose", "forced", "triton_available", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fsharded.kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fsharded.kernels.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
