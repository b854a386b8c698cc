"""Peer-side pieces of ``fsharded bench pipeline``: the functional GPT as a list of layer
modules (embeddings, each block, final norm and head), cut as our stages cut it, for
DeepSpeed's ``PipelineModule`` and ``torch.distributed.pipelining``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsharded.bench._zero_peers import _Block, _Leaves

__all__ = ["Embed", "Head", "layers", "stage_module", "token_loss"]


class Embed(_Leaves):
    """``gpt.embed``: tokens (B, T) -> (B, T, D)."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from fsharded.models import gpt

        return gpt.embed(self.tree(), tokens)


class Head(_Leaves):
    """``gpt.unembed``: (B, T, D) -> logits (B, T, V) (an untied head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from fsharded.models import gpt

        return gpt.unembed(self.tree(), x)


class _BlockLayer(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the positional-only form the peers call
        return super().forward(x)


def layers(params: dict) -> list[nn.Module]:
    """The GPT's layers in order: embeddings, the blocks, final norm and head."""
    first = {k: params[k] for k in ("emb", "pos") if k in params}
    last = {k: params[k] for k in ("final_norm", "head")}
    return [Embed(first), *(_BlockLayer(b) for b in params["blocks"]), Head(last)]


def stage_module(params: dict, ranges: tuple[range, ...], s: int) -> nn.Module:
    """Stage ``s`` as one module: its blocks, with the embeddings first (stage 0) and the
    head last (the last stage), as ``gpt_stages.pipeline_stages`` cuts it."""
    all_layers = layers(params)
    lo, hi = ranges[s].start + 1, ranges[s].stop + 1  # +1: the embedding layer
    if s == 0:
        lo = 0
    if s == len(ranges) - 1:
        hi = len(all_layers)
    return nn.Sequential(*all_layers[lo:hi])


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from fsharded.models import gpt

    return gpt.token_loss(logits, targets)


def deepspeed_engine(params: dict, ranges: tuple[range, ...], *, micro: int, m: int, lr: float) -> Any:
    """DeepSpeed's ``PipelineModule`` over the same layers, cut where ours are, in its 1F1B
    engine with torch's AdamW (no clipping, no weight decay: as ours in the bench)."""
    import deepspeed
    from deepspeed.pipe import PipelineModule

    parts = [0] + [r.stop + 1 for r in ranges[:-1]] + [len(params["blocks"]) + 2]

    class OurCut(PipelineModule):
        def _partition_layers(self, method: str = "uniform") -> None:
            self.parts = list(parts)
            me = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=self.parts[me], stop=self.parts[me + 1])

    model = OurCut(layers=layers(params), num_stages=len(ranges), loss_fn=_DSLoss())
    cfg = {"train_batch_size": micro * m, "train_micro_batch_size_per_gpu": micro,
           "gradient_accumulation_steps": m, "steps_per_print": 1 << 30,
           "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=cfg)
    return engine


class _DSLoss(nn.Module):
    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, targets)
