"""Generation on a mesh, run on real gloo ranks (tests/test_inference_mesh.py) and on the
virtual mesh: each rank builds the same model, takes its shards and decodes."""

from __future__ import annotations

import torch

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


def decode(name: str, mesh_shape: dict | None, *, key: int | None = None, n: int = 8,
           int8: int | None = None, group_size: int | None = None) -> dict:
    """Greedy (or, with ``key``, sampled) tokens of the model ``name`` on ``mesh_shape``
    (None: one device), and the cache's first and last layers' keys gathered whole (the
    last layer's come after every layer's sums below it). ``int8``: the weights
    quantized for that tensor size (``quantize(..., tensor=int8)``; on real ranks each
    rank quantizes its own shards)."""
    params = params_of(name)
    moe = MOE if "moe" in MODELS[name] else None
    kw = dict(key=fs.random.key(key), temperature=0.9, top_k=40) if key is not None else {}
    if mesh_shape is None:
        if int8 is not None:
            params = fs.inference.quantize(params, group_size, tensor=int8)
        out = fs.inference.generate(params, PROMPTS, n, moe=moe, **kw)
        return {"tokens": out.tokens, "k0": out.cache.k[0], "kL": out.cache.k[-1]}
    mesh = fs.Mesh(mesh_shape)
    specs = fs.inference.mesh_specs(params, mesh)
    if fs.distributed.is_initialized():
        params = local_shards(params, specs, mesh)  # this rank's shards, as a checkpoint load gives them
        if int8 is not None:
            params = fs.inference.quantize(params, group_size)
    elif int8 is not None:
        params = fs.inference.quantize(params, group_size, tensor=int8)
    out = fs.inference.generate(params, PROMPTS, n, moe=moe, mesh=mesh, **kw)
    rows = tuple(a for a in ("data", "expert") if a in mesh_shape)
    spec = fs.P(rows if len(rows) > 1 else (rows[0] if rows else None), None,
                "tensor" if "tensor" in mesh_shape else None, None)
    whole = [fs.unshard(k, spec, mesh) if fs.distributed.is_initialized() else k for k in (out.cache.k[0],
                                                                                           out.cache.k[-1])]
    return {"tokens": out.tokens, "k0": whole[0], "kL": whole[1]}


def decode_safetensors(path: str, name: str, mesh_shape: dict) -> dict:
    """Load the file's GPT laid out on ``mesh_shape`` (each rank reads its slices) and decode."""
    cfg = gpt.GPTConfig.tiny(**MODELS[name])
    mesh = fs.Mesh(mesh_shape)
    params, _ = fs.inference.load_safetensors(path, cfg, mesh=mesh)
    out = fs.inference.generate(params, PROMPTS, 8, mesh=mesh, moe=MOE if "moe" in MODELS[name] else None)
    return {"tokens": out.tokens, "wq": tuple(params["blocks"][0]["attn"]["wq"].shape)}


def hf_model(kind: str, seed: int = 0, positions: int = 64) -> torch.nn.Module:
    """A tiny Hugging Face GPT-2 (``positions`` learned positions) or Llama (grouped-query
    heads) built from a config, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=positions, n_embd=32, n_layer=2, n_head=2)
        return transformers.GPT2LMHeadModel(cfg).eval()
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def engine_and_generate(kind: str, mesh_shape: dict | None) -> dict:
    """Greedy tokens of ``generate`` and of the ``Engine`` (small budget: chunked prompts)
    for a Hugging Face model (``kind`` "gpt2" / "llama") or the bundled GPT ("gpt"), on
    ``mesh_shape`` (None: one device). Every rank holds the whole model; each takes its
    shards (the GPT's through ``mesh_specs``, as a checkpoint load would give them)."""

    mesh = fs.Mesh(mesh_shape) if mesh_shape else None
    if kind == "gpt":
        model = gpt.init(gpt.GPTConfig.tiny(positions="rotary", n_kv_heads=2, init_std=0.2), 0)
        if mesh is not None and fs.distributed.is_initialized():
            model = local_shards(model, fs.inference.mesh_specs(model, mesh), mesh)
    else:
        model = hf_model(kind)
    gen = fs.inference.generate(model, PROMPTS, 8, mesh=mesh).tokens
    engine = fs.inference.Engine(model, max_batch_tokens=6, page_size=4, mesh=mesh)
    return {"generate": gen, "engine": engine.generate(PROMPTS, 8), "kv": engine.cache.k[0].shape[1]}
