"""Pieces of ``fsharded train``'s step loop: whether it compiles its step, calling the
step, and the progress shown.

``compile`` is true, false or ``"auto"``. ``"auto"`` (the default) compiles where it applies and pays:

- the job runs at least ``AUTO_MIN_STEPS`` steps: capturing and compiling costs seconds
  once (about 6 s for the default job from Inductor's cache on 2 CPU cores, 35 s the first
  time), which a short job (a smoke test, a debugging run) does not earn back;
- Inductor can generate code here: a C++ compiler on CPU, Triton with CUDA;
- the layout captures as one graph (an optimizer state in a memory tier streams through
  host buffers between the step's ops: eager).

Under torchrun every rank decides, and the ranks compile only if all of them would.
In one process, a capture that fails under ``"auto"`` (one not built for the layout, a
C++ toolchain that does not work) runs the job eagerly, said once; on real ranks, and
asked for with ``compile=true``, it is the error (which says to pass ``--no-compile``):
a rank cannot fall back alone while its peers run the graph.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AUTO_MIN_STEPS", "inductor_missing", "decide", "call", "Progress"]

AUTO_MIN_STEPS = 200


def inductor_missing() -> str | None:
    """Why Inductor cannot generate code on this machine (None: it can)."""
    if torch.cuda.is_available():
        from torch.utils._triton import has_triton

        return None if has_triton() else "Triton is not installed"
    try:
        from torch._inductor import cpp_builder

        cpp_builder.get_cpp_compiler()
    except Exception as e:  # noqa: BLE001 - any failure to find one means no compile here
        return f"no C++ compiler for Inductor ({type(e).__name__})"
    return None


def decide(cfg: Any, steps: int, *, distributed: bool = False) -> tuple[bool, str]:
    """``(compile the step, why not)`` for a job of ``cfg`` running ``steps`` steps
    (``distributed``: under torchrun, where every rank calls this and they agree)."""
    if cfg.compile is True:
        return True, ""
    if cfg.compile is False:
        return False, "compile=false"
    why = ""
    if steps < AUTO_MIN_STEPS:
        why = f"{steps} steps, fewer than the {AUTO_MIN_STEPS} compile=auto compiles for"
    elif cfg.offload.active:
        why = "the optimizer state is in a memory tier"
    else:
        why = inductor_missing() or ""
    if distributed:  # compiled only if every rank would compile
        flag = torch.tensor([0 if why else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not why and not int(flag):
            why = "another rank cannot compile here"
    return not why, why


def _capture_failed(e: BaseException) -> bool:
    """Whether ``e`` is the step's capture or compile failing (not the step's own error)."""
    return isinstance(e, NotImplementedError) or (isinstance(e, RuntimeError) and "(compile=True)" in str(e))


def call(step: Any, state: Any, batch: Any, *, auto: bool, main_rank: bool,
         distributed: bool = False) -> tuple[Any, dict]:
    """``step(state, batch)``; in one process under ``compile=auto``, a capture that fails
    runs the job eagerly from then on (said once) instead of stopping it."""
    try:
        return step(state, batch)
    except (NotImplementedError, RuntimeError) as e:
        if not (auto and step.compiling and not distributed and _capture_failed(e)):
            raise
        if main_rank:
            print(f"fsharded train: compile=auto: running eagerly ({str(e).splitlines()[0]})", flush=True)
        step.eager()
        return step(state, batch)


class Progress:
    """tqdm on a terminal, a plain log line every ``every`` steps otherwise."""

    def __init__(self, total: int, mode: str, every: int, enabled: bool):
        self.every, self.enabled, self.bar = every, enabled, None
        tty = sys.stderr.isatty()
        if enabled and (mode == "on" or (mode == "auto" and tty)):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="step", dynamic_ncols=True)
            except ImportError:
                self.bar = None

    def update(self, step: int, rec: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:,.0f}")
        elif step % self.every == 0 or step == 1:
            print(f"step {step:5d}  loss {rec['loss']:.4f}  lr {rec.get('lr', float('nan')):.2e}  "
                  f"grad_norm {rec['grad_norm']:.3f}  {rec['tokens_per_s']:,.0f} tok/s"
                  + (f"  MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else ""), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
