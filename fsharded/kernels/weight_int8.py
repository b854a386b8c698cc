"""Int8 weight-only matrix products: ``x @ W`` with ``W`` stored as int8 and a scale per
output channel, or per group of input rows and output channel.

``quantize_weight(w, group_size)`` takes a weight ``w`` ``(K, N)`` (``x @ w`` maps ``K``
features to ``N``) and returns ``q`` ``(N, K)`` int8 (each output channel's weights
contiguous) and ``scales`` ``(N, K // group_size)`` fp32, symmetric absmax: for each
output channel ``n`` and group ``g`` of ``group_size`` consecutive input rows,
``scale = absmax(w[g, n]) / 127`` and ``q = round(w / scale)`` (round half to even, in
[-127, 127]; an all-zero group gets scale 0). ``group_size=None`` is one group of all
``K``: a scale per output channel. ``dequantize_weight`` gives ``q * scale`` back as
``(K, N)``; each element is within ``scale / 2`` (plus fp32 rounding) of ``w``.

``int8_matmul(x, q, scales)`` is ``x @ dequantize_weight(q, scales)`` for ``x``
``(..., K)`` in fp32, bf16 or fp16, in ``x``'s dtype, the weights dequantized inside the
product (never written out whole):

- ``triton`` (CUDA, or CPU under ``TRITON_INTERPRET=1``): tiles of ``x`` and of ``q``,
  each ``q`` tile scaled in registers by its group's scales, accumulated in fp32;
- ``cpp`` (CPU tensors, up to ``CPP_ROWS`` rows of ``x``: decoding): fsharded's C++
  product (``csrc/int8_matmul.cpp``), each output channel's int8 row read once for every
  row of ``x``, the inner loop vectorised for AVX-512 / AVX2 (chosen at load time),
  fp32 accumulation, output channels across the threads; built on first use, the packed
  or reference product where no compiler is present;
- ``cpu`` (CPU tensors, one scale per output channel, ``K`` a multiple of 16: other
  ``K`` give wrong values in torch 2.13's kernel): ATen's packed int8 product
  (``aten._weight_int8pack_mm``, as torchao and gpt-fast use on CPU), whose scales are in
  ``x``'s dtype (a bf16 scale rounds to 8 bits: within ``2**-9`` of the fp32 one);
- ``reference``: the weights dequantized in fp32 and multiplied in fp32, cast to ``x``'s
  dtype (the ground truth the tests hold the others to).

By default Triton on CUDA; on CPU the C++ product for up to ``CPP_ROWS`` rows, the packed
product for more where it applies, the reference otherwise; ``impl=`` or ``FSHARDED_KERNELS`` choose (``kernels._dispatch``). It is a
custom op (``torch.ops.fsharded.int8_matmul``; the C++ product ``torch.ops.fsharded_cpu.int8_matmul``,
registered in C++) with fake and vmap rules, so it traces. It takes
no gradient: the weights are frozen integers.

>>> w = torch.randn(64, 32)
>>> q, s = quantize_weight(w)
>>> q.shape, s.shape
(torch.Size([32, 64]), torch.Size([32, 1]))
>>> x = torch.randn(3, 64)
>>> bool(((int8_matmul(x, q, s) - x @ w).abs() < 0.1).all())
True
"""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from fsharded import _cext
from fsharded.kernels import _dispatch
from fsharded.kernels.quant import _quant_rows_ref

__all__ = ["quantize_weight", "dequantize_weight", "int8_matmul", "int8_matmul_reference", "rows_matmul"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _groups(K: int, group_size: int | None, op: str) -> int:
    G = K if group_size is None else group_size
    if not isinstance(G, int) or isinstance(G, bool) or G < 1 or K % G:
        raise ValueError(f"{op}: group_size={group_size!r} must be a positive divisor of the {K} input "
                         f"features (or None: a scale per output channel)")
    return G


def quantize_weight(w: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``(K, N)`` -> ``q`` ``(N, K)`` int8 and ``scales`` ``(N, K // group_size)`` fp32."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.dtype not in _FLOATS:
        raise ValueError(f"quantize_weight: w must be a 2-D float32/bfloat16/float16 tensor (K, N), got "
                         f"{getattr(w, 'dtype', type(w))} {tuple(getattr(w, 'shape', ()))}")
    K = w.shape[0]
    G = _groups(K, group_size, "quantize_weight")
    q, scales = _quant_rows_ref(w.detach().T.contiguous(), G)  # rows: the output channels
    prepare(q)
    return q.contiguous(), scales.contiguous()


def _check(q: torch.Tensor, scales: torch.Tensor, K: int | None, op: str) -> int:
    """The group size of ``q`` ``(N, K)`` and ``scales`` ``(N, K // G)``, checked."""
    if not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.dim() != 2:
        raise ValueError(f"{op}: q must be a 2-D int8 tensor (N, K), got {getattr(q, 'dtype', type(q))} "
                         f"{tuple(getattr(q, 'shape', ()))}")
    N, Kq = q.shape
    if K is not None and K != Kq:
        raise ValueError(f"{op}: x has {K} features but the weight {Kq} (q is (N, K) = {tuple(q.shape)})")
    if (not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32 or scales.dim() != 2
            or scales.shape[0] != N or scales.shape[1] < 1 or Kq % scales.shape[1]):
        raise ValueError(f"{op}: scales must be fp32 (N, K // group_size) = ({N}, a divisor of {Kq}), got "
                         f"{getattr(scales, 'dtype', type(scales))} {tuple(getattr(scales, 'shape', ()))}")
    if q.device != scales.device:
        raise ValueError(f"{op}: q is on {q.device} but scales on {scales.device}")
    return Kq // scales.shape[1]


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale`` as the ``(K, N)`` weight, in ``dtype``."""
    G = _check(q, scales, None, "dequantize_weight")
    N, K = q.shape
    w = q.view(N, K // G, G).float() * scales[:, :, None]
    return w.view(N, K).T.to(dtype)


def int8_matmul_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize_weight(q, scales)`` in fp32, cast to ``x``'s dtype."""
    return (x.float() @ dequantize_weight(q, scales)).to(x.dtype)


CPP_ROWS = 16  # the C++ product up to this many rows of x (decoding); above, the packed or reference product


@functools.cache
def _build() -> tuple[ModuleType | None, str]:
    ops, why = _cext.build("fsharded_int8_matmul", ("int8_matmul.cpp",), root=_cext.CSRC,
                           what="the int8 weight-only CPU product", took="~10 s",
                           extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"],
                           ops_namespace="fsharded_cpu")
    if ops is not None:  # (the op's rules for tracing and for vmap, once it exists)
        torch.library.register_fake("fsharded_cpu::int8_matmul", _fake)
        torch.library.register_vmap("fsharded_cpu::int8_matmul", _vmap_rule(ops.int8_matmul))
        torch.library.register_fake("fsharded_cpu::rows_matmul", _rows_fake)
        torch.library.register_vmap("fsharded_cpu::rows_matmul", _rows_vmap)
    return ops, why


def load(required: bool = False) -> ModuleType | None:
    """The compiled C++ product (built on first use): ``torch.ops.fsharded_cpu``, whose
    ``int8_matmul(x, q, scales)`` is a dispatcher op (no Python between a compiled graph
    and the kernel), or None where it cannot be built (with ``required``, a
    ``RuntimeError`` saying why)."""
    mod, why = _build()
    if mod is None and required:
        raise RuntimeError(f"int8_matmul: the C++ product cannot be built here: {why}")
    return mod


_CPP: list[bool] = []  # whether the C++ product loads, found by the first eager call


def _cpp_available() -> bool:
    if not _CPP:
        if torch.compiler.is_compiling():  # (no build while tracing: a graph traced first takes another product)
            return False
        _CPP.append(load() is not None)
    return _CPP[0]


def prepare(t: torch.Tensor) -> None:
    """Build or load the C++ products now where the weight ``t`` is on the CPU, outside any
    trace: a graph traced later (a compiled decode step) can only call a product that is
    loaded already. Called where int8 weights are made (``quantize_weight``,
    ``fs.inference.Int8Weight``) and before a decode step is compiled."""
    if t.device.type == "cpu" and not torch.compiler.is_compiling():
        _cpp_available()


def _cpp_ok(x: torch.Tensor, q: torch.Tensor) -> bool:
    return x.device.type == "cpu" and q.device.type == "cpu" and x.shape[0] <= CPP_ROWS


def _packed_ok(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> bool:
    # ATen's packed product (torch 2.13, CPU) is right only where K is a multiple of 16:
    # other K give wrong values (K = 36, 100, 168, 180, 200 measured) or a crash (172 at 3 rows).
    return (x.device.type == "cpu" and q.device.type == "cpu" and scales.shape[1] == 1 and q.shape[1] % 16 == 0
            and hasattr(torch.ops.aten, "_weight_int8pack_mm"))


@torch.library.custom_op("fsharded::int8_matmul", mutates_args=())
def _op(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, impl: str) -> torch.Tensor:
    """``x`` (M, K) -> (M, N)."""
    if impl == "triton":
        from fsharded.kernels import _triton_weight_int8

        return _triton_weight_int8.int8_matmul(x, q, scales)
    if impl == "cpp":
        return load(required=True).int8_matmul(x, q, scales)
    if impl == "cpu":
        return torch.ops.aten._weight_int8pack_mm(x.contiguous(), q, scales.view(-1).to(x.dtype))
    return int8_matmul_reference(x, q, scales)


def _cpp(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.fsharded_cpu.int8_matmul(x, q, scales)  # (loaded: the caller checked _cpp_available)


def _fake(x, q, scales, *impl):
    return x.new_empty((x.shape[0], q.shape[0]))


_op.register_fake(_fake)


def _vmap_rule(op):
    """Under ``vmap`` (the virtual mesh's devices): a weight shared by the batch takes every
    batch's rows in one product; weights per batch entry, one product each. ``op(x, q,
    scales, *rest)``."""

    def rule(info, in_dims, x, q, scales, *rest):
        xd, qd, sd = in_dims[:3]
        if qd is None and sd is None:
            xb = x.movedim(xd, 0) if xd is not None else x.expand(info.batch_size, *x.shape)
            y = op(xb.reshape(-1, xb.shape[-1]).contiguous(), q, scales, *rest)
            return y.view(xb.shape[0], xb.shape[1], q.shape[0]), 0

        def pick(t, d, i):
            return t if d is None else t.select(d, i).contiguous()

        return torch.stack([op(pick(x, xd, i), pick(q, qd, i), pick(scales, sd, i), *rest)
                            for i in range(info.batch_size)]), 0
    return rule


_op.register_vmap(_vmap_rule(_op))


ROWS_MAX = 4  # rows_matmul's C++ product takes up to this many rows of x


def _rows_vmap(info, in_dims, x, w):
    """Under vmap: the batch's rows through torch's product (batched weights, or more rows
    than the C++ product takes)."""
    xd, wd = in_dims
    xb = x.movedim(xd, 0) if xd is not None else x
    wb = w.movedim(wd, 0) if wd is not None else w
    return torch.matmul(xb, wb), 0


def _rows_fake(x, w):
    return x.new_empty((x.shape[0], w.shape[1]))


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for a float weight ``w`` ``(K, N)``: where ``x`` ``(..., K)`` is at most
    ``ROWS_MAX`` rows on the CPU (decoding), ``w`` of ``x``'s dtype (fp32 or bf16) and no
    gradient is asked for, fsharded's C++ product (``torch.ops.fsharded_cpu.rows_matmul``:
    ``w``'s rows in fixed blocks of 256, each thread streaming a run of blocks, each block's
    fp32 sums over every column added in block order, so the result does not depend on
    the thread count); torch's product otherwise (also for a weight that is not
    contiguous, which the C++ product would copy). Torch's small-row product reads fp32 weights at about a
    third of this machine's memory bandwidth; a decoded token reads every weight once."""
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if (1 <= x2.shape[0] <= ROWS_MAX and x.device.type == "cpu" and w.device.type == "cpu" and w.dim() == 2
            and w.is_contiguous() and x.dtype == w.dtype and x.dtype in (torch.float32, torch.bfloat16)
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)) and _cpp_available()):
        return torch.ops.fsharded_cpu.rows_matmul(x2, w).view(*x.shape[:-1], w.shape[1])
    return x @ w


def int8_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, impl: str | None = None) -> torch.Tensor:
    """``x`` ``(..., K)`` times the int8 weight ``q`` ``(N, K)`` with ``scales``
    ``(N, K // group_size)``: ``(..., N)`` in ``x``'s dtype (see the module docstring)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _FLOATS:
        raise ValueError(f"int8_matmul: x must be a float32/bfloat16/float16 tensor, got "
                         f"{getattr(x, 'dtype', type(x))}")
    _check(q, scales, x.shape[-1], "int8_matmul")
    if x.device != q.device:
        raise ValueError(f"int8_matmul: x is on {x.device} but the weight on {q.device}")
    if x.requires_grad:
        raise ValueError("int8_matmul: x requires grad, but the int8 product has no gradient rule; it is for "
                         "inference (run it under torch.no_grad())")
    want = (impl or "auto").lower()
    x2 = x.reshape(-1, x.shape[-1])
    if want == "cpu":
        if not _packed_ok(x, q, scales):
            raise RuntimeError("int8_matmul: impl='cpu' runs CPU tensors with one scale per output channel "
                               "(group_size=None) and input features a multiple of 16")
        chosen = "cpu"
    elif want == "cpp":
        if x.device.type != "cpu" or q.device.type != "cpu":
            raise RuntimeError("int8_matmul: impl='cpp' runs CPU tensors")
        if not _cpp_available():
            load(required=True)  # (raises, saying why)
        chosen = "cpp"
    else:
        chosen = _dispatch.choose("int8_matmul", x, q, scales, impl=impl)
        if chosen == "reference" and want == "auto" and _dispatch.forced() in ("auto", "cpp"):
            if _cpp_ok(x2, q) and _cpp_available():
                chosen = "cpp"
            elif _packed_ok(x, q, scales) and _dispatch.forced() == "auto":
                chosen = "cpu"
    lead = x.shape[:-1]
    # The C++ product is a dispatcher op of its own: called straight, a compiled graph holds it.
    y = _cpp(x2, q, scales) if chosen == "cpp" else _op(x2, q, scales, chosen)
    return y.view(*lead, q.shape[0])
