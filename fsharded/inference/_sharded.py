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

import math
from typing import Any

import optree
import torch

from fsharded import comm
from fsharded.inference._cache import KVCache
from fsharded.inference._gpt import check_context, contiguous, extend, forward
from fsharded.inference._hf import HFDecoder
from fsharded.inference._int8 import Int8Linear, Int8Weight
from fsharded.mesh import Mesh, P
from fsharded.mesh._spec import shard_shape
from fsharded.mesh._tree import broadcast_prefix, tree_flatten_with_paths
from fsharded.models import gpt_plans
from fsharded.models._gpt_config import MoEConfig
from fsharded.parallel import tensor as T
from fsharded.spmd import shard_map
from fsharded.spmd._transfer import backend_for, gather_global, local_shards, local_slice

__all__ = ["MeshRunner", "GPTOnMesh", "HFOnMesh", "mesh_specs", "check_divides", "split_int8"]

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


def split_int8(params: Any, specs: Any, mesh: Any, local: bool) -> tuple[Any, Any, Any]:
    """``params`` and their ``specs`` with every ``Int8Weight`` as ``{"q", "scales"}``
    (specs from the float weight's: the first output dim's axis on ``q``'s rows, the first
    input dim's on its columns and the scales' groups), and ``join(tree)`` that rebuilds
    the ``Int8Weight``s from a ``shard_map`` body's local leaves. ``local``: the weights
    are already this rank's shards (real ranks)."""
    paths, leaves, treedef = tree_flatten_with_paths(params)
    if not any(isinstance(x, Int8Weight) for x in leaves):
        return params, specs, lambda tree: tree
    spec_list = broadcast_prefix(specs, params)
    new, new_specs, shapes = [], [], {}
    for i, (path, x, spec) in enumerate(zip(paths, leaves, spec_list)):
        if not isinstance(x, Int8Weight):
            new.append(x)
            new_specs.append(spec)
            continue
        entries = tuple(spec) + (None,) * (len(x.shape) - len(spec))
        ins, outs = entries[:x.inputs], entries[x.inputs:]
        if any(e is not None for e in (*ins[1:], *outs[1:])):
            raise NotImplementedError(f"generate: {path}: an int8 weight split on an inner dim ({spec}) is not "
                                      f"implemented")
        k_axis = ins[0]
        if k_axis is not None and not local:
            t = math.prod(mesh.shape[a] for a in ((k_axis,) if isinstance(k_axis, str) else k_axis))
            if x.scales.shape[1] % t:
                raise ValueError(f"generate: {path}: its int8 scales ({x.scales.shape[1]} groups of input features) "
                                 f"do not split over {k_axis}={t}; quantize with fs.inference.quantize(params, "
                                 f"tensor={t}) (a scale per output channel per shard) or a group size dividing "
                                 f"each shard's inputs")
        shapes[i] = (x.shape if local else shard_shape(P(*entries), x.shape, mesh), x.inputs)
        new.append({"q": x.q, "scales": x.scales})
        q_spec = P(outs[0] if outs else None, k_axis)
        new_specs.append({"q": q_spec, "scales": q_spec})

    def join(tree: Any) -> Any:
        flat = optree.tree_flatten(tree, is_leaf=lambda n: isinstance(n, dict) and set(n) == {"q", "scales"})[0]
        return treedef.unflatten([Int8Weight(n["q"], n["scales"], *shapes[i]) if i in shapes else n
                                  for i, n in enumerate(flat)])

    return treedef.unflatten(new), treedef.unflatten(new_specs), join


class MeshRunner:
    """``extend`` on ``mesh`` for ``params`` laid out by ``param_specs`` (default: the
    tensor- and expert-parallel plans for the mesh's axes)."""

    def __init__(self, params: dict, mesh: Mesh, param_specs: Any = None, *, moe: MoEConfig | None = None,
                 model_state: Any = None) -> None:
        other = [a for a in mesh.shape if a not in AXES]
        if other:
            raise ValueError(f"generate: mesh axes {other} are not ones generation shards over ({', '.join(AXES)}): "
                             f"build the mesh from those (e.g. Mesh({{'tensor': 2}}))")
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
        self.full = params
        self.params, self.param_specs, self._join = split_int8(params, param_specs, mesh, self.dist)
        row = self.rows if len(self.rows) > 1 else (self.rows[0] if self.rows else None)
        self.row_spec = P(row)
        self.cache_spec = P(row, None, self.tensor, None)
        n = len(params["blocks"])
        cache_specs = [self.cache_spec] * n
        ms_specs = None if model_state is None else optree.tree_map(lambda _: P(), model_state)
        self.fn = shard_map(self._body, mesh=mesh,
                            in_specs=(self.param_specs, ms_specs, self.row_spec, cache_specs, cache_specs, self.row_spec,
                                      P()),
                            out_specs=(self.row_spec, cache_specs, cache_specs))

    def _body(self, params, model_state, tokens, k, v, start, length):
        cache = KVCache(list(k), list(v), start, length)
        logits = extend(self._join(params), tokens, cache, moe=self.moe, model_state=model_state,
                        tensor_axis=self.tensor, expert_axis=self.expert, _unchecked=True)
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
        start = self.start = start.to(torch.int64)  # every row's: the same checks on every rank
        local = self._local(start)
        return KVCache.empty(self.full, local.shape[0], slots, start=local, dtype=dtype)

    def extend(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The whole batch's logits ``(B, T, V)`` on every rank; the cache advanced."""
        check_context(self.full, KVCache(cache.k, cache.v, self.start, cache.length), tokens.shape[1])
        logits, cache.k, cache.v = self.fn.local(self.params, self.model_state, self._local(tokens), cache.k,
                                                 cache.v, cache.start, cache.length)
        cache.k, cache.v = list(cache.k), list(cache.v)
        cache.length += tokens.shape[1]
        return gather_global(logits, self.row_spec, self.mesh) if self.dist else logits


def _tensor_only(mesh: Mesh, what: str) -> int:
    other = [a for a in mesh.shape if a != "tensor" and mesh.shape[a] > 1]
    if other or "tensor" not in mesh.shape:
        raise NotImplementedError(f"{what} on a mesh splits the heads over a 'tensor' axis only; got {mesh!r}")
    return mesh.shape["tensor"]


class _OnMesh:
    """One forward of a model inside a ``shard_map`` over a ``tensor`` axis, for the
    ``Engine``'s pages (``paged_step``) or ``generate``'s cache (``extend``)."""

    mesh: Mesh
    specs: Any
    params: Any
    heads_split: bool

    def run(self, params: Any, ids: torch.Tensor, pos: torch.Tensor, attend: Any,
            keep: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError

    def _cache_specs(self, dims: int) -> list:
        head = (None,) * (dims - 2) + ("tensor" if self.heads_split else None, None)
        return [P(*head)] * self.layers

    def paged_step(self, ids: torch.Tensor, pos: torch.Tensor, cache: Any, attending: Any,
                   keep: torch.Tensor | None = None) -> torch.Tensor:
        """The logits ``(1, N, V)`` of one engine step (``keep``: of those tokens only); each
        device's pages updated."""
        specs = self._cache_specs(3)

        def body(params: Any, k: list, v: list) -> tuple:
            k, v = list(k), list(v)
            return self.run(params, ids, pos, attending(k, v), keep), k, v

        fn = shard_map(body, mesh=self.mesh, in_specs=(self.specs, specs, specs), out_specs=(P(), specs, specs))
        logits, cache.k, cache.v = fn.local(self.params, cache.k, cache.v)
        cache.k, cache.v = list(cache.k), list(cache.v)
        return logits


class GPTOnMesh(_OnMesh):
    """The bundled GPT with its heads and hidden units over ``tensor`` (``mesh_specs``);
    ``params`` global on the virtual mesh, this rank's shards on real ranks (as given)."""

    def __init__(self, params: dict, mesh: Mesh, *, moe: MoEConfig | None = None, model_state: Any = None) -> None:
        _tensor_only(mesh, "the Engine")
        self.mesh, self.moe, self.model_state, self.heads_split = mesh, moe, model_state, True
        self.dist = backend_for(mesh, None) == "distributed" and mesh.size > 1
        if not self.dist:
            check_divides(params, mesh)
        self.full = params
        self.params, self.specs, self._join = split_int8(params, mesh_specs(params, mesh), mesh, self.dist)
        self.layers = len(params["blocks"])

    def cache_shape(self) -> tuple[int, int, int, torch.dtype]:
        wk = self.full["blocks"][0]["attn"]["wk"]  # (this rank's key/value heads on real ranks)
        return self.layers, wk.shape[1], wk.shape[2], self.full["emb"].dtype

    def run(self, params: Any, ids: torch.Tensor, pos: torch.Tensor, attend: Any,
            keep: torch.Tensor | None = None) -> torch.Tensor:
        return forward(self._join(params), ids, pos, attend, moe=self.moe, model_state=self.model_state,
                       tensor_axis="tensor", keep=keep)


class HFOnMesh(_OnMesh):
    """A Hugging Face causal LM under fsharded's tensor-parallel plan for it
    (``fs.parallel.tensor.LLAMA`` for Llama, Mistral and Qwen2: the heads and MLP split;
    ``GPT2``: the MLP and the vocabulary split, attention replicated). Every rank holds the
    whole model; each takes its shards."""

    TABLES = {"llama": "LLAMA", "mistral": "LLAMA", "qwen2": "LLAMA", "gpt2": "GPT2"}

    def __init__(self, hf: HFDecoder, mesh: Mesh) -> None:
        t = _tensor_only(mesh, "a Hugging Face model")
        kind = getattr(hf.fm.module.config, "model_type", None)
        if kind not in self.TABLES:
            raise NotImplementedError(f"generate: no tensor-parallel plan for a Hugging Face {kind!r} model here "
                                      f"(known: {', '.join(sorted(self.TABLES))})")
        int8 = [n for n, m in hf.fm.module.named_modules() if isinstance(m, Int8Linear)]
        if int8:
            raise NotImplementedError(f"generate: {int8[0]} (and {len(int8) - 1} more) of this Hugging Face model are "
                                      f"int8 layers (fs.inference.quantize), which decode on one device; decode the "
                                      f"float model on the mesh, or the int8 one without it")
        self.hf, self.mesh = hf, mesh
        self.heads_split = self.TABLES[kind] == "LLAMA"
        if self.heads_split and (hf.kv_heads % t or hf.heads % t):
            raise ValueError(f"generate: tensor={t} does not divide the model's {hf.heads} query heads and "
                             f"{hf.kv_heads} key/value heads")
        self.plan = T.plan(hf.fm, getattr(T, self.TABLES[kind]), axis="tensor", allow_unmatched=True)
        self.specs = self.plan.specs
        self.dist = backend_for(mesh, None) == "distributed" and mesh.size > 1
        self.params = local_shards(hf.params, self.specs, mesh) if self.dist else hf.params
        self.layers = hf.layers
        self.local_kv = hf.kv_heads // t if (self.heads_split and self.dist) else hf.kv_heads

    def cache_shape(self) -> tuple[int, int, int, torch.dtype]:
        return self.layers, self.local_kv, self.hf.head_dim, self.hf.dtype

    def run(self, params: Any, ids: torch.Tensor, pos: torch.Tensor, attend: Any,
            keep: torch.Tensor | None = None) -> torch.Tensor:
        with self.plan.applied():
            return self.hf.run(ids, pos, attend, params=params, keep=keep)

    # -- generate's contiguous cache ------------------------------------------------------------

    def empty_cache(self, batch: int, slots: int, start: torch.Tensor, dtype: torch.dtype | None) -> KVCache:
        shape = (batch, slots, self.local_kv, self.hf.head_dim)
        dt = dtype or self.hf.dtype
        k = [torch.zeros(shape, dtype=dt, device=self.hf.device) for _ in range(self.layers)]
        v = [torch.zeros(shape, dtype=dt, device=self.hf.device) for _ in range(self.layers)]
        return KVCache(k, v, start.to(torch.int64), 0)

    def extend(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """``HFDecoder.forward`` on the mesh: the logits ``(B, T, V)``, the cache advanced."""
        self.hf.check(cache, tokens.shape[1])
        specs = self._cache_specs(4)
        length, start = cache.length, cache.start

        def body(params: Any, k: list, v: list) -> tuple:
            local = KVCache(list(k), list(v), start, length)
            pos, attend = contiguous(local, tokens.shape[1], tokens.device)
            return self.run(params, tokens, pos, attend), local.k, local.v

        fn = shard_map(body, mesh=self.mesh, in_specs=(self.specs, specs, specs), out_specs=(P(), specs, specs))
        logits, k, v = fn.local(self.params, cache.k, cache.v)
        cache.k, cache.v = list(k), list(v)
        cache.length += tokens.shape[1]
        return logits
