"""``fsharded train`` with a ``pipe`` mesh axis: the bundled GPT cut into stages and run as
a pipelined loss (``fsharded.parallel.pipeline.pipelined``) under ``cfg.pipeline``'s schedule."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from fsharded.mesh import Mesh
from fsharded.models import gpt_stages
from fsharded.parallel.pipeline import pipelined
from fsharded.step import _estimate as _memory

__all__ = ["pipeline_loss", "check_fits_pipelined"]


def pipeline_loss(cfg: Any, mesh: Mesh, mcfg: Any, params: Any, seq: Any) -> Any:
    """The job's loss as a pipeline over ``pipe``, or None without that axis. The
    micro-batches are the job's accumulation (``cfg.grad_accum_steps``)."""
    if "pipe" not in mesh.shape:
        return None
    p, v = mesh.shape["pipe"], cfg.pipeline.stages_per_rank
    if p * v > mcfg.n_layers:
        raise ValueError(f"fsharded train: pipe={p} x {v} stages per rank = {p * v} stages, but the model has "
                         f"{mcfg.n_layers} blocks; use a smaller pipe axis or --set model.n_layers={p * v}")
    if cfg.grad_accum_steps < p:
        warnings.warn(f"fsharded train: pipe={p} with {cfg.grad_accum_steps} micro-batch(es) per step keeps "
                      f"most ranks idle (the bubble of 1F1B is (p-1)/(m+p-1)); give more, e.g. "
                      f"--set pipeline.microbatches={4 * p}", stacklevel=2)
    kw = getattr(seq.loss, "keywords", {})  # the job's sequence parallelism, as its loss takes it
    stages = gpt_stages.pipeline_stages(params, p * v, seq_axis=kw.get("seq_axis"),
                                        seq_parallel=kw.get("seq_parallel", "ulysses"),
                                        seq_layout=kw.get("seq_layout", "contiguous"), moe=mcfg.moe)
    return pipelined(stages, schedule=cfg.pipeline.schedule, microbatches=cfg.grad_accum_steps, virtual=v)


def check_fits_pipelined(cfg: Any, mcfg: Any, mesh: Mesh, specs: Any, dist_on: bool, seq: Any, piped: Any, meta: Any,
                         state: Any, kw: dict, what: str, optimizer: Any) -> None:
    """``fsharded train``'s memory check with a pipe axis: on real ranks the rank that
    needs most, its own stages' state and its schedule's bound of micro-batches held times
    one micro-batch of its stages (``estimate_memory`` of the pipelined loss); the virtual
    mesh's process holds the whole state (``state``) and every rank's and every data
    shard's activations."""
    rows = cfg.micro_batch_size * cfg.grad_accum_steps * cfg.data_parallel_size  # the step's batch
    batch = {"tokens": torch.empty((rows, mcfg.seq_len + 1), dtype=torch.int64, device="meta")}
    try:
        if dist_on:
            est = _memory.estimate_memory(meta, specs, optimizer, precision=cfg.policy(), mesh=mesh, loss=piped,
                                          batch=batch, batch_spec=seq.batch_spec, blocks="blocks")
            need, acts = est.total, est.activations
        else:
            per_rank = _memory.pipeline_activations(piped, meta, _memory.placement_of(specs, meta, mesh), mesh,
                                                    cfg.policy(), batch, seq.batch_spec)
            # (the virtual mesh's process: every pipe rank's, times every device of each)
            acts = sum(per_rank) * (mesh.size // mesh.shape["pipe"])
            need = state.total + acts
    except Exception as e:  # noqa: BLE001 - the state alone was checked
        warnings.warn(f"fsharded train: the memory check counted the state only: the activations could "
                      f"not be measured ({type(e).__name__}: {e})", stacklevel=4)
        return
    more = (f"fewer micro-batches held at once (pipeline.schedule=1f1b holds at most pipe of them; now "
            f"{cfg.pipeline.schedule}, {acts / 2**30:,.2f} GiB of activations)", "a smaller --batch")
    _memory.check_fits(need, what=what.replace("the training state", "the training state and the "
                                                             "pipeline's activations"), hints=more, **kw)
