"""``fsharded train`` with a ``pipe`` mesh axis: the bundled GPT cut into stages and run as
a pipelined loss (``fsharded.parallel.pipeline.pipelined``) under ``cfg.pipeline``'s schedule."""

from __future__ import annotations

import warnings
from typing import Any

from fsharded.mesh import Mesh
from fsharded.models import gpt_stages
from fsharded.parallel.pipeline import pipelined

__all__ = ["pipeline_loss"]


def pipeline_loss(cfg: Any, mesh: Mesh, mcfg: Any, params: Any, seq: Any) -> Any:
    """The job's loss as a pipeline over ``pipe``, or None without that axis. The
    micro-batches are the job's accumulation (``cfg.grad_accum_steps``)."""
    if "pipe" not in mesh.shape:
        return None
    if seq.n > 1 or seq.megatron:
        raise NotImplementedError("fsharded train: a pipe axis with sequence parallelism is not supported yet; "
                                  "pipe composes with data (and ZeRO-1/2) and tensor for now")
    if mcfg.moe is not None:
        raise NotImplementedError("fsharded train: a pipe axis with a mixture-of-experts GPT is not supported yet")
    p, v = mesh.shape["pipe"], cfg.pipeline.stages_per_rank
    if p * v > mcfg.n_layers:
        raise ValueError(f"fsharded train: pipe={p} x {v} stages per rank = {p * v} stages, but the model has "
                         f"{mcfg.n_layers} blocks; use a smaller pipe axis or --set model.n_layers={p * v}")
    if cfg.grad_accum_steps < p:
        warnings.warn(f"fsharded train: pipe={p} with {cfg.grad_accum_steps} micro-batch(es) per step keeps "
                      f"most ranks idle (the bubble of 1F1B is (p-1)/(m+p-1)); give more, e.g. "
                      f"--set pipeline.microbatches={4 * p}", stacklevel=2)
    stages = gpt_stages.pipeline_stages(params, p * v)
    return pipelined(stages, schedule=cfg.pipeline.schedule, microbatches=cfg.grad_accum_steps, virtual=v)
