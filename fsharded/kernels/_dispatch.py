"""Which implementation of a kernel runs: Triton, the C++ extension, or the torch reference.

Every kernel in :mod:`fsharded.kernels` has a pure-torch reference beside it. ``choose``
decides per call:

- ``impl`` argument (``"auto"``/``None``, ``"triton"``, ``"cpp"``, ``"reference"``) wins;
- else the environment variable ``FSHARDED_KERNELS`` (same values; ``reference`` forces the
  reference everywhere, for debugging numerics; ``cpp`` applies to the kinds that have a
  C++ form, the others choose automatically);
- else ``auto``: Triton when every tensor is on CUDA and Triton imports; the C++ extension
  for kinds that have one (the CPU optimizer) when the tensors are on CPU and it builds;
  the reference otherwise.

Asking for an implementation that cannot run (``triton`` on CPU tensors without
``TRITON_INTERPRET=1``, ``cpp`` without a compiler) raises a ``RuntimeError`` that says why,
instead of silently running something else.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

__all__ = ["IMPLS", "choose", "triton_available", "triton_interpreting", "forced"]

IMPLS = ("auto", "triton", "cpp", "reference")
ENV = "FSHARDED_KERNELS"


def forced() -> str:
    """The implementation ``FSHARDED_KERNELS`` forces (``"auto"`` when unset)."""
    value = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if value not in IMPLS:
        raise ValueError(f"{ENV}={value!r}: expected one of {', '.join(IMPLS)}")
    return value


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _triton_importable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install counts as absent
        return False
    return True


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether Triton kernels can run on tensors of ``device`` (CUDA, or CPU under the
    interpreter)."""
    if not _triton_importable():
        return False
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type == "cuda":
        return torch.cuda.is_available() or triton_interpreting()
    return dev.type == "cpu" and triton_interpreting()


def _devices(tensors) -> set[str]:
    return {t.device.type for t in tensors if isinstance(t, torch.Tensor)}


def choose(kind: str, *tensors: torch.Tensor, impl: str | None = None, cpp: bool = False) -> str:
    """Pick ``"triton"``, ``"cpp"`` or ``"reference"`` for kernel ``kind`` on ``tensors``.

    ``cpp=True`` says the kind has a C++ CPU implementation (``fsharded.kernels.cpu_optim``
    decides whether it builds).
    """
    want = (impl or "auto").lower()
    if want not in IMPLS:
        raise ValueError(f"{kind}: impl={impl!r}, expected one of {', '.join(IMPLS)}")
    if want == "auto":
        want = forced()
        if want == "cpp" and not cpp:
            # FSHARDED_KERNELS=cpp forces the C++ optimizer; kernels without a C++ form
            # keep their automatic choice.
            want = "auto"
    devices = _devices(tensors)
    if want == "reference":
        return "reference"
    if want == "triton":
        dev = "cuda" if devices == {"cuda"} else ("cpu" if devices == {"cpu"} else None)
        if dev is None or not triton_available(dev):
            why = (
                "Triton is not installed"
                if not _triton_importable()
                else f"tensors are on {sorted(devices) or 'no device'}; Triton runs on CUDA, "
                "or on CPU with TRITON_INTERPRET=1 set before fsharded.kernels is used"
            )
            raise RuntimeError(f"{kind}: impl='triton' requested but {why}")
        return "triton"
    if want == "cpp":
        if not cpp:
            raise RuntimeError(f"{kind}: there is no C++ implementation; use 'triton' or 'reference'")
        if devices - {"cpu"}:
            raise RuntimeError(f"{kind}: the C++ implementation runs on CPU tensors, got {sorted(devices)}")
        from . import cpu_optim

        cpu_optim.load(required=True)  # raises with the build error
        return "cpp"
    # auto
    if devices == {"cuda"} and _triton_importable():
        return "triton"
    if cpp and devices <= {"cpu"}:
        from . import cpu_optim

        if cpu_optim.load(required=False) is not None:
            return "cpp"
    return "reference"
