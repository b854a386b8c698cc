"""Generation on a mesh: the cached forward (``extend``) inside a ``shard_map``.

The heads and the MLP's hidden units are split over ``tensor`` (the training plans,
``gpt.tensor_parallel_specs``; one ``psum`` per attention and per MLP), the experts over
``expert`` (``gpt.expert_parallel_specs``; tokens routed by ``all_to_all`` as in
training), and the prompts' rows over ``data`` and ``expert``. Each device's cache holds
its rows and its heads: ``P(rows, None, "tensor", None)``. On the virtual mesh values are
global; on real ranks the parameters are this rank's shards (as ``fs.checkpoint.load``
with the same specs gives them), each rank passes the same prompts, keeps its rows of
the cache, and every rank gets the whole batch's logits (all-gathered), so the sampled
tokens are the same on every rank and equal the virtual mesh's.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.inference._cache import KVCache
from fsharded.inference._gpt import check_context, extend
from fsharded.inference._int8 import Int8Weight
from fsharded.mesh import Mesh, P
from fsharded.models import gpt_plans
from fsharded.models._gpt_config import MoEConfig
from fsharded.spmd import shard_map
from fsharded.spmd._transfer import backend_for, gather_global, local_slice

__all__ = ["MeshRunner", "mesh_specs", "check_divides"]

ROW_AXES = ("data", "expert")
AXES = (*ROW_AXES, "tensor")


def mesh_specs(params: dict, mesh: Mesh) -> Any:
    """How generation lays ``params`` (a GPT's tree) out on ``mesh``: the heads and hidden
    units over ``tensor`` (``gpt.tensor_parallel_specs``), the experts over ``expert``
    (``gpt.expert_parallel_specs``), the rest replicated. Load a checkpoint with these
    specs to get each rank's shards."""
    specs = gpt_plans.tensor_parallel_specs(params) if "tensor" in mesh.shape else optree.tree_map(lambda _: P(), params)
    return gpt_plans.expert_parallel_specs(params, base=specs) if "expert" in mesh.shape else specs


def check_divides(params: dict, mesh: Mesh) -> None:
    """A clear error where ``mesh`` cannot split the (global) ``params``: heads or hidden
    units over ``tensor``, experts over ``expert``."""
    t, e = mesh.shape.get("tensor", 1), mesh.shape.get("expert", 1)
    blocks = params["blocks"]
    if t > 1 and blocks:
        heads, kv = blocks[0]["attn"]["wq"].shape[1], blocks[0]["attn"]["wk"].shape[1]
        ff = [p["mlp"][k].shape[-1] for p in blocks for k in ("w_in", "w_gate") if k in p["mlp"]]
        bad = [f"{what} {n}" for what, n in (("query heads", heads), ("key/value heads", kv),
                                             *(("MLP hidden units", f) for f in ff[:1])) if n % t]
        if bad:
            raise ValueError(f"generate: tensor={t} does not divide the model's {', '.join(bad)}: use a tensor "
                             f"size that divides them (GPTConfig.check_tensor_parallel)")
    experts = [p["mlp"]["router"].shape[1] for p in blocks if "router" in p["mlp"]]
    if e > 1 and experts and experts[0] % e:
        raise ValueError(f"generate: expert={e} does not divide the model's {experts[0]} experts: use an expert "
                         f"axis that divides them")


class MeshRunner:
    """``extend`` on ``mesh`` for ``params`` laid out by ``param_specs`` (default: the
    tensor- and expert-parallel plans for the mesh's axes)."""

    def __init__(self, params: dict, mesh: Mesh, param_specs: Any = None, *, moe: MoEConfig | None = None,
                 model_state: Any = None) -> None:
        other = [a for a in mesh.shape if a not in AXES]
        if other:
            raise ValueError(f"generate: mesh axes {other} are not ones generation shards over ({', '.join(AXES)}): "
                             f"build the mesh from those (e.g. Mesh({{'tensor': 2}}))")
        if any(isinstance(x, Int8Weight) for x in optree.tree_leaves(params)):
            raise NotImplementedError("generate: int8 weights on a mesh are not implemented (neither with tensor "
                                      "parallelism nor replicated); quantize for one device, or decode on the mesh "
                                      "in bf16/fp32")
        self.mesh, self.moe, self.model_state = mesh, moe, model_state
        self.tensor = "tensor" if "tensor" in mesh.shape else None
        self.expert = "expert" if "expert" in mesh.shape else None
        self.rows = tuple(a for a in ROW_AXES if a in mesh.shape)
        self.n_rows = 1
        for a in self.rows:
            self.n_rows *= mesh.shape[a]
        self.dist = backend_for(mesh, None) == "distributed" and mesh.size > 1
        if param_specs is None:
            param_specs = mesh_specs(params, mesh)
        if not self.dist:
            check_divides(params, mesh)
        self.params, self.param_specs = params, param_specs
        row = self.rows if len(self.rows) > 1 else (self.rows[0] if self.rows else None)
        self.row_spec = P(row)
        self.cache_spec = P(row, None, self.tensor, None)
        n = len(params["blocks"])
        cache_specs = [self.cache_spec] * n
        ms_specs = None if model_state is None else optree.tree_map(lambda _: P(), model_state)
        self.fn = shard_map(self._body, mesh=mesh,
                            in_specs=(param_specs, ms_specs, self.row_spec, cache_specs, cache_specs, self.row_spec,
                                      P()),
                            out_specs=(self.row_spec, cache_specs, cache_specs))

    def _body(self, params, model_state, tokens, k, v, start, length):
        cache = KVCache(list(k), list(v), start, length)
        logits = extend(params, tokens, cache, moe=self.moe, model_state=model_state, tensor_axis=self.tensor,
                        expert_axis=self.expert, _unchecked=True)
        return logits, cache.k, cache.v

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """This device's rows of a global per-row tensor (on real ranks)."""
        return local_slice(x, self.row_spec, self.mesh, self.mesh.coords(comm.rank())) if self.dist else x

    def check_batch(self, batch: int) -> None:
        if batch % self.n_rows:
            raise ValueError(f"generate: {batch} prompts do not split over the mesh's row axes "
                             f"{dict((a, self.mesh.shape[a]) for a in self.rows)}: give a multiple of {self.n_rows} "
                             f"prompts")

    def empty_cache(self, batch: int, slots: int, start: torch.Tensor, dtype: torch.dtype | None) -> KVCache:
        """A cache of this device's rows and heads (the whole on the virtual mesh)."""
        self.check_batch(batch)
        start = start.to(torch.int64)
        local = self._local(start)
        return KVCache.empty(self.params, local.shape[0], slots, start=local, dtype=dtype)

    def extend(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The whole batch's logits ``(B, T, V)`` on every rank; the cache advanced."""
        check_context(self.params, cache, tokens.shape[1])
        logits, cache.k, cache.v = self.fn.local(self.params, self.model_state, self._local(tokens), cache.k,
                                                 cache.v, cache.start, cache.length)
        cache.k, cache.v = list(cache.k), list(cache.v)
        cache.length += tokens.shape[1]
        return gather_global(logits, self.row_spec, self.mesh) if self.dist else logits
