"""Generation on a mesh, run on real gloo ranks (tests/test_inference_mesh.py) and on the
virtual mesh: each rank builds the same model, takes its shards and decodes."""

from __future__ import annotations

import fsharded as fs
from fsharded.models import gpt
from fsharded.models._gpt_config import MoEConfig
from fsharded.spmd._transfer import local_shards

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4], [1, 2]]
MOE = MoEConfig(experts=4, top_k=2, every=1)
MODELS = {
    "learned": dict(),
    "rotary, grouped-query, untied": dict(positions="rotary", n_kv_heads=2, tied_embeddings=False),
    "llama-style": dict(positions="rotary", norm="rmsnorm", activation="swiglu", bias=False),
    "mixture of experts": dict(moe=MOE),
}


def params_of(name: str) -> dict:
    return gpt.init(gpt.GPTConfig.tiny(**MODELS[name]), 0)


def decode(name: str, mesh_shape: dict | None, *, key: int | None = None, n: int = 8) -> dict:
    """Greedy (or, with ``key``, sampled) tokens of the model ``name`` on ``mesh_shape``
    (None: one device), and the cache's first layer gathered whole."""
    params = params_of(name)
    moe = MOE if "moe" in MODELS[name] else None
    kw = dict(key=fs.random.key(key), temperature=0.9, top_k=40) if key is not None else {}
    if mesh_shape is None:
        out = fs.inference.generate(params, PROMPTS, n, moe=moe, **kw)
        return {"tokens": out.tokens, "k0": out.cache.k[0]}
    mesh = fs.Mesh(mesh_shape)
    specs = fs.inference.mesh_specs(params, mesh)
    if fs.distributed.is_initialized():
        params = local_shards(params, specs, mesh)  # this rank's shards, as a checkpoint load gives them
    out = fs.inference.generate(params, PROMPTS, n, moe=moe, mesh=mesh, **kw)
    rows = tuple(a for a in ("data", "expert") if a in mesh_shape)
    spec = fs.P(rows if len(rows) > 1 else (rows[0] if rows else None), None,
                "tensor" if "tensor" in mesh_shape else None, None)
    k0 = fs.unshard(out.cache.k[0], spec, mesh) if fs.distributed.is_initialized() else out.cache.k[0]
    return {"tokens": out.tokens, "k0": k0}


def decode_safetensors(path: str, name: str, mesh_shape: dict) -> dict:
    """Load the file's GPT laid out on ``mesh_shape`` (each rank reads its slices) and decode."""
    cfg = gpt.GPTConfig.tiny(**MODELS[name])
    mesh = fs.Mesh(mesh_shape)
    params, _ = fs.inference.load_safetensors(path, cfg, mesh=mesh)
    out = fs.inference.generate(params, PROMPTS, 8, mesh=mesh, moe=MOE if "moe" in MODELS[name] else None)
    return {"tokens": out.tokens, "wq": tuple(params["blocks"][0]["attn"]["wq"].shape)}
