"""The reference GPT cut into pipeline stages (``fsharded.parallel.pipeline``): kept beside
the model, which does not import it, like its sharding plans (``gpt_plans``)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsharded.models import gpt
from fsharded.models._gpt_config import EXPERT, TENSOR, MoEConfig
from fsharded.parallel.pipeline import Stages, cut

__all__ = ["pipeline_stages"]

Params = dict[str, Any]


def pipeline_stages(params: Params, stages: int, *, boundaries: list[int] | None = None,
                    attention: str = "auto", tensor_axis: str | None = TENSOR, seq_axis: Any = None,
                    seq_parallel: str = "ulysses", seq_layout: str = "contiguous", moe: MoEConfig | None = None,
                    expert_axis: str | None = EXPERT) -> Stages:
    """The GPT cut into ``stages`` pipeline stages: the embeddings (and learned positions)
    on the first, the final norm and head on the last (tied embeddings: on both), the
    blocks balanced by parameter count or cut at ``boundaries`` (the first block of each
    stage after the first). The stages' losses are ``gpt.loss``'s, sequence parallel
    (``seq_axis``, ``seq_parallel``, ``seq_layout``) and mixture of experts (``moe``, the
    experts over ``expert_axis``) as ``gpt.loss`` takes them: a stage's MoE blocks add
    their weighted balancing and z-losses to the loss where they run.

    >>> from fsharded.models import gpt
    >>> s = pipeline_stages(gpt.init(gpt.GPTConfig.tiny(n_layers=4)), 2)
    >>> s.ranges, s.first_keys, s.last_keys
    ((range(0, 2), range(2, 4)), ('emb', 'pos'), ('final_norm', 'emb'))
    """
    if moe is None and any(gpt._is_moe(p) for p in params["blocks"]):
        raise ValueError("pipeline_stages: this GPT has mixture-of-experts blocks; pass its routing config, "
                         "pipeline_stages(params, n, moe=config.moe), as gpt.loss takes it")
    size = lambda t: sum(x.numel() for x in optree.tree_leaves(t))  # noqa: E731
    first_keys = ("emb", "pos") if "pos" in params else ("emb",)
    last_keys = ("final_norm", "head") if "head" in params else ("final_norm", "emb")
    ranges = cut([size(p) for p in params["blocks"]], stages, boundaries=boundaries,
                 first=sum(size(params[k]) for k in first_keys),
                 last=sum(size(params[k]) for k in last_keys))
    rotary = "pos" not in params
    seq_axis = gpt.check_seq(seq_axis, seq_parallel, seq_layout)
    megatron = seq_parallel == "megatron"

    def axis() -> Any:  # the axis the blocks see the sequence sharded over (Megatron-SP: tensor's, when bound)
        if not megatron:
            return seq_axis
        return tensor_axis if tensor_axis is not None and gpt._seq(tensor_axis) else None

    def first(p: Params, batch: Any):
        tokens = gpt._split_batch(batch)[0]
        if megatron:
            _, tokens = gpt._megatron_chunk(tokens, seq_axis, tensor_axis)
        return gpt.embed(p, tokens, seq_axis=axis(), seq_layout=seq_layout)

    def block(p: Params, x, selection_bias=None, load_name=None):
        a = axis()
        seq = {"seq_axis": a, "seq_parallel": seq_parallel, "seq_layout": seq_layout} if a is not None else {}
        if not gpt._is_moe(p):
            return gpt.block(p, x, rotary=rotary, attention=attention, tensor_axis=tensor_axis, **seq)
        x, aux = gpt.block(p, x, rotary=rotary, attention=attention, tensor_axis=tensor_axis, moe=moe,
                           expert_axis=expert_axis, selection_bias=selection_bias, **seq)
        extra = moe.aux_loss_weight * aux["aux_loss"].float() + moe.z_loss_weight * aux["z_loss"].float()
        # gpt.loss(metrics=True)'s: the losses summed over the MoE blocks, the rest their mean
        reported = {"moe_aux_loss": aux["aux_loss"].detach(), "moe_z_loss": aux["z_loss"].detach(),
                    "moe_drop_fraction": aux["drop_fraction"].detach() / n_moe,
                    "moe_load_imbalance": (aux["load"].max() / aux["load"].mean()).detach() / n_moe}
        if load_name is not None:  # with routing biases: the block's tokens per expert, a stat
            reported[load_name] = aux["load"].detach()
        return x, extra, reported

    def last(p: Params, x, batch: Any):
        out = gpt.shard_loss(gpt.unembed(p, x), gpt._split_batch(batch)[1], seq_axis=seq_axis,
                             seq_parallel=seq_parallel, tensor_axis=tensor_axis)
        return (out, {"lm_loss": out.detach()}) if n_moe else out

    n_moe = sum(gpt._is_moe(p) for p in params["blocks"])
    metrics = ("lm_loss", "moe_aux_loss", "moe_z_loss", "moe_drop_fraction", "moe_load_imbalance") if n_moe else ()
    # The k-th MoE block's routing bias is model_state["moe_bias"][k] (gpt.init_model_state).
    ordinal = {i: k for k, i in enumerate(i for i, p in enumerate(params["blocks"]) if gpt._is_moe(p))}

    def block_state(ms: Any, i: int) -> dict:
        if i not in ordinal:
            return {}
        return {"selection_bias": ms["moe_bias"][ordinal[i]], "load_name": f"moe_load.{ordinal[i]}"}

    def stats(ms: Any, reported: dict) -> dict:  # gpt.loss's stats: each MoE block's load, in order
        return {"moe_load": [reported.get(f"moe_load.{k}", torch.zeros_like(b)) for k, b in enumerate(ms["moe_bias"])]}

    hooks = {"block_state": block_state, "stats": stats} if n_moe and moe.bias_update_rate is not None else {}
    return Stages(first, block, last, first_keys, last_keys, ranges, metrics=metrics, **hooks)
