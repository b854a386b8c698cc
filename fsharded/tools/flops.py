"""FLOPs of a training step, and model FLOPs utilisation (MFU).

``gpt_step_flops(params, batch, seq_len)`` counts the bundled GPT's step analytically from
its parameter tree: every matmul ``2 * m * n * k``, attention's two ``(T, T)`` products per
layer as computed (the full square, as the einsum and SDPA kernels on CPU compute it), and
backward twice the forward (the gradients of both operands of every product). It equals
``torch.utils.flop_counter.FlopCounterMode`` on the same step (``measure_flops``), which
counts only matmul-like ops too. ``mfu(flops, seconds, peak)``: achieved over peak.

>>> params = gpt.init(gpt.GPTConfig.tiny())
>>> gpt_step_flops(params, batch=4, seq_len=32) > 0
True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsharded.models.gpt import _is_moe
from fsharded.parallel.moe import capacity

__all__ = ["gpt_step_flops", "measure_flops", "mfu", "peak_tflops", "PEAK_TFLOPS"]

# Dense peak TFLOP/s by device name (substring, lower case) and dtype, from the vendors'
# data sheets (no sparsity).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "h200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "h100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "a100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "l40s": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
}


def peak_tflops(precision: str, device: Any = None) -> float | None:
    """The table's peak for this CUDA device and compute precision, or None (CPU, or a
    device not in the table: give the peak yourself)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device).lower()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks.get(precision)
    return None


def gpt_step_flops(params: dict, *, batch: int, seq_len: int, moe: Any = None, routing_shards: int = 1,
                   count: str = "model") -> int:
    """FLOPs of one forward + backward of ``fsharded.models.gpt.loss`` on ``batch`` rows of
    ``seq_len`` tokens (the whole step, summed over all devices).

    Mixture-of-experts blocks need their routing config ``moe`` (``GPTConfig.moe``) and the
    number of shards the batch's tokens are routed on (``routing_shards``: the data x
    expert shards; capacity is per shard). Their router is ``2 * tokens * d * E`` forward;
    the experts' rows depend on ``count``: ``"model"`` (the default, what MFU counts) takes
    each token through its ``top_k`` experts, ``k * tokens`` rows; ``"computed"`` takes the
    rows the batched matmuls run, ``E * C`` per shard with the capacity buffer (empty slots
    included) and ``E * T`` on the dropless form's padded buffer (what FlopCounterMode
    sees on CPU)."""
    if count not in ("model", "computed"):
        raise ValueError(f"gpt_step_flops: count must be 'model' or 'computed', got {count!r}")
    tokens = batch * seq_len
    if tokens % routing_shards:
        raise ValueError(f"gpt_step_flops: {tokens} tokens do not split into {routing_shards} routing shards")
    fwd = 0
    for i, p in enumerate(params["blocks"]):
        a = p["attn"]
        H, Dh = a["wq"].shape[1], a["wq"].shape[2]
        for w in ("wq", "wk", "wv", "wo"):
            fwd += 2 * tokens * a[w].numel()
        fwd += 2 * 2 * batch * seq_len * seq_len * H * Dh  # q k^T and p v, the full square
        if _is_moe(p):
            if moe is None:
                raise ValueError(f"gpt_step_flops: block {i} is a mixture of experts; pass its routing "
                                 f"config (moe=GPTConfig.moe) and routing_shards")
            m = p["mlp"]
            E = m["router"].shape[1]
            fwd += 2 * tokens * m["router"].numel()
            per_row = 2 * (m["w1"].numel() + m["w2"].numel()) // E
            ts = tokens // routing_shards
            if count == "model":
                rows = moe.top_k * ts
            elif moe.capacity_factor is None:
                rows = E * ts
            else:
                rows = E * capacity(ts, E, top_k=moe.top_k, capacity_factor=moe.capacity_factor,
                                    min_capacity=moe.min_capacity)
            fwd += routing_shards * rows * per_row
            continue
        for w in ("w_in", "w_out", "w_gate", "w_up", "w_down"):
            if w in p["mlp"]:
                fwd += 2 * tokens * p["mlp"][w].numel()
    fwd += 2 * tokens * (params["head"] if "head" in params else params["emb"]).numel()
    return 3 * fwd


def measure_flops(fn: Callable[..., torch.Tensor], *args: Any, backward: bool = True, **kwargs: Any) -> int:
    """FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts for ``fn(*args)`` and, with
    ``backward``, the backward of its (scalar) result with respect to every input that
    requires grad."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = fn(*args, **kwargs)
        if backward:
            out.backward()
    return int(counter.get_total_flops())


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops / seconds`` over ``peak`` TFLOP/s (None without a peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / (peak * 1e12)
