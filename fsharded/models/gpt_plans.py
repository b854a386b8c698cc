"""The reference GPT's sharding plans: spec trees for its parameters, by path.

Kept beside the model (``fsharded.models.gpt``), which never imports the mesh: the model is
written once in per-shard form and reads how it is split from its tensors; these plans say
how to split it. ``gpt.tensor_parallel_specs`` and the others are reachable from the model
module too.

>>> from fsharded.models import gpt
>>> specs = tensor_parallel_specs(gpt.init(gpt.GPTConfig.tiny()))
>>> specs["blocks"][0]["mlp"]["w_in"]
PartitionSpec(None, 'tensor')
"""

from __future__ import annotations

from typing import Any

import optree

from fsharded.mesh import P
from fsharded.mesh._tree import rules
from fsharded.models._gpt_config import EXPERT, TENSOR

__all__ = ["tensor_parallel_specs", "expert_parallel_specs", "gpt_specs", "TENSOR_PARALLEL_RULES"]

Params = dict[str, Any]

TENSOR_PARALLEL_RULES: dict[str, P] = {
    # Column-parallel: split the output features (heads / MLP hidden units) ...
    "blocks.*.attn.w[qkv]": P(None, TENSOR, None),
    "blocks.*.attn.b[qkv]": P(TENSOR),
    "blocks.*.mlp.w_in": P(None, TENSOR),
    "blocks.*.mlp.w_gate": P(None, TENSOR),
    "blocks.*.mlp.w_up": P(None, TENSOR),
    "blocks.*.mlp.b_in": P(TENSOR),
    "blocks.*.mlp.b_gate": P(TENSOR),
    "blocks.*.mlp.b_up": P(TENSOR),
    # mixture-of-experts blocks: every expert's hidden units (expert tensor parallelism) ...
    "blocks.*.mlp.w1": P(None, None, TENSOR),
    "blocks.*.mlp.b1": P(None, TENSOR),
    "blocks.*.mlp.w2": P(None, TENSOR, None),
    # ... row-parallel: split the input features, outputs are psum'ed over tensor.
    "blocks.*.attn.wo": P(TENSOR, None, None),
    "blocks.*.mlp.w_out": P(TENSOR, None),
    "blocks.*.mlp.w_down": P(TENSOR, None),
}
"""Megatron placement by parameter path; everything unmatched (embeddings, norms, the
biases of row-parallel layers) is replicated."""


def tensor_parallel_specs(params: Params, axis: str = TENSOR) -> Any:
    """The spec tree that shards ``params`` Megatron-style over the mesh axis ``axis``.

    Query heads, key/value heads and the MLP hidden width are split, so ``n_heads``,
    ``n_kv_heads`` and ``d_ff`` must be divisible by the tensor-parallel size
    (``GPTConfig.check_tensor_parallel``; ``shard_map`` names any leaf that does not fit).

    >>> from fsharded.models import gpt
    >>> specs = tensor_parallel_specs(gpt.init(gpt.GPTConfig.tiny()))
    >>> specs["blocks"][0]["attn"]["wo"], specs["emb"]
    (PartitionSpec('tensor', None, None), PartitionSpec())
    """
    if axis == TENSOR:
        table = TENSOR_PARALLEL_RULES
    else:
        table = {k: P(*(axis if e == TENSOR else e for e in v)) for k, v in TENSOR_PARALLEL_RULES.items()}
    # One table for every GPT variant (biases, gated MLPs): not every rule matches.
    return rules(params, table, allow_unmatched=True)


def expert_parallel_specs(params: Params, axis: str = EXPERT, base: Any = None) -> Any:
    """The spec tree that splits every mixture-of-experts block's experts over the mesh
    axis ``axis`` (``w1``, ``w2`` and their biases on dim 0, the router replicated), on top
    of ``base`` (a spec tree such as ``tensor_parallel_specs(params)``, whose split of each
    expert's hidden units over the tensor axis is kept: expert tensor parallelism; default
    all replicated). The experts must divide over the axis (``shard_map`` names any leaf that
    does not fit).

    >>> from fsharded.models import gpt
    >>> cfg = gpt.GPTConfig.tiny(moe={"experts": 4})
    >>> expert_parallel_specs(gpt.init(cfg))["blocks"][1]["mlp"]["w1"]
    PartitionSpec('expert')
    """
    specs = optree.tree_map(lambda _: P(), params) if base is None else base
    specs = {**specs, "blocks": [dict(b) for b in specs["blocks"]]}
    for p, b in zip(params["blocks"], specs["blocks"]):
        if "router" in p["mlp"]:  # dim 0 over axis; the base's split of the hidden dim kept
            b["mlp"] = {k: P(axis, *tuple(b["mlp"][k])[1:]) if k in ("w1", "w2", "b1", "b2") else P()
                        for k in p["mlp"]}
    return specs


def gpt_specs(params: Params, *, axis: str) -> Any:
    """The bundled GPT's tensor-parallel plan, in the form of ``fsharded.parallel.tensor``'s
    plans (the axis keyword-only): ``tensor_parallel_specs(params, axis)``. The GPT inserts
    its own collectives; pass it the axis name too (``functools.partial(gpt.loss,
    tensor_axis=axis)``)."""
    return tensor_parallel_specs(params, axis)
